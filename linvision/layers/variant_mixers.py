"""Token mixers of the linear-attention designs in :mod:`linvision.ops.attention_variants`, registered by name:

- ``"pola"``: PolaFormer (ICLR 2025). Polarity-aware linear attention; q and k are divided by a learnable
  softplus scale per channel and sharpened by a learnable power p = 1 + alpha * sigmoid(w) per head and channel
  (alpha 4, w = 0 at start: p = 3). Default LePE (PolaFormer's depthwise conv on v).
- ``"inline"``: InLine (NeurIPS 2024). Injective linear attention (identity map, scores minus their mean plus
  1/N) and its local residual: per token and head, 9 weights predicted from the input (3x3 depthwise conv, GELU,
  1x1 conv) mix the 3x3 neighbourhood of v.
- ``"rala"``: RALA of RAVLT (CVPR 2025). Keys reweighted by the softmax of the global query's scores; LePE added,
  then the element-wise output modulation (o + LePE) * (W_o x) (linear, no activation), as RAVLT computes it.
  Default axial RoPE and LePE (RAVLT has both). ``"rala_premod"``: the earlier form measured on the results
  page, the modulation on the attention term o alone, before LePE is added.
- ``"mala"``: MALA (ICCV 2025). Magnitude-aware linear attention (elu+1 map, D^-1/2 score scale). Default axial
  RoPE and LePE (as in MAViT).
- ``"agent"``: Agent attention (ECCV 2024). Agents pooled from q on a ``agent_grid`` (default 7 x 7 = 49, the
  paper's count), two softmax stages. Default LePE (the paper's depthwise conv on v); no RoPE (an agent averages
  many positions and has no single rotation) and no agent bias tables (the model's CPE/LePE give positions).

All are :class:`~linvision.layers.mixers.AttentionMixer` subclasses (qkv projection, optional LePE, output gate,
projection), so every model family and the ablation take them by name. pola, rala, rala_premod and mala take
prefix tokens (class / register tokens); inline and agent, which work on the grid, do not. Which run on the fused
kernels: see :mod:`linvision.ops.attention_variants`.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linvision.ops import Rope
from linvision.ops.attention_variants import (
    agent_attention,
    injective_linear_attention,
)

from .mixers import AttentionMixer
from .options import check_square_grid
from .registry import register_mixer

__all__ = ["PolaAttention", "InLineAttention", "OutputModulation", "RALAttention", "RALAPremodAttention",
           "MALAttention", "AgentAttention"]


@register_mixer("inline")
class InLineAttention(AttentionMixer):
    """InLine's injective linear attention with its local residual (``local=False`` drops it).

    scale: score scale (default head_dim^-1/2). RoPE (if set) rotates q and k before the scores.
    """

    takes_prefix_tokens = False  # the local residual convolves the grid

    def __init__(self, dim: int, num_heads: int, *, local: bool = True, scale: Optional[float] = None, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.scale = scale
        self.local = None
        if local:
            self.local = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim), nn.GELU(),
                                       nn.Conv2d(dim, 9 * num_heads, 1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], rope: Optional[Rope], x: Tensor) -> Tensor:
        out = injective_linear_attention(q, k, v, scale=self.scale, rope=rope)
        if self.local is None:
            return out
        b, nh, n, d = v.shape
        h, w = hw
        weights = self.local(x.transpose(1, 2).reshape(b, x.shape[-1], h, w)).reshape(b, nh, 9, n)
        patches = F.unfold(v.transpose(2, 3).reshape(b * nh, d, h, w), 3, padding=1).reshape(b, nh, d, 9, n)
        return out + torch.einsum("bhdtn,bhtn->bhnd", patches, weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, local={self.local is not None}"


@register_mixer("agent")
class AgentAttention(AttentionMixer):
    """Agent attention. agent_grid: (rows, cols) of the agent pool (default (7, 7)); no RoPE (ValueError)."""

    takes_prefix_tokens = False  # the agents are pooled from the grid

    def __init__(self, dim: int, num_heads: int, *, agent_grid: Tuple[int, int] = (7, 7), lepe: bool = True,
                 rope: Optional[str] = None, **kwargs):
        if rope is not None:
            raise ValueError("rope: agent attention takes no RoPE (an agent averages many positions and has no "
                             "single rotation); use LePE/CPE for positions")
        agent_grid = check_square_grid("agent_grid", agent_grid)
        super().__init__(dim, num_heads, lepe=lepe, **kwargs)
        self.agent_grid = agent_grid

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], rope: Optional[Rope], x: Tensor) -> Tensor:
        return agent_attention(q, k, v, hw, self.agent_grid)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, agents={math.prod(self.agent_grid)}"
