"""InLine's injective linear attention, in its ablation form and as InLine-DeiT / -Swin / -PVT / -CSwin publish it.

Han et al. 2024, "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv:2412.06590; the models that load the authors' weights: :mod:`linvision.models.inline`.

Injective linear attention: the identity map, the scores minus their mean plus 1/N,
o_i = sum_j (s q_i.k_j - s q_i.kbar + 1) / N v_j with s = D^-1/2
(:func:`linvision.ops.attention_variants.injective_linear_attention`), plus a local residual, a 3x3 mixing of v
whose weights are predicted from the input:

- ``"inline"`` (:class:`InLineAttention`, the ablation's form, the one the results page measured): per token and
  head, 9 weights predicted from the input (3x3 depthwise conv, GELU, 1x1 conv) mix the 3x3 neighbourhood of v;
  no prefix tokens.
- ``"inline_deit"`` (:class:`InLineDeitAttention`, the published form): a 3x3 depthwise convolution of v whose nine
  weights per image and channel are predicted from the mean input token by two grouped 1x1 projections (one group
  per head) with a GELU between them; prefix tokens (the class token) take part in the attention and the mean.
- ``"inline_cswin"`` (:class:`InLineCswinAttention`): ``"inline_deit"`` on the grid with a 3x3 LePE of v, the
  kernels predicted from the block's input before its norm (the context's ``block_input``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linvision.ops import Rope
from linvision.ops.attention_variants import injective_linear_attention

from .context import MixerContext
from .mixers import AttentionMixer
from .registry import register_mixer

__all__ = ["InLineAttention", "InLineDeitAttention", "InLineCswinAttention"]


@register_mixer("inline")
class InLineAttention(AttentionMixer):
    """InLine's injective linear attention with its local residual (``local=False`` drops it).

    scale: score scale (default head_dim^-1/2). RoPE (if set) rotates q and k before the scores.
    """

    accepts = frozenset()  # the local residual convolves the grid

    def __init__(self, dim: int, num_heads: int, *, local: bool = True, scale: Optional[float] = None, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.scale = scale
        self.local = None
        if local:
            self.local = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim), nn.GELU(),
                                       nn.Conv2d(dim, 9 * num_heads, 1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        out = injective_linear_attention(q, k, v, scale=self.scale, rope=rope)
        if self.local is None:
            return out
        b, nh, n, d = v.shape
        h, w = ctx.hw
        weights = self.local(x.transpose(1, 2).reshape(b, x.shape[-1], h, w)).reshape(b, nh, 9, n)
        patches = F.unfold(v.transpose(2, 3).reshape(b * nh, d, h, w), 3, padding=1).reshape(b, nh, d, 9, n)
        return out + torch.einsum("bhdtn,bhtn->bhnd", patches, weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, local={self.local is not None}"


@register_mixer("inline_deit")
class InLineDeitAttention(AttentionMixer):
    """InLine-DeiT's attention (see the module docstring): injective linear attention over every token and the
    local residual of v on the grid, with kernels predicted per image and channel from the mean input token.

    scale: score scale (default head_dim^-1/2). RoPE (if set) rotates q and k before the scores. Prefix tokens take
    part in the attention and in the mean that predicts the kernels; the residual adds nothing to them.
    """

    def __init__(self, dim: int, num_heads: int, *, scale: Optional[float] = None, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.scale = scale
        self.local = nn.Sequential(nn.Conv1d(dim, dim, 1, groups=num_heads), nn.GELU(),
                                   nn.Conv1d(dim, 9 * dim, 1, groups=num_heads))

    def local_kernels(self, x: Tensor) -> Tensor:
        """x (B, N, C) -> the 3x3 kernels (B, C, 9) of the local residual, row-major over the window; channel c's
        nine weights are outputs 9c..9c+8 of the second projection."""
        b, _, c = x.shape
        return self.local(x.mean(dim=1).unsqueeze(-1)).reshape(b, c, 9)

    def kernel_input(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """The tokens (B, N, C) whose mean predicts the local kernels: the mixer's input x."""
        return x

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        out = injective_linear_attention(q, k, v, scale=self.scale, rope=rope)
        b, nh, n, d = v.shape
        h, w = ctx.hw
        p = n - h * w  # prefix tokens
        grid = v[:, :, p:].transpose(2, 3).reshape(b, nh * d, h, w)  # channel head * D + i, as x's
        kernels = self.local_kernels(self.kernel_input(x, ctx)).to(grid.dtype)[..., None, None]
        # the per-image depthwise 3x3 cross-correlation as nine shifted products (no convolution with one group
        # per image and channel, whose group count depends on the batch: ONNX cannot export that)
        padded = F.pad(grid, (1, 1, 1, 1))
        local = kernels[:, :, 0] * padded[:, :, :h, :w]
        for t in range(1, 9):
            local = local + kernels[:, :, t] * padded[:, :, t // 3:t // 3 + h, t % 3:t % 3 + w]
        local = local.reshape(b, nh, d, h * w).transpose(2, 3)
        return out + (F.pad(local, (0, 0, p, 0)) if p else local).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, local=per-image 3x3"


@register_mixer("inline_cswin")
class InLineCswinAttention(InLineDeitAttention):
    """InLine-CSwin's attention: ``"inline_deit"`` on the grid (no prefix tokens) with a 3x3 depthwise LePE of v
    (``lepe``, on by default) added to the output, the local residual's kernels predicted from the mean of the
    block's input before its norm (the context's ``block_input``, which a block hands to every mixer; the mixer's
    input x when called alone)."""

    accepts = frozenset()

    def __init__(self, dim: int, num_heads: int, *, lepe: bool = True, **kwargs):
        super().__init__(dim, num_heads, lepe=lepe, **kwargs)

    def kernel_input(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """The block's input before its norm (x when there is none)."""
        return ctx.input_tokens(x)
