"""The weight initialisation the model families use (timm's ViT convention), and the order that keeps each
module's own start: the model's generic rule first, then every module's ``init_weights()``."""
from __future__ import annotations

from timm.layers import trunc_normal_
from torch import nn

__all__ = ["init_linear_weights", "init_model_weights"]


def init_linear_weights(m: nn.Module) -> None:
    """For ``model.apply``: Linear weights from a truncated normal of std 0.02, biases zero; other modules keep
    their own initialisation."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def init_model_weights(model: nn.Module, generic=init_linear_weights) -> None:
    """``model.apply(generic)``, then ``init_weights()`` of every submodule that defines one (a mixer whose start
    is part of its design, e.g. :class:`~linvision.layers.recurrent.BidirGatedAttention`'s forget gate at RetNet's decays),
    so that no generic rule of the model overwrites it. The model's own ``init_weights``, if any, is not called."""
    model.apply(generic)
    for m in model.modules():
        if m is not model and callable(getattr(m, "init_weights", None)):
            m.init_weights()
