"""MLLA's Mamba-like linear attention, the mixer of the published MLLA backbones.

Han et al. 2024, "Demystify Mamba in Vision: A Linear Attention Perspective", NeurIPS 2024, arXiv:2405.16605; the
models that load the authors' weights: :mod:`linvision.models.mlla`.

- ``"mlla"`` (:class:`MllaMixer`, the published form): linear attention on a convolved input inside a Mamba-like
  gated branch; its attention is :class:`MllaAttention` (q and k from one projection, v the input itself, no output
  projection of its own, MLLA's RoPE table over all channels).
- The ablation's form of the attention alone is ``"linear_rope"``
  (:class:`~linvision.layers.mixers.LinearRopeAttention`: linear attention with axial RoPE and LePE).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linvision.ops import Rope, axial_rope, check_grid

from .context import MixerContext
from .mixers import LinearAttention
from .registry import TokenMixer, register_mixer

__all__ = ["MllaAttention", "MllaMixer"]


class MllaAttention(LinearAttention):
    """MLLA's linear attention: :class:`~linvision.layers.LinearAttention` whose ``qkv`` projects q and k only
    (v is the input itself), with no output projection of its own (``proj`` is an Identity: the gated branch
    around it projects), and MLLA's RoPE: one axial table over all C channels, split into per-head tables,
    instead of one table of the head dim shared by every head. Options: those of LinearAttention."""

    def build_qkv(self, dim: int, bias: bool) -> nn.Module:
        return nn.Linear(dim, 2 * dim, bias=bias)

    def build_proj(self, dim: int) -> nn.Module:
        return nn.Identity()

    def project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        q, k = self.qkv(x).chunk(2, dim=-1)
        return q, k, x

    def make_rope(self, hw: Tuple[int, int], device: torch.device, num_prefix_tokens: int = 0) -> Optional[Rope]:
        if self.rope_type != "axial":
            return super().make_rope(hw, device, num_prefix_tokens)
        return axial_rope(self.rope_dim * self.num_heads, hw, num_prefix_tokens=num_prefix_tokens, device=device,
                          num_heads=self.num_heads, ref_grid=self.rope_ref_grid, **self.rope_axial)


@register_mixer("mlla")
class MllaMixer(TokenMixer):
    """MLLA's Mamba-like token mixer (Han et al. 2024, arXiv:2405.16605): linear attention on a convolved input,
    gated by the input, as Mamba gates its scan:

        u = SiLU(dwconv3x3(in_proj(x)));  out = out_proj(attn(u) * SiLU(act_proj(x)))

    attn: :class:`MllaAttention` (q, k from one projection of u and v = u, no output projection of its own),
    elu+1 map, mean-form eps 1e-6, LePE 3x3 on v, RoPE with theta 10000 and the rows in the first half of the
    pairs. MLLA pairs channels (2t, 2t+1); the pairs here are (t, t + D/2), so its checkpoints are loaded with
    the rows of the q and k projection reordered (:func:`linvision.ops.halves_from_interleaved`), which computes
    the same outputs.

    Options: feature_map, eps, rope (None drops RoPE), rope_ref_grid (position interpolation, as
    :class:`~linvision.layers.mixers.AttentionMixer`'s), qkv_bias, proj_drop. The grid is given at call time, so
    the RoPE tables follow any input size (the published model fixed them to the 224 px grid).
    """

    def __init__(self, dim: int, num_heads: int, *, feature_map: str = "elu", eps: float = 1e-6,
                 rope: Optional[str] = "axial", rope_ref_grid: Optional[Union[int, Tuple[int, int]]] = None,
                 qkv_bias: bool = True, proj_drop: float = 0.0):
        super().__init__()
        self.dim = dim
        self.in_proj = nn.Linear(dim, dim)
        self.act_proj = nn.Linear(dim, dim)
        self.dwc = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.attn = MllaAttention(
            dim, num_heads, feature_map=feature_map, eps=eps, rope=rope, rope_theta=10000.0, rope_row_first=True,
            rope_ref_grid=rope_ref_grid, lepe=True, qkv_bias=qkv_bias,
        )
        self.out_proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def mix(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """x: (B, N, C) tokens on the grid ``ctx.hw`` -> (B, N, C)."""
        h, w = check_grid(ctx.hw, x.shape[1], name="hw")
        b, n, c = x.shape
        gate = F.silu(self.act_proj(x))
        u = self.in_proj(x).transpose(1, 2).reshape(b, c, h, w)
        u = F.silu(self.dwc(u)).flatten(2).transpose(1, 2)  # (B, N, C)
        return self.proj_drop(self.out_proj(self.attn(u, (h, w)) * gate))
