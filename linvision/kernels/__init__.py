"""Triton kernels for linear attention, installed as ``linvision.kernels``.

The kernels know only tensors, ints and flags and import nothing from the rest of linvision:
``linvision.ops`` dispatches to them, never the other way round.

- ``linear_attention_triton`` (in ``linear_attention.py``, needs Triton): the fused non-causal forward and
  backward; ``unsupported_reason`` says why a call cannot run there (the dispatcher,
  ``linvision.ops.attention.dispatch``, then falls back to PyTorch, with a warning under ``backend="auto"``).
  Below it, one job a module: ``la_op`` (the torch custom ops, their fake implementations, autograd and FLOP
  formulas), ``la_launch`` (autotuning, buffers, RoPE tables, grids and the launches; the process's caches) and
  ``la_kernels`` (the Triton jit code and its tables).
- ``common``: what the ops and the kernels both need (input validation, :class:`~.common.RopeSpec`, the one table
  of feature maps); no Triton.
- ``traffic``: memory traffic of kernel launches counted in the Triton interpreter.
- ``compile_check``: the kernels compiled for sm_90 without a GPU (registers, spills, shared memory, pipelining),
  for ``linvision-check-kernels``.

The Triton names load on first use, so ``linvision.kernels.common`` imports where Triton is not installed.
"""
import importlib

__all__ = ["FUSED_FEATURE_MAPS", "MAX_HEAD_DIM", "MIN_HEAD_DIM", "chosen_configs", "linear_attention_triton",
           "unsupported_reason"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(".linear_attention", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
