"""PolaFormer's polarity-aware linear attention, in its ablation form and as Pola-Swin / Pola-PVT publish it.

Meng et al. 2025, "PolaFormer: Polarity-aware Linear Attention for Vision Transformers", ICLR 2025,
arXiv:2501.15061; the models that load the authors' weights: :mod:`linvision.models.polaformer`.

- ``"pola"`` (:class:`PolaAttention`, the ablation's form): q and k are divided by a learnable softplus scale per
  channel and sharpened by a learnable power p = 1 + alpha * sigmoid(w) per head and channel (alpha 4, w = 0 at
  start: p = 3). Default LePE (a per-channel 3x3 depthwise conv on v); takes prefix tokens.
- ``"pola_swin"`` (:class:`PolaSwinAttention`, the published block attention): the same attention with q, k, v
  and the output modulation from one input, a learned key position encoding of the stage grid, a 5x5 depthwise
  conv of v shared by the heads (:class:`HeadSharedConv`) and the modulation (attention + conv) * (W_g x).

The op: :func:`linvision.ops.attention_variants.polarity_linear_attention`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import Tensor, nn

from linvision.ops import Rope
from linvision.ops.attention_variants import polarity_linear_attention

from .context import MixerContext
from .derived import derived
from .mixers import AttentionMixer, OutputModulation
from .options import lepe_size
from .registry import register_mixer

__all__ = ["PolaAttention", "HeadSharedConv", "PolaSwinAttention"]


@register_mixer("pola")
class PolaAttention(AttentionMixer):
    """PolaFormer's polarity-aware linear attention (see the module docstring).

    alpha: the power ranges over 1..1 + alpha (default 4). eps: the denominators' eps (default 1e-6).
    RoPE rotates the 2D-channel polarity features (``rope_dim`` = 2 * head dim). Other options:
    :class:`AttentionMixer`. Needs an even head dim (the value channels are split in two).
    """

    def __init__(self, dim: int, num_heads: int, *, alpha: float = 4.0, eps: float = 1e-6, lepe: bool = True,
                 **kwargs):
        if not alpha > 0:
            raise ValueError(f"alpha: must be > 0, got {alpha!r}")
        super().__init__(dim, num_heads, lepe=lepe, **kwargs)
        if self.head_dim % 2:
            raise ValueError(f"num_heads: PolaFormer needs an even head dim, got {self.head_dim}")
        self.alpha, self.eps = float(alpha), eps
        self.power_logit = nn.Parameter(torch.zeros(num_heads, 1, self.head_dim))  # p = 1 + alpha/2 at start
        self.qk_scale = nn.Parameter(torch.zeros(num_heads, 1, self.head_dim))  # divisor softplus(s)

    @property
    def rope_dim(self) -> int:
        return 2 * self.head_dim

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return super().no_weight_decay() | {"power_logit", "qk_scale"}

    def power(self) -> Tensor:
        return 1 + self.alpha * torch.sigmoid(self.power_logit)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # features and division in fp32
        # the divisor and the power, formed once for inference (derived), on every call when trained
        div, power = derived(self, f"scale-power-{cdt}", (self.qk_scale, self.power_logit),
                             lambda: (F.softplus(self.qk_scale).to(cdt), self.power().to(cdt))) \
            or (F.softplus(self.qk_scale).to(cdt), self.power())
        return polarity_linear_attention(q, k, v, power, rope=rope, eps=self.eps, scale=div).to(v.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha}"


class HeadSharedConv(nn.Module):
    """One depthwise k x k convolution of a head's D channels, applied to every head: (B, heads * D, H, W) ->
    the same shape (PolaFormer's ``dwc``; an ordinary per-channel LePE has heads times its weights)."""

    def __init__(self, head_dim: int, num_heads: int, kernel_size: int = 5):
        super().__init__()
        self.num_heads = num_heads
        self.conv = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        return self.conv(x.reshape(b * self.num_heads, c // self.num_heads, h, w)).reshape(b, c, h, w)


@register_mixer("pola_swin")
class PolaSwinAttention(OutputModulation, PolaAttention):
    """PolaFormer's block attention as Pola-Swin publishes it: ``"pola"`` (polarity-aware linear attention, power
    1 + alpha sigmoid(w) per head and channel, keys and queries divided by softplus(s) per channel, eps 1e-6), with

    - q, k, v and the modulation W_g x from one input (``qkv`` and ``gate``, the authors' ``qkvg`` split);
    - a learned position encoding of the map ``grid`` (H, W) added to the keys before the division (zeros, as
      the authors start it; none when ``grid`` is None), resampled to the input's grid when that differs (a
      model gives every block its stage's grid);
    - a ``lepe_kernel`` x ``lepe_kernel`` (default 5) depthwise convolution of v whose weights every head shares
      (:class:`HeadSharedConv`), added to the attention output;
    - the output modulation (attention + conv) * (W_g x), no activation, then the projection.

    The ablation's ``"pola"`` has a per-channel 3x3 LePE, no modulation and no key position encoding. No prefix
    tokens (the key encoding is a grid's).
    """

    accepts = frozenset()

    def __init__(self, dim: int, num_heads: int, *, lepe: bool = True, lepe_kernel: Optional[int] = None,
                 gate: bool = True, grid: Optional[Tuple[int, int]] = None, **kwargs):
        super().__init__(dim, num_heads, lepe=False, gate=gate, **kwargs)
        lepe_kernel = lepe_size(lepe, lepe_kernel, 5)
        self.lepe = HeadSharedConv(self.head_dim, num_heads, lepe_kernel) if lepe else None
        self.key_pos: Optional[nn.Parameter] = None
        self.key_pos_grid: Optional[Tuple[int, int]] = None
        if grid is not None:
            self.key_pos_grid = (int(grid[0]), int(grid[1]))
            self.key_pos = nn.Parameter(torch.zeros(1, grid[0] * grid[1], dim))

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return super().no_weight_decay() | ({"key_pos"} if self.key_pos is not None else set())

    def key_position(self, hw: Tuple[int, int]) -> Tensor:
        """The key position encoding on grid ``hw``: (1, H * W, C), resampled when ``hw`` is not its own grid."""
        if tuple(hw) == self.key_pos_grid:
            return self.key_pos
        return resample_abs_pos_embed(self.key_pos, list(hw), list(self.key_pos_grid), num_prefix_tokens=0)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        if self.key_pos is not None:
            b, nh, n, d = k.shape
            k = k + self.key_position(ctx.hw).to(k.dtype).reshape(1, n, nh, d).transpose(1, 2)
        return super().attend(q, k, v, rope, x, ctx)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, key_pos_grid={self.key_pos_grid}"
