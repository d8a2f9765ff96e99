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
- :func:`full_precision`: the decorator of every public op that turns ``torch.autocast`` off around it, so that its
  sums, states and normalisers stay in the compute dtype, and hands back the autocast dtype.
- :data:`FEATURE_MAPS`: the one table of named feature maps and where each may be used.

The tensor checks, ``DEFAULT_EPS``, ``compute_dtype``, the feature-map names and ``RopeSpec`` are defined in
:mod:`linvision.kernels.common`, because the kernels check their own direct calls with them and import nothing
from the ops; this module hands them on, so that an op imports its checks and constants from here alone.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable, Iterator, List, Optional, Set, Tuple, TypeVar

import torch

from linvision.kernels.common import (
    DEFAULT_EPS,
    EPILOGUE_GATES,
    FEATURE_MAP_ALIASES,
    FEATURE_MAPS,
    FLOAT_DTYPES,
    FUSED_FEATURE_MAPS,
    FeatureMapInfo,
    RopeSpec,
    check_epilogue,
    check_eps,
    check_grid,
    check_int,
    check_qkv,
    check_rope,
    check_valid,
    compute_dtype,
    feature_map_info,
    feature_map_name,
    feature_maps_where,
)

__all__ = [
    "BACKENDS",
    "warn_fallback",
    "DEFAULT_EPS",
    "EPILOGUE_GATES",
    "FEATURE_MAP_ALIASES",
    "FEATURE_MAPS",
    "FLOAT_DTYPES",
    "FUSED_FEATURE_MAPS",
    "FeatureMapInfo",
    "RopeSpec",
    "check_backend",
    "check_epilogue",
    "check_eps",
    "check_grid",
    "check_int",
    "check_qkv",
    "check_rope",
    "check_valid",
    "autocast_dtype",
    "compute_dtype",
    "feature_map_info",
    "feature_map_name",
    "feature_maps_where",
    "full_precision",
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


# From torch 2.8 torch.export sets its flag while TorchDynamo traces in strict mode too; before, only its later
# steps saw it, and ``torch.compiler.is_exporting()`` (True in every TorchDynamo trace) was the only answer.
_EXPORT_FLAG_TRACED = torch.__version__ >= "2.8"


def is_exporting() -> bool:
    """True while torch.export traces (torch >= 2.6; always False before). From torch 2.8 it reads the flag
    torch.export sets, strict and not: releases up to torch 2.11 at least answer a call of
    ``torch.compiler.is_exporting()`` with True while TorchDynamo traces for torch.compile as well, which would
    keep the kernels out of every compiled model (before 2.8 they still do)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is not None and _EXPORT_FLAG_TRACED:
        return bool(flag)
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


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` runs lower-precision ops in on ``device`` (fp16 or bf16), None when it is off."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device.type) if enabled else None


_Op = TypeVar("_Op", bound=Callable)


def full_precision(op: _Op) -> _Op:
    """Run ``op`` with ``torch.autocast`` off for the device of its first tensor argument.

    Autocast would re-run the op's matrix products (einsum, matmul) in fp16 or bf16 and with them the sums over
    tokens: a state, key sum or normaliser over 100k tokens overflows fp16 (65504) or loses bf16's few bits. The op
    computes as it does without autocast (features, sums, states, solves and the division in fp32, float64 for
    float64 inputs) and returns what autocast would: a result from fp32 inputs in the autocast dtype, one from
    16-bit inputs in their dtype. Of a tuple result (an output and a state) only the first item is cast; a state
    stays in the compute dtype. Without autocast the op runs untouched."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        amp = None if first is None else autocast_dtype(first.device)
        if amp is None:
            return op(*args, **kwargs)
        with torch.autocast(first.device.type, enabled=False):
            result = op(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return result.to(amp) if result.dtype == torch.float32 else result
        if isinstance(result, tuple) and result and isinstance(result[0], torch.Tensor) \
                and result[0].dtype == torch.float32:
            items = (result[0].to(amp), *result[1:])
            return type(result)(*items) if hasattr(result, "_fields") else type(result)(items)
        return result

    return run  # type: ignore[return-value]


def warn_fallback(warned: Set[str], op: str, kernels: str, reason: str, stacklevel: int) -> None:
    """A RuntimeWarning that ``backend="auto"`` runs a call of ``op`` in PyTorch instead of ``kernels``, for
    ``reason``; said once per reason (``warned``: the caller's record of the reasons said so far)."""
    if reason in warned:
        return
    warned.add(reason)
    warnings.warn(f"{op}: backend='auto' runs this call in PyTorch, not {kernels}: {reason} (said once per reason; "
                  "backend='torch' chooses PyTorch without this warning)", RuntimeWarning, stacklevel=stacklevel)
