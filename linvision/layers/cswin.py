"""CSWin's cross-shaped window attention, the ``"cswin_stripes"`` mixer of the published InLine-CSwin backbones.

Dong et al. 2022, "CSWin Transformer: A General Vision Transformer Backbone with Cross-Shaped Windows",
arXiv:2107.00652; the layout: :mod:`linvision.models.cswinhier`. Half the heads attend inside vertical stripes of
the map, the other half inside horizontal ones, each with a LePE of v inside its stripe. CSWin's last stage, whose
map is a single stripe at 224 px, attends over the whole map: ``"softmax"`` with ``lepe=True``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linvision.ops import Rope, is_tracing

from .context import MixerContext
from .mixers import AttentionMixer
from .options import check_size, lepe_size
from .registry import register_mixer

__all__ = ["CswinStripeAttention"]


@register_mixer("cswin_stripes")
class CswinStripeAttention(AttentionMixer):
    """CSWin's cross-shaped window attention: softmax attention (scale D^-1/2), the first half of the heads inside
    vertical stripes ``stripe`` tokens wide and the whole map high, the second half inside horizontal stripes
    ``stripe`` tokens high and the whole map wide; to each stripe's output a ``lepe_kernel`` x ``lepe_kernel``
    (3) depthwise convolution of its v (zero padding at the stripe's edges: LePE, ``stripe_lepe``, one kernel
    per channel; none with ``lepe=False``) is added. A map that is
    not a whole number of stripes is padded at the right / bottom, padded keys taking no weight. No RoPE, no
    prefix tokens (CSWin's whole-map last stage is ``"softmax"`` with ``lepe=True``)."""

    accepts = frozenset()
    exports_fixed_grid = True  # the stripe count and padding follow the size: exported at one size

    def __init__(self, dim: int, num_heads: int, *, stripe: int = 7, lepe: bool = True,
                 lepe_kernel: Optional[int] = None, **kwargs):
        # its LePE is the stripes' own (stripe_lepe), not the mixer's of the whole map (lepe=False)
        super().__init__(dim, num_heads, **kwargs)
        lepe_kernel = lepe_size(lepe, lepe_kernel, 3)
        if self.rope_type is not None:
            raise ValueError(f"rope: cswin_stripes places tokens by its LePE, not RoPE; got {self.rope_type!r}")
        check_size("stripe", stripe)
        if num_heads % 2:
            raise ValueError(f"num_heads: cswin_stripes splits the heads between vertical and horizontal stripes, "
                             f"so needs an even count, got {num_heads}")
        self.stripe = stripe
        self.stripe_lepe = nn.Conv2d(dim, dim, lepe_kernel, padding=lepe_kernel // 2, groups=dim) if lepe else None

    def _branch(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], vertical: bool,
                weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
        """Attention inside the stripes of one direction for q, k, v (B, h, N, D); the LePE with ``weight``
        (h * D, 1, k, k) and ``bias`` inside each stripe (none when ``weight`` is None)."""
        b, nh, n, d = q.shape
        h, w = hw
        s = self.stripe
        count = (w + s - 1) // s if vertical else (h + s - 1) // s  # stripes per image
        # the padded map as count stripes of s: a product, so a symbolic size (torch.compile) needs no guard on it
        hp, wp = (h, count * s) if vertical else (count * s, w)
        pad_h, pad_w = hp - h, wp - w

        def stripes(t: Tensor) -> Tensor:  # (B, h, N, D) -> (B * stripes, h, tokens of a stripe, D)
            th, td = t.shape[1], t.shape[3]
            t = F.pad(t.reshape(b, th, h, w, td), (0, 0, 0, pad_w, 0, pad_h))
            if vertical:  # (B, h, H, W / s, s, D) -> (B, W / s, h, H, s, D)
                t = t.reshape(b, th, hp, count, s, td).permute(0, 3, 1, 2, 4, 5)
            else:  # (B, h, H / s, s, W, D) -> (B, H / s, h, s, W, D)
                t = t.reshape(b, th, count, s, wp, td).permute(0, 2, 1, 3, 4, 5)
            return t.reshape(b * count, th, hp * s if vertical else s * wp, td)

        qs, ks, vs = stripes(q), stripes(k), stripes(v)
        mask = None
        # padded keys take no weight: (B * stripes, 1, 1, tokens); always built in a traced graph, which holds for
        # every size (whether a size pads is not asked of a symbolic size)
        if is_tracing(n) or pad_h or pad_w:
            real = stripes(torch.ones(b, 1, n, 1, dtype=q.dtype, device=q.device)) > 0
            mask = real[..., 0][:, :, None, :]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        if weight is not None:
            sh, sw = (hp, s) if vertical else (s, wp)
            grid = vs.transpose(2, 3).reshape(b * count, nh * d, sh, sw)  # channel head * D + i, per stripe
            lepe = F.conv2d(grid, weight, bias, padding=weight.shape[-1] // 2, groups=nh * d)
            out = out + lepe.reshape(b * count, nh, d, sh * sw).transpose(2, 3)
        # back to the map: (B * stripes, h, tokens, D) -> (B, h, N, D)
        if vertical:
            out = out.reshape(b, count, nh, hp, s, d).permute(0, 2, 3, 1, 4, 5).reshape(b, nh, hp, wp, d)
        else:
            out = out.reshape(b, count, nh, s, wp, d).permute(0, 2, 1, 3, 4, 5).reshape(b, nh, hp, wp, d)
        return out[:, :, :h, :w].reshape(b, nh, n, d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        half, c = self.num_heads // 2, self.dim // 2
        weight = bias = (None, None)
        if self.stripe_lepe is not None:
            w, b = self.stripe_lepe.weight.to(v.dtype), self.stripe_lepe.bias.to(v.dtype)
            weight, bias = (w[:c], w[c:]), (b[:c], b[c:])
        vertical = self._branch(q[:, :half], k[:, :half], v[:, :half], ctx.hw, True, weight[0], bias[0])
        horizontal = self._branch(q[:, half:], k[:, half:], v[:, half:], ctx.hw, False, weight[1], bias[1])
        return torch.cat([vertical, horizontal], dim=1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stripe={self.stripe}"
