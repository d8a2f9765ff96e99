"""The weight initialisation the model families use (timm's ViT convention), and the order that keeps each
module's own start: the model's generic rule first, then every module's own initialisation (``init_weights()``,
else a ``reset_parameters()`` of its own)."""
from __future__ import annotations

from typing import Callable, Optional

from timm.layers import trunc_normal_
from torch import nn

__all__ = ["init_linear_weights", "init_model_weights", "own_reset_parameters"]


def init_linear_weights(m: nn.Module) -> None:
    """For ``model.apply``: Linear weights from a truncated normal of std 0.02, biases zero; other modules keep
    their own initialisation."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def own_reset_parameters(m: nn.Module) -> Optional[Callable[[], None]]:
    """``m.reset_parameters`` when a class outside PyTorch defines it (timm's LayerScale, a project module): the
    module's own start. None for PyTorch's layers (Linear, Conv, norms), whose reset_parameters is only PyTorch's
    default, which a model's generic rule replaces on purpose, and for modules without one."""
    for cls in type(m).__mro__:
        if "reset_parameters" in vars(cls):
            return None if cls.__module__.split(".")[0] == "torch" else m.reset_parameters
    return None


def init_model_weights(model: nn.Module, generic=init_linear_weights) -> None:
    """``model.apply(generic)``, then each submodule's own start, so that no generic rule of the model overwrites
    it: its ``init_weights()`` when it has one (a mixer whose start is part of its design, e.g.
    :class:`~linvision.layers.recurrent.BidirGatedAttention`'s forget gate at RetNet's decays), else its
    ``reset_parameters()`` when a class outside PyTorch defines it (:func:`own_reset_parameters`; timm's
    ``init_weights_vit_timm`` honours both the same way). PyTorch's own ``reset_parameters`` (Linear, Conv, the
    norms) is never called: it would undo the generic rule. A module's own start covers what it resets, its
    children included (a Linear subclass with its own ``reset_parameters`` keeps it). Submodules are visited
    parents first. The model's own ``init_weights`` / ``reset_parameters``, if any, are not called."""
    model.apply(generic)
    for m in model.modules():
        if m is model:
            continue
        if callable(getattr(m, "init_weights", None)):
            m.init_weights()
            continue
        reset = own_reset_parameters(m)
        if reset is not None:
            reset()
