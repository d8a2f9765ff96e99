"""The checks and constants every op shares: the one module the ops take them from.

- Input checks: ``check_qkv`` (q, k, v shapes, dtypes, devices), ``check_eps``, ``check_int`` (chunk and split
  sizes), ``check_grid`` ((H, W) token grids), ``check_rope`` (a rotation against its inputs) and
  :func:`check_backend`; errors name the argument, the value and what is allowed.
- Constants: ``DEFAULT_EPS`` (the denominators' eps), :data:`BACKENDS` (the ``backend=`` choices of every op that
  dispatches to kernels), ``compute_dtype`` (the dtype of every accumulation).
- ``RopeSpec``: a 2D rotation as plain data, which :class:`linvision.ops.rope.Rope` extends with its tables.
- :func:`is_tracing`, :func:`is_exporting`: whether a graph is being traced, so that nothing is cached then.

The tensor checks, ``DEFAULT_EPS``, ``compute_dtype``, the feature-map names and ``RopeSpec`` are defined in
:mod:`linvision.kernels.common`, because the kernels check their own direct calls with them and import nothing
from the ops; this module hands them on, so that an op imports its checks and constants from here alone.
"""
from __future__ import annotations

import torch

from linvision.kernels.common import (
    DEFAULT_EPS,
    FEATURE_MAP_ALIASES,
    FLOAT_DTYPES,
    RopeSpec,
    check_eps,
    check_grid,
    check_int,
    check_qkv,
    check_rope,
    compute_dtype,
    feature_map_name,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_EPS",
    "FEATURE_MAP_ALIASES",
    "FLOAT_DTYPES",
    "RopeSpec",
    "check_backend",
    "check_eps",
    "check_grid",
    "check_int",
    "check_qkv",
    "check_rope",
    "compute_dtype",
    "feature_map_name",
    "is_exporting",
    "is_tracing",
]

# The backend= choices of the ops that can run on kernels: "auto" (kernels for CUDA tensors where they apply),
# "torch" (the PyTorch path), "triton" (the kernels, or an error saying why not).
BACKENDS = ("auto", "torch", "triton")


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKENDS`, else ValueError naming the allowed values."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    return backend


def is_exporting() -> bool:
    """True while torch.export traces (torch >= 2.6; always False before)."""
    return getattr(torch.compiler, "is_exporting", lambda: False)()


def is_tracing(*sizes) -> bool:
    """True while torch.compile or torch.export traces, or when a size is symbolic: tensors made then are part of a
    graph (fake, or to be recomputed for every input), so nothing is cached or taken from a cache."""
    return torch.compiler.is_compiling() or is_exporting() or any(isinstance(s, torch.SymInt) for s in sizes)
