"""The checks and constants every op shares: the one module the ops take them from.

- Input checks: ``check_qkv`` (q, k, v shapes, dtypes, devices), ``check_eps``, ``check_int`` (chunk and split
  sizes), ``check_grid`` ((H, W) token grids), ``check_rope`` (a rotation against its inputs) and
  :func:`check_backend`; errors name the argument, the value and what is allowed.
- Constants: ``DEFAULT_EPS`` (the denominators' eps), :data:`BACKENDS` (the ``backend=`` choices of every op that
  dispatches to kernels), ``compute_dtype`` (the dtype of every accumulation).
- ``RopeSpec``: a 2D rotation as plain data, which :class:`linvision.ops.rope.Rope` extends with its tables.
- :func:`is_tracing`, :func:`is_exporting`: whether a graph is being traced, so that nothing is cached then.
- :func:`record_backends`, :func:`note_backend`: which path (fused kernels or PyTorch) each dispatching op took,
  for benchmarks and tests to report.

The tensor checks, ``DEFAULT_EPS``, ``compute_dtype``, the feature-map names and ``RopeSpec`` are defined in
:mod:`linvision.kernels.common`, because the kernels check their own direct calls with them and import nothing
from the ops; this module hands them on, so that an op imports its checks and constants from here alone.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Set, Tuple

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
    "note_backend",
    "record_backends",
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


_RECORDERS: List[Set[Tuple[str, str]]] = []  # the sets of the open record_backends blocks


@contextlib.contextmanager
def record_backends() -> Iterator[Set[Tuple[str, str]]]:
    """Within the block, every op that dispatches between kernels and PyTorch adds (op, path) to the set it yields:
    path "triton" (linvision's fused linear-attention kernels), "fla" (fla-core's kernels of the recurrences) or
    "torch". Nothing is recorded while a graph is being traced (torch.compile, torch.export)::

        with record_backends() as used:
            model(x)
        # used == {("bidirectional_delta_rule_attention", "torch")} for linhier_delta_* on a CPU
    """
    used: Set[Tuple[str, str]] = set()
    _RECORDERS.append(used)
    try:
        yield used
    finally:
        _RECORDERS.remove(used)


def note_backend(op: str, path: str) -> None:
    """Record that ``op`` ran on ``path`` in every open :func:`record_backends` block (nothing when none is open)."""
    if _RECORDERS and not (torch.compiler.is_compiling() or is_exporting()):
        for used in _RECORDERS:
            used.add((op, path))
