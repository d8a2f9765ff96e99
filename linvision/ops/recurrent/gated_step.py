"""The decay and gated recurrences token by token: the step every normalised or plain gated form shares (causal
linear attention's step included, with a unit gate) and the ops' step forms."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..common import DEFAULT_EPS, check_eps, check_qkv, full_precision
from ..feature_maps import FeatureMapArg, causal_features
from .gated_chunk import DecayArg, check_log_gate, decay_log_gate
from .state import RecurrentState, StepResult, check_state

__all__ = ["gated_step", "gated_linear_attention_step", "decay_linear_attention_step"]


def gated_step(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, gamma: Tensor, state: Optional[RecurrentState] = None, *,
    normalize: bool = True, eps: float = DEFAULT_EPS, rotated: Optional[Tuple[Tensor, Tensor]] = None,
) -> StepResult:
    """One token of the gated recurrence: features phi_q, phi_k (B, H, D) and v (B, H, Dv) in the compute dtype,
    gate gamma (B, H, G) (ones: plain causal linear attention), ``state`` already checked, ``rotated`` as in
    :func:`~.gated_chunk.normalized_gated_chunk_scan`. Returns a :class:`~.state.StepResult`: o (B, H, Dv) in the
    compute dtype and the new state."""
    rot_q, rot_k = (phi_q, phi_k) if rotated is None else rotated
    s_prev = state.s if state is not None else phi_k.new_zeros(*phi_k.shape, v.shape[-1])
    s = gamma.unsqueeze(-1) * s_prev + rot_k.unsqueeze(-1) * v.unsqueeze(-2)
    num = torch.einsum("bhd,bhde->bhe", rot_q, s)
    seen = 1 + (0 if state is None else state.num_tokens)
    if not normalize:
        return StepResult(num, RecurrentState(s, num_tokens=seen))
    z_prev = state.z if state is not None else torch.zeros_like(phi_k)
    c_prev = state.count if state is not None else torch.zeros_like(gamma)
    z = gamma * z_prev + phi_k
    count = gamma * c_prev + 1
    den = (phi_q * z).sum(-1) + count.mean(-1) * eps
    return StepResult(num / den.unsqueeze(-1), RecurrentState(s, z, count, seen))


@full_precision
def gated_linear_attention_step(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "elu", *, normalize: bool = True, eps: float = DEFAULT_EPS,
) -> Tuple[Tensor, RecurrentState]:
    """One token of :func:`gated_linear_attention`. q, k: (B, H, D), v: (B, H, Dv), log_gate: (B, H) per head
    or (B, H, D) per key channel (or broadcastable). Returns (o (B, H, Dv) in q's dtype, new state)."""
    q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)  # (B, H, 1, D): one token
    check_qkv(q, k, v)
    eps = check_eps(eps)
    if isinstance(log_gate, Tensor) and log_gate.dim() in (1, 2, 3):
        log_gate = log_gate.unsqueeze(2) if log_gate.dim() == 3 else log_gate.unsqueeze(-1)
    return _gated_token(q, k, v, check_log_gate(log_gate, q)[:, :, 0], state, feature_map, normalize, eps)


@full_precision
def decay_linear_attention_step(
    q: Tensor, k: Tensor, v: Tensor, decay: DecayArg, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "elu", *, normalize: bool = True, eps: float = DEFAULT_EPS,
) -> Tuple[Tensor, RecurrentState]:
    """One token of :func:`decay_linear_attention`. q, k: (B, H, D), v: (B, H, Dv). Returns (o, new state)."""
    q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)  # (B, H, 1, D): one token
    check_qkv(q, k, v)
    log_gate = decay_log_gate(decay, q).unsqueeze(-1)  # (1, H, 1, 1)
    eps = check_eps(eps)
    return _gated_token(q, k, v, check_log_gate(log_gate, q)[:, :, 0], state, feature_map, normalize, eps)


def _gated_token(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, state: Optional[RecurrentState],
                 feature_map: FeatureMapArg, normalize: bool, eps: float) -> Tuple[Tensor, RecurrentState]:
    """One token of a gated op on checked q, k, v (B, H, 1, .), eps and (B, H, G) log-gates; checks the state."""
    state = check_state(state, q, v, log_gate.shape[-1] if normalize else None)
    phi_q, phi_k, vc = (t[:, :, 0] for t in causal_features(feature_map, q, k, v, "the gated step"))
    out, new_state = gated_step(phi_q, phi_k, vc, log_gate.exp(), state, normalize=normalize, eps=eps)
    return out.to(q.dtype), new_state
