"""Agent attention, the ablation's ``"agent"`` mixer.

Han et al. 2024, "Agent Attention: On the Integration of Softmax and Linear Attention", ECCV 2024,
arXiv:2312.08874. Agents pooled from q on an ``agent_grid`` (default 7 x 7 = 49, the paper's count), two softmax
stages (:func:`linvision.ops.attention_variants.agent_attention`). Default LePE (the paper's depthwise conv on v);
no RoPE (an agent averages many positions and has no single rotation) and no agent bias tables (the model's
CPE/LePE give positions). No prefix tokens: the agents are pooled from the grid.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

from torch import Tensor

from linvision.ops import Rope
from linvision.ops.attention_variants import agent_attention

from .context import MixerContext
from .mixers import AttentionMixer
from .options import check_square_grid
from .registry import register_mixer

__all__ = ["AgentAttention"]


@register_mixer("agent")
class AgentAttention(AttentionMixer):
    """Agent attention. agent_grid: (rows, cols) of the agent pool (default (7, 7)); no RoPE (ValueError)."""

    accepts = frozenset()  # the agents are pooled from the grid

    def __init__(self, dim: int, num_heads: int, *, agent_grid: Tuple[int, int] = (7, 7), lepe: bool = True,
                 rope: Optional[str] = None, **kwargs):
        if rope is not None:
            raise ValueError("rope: agent attention takes no RoPE (an agent averages many positions and has no "
                             "single rotation); use LePE/CPE for positions")
        agent_grid = check_square_grid("agent_grid", agent_grid)
        super().__init__(dim, num_heads, lepe=lepe, **kwargs)
        self.agent_grid = agent_grid

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        return agent_attention(q, k, v, ctx.hw, self.agent_grid)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, agents={math.prod(self.agent_grid)}"
