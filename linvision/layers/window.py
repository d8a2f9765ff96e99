"""Swin's shifted-window softmax attention, the ``"swin_window"`` mixer of the published Swin-shaped backbones.

Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", arXiv:2103.14030; the
layout that alternates its shift: :mod:`linvision.models.swinhier`. The ablation's window form is the local branch
of ``"hybrid"`` (:class:`~linvision.layers.mixers.HybridAttention`, whose window helpers this module shares).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models.swin_transformer import get_relative_position_index
from torch import Tensor, nn

from linvision.ops import Rope

from .context import MixerContext
from .mixers import AttentionMixer, window_merge, window_partition
from .options import check_size
from .registry import register_mixer

__all__ = ["SwinWindowAttention"]


@register_mixer("swin_window")
class SwinWindowAttention(AttentionMixer):
    """Swin's window attention: softmax attention (scale D^-1/2) inside ``window`` x ``window`` windows, with a
    learned bias per head and relative offset (``relative_position_bias_table``, (2 window - 1)^2 x heads).
    ``shift``: the windows are shifted by half a window (Swin's odd blocks; along an axis no longer than the
    window, nothing shifts), tokens brought together across the map's edge by the shift kept apart by a bias of
    -100, as Swin does. The map is padded at the bottom and right to whole windows; padded keys take no weight.
    No RoPE, no prefix tokens."""

    accepts = frozenset()
    exports_fixed_grid = True  # the window count, padding and shift follow the size: exported at one size

    def __init__(self, dim: int, num_heads: int, *, window: int = 7, shift: bool = False, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        check_size("window", window)
        if self.rope_type is not None:
            raise ValueError(f"rope: swin_window places tokens by its relative position bias, not RoPE; got "
                             f"{self.rope_type!r}")
        self.window, self.shift = window, bool(shift)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", get_relative_position_index(window, window).flatten(),
                             persistent=False)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return super().no_weight_decay() | {"relative_position_bias_table"}

    def _shifts(self, hw: Tuple[int, int]) -> Tuple[int, int]:
        s = self.window // 2 if self.shift else 0
        return tuple(s if n > self.window else 0 for n in hw)

    def _bias(self, padded: Tuple[int, int], shifts: Tuple[int, int], valid: Tensor, dtype: torch.dtype) -> Tensor:
        """(heads, windows, w*w, w*w): the relative position bias, -100 between tokens of different regions of
        the padded, shifted map (Swin's regions: the last ``shift`` rows and columns are those the roll brought
        round), -inf for padded keys; ``valid``: (windows, w*w), the real tokens."""
        area = self.window * self.window
        table = self.relative_position_bias_table.to(dtype)
        bias = table[self.relative_position_index].reshape(area, area, -1).permute(2, 0, 1)[:, None]
        (hp, wp), (sh, sw) = padded, shifts
        rows = torch.arange(hp, device=valid.device) >= hp - sh  # the rows the shift brought in (none for sh = 0)
        cols = torch.arange(wp, device=valid.device) >= wp - sw
        region = (rows[:, None] * 2 + cols[None, :]).to(dtype).reshape(1, 1, hp * wp, 1)
        windows = window_partition(region, padded, self.window)[0][0, 0, :, :, 0]  # (nW, w*w)
        other = (windows[:, :, None] != windows[:, None, :]).to(dtype) * -100.0
        other = other.masked_fill(~valid[:, None, :], float("-inf"))
        return bias + other[None]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        """Swin's order: the map padded at the bottom and right to whole windows, then rolled by the shift, then
        split into windows; after attention rolled back and cropped."""
        b, nh, n, d = q.shape
        hw = ctx.hw
        (h, w), win = hw, self.window
        padded = (math.ceil(h / win) * win, math.ceil(w / win) * win)
        shifts = self._shifts(hw)

        def shifted(t: Tensor, sign: int = -1) -> Tensor:  # (..., Hp, Wp, D) rolled by sign * shifts
            return t.roll((sign * shifts[0], sign * shifts[1]), dims=(-3, -2)) if any(shifts) else t

        def windows(t: Tensor) -> Tensor:
            grid = F.pad(t.reshape(b, nh, h, w, d), (0, 0, 0, padded[1] - w, 0, padded[0] - h))
            return window_partition(shifted(grid).reshape(b, nh, padded[0] * padded[1], d), padded, win)[0]

        real = shifted(F.pad(torch.ones(h, w, 1, device=q.device), (0, 0, 0, padded[1] - w, 0, padded[0] - h)))
        valid = window_partition(real.reshape(1, 1, -1, 1), padded, win)[0][0, 0, :, :, 0] > 0
        qw, kw, vw = windows(q), windows(k), windows(v)
        count, area = qw.shape[2], qw.shape[3]
        # heads and windows on one axis: SDPA on 4D tensors (as ONNX's operator takes them), the bias per both
        mask = self._bias(padded, shifts, valid, q.dtype).reshape(1, nh * count, area, area)
        out = F.scaled_dot_product_attention(*(t.reshape(b, nh * count, area, d) for t in (qw, kw, vw)),
                                             attn_mask=mask)
        grid = window_merge(out.reshape(b, nh, count, area, d), padded, padded, win).reshape(b, nh, *padded, d)
        return shifted(grid, 1)[:, :, :h, :w].reshape(b, nh, n, d)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, shift={self.shift}"
