"""What a token mixer is told about its tokens besides the tokens themselves: :class:`MixerContext`.

Every token mixer is called one way, ``mixer(x, ctx)``: x the tokens (B, N, C) and ctx one
:class:`MixerContext`, which says where the tokens lie (the grid, the prefix tokens before it, or the layout of a
batch of images of different sizes) and hands on the block's input before its norm. The grid alone, ``(H, W)``,
stands for ``MixerContext((H, W))``. A mixer reads the parts it uses and names, in its class's ``accepts``, the
parts beyond the grid it can take (:data:`CONTEXT_PARTS`); :class:`~linvision.layers.TokenMixer` refuses the
others in one line before any work.

The context is a named tuple, so timm's FX tracing records a mixer called with it as one leaf node, and
``torch.compile`` and ``torch.export`` trace through it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

from torch import Tensor

from .layout import TokenLayout

__all__ = ["MixerContext", "CONTEXT_PARTS"]

# what a mixer may take beyond the grid: prefix tokens (class / register tokens) before it, and a layout
CONTEXT_PARTS = ("prefix_tokens", "layout")


class MixerContext(NamedTuple):
    """Where a mixer's tokens x (B, N, C) lie.

    hw: the grid (H, W) of the tokens in raster order, N = P + H * W (with a layout, the batch's own sizes
        hold and ``hw`` is not read).
    num_prefix_tokens: P, the class / register tokens before the grid (part ``"prefix_tokens"``).
    layout: a batch of images of different sizes, each sample's tokens where the
        :class:`~linvision.layers.TokenLayout` puts them after the prefix tokens (part ``"layout"``).
    block_input: the block's input before its norm, tokens (B, N, C) or a channels-last grid (B, H, W, C), for a
        mixer that reads it (InLine-CSwin predicts its local kernels from its mean); None outside a block.
    """

    hw: Tuple[int, int]
    num_prefix_tokens: int = 0
    layout: Optional[TokenLayout] = None
    block_input: Optional[Tensor] = None

    @classmethod
    def of(cls, ctx: Union["MixerContext", Tuple[int, int]]) -> "MixerContext":
        """``ctx`` itself, or the context of the grid ``ctx`` = (H, W); TypeError in one line otherwise."""
        if isinstance(ctx, MixerContext):
            return ctx
        if isinstance(ctx, (tuple, list)) and len(ctx) == 2:
            return cls(tuple(ctx))
        raise TypeError(f"ctx: expected a MixerContext or the grid (H, W), got {type(ctx).__name__}"
                        + (f" of length {len(ctx)}" if isinstance(ctx, (tuple, list)) else ""))

    def parts(self) -> Tuple[str, ...]:
        """The parts of :data:`CONTEXT_PARTS` this context holds."""
        return tuple(part for part, held in zip(CONTEXT_PARTS, (self.num_prefix_tokens, self.layout is not None))
                     if held)

    def input_tokens(self, x: Tensor) -> Tensor:
        """The block's input as tokens shaped as x (B, N, C); x itself when there is none."""
        return x if self.block_input is None else self.block_input.reshape(x.shape)
