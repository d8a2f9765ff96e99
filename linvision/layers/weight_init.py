"""The weight initialisation both model families use (timm's ViT convention)."""
from __future__ import annotations

from timm.layers import trunc_normal_
from torch import nn

__all__ = ["init_linear_weights"]


def init_linear_weights(m: nn.Module) -> None:
    """For ``model.apply``: Linear weights from a truncated normal of std 0.02, biases zero; other modules keep
    their own initialisation."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
