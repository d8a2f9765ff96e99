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
from typing import Callable, Dict, List, Sequence, Tuple, Type, Union

from timm.layers import register_notrace_module
from torch import nn

__all__ = ["register_mixer", "create_mixer", "list_mixers", "mixer_options", "parse_mixer_list",
           "no_weight_decay_of"]

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


def parse_mixer_list(token_mixers: Union[str, Sequence[str]], num_stages: int,
                     name: str = "token_mixers") -> Tuple[str, ...]:
    """"linear,linear,none,softmax" or a sequence -> a tuple of ``num_stages`` registered mixer names; one name
    is repeated for every stage. Raises ValueError (naming ``name``) for a wrong count or an unknown mixer."""
    names = token_mixers.split(",") if isinstance(token_mixers, str) else list(token_mixers)
    names = [n.strip() for n in names]
    if len(names) == 1:
        names = names * num_stages
    if len(names) != num_stages:
        raise ValueError(f"{name}: {len(names)} names {names} for {num_stages} stages; give 1 or {num_stages}")
    unknown = [n for n in names if n not in _MIXERS]
    if unknown:
        raise ValueError(f"{name}: unknown {unknown}; allowed: {', '.join(list_mixers())}")
    return tuple(names)


def no_weight_decay_of(model: nn.Module) -> set:
    """Full names of the parameters that the sub-modules of ``model`` exclude from weight decay through their
    own ``no_weight_decay()`` (timm's convention), so a model aggregates them instead of matching names."""
    names = set()
    for prefix, module in model.named_modules():
        if module is not model and hasattr(module, "no_weight_decay"):
            names |= {f"{prefix}.{n}" for n in module.no_weight_decay()}
    return names
