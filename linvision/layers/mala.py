"""MALA, the magnitude-aware linear attention of MAViT, in its ablation form and as MAViT publishes it.

Fan et al. 2025, "Rectifying Magnitude Neglect in Linear Attention", ICCV 2025, arXiv:2507.00698; the models that
load the authors' weights: :mod:`linvision.models.mavit`.

- ``"mala"`` (:class:`MALAttention`): magnitude-aware linear attention (elu+1 map, D^-1/2 score scale). Default
  axial RoPE and LePE (as in MAViT).
- ``"mavit_mala"`` (:class:`MavitMala`): ``"mala"`` with RAVLT's RoPE frequencies
  (:class:`~linvision.layers.mixers.RavltRope`) and the output modulation
  (:class:`~linvision.layers.mixers.OutputModulation`), MAViT's first two stages.

The op: :func:`linvision.ops.attention_variants.magnitude_aware_linear_attention`.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from linvision.ops import Rope
from linvision.ops.attention_variants import magnitude_aware_linear_attention

from .context import MixerContext
from .mixers import AttentionMixer, OutputModulation, RavltRope
from .registry import register_mixer

__all__ = ["MALAttention", "MavitMala"]


@register_mixer("mala")
class MALAttention(AttentionMixer):
    """MALA: magnitude-aware linear attention. feature_map (default "elu"), scale (default head_dim^-1/2), eps."""

    def __init__(self, dim: int, num_heads: int, *, feature_map: str = "elu", scale: Optional[float] = None,
                 eps: float = 1e-6, rope: Optional[str] = "axial", lepe: bool = True, **kwargs):
        super().__init__(dim, num_heads, rope=rope, lepe=lepe, **kwargs)
        self.use_feature_map(feature_map, nonnegative=True)
        self.scale, self.eps = scale, eps

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        return magnitude_aware_linear_attention(q, k, v, self.phi(), scale=self.scale, rope=rope,
                                                eps=self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map}"


@register_mixer("mavit_mala")
class MavitMala(RavltRope, OutputModulation, MALAttention):
    """MAViT's linear-attention stages: ``"mala"`` (magnitude-aware linear attention, LePE) with RAVLT's RoPE
    frequencies and the output modulation (x (W_o x), no activation: the mixer's ``gate``)."""
