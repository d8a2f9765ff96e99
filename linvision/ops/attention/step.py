"""Causal linear attention token by token: the gated step of :mod:`linvision.ops.recurrent` with a unit gate."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ..common import DEFAULT_EPS, check_qkv, full_precision
from ..feature_maps import FeatureMapArg, causal_features
from ..recurrent.gated_step import gated_step
from ..recurrent.state import RecurrentState, check_state
from ..rope import Rope, rotate_pairs
from .reference import check_options

__all__ = ["LinearAttentionState", "linear_attention_step"]

# The state of causal linear attention is the recurrent state with a zero log-gate: one type for both.
LinearAttentionState = RecurrentState


@full_precision
def linear_attention_step(
    q: Tensor, k: Tensor, v: Tensor, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None, eps: float = DEFAULT_EPS,
) -> Tuple[Tensor, RecurrentState]:
    """One token of causal linear attention. q, k: (B, H, D), v: (B, H, Dv). Returns (o (B, H, Dv), new state).

    With ``rope``, the token's position is ``state.num_tokens`` in the sequence the rope describes.
    """
    q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)  # (B, H, 1, D): one token
    check_qkv(q, k, v)
    eps = check_options(eps, "torch", rope)
    state = check_state(state, q, v, 1)
    phi_q, phi_k, vc = (t[:, :, 0] for t in causal_features(feature_map, q, k, v, "linear_attention_step"))
    rotated = None
    if rope is not None:
        t = 0 if state is None else state.num_tokens
        if t >= rope.num_tokens:
            raise ValueError(f"rope: describes {rope.num_tokens} tokens, step {t} is past its end")
        cos, sin = (x[:, t].to(device=q.device, dtype=phi_q.dtype) for x in rope.tables())  # (heads or 1, P)
        rotated = (rotate_pairs(phi_q, cos, sin), rotate_pairs(phi_k, cos, sin))
    ones = phi_q.new_ones(*phi_q.shape[:2], 1)
    out, new_state = gated_step(phi_q, phi_k, vc, ones, state, normalize=True, eps=eps, rotated=rotated)
    return out.to(q.dtype), new_state
