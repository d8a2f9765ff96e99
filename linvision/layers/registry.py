"""Registry of token mixers, so that models and ablations pick a mixer by name.

A token mixer is an ``nn.Module`` built as ``cls(dim, num_heads, **kwargs)`` whose ``forward(x, hw)`` maps
tokens x of shape (B, N, C) on a grid hw = (H, W) with N = H * W to (B, N, C).

Every registered mixer is also registered with timm as a leaf of FX tracing (``register_notrace_module``): a
mixer builds its RoPE tables and checks the token count against the grid with Python ints, which symbolic
tracing cannot see. A traced model calls the mixer as one module (its parameters stay in the graph module), and
those checks still run on every call.
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Type

from timm.layers import register_notrace_module
from torch import nn

__all__ = ["register_mixer", "create_mixer", "list_mixers", "mixer_options"]

_MIXERS: Dict[str, Type[nn.Module]] = {}


def register_mixer(name: str) -> Callable[[Type[nn.Module]], Type[nn.Module]]:
    """Class decorator that registers a token mixer under ``name`` (and with timm as an FX leaf module)."""

    def wrap(cls: Type[nn.Module]) -> Type[nn.Module]:
        if name in _MIXERS and _MIXERS[name] is not cls:
            raise ValueError(f"name: token mixer {name!r} is already registered by {_MIXERS[name].__name__}")
        _MIXERS[name] = cls
        return register_notrace_module(cls)

    return wrap


def list_mixers() -> List[str]:
    return sorted(_MIXERS)


def create_mixer(name: str, dim: int, num_heads: int, **kwargs) -> nn.Module:
    """Build the mixer registered as ``name``; ValueError names the known mixers otherwise."""
    if name not in _MIXERS:
        raise ValueError(f"token mixer: unknown {name!r}; allowed: {', '.join(list_mixers())}")
    return _MIXERS[name](dim, num_heads, **kwargs)


def mixer_options(name: str) -> List[str]:
    """Keyword options the mixer ``name`` accepts (besides dim and num_heads), following ``**kwargs`` up the
    class hierarchy. Models use it to hand shared options (e.g. ``rope``) only to the mixers that have them."""
    if name not in _MIXERS:
        raise ValueError(f"token mixer: unknown {name!r}; allowed: {', '.join(list_mixers())}")
    options: List[str] = []
    for cls in _MIXERS[name].__mro__:
        if "__init__" not in vars(cls):
            continue
        params = list(inspect.signature(vars(cls)["__init__"]).parameters.values())[3:]  # self, dim, num_heads
        options += [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return sorted(set(options))
