"""Tensors derived from a module's parameters (a merged weight, a folded residual, a parameterised power) formed once
for inference instead of on every forward: each is a launch or more per block that a forward without gradients
need not pay again while the parameters stay as they are.

:func:`derived` gives the cached tensors when nothing asks for a gradient of the parameters (eval under
``torch.no_grad`` or ``torch.inference_mode``, or frozen parameters) and no graph is being traced, and None
otherwise, where the caller runs its ordinary ops (autograd, torch.compile and torch.export then see the
parameters themselves). A cached entry holds while every parameter it was formed from keeps its storage, version
(an in-place update such as an optimiser step or ``load_state_dict`` bumps it), dtype and device; otherwise it is
formed anew. The entries live in a plain dict on the module, outside its state dict.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from linvision.ops import is_tracing

__all__ = ["derived"]

_CACHE = "_derived_cache"


def derived(module: nn.Module, key: str, params: Sequence[Optional[Tensor]],
            form: Callable[[], Tuple[Optional[Tensor], ...]]) -> Optional[Tuple[Optional[Tensor], ...]]:
    """``form()``'s tensors, formed once per state of ``params`` and kept on ``module`` under ``key``, when no
    gradient can reach ``params`` and nothing is being traced; None otherwise (the caller computes its plain way).
    ``params``: the tensors ``form`` reads (None entries skipped)."""
    present = [p for p in params if p is not None]
    if is_tracing() or torch.jit.is_scripting() or (torch.is_grad_enabled() and any(p.requires_grad for p in present)):
        return None
    try:
        stamp = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in present)
    except RuntimeError:  # inference tensors (parameters made under inference_mode) keep no version: not cached
        return None
    cache = module.__dict__.setdefault(_CACHE, {})
    entry = cache.get(key)
    if entry is None or entry[0] != stamp:
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable outside inference mode too
            entry = cache[key] = (stamp, tuple(form()))
    return entry[1]
