"""Linear-attention designs that close part of the gap to softmax, as tensor functions on (B, H, N, D) inputs.

- :func:`polarity_linear_attention`: PolaFormer (Meng et al., ICLR 2025, arXiv:2501.15061). q and k split into
  positive and negative parts q+ = relu(q), q- = relu(-q), sharpened by a power p > 1 (per channel, learnable in
  the layer). Half of the value channels (v_s) is mixed by the same-sign similarity q+.k+ + q-.k-, the other half
  (v_o) by the opposite-sign similarity q+.k- + q-.k+, each normalised like linear attention:
  o_s = sum_j s_ij v_s,j / sum_j s_ij, o_o likewise; o = [o_s, o_o]. Both halves are plain linear attention with
  2D-channel features phi_q = [q+^p, q-^p] (same) or [q-^p, q+^p] (opposite) and phi_k = [k+^p, k-^p].
- :func:`injective_linear_attention`: InLine (Han et al., NeurIPS 2024, arXiv:2412.06590). Weights
  w_ij = s phi(q_i).phi(k_j) / N - s mean_m phi(q_i).phi(k_m) / N + 1/N (the score minus its mean over keys,
  plus 1/N): they sum to one for every query without a division, and two queries give the same weights only if
  their scores differ by nothing (the normalised form is blind to a rescaling of the query). phi: identity.
- :func:`rank_augmented_linear_attention`: RALA (Fan et al., CVPR 2025, arXiv:2411.07635). Keys reweighted by
  the global query: alpha_j = N softmax_j(s qbar.phi(k_j)), qbar = mean_i phi(q_i); then linear attention of
  phi(q) and alpha_j phi(k_j). (The element-wise output modulation of RALA lives in the layer.)
- :func:`magnitude_aware_linear_attention`: MALA (Fan et al., ICCV 2025, arXiv:2507.00698). With
  a_ij = s phi(q_i).phi(k_j) and m_i = mean_j a_ij, w_ij = ((1 + 1/(m_i + eps)) a_ij - m_i) / N: the
  normalised weights of linear attention plus the centred scores, whose spread grows with the query's
  magnitude as softmax's does. The weights sum to m_i / (m_i + eps) (one up to eps).
- :func:`agent_attention`: Agent attention (Han et al., ECCV 2024, arXiv:2312.08874). n agent tokens A pooled
  from q on an agent grid; V_A = softmax(s A K^T) V (agent aggregation), O = softmax(s Q A^T) V_A (agent
  broadcast): two softmax stages of cost O(N n), a generalised linear attention with the rank-n map.

Precision: every feature, score and division is computed in fp32 (float64 for float64 inputs) whatever the input
dtype; the output has the input dtype. Routing: PolaFormer and RALA are linear attention with features computed
here; InLine and MALA become linear attention too, with the identity map on features augmented by one constant
channel pair (their weights sum to one, so the op's denominator is one and is multiplied back out). All four call
:func:`linvision.ops.linear_attention` with ``feature_map="identity"``, which the fused kernels run (CUDA,
``backend="auto"``; head dims within the kernels' limits). Agent attention is two ``scaled_dot_product_attention``
calls in fp32 (SDPA's fused softmax kernels, not linvision's).

RoPE (a :class:`~linvision.ops.rope.Rope` for the head dim D): PolaFormer and RALA rotate the numerator features
as :func:`~linvision.ops.linear_attention` does (PolaFormer's features have 2D channels: its Rope must be built
for 2D); InLine rotates q and k before the scores (its scores are signed, no positivity to keep) and MALA rotates
the numerator term; both keep the constant pair unrotated. Agent attention takes no RoPE: an agent is an average
of many positions and has no single rotation.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import check_eps, check_grid, check_qkv, compute_dtype, full_precision, is_tracing

from .feature_maps import FeatureMapArg, get_feature_map
from .attention import linear_attention
from .rope import Rope, apply_rope

__all__ = [
    "polarity_features",
    "polarity_linear_attention",
    "injective_linear_attention",
    "rank_augmented_linear_attention",
    "magnitude_aware_linear_attention",
    "agent_attention",
]

# The op's own eps where the denominator is one by construction (InLine, MALA): it is multiplied back out.
_UNIT_DEN_EPS = 1e-6


def _scale(scale: Optional[float], d: int) -> float:
    if scale is None:
        return d ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: must be a positive number or None, got {scale!r}")
    return float(scale)


def polarity_features(x: Tensor, power: Union[float, Tensor], opposite: bool = False) -> Tensor:
    """[relu(x)^p, relu(-x)^p] (or the two halves swapped with ``opposite``) on the last dim: (..., D) -> (..., 2D).
    ``power``: a number or a tensor broadcastable to (..., D) (per head and channel), each >= 1."""
    both = _polarity_parts(x, power, 3 if opposite else 2)
    d = x.shape[-1]
    return both[..., d:] if opposite else both


def _polarity_parts(x: Tensor, power: Union[float, Tensor], parts: int) -> Tensor:
    """[relu(x), relu(-x), relu(x)][:parts] ** p on the last dim in one buffer (..., parts * D): its first 2D
    channels are the features [pos, neg] and, with ``parts=3``, its last 2D the opposite ones [neg, pos], a view of
    the same memory. relu(-x) is formed as relu(x) - x (exact: 0 - x or x - x) and the power is taken once, a
    per-channel power broadcast over the parts (no copy of it)."""
    r = F.relu(x)
    stacked = torch.cat([r, r - x, r][:parts], dim=-1)
    if isinstance(power, Tensor) and power.dim() and power.shape[-1] != 1:  # per channel: the same for each part
        return (stacked.unflatten(-1, (parts, x.shape[-1])) ** power.unsqueeze(-2)).flatten(-2)
    return stacked ** power


def _rope_for(rope: Optional[Rope], channels: int, name: str) -> None:
    if rope is not None and rope.freqs_x.shape[-1] * 2 != channels:
        raise ValueError(f"rope: {name} rotates {channels}-channel features; got a Rope for "
                         f"{rope.freqs_x.shape[-1] * 2} channels")


@full_precision
def polarity_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, power: Union[float, Tensor] = 3.0, *, rope: Optional[Rope] = None,
    eps: float = 1e-6, backend: str = "auto", scale: Optional[Tensor] = None,
) -> Tensor:
    """PolaFormer's polarity-aware linear attention (see the module docstring); v needs an even channel count
    (first half: same-sign path, second half: opposite-sign path). ``rope`` is built for 2D channels. ``scale``:
    a divisor of q and k (broadcast to them, e.g. PolaFormer's learned softplus scale per head and channel),
    applied in the compute dtype before the features. Without gradients, and with as many queries as keys, the
    features of q and k are formed in one pass over both."""
    check_qkv(q, k, v, same_tokens=rope is not None)
    check_eps(eps)
    if v.shape[-1] % 2:
        raise ValueError(f"v: PolaFormer splits the value channels in two; got an odd count {v.shape[-1]}")
    if isinstance(power, (int, float)) and not power >= 1:
        raise ValueError(f"power: must be >= 1, got {power!r}")
    _rope_for(rope, 2 * q.shape[-1], "polarity attention")
    cdt = compute_dtype(q.dtype)
    power = power.to(cdt) if isinstance(power, Tensor) else power
    d = q.shape[-1]
    vc = v.to(cdt)
    if not torch.is_grad_enabled() and q.shape == k.shape:
        # q and k side by side along the batch: one division and one set of feature launches for both (k's
        # opposite part, formed with them, is not read)
        qk = torch.cat([q, k]).to(cdt)
        parts = _polarity_parts(qk if scale is None else qk / scale, power, 3)
        both_q, phi_k = parts[:q.shape[0]], parts[q.shape[0]:, ..., :2 * d]
    else:
        qc, kc = q.to(cdt), k.to(cdt)
        if scale is not None:
            qc, kc = qc / scale, kc / scale
        phi_k = _polarity_parts(kc, power, 2)
        both_q = _polarity_parts(qc, power, 3)  # the query features and their opposites, one buffer
    v_same, v_opp = vc.chunk(2, dim=-1)
    same = linear_attention(both_q[..., :2 * d], phi_k, v_same, "identity", rope=rope, eps=eps, backend=backend)
    opp = linear_attention(both_q[..., d:], phi_k, v_opp, "identity", rope=rope, eps=eps, backend=backend)
    if torch.is_grad_enabled() or is_tracing():
        return torch.cat([same, opp], dim=-1).to(q.dtype)
    # inference: joined into token-major memory in q's dtype, so the heads merge back into channels (B, N, C)
    # with no copy and no cast of their own
    b, h, n, _ = same.shape
    return torch.cat([same, opp], dim=-1, out=q.new_empty(b, n, h, v.shape[-1]).transpose(1, 2))


def _augment(x: Tensor, extra: Tensor) -> Tensor:
    """[x_first_half, extra, x_second_half, 0]: one more RoPE channel pair (extra, 0) after the D/2 pairs of x."""
    p = x.shape[-1] // 2
    return torch.cat([x[..., :p], extra, x[..., p:], torch.zeros_like(extra)], dim=-1)


def _augmented_rope(rope: Optional[Rope]) -> Optional[Rope]:
    """The rope with one more channel pair at frequency zero (the constant pair of :func:`_augment` stays put)."""
    if rope is None:
        return None
    pad = lambda f: torch.cat([f, f.new_zeros(*f.shape[:-1], 1)], dim=-1)  # noqa: E731
    return dataclasses.replace(rope, freqs_x=pad(rope.freqs_x), freqs_y=pad(rope.freqs_y), _tables=None)


def _unit_den_attention(q_aug: Tensor, k_aug: Tensor, v: Tensor, rope: Optional[Rope], backend: str) -> Tensor:
    """sum_j (q_aug_i . k_aug_j) v_j / N through linear attention with the identity map: the op divides by
    q_aug_i . mean_j k_aug_j + eps, which is multiplied back out here (exact whatever that denominator is)."""
    den = torch.einsum("bhnd,bhd->bhn", q_aug, k_aug.mean(dim=2)) + _UNIT_DEN_EPS
    out = linear_attention(q_aug, k_aug, v, "identity", rope=rope, eps=_UNIT_DEN_EPS, backend=backend)
    return out * den.unsqueeze(-1)


@full_precision
def injective_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, rope: Optional[Rope] = None,
    backend: str = "auto",
) -> Tensor:
    """InLine: o_i = sum_j w_ij v_j, w_ij = (s q_i.k_j - s mean_m q_i.k_m + 1) / N; s = ``scale`` (default
    D^-1/2). With ``rope`` q and k are rotated first (q_i.k_j becomes (R_i q_i).(R_j k_j))."""
    check_qkv(q, k, v, same_tokens=rope is not None)
    s = _scale(scale, q.shape[-1])
    _rope_for(rope, q.shape[-1], "InLine")
    cdt = compute_dtype(q.dtype)
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    if rope is not None:
        qc, kc = apply_rope(qc, rope), apply_rope(kc, rope)
    ones = qc.new_ones(*qc.shape[:-1], 1)
    # (s q_i, 1) . (k_j - kbar, 1) = s q_i.k_j - s q_i.kbar + 1, and the mean of that over j is 1
    q_aug = _augment(s * qc, ones)
    k_aug = _augment(kc - kc.mean(dim=2, keepdim=True), kc.new_ones(*kc.shape[:-1], 1))
    return _unit_den_attention(q_aug, k_aug, vc, None, backend).to(q.dtype)


def _mapped_inputs(q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg, scale: Optional[float],
                   rope: Optional[Rope], eps: float, name: str) -> Tuple[float, Tensor, Tensor, Tensor]:
    """Checks, then (s, phi(q), phi(k), v) in the compute dtype: what RALA and MALA start from."""
    check_qkv(q, k, v, same_tokens=rope is not None)
    check_eps(eps)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    cdt = compute_dtype(q.dtype)
    phi_q, phi_k, vc = phi(q.to(cdt), True), phi(k.to(cdt), False), v.to(cdt)
    _rope_for(rope, phi_q.shape[-1], name)
    return _scale(scale, q.shape[-1]), phi_q, phi_k, vc


@full_precision
def rank_augmented_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, scale: Optional[float] = None,
    rope: Optional[Rope] = None, eps: float = 1e-6, backend: str = "auto",
) -> Tensor:
    """RALA's linear attention: keys weighted by alpha_j = N softmax_j(s qbar.phi(k_j)), qbar = mean_i phi(q_i),
    s = ``scale`` (default D^-1/2); o_i = R_i phi(q_i) (1/N) sum_j alpha_j (R_j phi(k_j))^T v_j /
    (phi(q_i).(1/N) sum_j alpha_j phi(k_j) + eps)."""
    s, phi_q, phi_k, vc = _mapped_inputs(q, k, v, feature_map, scale, rope, eps, "RALA")
    logits = s * torch.einsum("bhd,bhnd->bhn", phi_q.mean(dim=2), phi_k)
    alpha = torch.softmax(logits, dim=-1) * phi_k.shape[2]
    return linear_attention(phi_q, phi_k * alpha.unsqueeze(-1), vc, "identity", rope=rope, eps=eps,
                            backend=backend).to(q.dtype)


@full_precision
def magnitude_aware_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, scale: Optional[float] = None,
    rope: Optional[Rope] = None, eps: float = 1e-6, backend: str = "auto",
) -> Tensor:
    """MALA: o_i = (1 + 1/(m_i + eps)) s phi(q_i) (1/N) sum_j phi(k_j)^T v_j - m_i vbar with m_i = s phi(q_i).kbar
    (kbar, vbar: means over the keys), s = ``scale`` (default D^-1/2). With ``rope`` the first term's phi(q_i),
    phi(k_j) are rotated (R_i, R_j; m_i is not)."""
    s, phi_q, phi_k, vc = _mapped_inputs(q, k, v, feature_map, scale, rope, eps, "MALA")
    m = s * torch.einsum("bhnd,bhd->bhn", phi_q, phi_k.mean(dim=2)).unsqueeze(-1)  # (B, H, N, 1)
    # (a_i phi(q_i), -m_i) . (phi(k_j), 1) = a_i phi(q_i).phi(k_j) - m_i, a_i = s (1 + 1/(m_i + eps))
    q_aug = _augment(s * (1 + 1 / (m + eps)) * phi_q, -m)
    k_aug = _augment(phi_k, phi_k.new_ones(*phi_k.shape[:-1], 1))
    return _unit_den_attention(q_aug, k_aug, vc, _augmented_rope(rope), backend).to(q.dtype)


@full_precision
def agent_attention(
    q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], agent_grid: Tuple[int, int] = (7, 7), *,
    scale: Optional[float] = None,
) -> Tensor:
    """Agent attention: agents A = adaptive average pool of q (on the token grid ``hw``) to ``agent_grid``;
    V_A = softmax(s A K^T) V, O = softmax(s Q A^T) V_A; s = ``scale`` (default D^-1/2). Scores and softmax in
    fp32 (float64 for float64 inputs): in bf16, logits of activations of +-30 are off by whole units.""" 
    check_qkv(q, k, v)
    h, w = check_grid(hw, q.shape[2], name="hw")
    ah, aw = check_grid(agent_grid, name="agent_grid")
    s = _scale(scale, q.shape[-1])
    b, nh, n, d = q.shape
    cdt = compute_dtype(q.dtype)  # half-precision logits of large activations are off by whole units
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    grid = qc.reshape(b * nh, h, w, d).permute(0, 3, 1, 2)
    agents = F.adaptive_avg_pool2d(grid, (ah, aw)).flatten(2).transpose(1, 2).reshape(b, nh, ah * aw, d)
    agent_v = F.scaled_dot_product_attention(agents, kc, vc, scale=s)  # (B, H, n, Dv)
    return F.scaled_dot_product_attention(qc, agents, agent_v, scale=s).to(q.dtype)
