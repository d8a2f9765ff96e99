"""The delta rule token by token."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..common import check_qkv, full_precision
from ..feature_maps import FeatureMapArg
from .delta_chunk import check_beta, delta_features
from .state import RecurrentState, check_state

__all__ = ["delta_rule_step"]


@full_precision
def delta_rule_step(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "identity", *, l2_normalize: bool = True,
) -> Tuple[Tensor, RecurrentState]:
    """One token of :func:`delta_rule_attention`. q, k: (B, H, D), v: (B, H, Dv), beta: (B, H).
    Returns (o (B, H, Dv) in q's dtype, new state)."""
    check_qkv(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))
    beta = check_beta(beta.unsqueeze(-1) if isinstance(beta, Tensor) else beta, q.unsqueeze(2))[:, :, 0]
    state = check_state(state, q.unsqueeze(2), v.unsqueeze(2), None)
    phi_q, phi_k, vc = delta_features(q, k, v, feature_map, l2_normalize)
    s_prev = state.s if state is not None else phi_k.new_zeros(*phi_k.shape, v.shape[-1])
    err = vc - torch.einsum("bhd,bhde->bhe", phi_k, s_prev)  # what the state gets wrong for k
    s = s_prev + phi_k.unsqueeze(-1) * (beta.unsqueeze(-1) * err).unsqueeze(-2)
    seen = 1 + (0 if state is None else state.num_tokens)
    return torch.einsum("bhd,bhde->bhe", phi_q, s).to(q.dtype), RecurrentState(s, num_tokens=seen)
