"""Causal linear attention, chunked: the gated scan of :mod:`linvision.ops.recurrent` with a zero log-gate."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..common import DEFAULT_EPS, check_int, check_qkv, check_rope, full_precision
from ..feature_maps import FeatureMap, FeatureMapArg, check_causal_map, get_feature_map
from ..recurrent.gated_chunk import normalized_gated_chunk_scan
from ..rope import Rope
from .reference import check_options, rotated_features

__all__ = ["causal_attention", "causal_linear_attention"]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope], eps: float,
                     chunk_size: int) -> Tensor:
    """:func:`causal_linear_attention` on inputs already checked, with the feature map resolved."""
    phi_q, phi_k, rot_q, rot_k, vc = rotated_features(q, k, v, check_causal_map(phi, "causal attention"), rope)
    rotated = None if rope is None else (rot_q, rot_k)
    num, den, count, _ = normalized_gated_chunk_scan(phi_q, phi_k, vc, None, chunk_size, rotated=rotated)
    return (num / (den + count * eps).unsqueeze(-1)).to(q.dtype)  # = (num / i) / (den / i + eps)


@full_precision
def causal_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    eps: float = DEFAULT_EPS, chunk_size: int = 64,
) -> Tensor:
    """Causal linear attention, chunked: o_i = (R_i phi(q_i)) S_i / (phi(q_i) . z_i + eps), with S_i and z_i the
    means over tokens j <= i. The gated scan with a zero log-gate: one state per chunk (N / chunk_size of them)
    is formed, never one per token.

    Arguments as :func:`~linvision.ops.attention.dispatch.linear_attention`; raises as it does."""
    check_qkv(q, k, v, same_tokens=True)
    eps = check_options(eps, "torch", rope)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    if rope is not None:
        check_rope(rope, phi.output_dim(q.shape[-1]), q.shape[2], q.shape[1], q.shape[0])
    return causal_attention(q, k, v, phi, rope, eps, chunk_size)
