"""RALA, the rank-augmented linear attention of RAVLT, in its ablation forms and as RAVLT publishes it.

Fan et al. 2025, "Breaking the Low-Rank Dilemma of Linear Attention", CVPR 2025, arXiv:2411.07635; the models that
load the authors' weights: :mod:`linvision.models.ravlt`.

- ``"rala"`` (:class:`RALAttention`): keys reweighted by the softmax of the global query's scores; LePE added,
  then the element-wise output modulation (o + LePE) * (W_o x) (linear, no activation), as RAVLT computes it.
  Default axial RoPE and LePE (RAVLT has both).
- ``"rala_premod"`` (:class:`RALAPremodAttention`): the earlier form measured on the results page, the modulation
  on the attention term o alone, before LePE is added.
- ``"ravlt_rala"`` (:class:`RavltRala`): ``"rala"`` with RAVLT's RoPE frequencies
  (:class:`~linvision.layers.mixers.RavltRope`), RAVLT's first two stages. Its softmax stages are
  ``"ravlt_softmax"`` (:class:`~linvision.layers.mixers.RavltSoftmax`, beside softmax attention).

The op: :func:`linvision.ops.attention_variants.rank_augmented_linear_attention`.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from linvision.ops import Rope
from linvision.ops.attention_variants import rank_augmented_linear_attention

from .context import MixerContext
from .mixers import AttentionMixer, OutputModulation, RavltRope
from .registry import register_mixer

__all__ = ["RALAttention", "RALAPremodAttention", "RavltRala"]


@register_mixer("rala")
class RALAttention(OutputModulation, AttentionMixer):
    """RALA as RAVLT publishes it: rank-augmented linear attention, LePE, then the element-wise output modulation
    (attention + LePE) * (W_o x) (``gate``, no activation; ``gate=False`` drops it), then the projection.
    feature_map: the map of q and k (default "elu"); eps: the denominator's eps."""

    def __init__(self, dim: int, num_heads: int, *, feature_map: str = "elu", eps: float = 1e-6,
                 rope: Optional[str] = "axial", lepe: bool = True, gate: bool = True, **kwargs):
        super().__init__(dim, num_heads, rope=rope, lepe=lepe, gate=gate, **kwargs)
        self.use_feature_map(feature_map, nonnegative=True)
        self.eps = eps

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        return rank_augmented_linear_attention(q, k, v, self.phi(), rope=rope, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map}, modulation={self.gate is not None}"


@register_mixer("rala_premod")
class RALAPremodAttention(AttentionMixer):
    """RALA's keys with the output modulation on the attention term alone, before LePE is added:
    proj(act(W_g x) * (attention * (W_o x) + LePE)) with the optional SiLU ``gate`` of AttentionMixer. The form
    the comparisons of the results page measured (under the name "rala" then); RAVLT's own form is ``"rala"``.
    ``modulation=False`` drops W_o. feature_map: the map of q and k (default "elu"); eps: the denominator's eps."""

    def __init__(self, dim: int, num_heads: int, *, feature_map: str = "elu", eps: float = 1e-6,
                 modulation: bool = True, rope: Optional[str] = "axial", lepe: bool = True, **kwargs):
        super().__init__(dim, num_heads, rope=rope, lepe=lepe, **kwargs)
        self.use_feature_map(feature_map, nonnegative=True)
        self.eps = eps
        self.modulation = nn.Linear(dim, dim) if modulation else None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        out = rank_augmented_linear_attention(q, k, v, self.phi(), rope=rope, eps=self.eps)
        if self.modulation is None:
            return out
        b, nh, n, d = v.shape
        return out * self.modulation(x).reshape(b, n, nh, d).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map}, modulation={self.modulation is not None}"


@register_mixer("ravlt_rala")
class RavltRala(RavltRope, RALAttention):
    """RAVLT's RALA stages: ``"rala"`` (rank-augmented linear attention, LePE, the output modulation) with RAVLT's
    RoPE frequencies."""
