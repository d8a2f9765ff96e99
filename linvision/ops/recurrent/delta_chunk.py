"""The delta rule (DeltaNet), chunked: the scan in the WY/UT form and the causal and bidirectional ops on it."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import check_int, check_qkv, compute_dtype, full_precision, is_exporting
from ..feature_maps import FeatureMapArg, causal_features
from . import kernels as fla_kernels
from .scan import (Reversal, Scan, chain, check_lengths, chunk_length, read_mask, read_product, to_chunks,
                   unit_lower_solve)
from .state import RecurrentState, check_state

__all__ = ["check_beta", "delta_features", "delta_chunk_scan", "delta_rule_attention",
           "bidirectional_delta_rule_attention"]


def check_beta(beta: Tensor, q: Tensor) -> Tensor:
    """Broadcast beta to (B, H, N) in the compute dtype."""
    if not isinstance(beta, Tensor) or not beta.is_floating_point():
        raise TypeError(f"beta: expected a floating-point torch.Tensor, got {type(beta).__name__}")
    try:
        return beta.to(device=q.device, dtype=compute_dtype(q.dtype)).expand(q.shape[:3])
    except RuntimeError:
        raise ValueError(
            f"beta: shape {tuple(beta.shape)} does not broadcast to (B, H, N) = {tuple(q.shape[:3])}"
        ) from None


def delta_features(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg, l2_normalize: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    """phi(q), phi(k) (L2-normalised by default) and v in the compute dtype."""
    phi_q, phi_k, vc = causal_features(feature_map, q, k, v, "the delta rule")
    if l2_normalize:
        phi_q, phi_k = F.normalize(phi_q, dim=-1), F.normalize(phi_k, dim=-1)
    return phi_q, phi_k, vc


def delta_chunk_scan(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, chunk_size: int, s0: Optional[Tensor] = None, *,
    strict: bool = False,
) -> Scan:
    """Delta-rule scan, chunked with the WY/UT form: o_i = q_i S_i, S_i = (I - b_i k_i^T k_i) S_{i-1} + b_i k_i^T v_i.

    Inside a chunk with entering state S0, S_i = S0 + sum_{j<=i} k_j^T u_j with u_i = b_i (v_i - k_i S_{i-1}), i.e.
    (I + tril(diag(b) K K^T, -1)) U = diag(b) (V - K S0): one unit-triangular solve per chunk gives U~ and W with
    U = U~ - W S0, independent of S0. So the chunk maps its entering state affinely, S = (I - K^T W) S0 + K^T U~,
    and reads O = (Q - A W) S0 + A U~ (A the masked Q K^T): everything but the chain of states is batched over
    chunks, and the chain is one fused multiply-add of a (D, D) and a (D, Dv) matrix per chunk.
    ``strict``: o_i = q_i S_{i-1} (the token's own update left out). Padded tokens (k = 0, b = 0) change nothing.
    Features q, k (B, H, N, D), v (B, H, N, E), beta (B, H, N) in the compute dtype; returns a
    :class:`~.scan.Scan` (outputs and the state after token N).
    """
    b, h, n, d = q.shape
    e = v.shape[-1]
    c = chunk_length(chunk_size, n)
    q, k, v, beta = (to_chunks(t, c) for t in (q, k, v, beta.unsqueeze(-1)))
    kb = k * beta  # (B, H, nc, c, D)
    # diag(b) K K^T, whose strict lower triangle plus I is the solve's matrix; in the compute dtype, as the solve
    # needs it (under autocast the product comes out in 16 bits)
    gram = (kb @ k.transpose(-1, -2)).to(q.dtype)
    rhs = torch.cat([v * beta, kb], dim=-1)
    if is_exporting():  # ONNX has no triangular solve: the same solution from products alone
        u_w = unit_lower_solve(gram.tril(-1), rhs)
    else:
        # the same solve posed on the transposes (X A^T = R^T, A^T upper), which LAPACK reads without copies
        # (2.5x faster on CPU for 1024 chunks of 32); unitriangular: only the strict triangle of gram^T is read,
        # the unit diagonal implied, so neither the mask nor the identity is formed (nor their gradients)
        u_w = torch.linalg.solve_triangular(gram.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    del kb, gram, rhs, v, beta  # (the names only: without autograd this frees them before the next products)
    attn = (q @ k.transpose(-1, -2)).masked_fill(~read_mask(c, strict, q.device), 0)
    # products sharing an operand are formed as one: A [U~ W] and K^T [U~ W]
    read = read_product(attn, u_w, strict)  # [A U~, A W]
    del attn
    kt_uw = k.transpose(-1, -2) @ u_w  # (B, H, nc, D, Dv + D): [K^T U~, K^T W]
    del u_w
    if s0 is None and q.shape[2] == 1:  # one chunk, nothing entering it
        return Scan(read[..., :e].flatten(2, 3)[:, :, :n], kt_uw[:, :, 0, :, :e])
    # the chain over chunks: (nc, B*H, D, Dv+D) contiguous, so each step is one batched multiply-add
    nc = q.shape[2]
    maps = torch.cat([kt_uw[..., :e], torch.eye(d, dtype=q.dtype, device=q.device) - kt_uw[..., e:]], dim=-1)
    del kt_uw
    maps = maps.permute(2, 0, 1, 3, 4).reshape(nc, b * h, d, e + d)
    s = s0.reshape(b * h, d, e) if s0 is not None else q.new_zeros(b * h, d, e)
    entering, s = chain(lambda s, m: torch.baddbmm(m[..., :e], m[..., e:], s), s, maps, stack_dim=1)
    entering = entering.reshape(b, h, nc, d, e)
    out = read[..., :e] + (q - read[..., e:]) @ entering
    return Scan(out.flatten(2, 3)[:, :, :n], s.reshape(b, h, d, e))


@full_precision
def delta_rule_attention(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, feature_map: FeatureMapArg = "identity", *,
    l2_normalize: bool = True, chunk_size: int = 64, state: Optional[RecurrentState] = None,
    return_state: bool = False, backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, RecurrentState]]:
    """Causal delta-rule (DeltaNet) linear attention, chunked: S_t = (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,
    o_t = q_t S_t, where q, k are the feature-mapped (and, by default, L2-normalised) queries and keys.

    q, k: (B, H, N, D); v: (B, H, N, Dv); beta: (B, H, N) writing strength, in [0, 1] for a stable state
    (e.g. a sigmoid; not checked); beta = 0 leaves the state unchanged, beta = 1 with unit keys overwrites the
    value stored for k_t. Unnormalised (no z). state / return_state / backend as
    :func:`gated_linear_attention`. Returns (B, H, N, Dv) in q's dtype. Raises TypeError for bad dtypes,
    ValueError for mismatched shapes, a bad chunk_size or a state that does not fit.
    """
    check_qkv(q, k, v)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    beta = check_beta(beta, q)
    state = check_state(state, q, v, None)
    phi_q, phi_k, vc = delta_features(q, k, v, feature_map, l2_normalize)
    s0 = None if state is None else state.s
    if fla_kernels.kernel_path(backend, q, v, "delta_rule_attention", "delta_rule"):
        out, s = fla_kernels.delta_scan(phi_q, phi_k, vc, beta, dtype=q.dtype, s0=s0, return_state=return_state)
    else:
        out, s = delta_chunk_scan(phi_q, phi_k, vc, beta, chunk_size, s0)
    out = out.to(q.dtype)
    final = RecurrentState(s, num_tokens=q.shape[2] + (0 if state is None else state.num_tokens))
    return (out, final) if return_state else out


@full_precision
def bidirectional_delta_rule_attention(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, feature_map: FeatureMapArg = "identity", *,
    l2_normalize: bool = True, chunk_size: int = 64, backend: str = "auto", lengths: Optional[Tensor] = None,
) -> Tensor:
    """Delta-rule attention scanned forward (o_i = q_i S_i) and backward over the reversed order, the backward
    read strictly before token i's own update (q_i S'_{i+1}), so the diagonal counts once; the two are added.
    ``lengths`` (B,): each sample's tokens are its first lengths[b], padding after them: each sample gets what it
    gets alone, zeros at the padding.
    Arguments and raises as :func:`delta_rule_attention`; returns (B, H, N, Dv) in q's dtype."""
    check_qkv(q, k, v)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    beta = check_beta(beta, q)
    lengths = check_lengths(lengths, q)
    flip = Reversal(lengths, q.shape[2])
    q, k, v = flip.clean(q, k, v)  # before any feature: the padding's gradients are zeros
    if flip.valid is not None:
        beta = beta.masked_fill(~flip.valid[..., 0], 0)
    phi_q, phi_k, vc = delta_features(q, k, v, feature_map, l2_normalize)
    if fla_kernels.kernel_path(backend, q, v, "bidirectional_delta_rule_attention", "delta_rule"):
        return flip.clean(fla_kernels.bidirectional_delta(phi_q, phi_k, vc, beta, dtype=q.dtype, flip=flip)
                          )[0].to(q.dtype)
    out_f = delta_chunk_scan(phi_q, phi_k, vc, beta, chunk_size).out
    out_b = delta_chunk_scan(flip(phi_q), flip(phi_k), flip(vc), flip(beta.unsqueeze(-1)).squeeze(-1), chunk_size,
                             strict=True).out
    return flip.clean(out_f + flip(out_b))[0].to(q.dtype)
