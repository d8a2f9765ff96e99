"""The decay and gated recurrences, chunked: the scans (unnormalised, and normalised with the decayed key sum and
token count) and the causal and bidirectional ops built on them."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..common import DEFAULT_EPS, check_eps, check_int, check_qkv, compute_dtype, full_precision
from ..feature_maps import FeatureMapArg, causal_features
from . import kernels as fla_kernels
from .scan import Reversal, check_lengths, chunk_length, chunk_states, read_mask, read_product, to_chunks
from .state import RecurrentState, check_state

__all__ = [
    "DecayArg",
    "GatedScan",
    "NormalizedScan",
    "check_log_gate",
    "decay_log_gate",
    "gated_chunk_scan",
    "normalized_gated_chunk_scan",
    "gated_linear_attention",
    "decay_linear_attention",
    "bidirectional_gated_linear_attention",
]

DecayArg = Union[float, Tensor]


def check_log_gate(log_gate: Tensor, q: Tensor) -> Tensor:
    """Broadcast a log-gate to (B, H, N, G), G = 1 (per head) or D (per key channel), in the compute dtype."""
    if not isinstance(log_gate, Tensor):
        raise TypeError(f"log_gate: expected a torch.Tensor, got {type(log_gate).__name__}")
    if not log_gate.is_floating_point():
        raise TypeError(f"log_gate: dtype {log_gate.dtype} is not floating point")
    b, h, n, d = q.shape
    if log_gate.dim() == 3:
        log_gate = log_gate.unsqueeze(-1)
    if log_gate.dim() != 4 or log_gate.shape[-1] not in (1, d):
        raise ValueError(
            f"log_gate: expected (B, H, N) per head or (B, H, N, {d}) per key channel (or broadcastable), "
            f"got shape {tuple(log_gate.shape)}"
        )
    try:
        log_gate = log_gate.expand(b, h, n, log_gate.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"log_gate: shape {tuple(log_gate.shape)} does not broadcast to q's (B, H, N) = {(b, h, n)}"
        ) from None
    return log_gate.to(device=q.device, dtype=compute_dtype(q.dtype))


def decay_log_gate(decay: DecayArg, q: Tensor) -> Tensor:
    """log(gamma) of a fixed decay (a float or one per head, in (0, 1]) as a (1, H, 1) log-gate."""
    h = q.shape[1]
    if isinstance(decay, bool) or not isinstance(decay, (int, float, Tensor)):
        raise TypeError(f"decay: expected a float in (0, 1] or a tensor with one per head, got {decay!r}")
    gamma = torch.as_tensor(decay, dtype=compute_dtype(q.dtype), device=q.device)
    if gamma.dim() > 1 or (gamma.dim() == 1 and gamma.numel() != h):
        raise ValueError(f"decay: expected a float or one value per head ({h}), got shape {tuple(gamma.shape)}")
    if not bool(((gamma > 0) & (gamma <= 1)).all()):
        raise ValueError(f"decay: every value must lie in (0, 1], got {gamma.tolist()}")
    return gamma.log().reshape(-1).expand(h).reshape(1, h, 1)


class GatedScan(NamedTuple):
    """The result of :func:`gated_chunk_scan`: outputs (B, H, N, E) and the final state (B, H, D, E); with the count
    asked for, also the decayed token count per token (B, H, N) and its final per-channel state (B, H, G) (else
    None)."""

    out: Tensor
    state: Tensor
    count: Optional[Tensor] = None
    final_count: Optional[Tensor] = None


class NormalizedScan(NamedTuple):
    """The result of :func:`normalized_gated_chunk_scan`: numerator (B, H, N, Dv), denominator (B, H, N), decayed
    token count (B, H, N) and the state after the last token."""

    num: Tensor
    den: Tensor
    count: Tensor
    state: RecurrentState


def gated_chunk_scan(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Optional[Tensor], chunk_size: int, s0: Optional[Tensor] = None, *,
    strict: bool = False, with_count: bool = False, count0: Optional[Tensor] = None,
) -> GatedScan:
    """Unnormalised gated scan, chunked: o_i = q_i S_i with S_i = diag(exp(log_gate_i)) S_{i-1} + k_i^T v_i.

    q, k (B, H, N, D), v (B, H, N, E), log_gate (B, H, N, G) all in the compute dtype; log_gate None is the zero
    log-gate (no decay: plain causal linear attention, without forming any exp); s0 (B, H, D, E) or None.
    ``strict`` drops the token's own term: o_i = q_i (S_i - k_i^T v_i).
    Returns a :class:`GatedScan` (outputs and final state). Padded tokens have log-gate 0 and zero keys, so the final
    state is that after token N.

    ``with_count`` (log_gate given) also returns the decayed token count c_i = mean_g sum_j w_ij^g (the weights
    of the same decay matrix, so no second scan) and its final per-channel state (B, H, G), starting from
    ``count0`` (B, H, G) or zero: the count rides through the chain of states as one more value column.
    """
    b, h, n, d = q.shape
    e = v.shape[-1]
    c = chunk_length(chunk_size, n)
    q, k, v = (to_chunks(t, c) for t in (q, k, v))
    mask = read_mask(c, strict, q.device)
    count = None
    if log_gate is None:
        attn = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0)
        q_in, kv, chunk_decay = q, k.transpose(-1, -2) @ v, None
    else:
        g = log_gate.shape[-1]
        cum = to_chunks(log_gate, c).cumsum(dim=3)  # (B, H, nc, c, G): log decay from the chunk start to token i
        total = cum[:, :, :, -1:]  # (B, H, nc, 1, G): log decay over the whole chunk
        # Decay from token j to token i (j <= i) inside a chunk; masked before exp so no positive exponent is formed.
        if g == 1:
            weight = (cum - cum.transpose(-1, -2)).masked_fill(~mask, float("-inf")).exp()  # (B, H, nc, c, c)
            attn = ((q @ k.transpose(-1, -2)) * weight).masked_fill(~mask, 0)  # a later inf key: not 0 * inf
        else:
            diff = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~mask.unsqueeze(-1), float("-inf"))
            weight = diff.exp()  # (B, H, nc, c, c, G)
            attn = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, weight).masked_fill(~mask, 0)  # (B, H, nc, c, c)
        q_in = q * cum.exp()  # reads the state entering the chunk, decayed up to token i
        to_end = (total - cum).exp()  # (B, H, nc, c, G): decay from token j to the chunk's end
        kv = (k * to_end).transpose(-1, -2) @ v  # (B, H, nc, D, E): chunk's keys decayed to its end
        chunk_decay = total.transpose(-1, -2).exp()  # (B, H, nc, G, 1)
        if with_count:
            count = weight.sum(-1) if g == 1 else weight.sum(-2).mean(-1)  # (B, H, nc, c): inside the chunk
            real = (torch.arange(kv.shape[2] * c, device=q.device) < n).to(q.dtype).view(-1, c, 1)
            tail = (to_end * real).sum(3).unsqueeze(-1)  # (B, H, nc, G, 1): real tokens only
            # one more value column: per channel for G = D, the same number in every row for G = 1
            kv = torch.cat([kv, tail.expand(b, h, kv.shape[2], d, 1)], dim=-1)
            if s0 is not None or count0 is not None:
                s0 = q.new_zeros(b, h, d, e) if s0 is None else s0
                c0 = q.new_zeros(b, h, g) if count0 is None else count0
                s0 = torch.cat([s0, c0.unsqueeze(-1).expand(b, h, d, 1)], dim=-1)
    if s0 is None and kv.shape[2] == 1:  # one chunk, nothing entering it
        out, s = read_product(attn, v, strict), kv[:, :, 0]
    else:
        entering, s = chunk_states(kv, chunk_decay, s0)
        out = read_product(attn, v, strict) + q_in @ entering[..., :e]
        if count is not None:
            count = count + (cum.exp() * entering[..., :g, e].unsqueeze(3)).mean(-1)
    out = out.flatten(2, 3)[:, :, :n]
    if count is None:
        return GatedScan(out, s)
    return GatedScan(out, s[..., :e], count.flatten(2, 3)[:, :, :n], s[..., :g, e])


def normalized_gated_chunk_scan(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Optional[Tensor], chunk_size: int,
    state: Optional[RecurrentState] = None, *, strict: bool = False, rotated: Optional[Tuple[Tensor, Tensor]] = None,
) -> NormalizedScan:
    """The normalised gated scan (log_gate None: no decay, plain causal linear attention) from features phi_q, phi_k
    (B, H, N, D) and v (B, H, N, Dv) in the compute dtype, continuing ``state`` (checked) if given: numerator,
    denominator, decayed count and final state (:class:`NormalizedScan`). ``rotated``: (R phi(q), R phi(k)) for the
    numerator (RoPE), the denominator keeping phi(q), phi(k). Without it the denominator rides along the numerator
    as an extra value column of ones. ``strict`` as in :func:`gated_chunk_scan`."""
    ones = v.new_ones(*v.shape[:-1], 1)
    counted = log_gate is not None  # the decayed count comes with the scan that has the denominator
    c0 = None if state is None else state.count
    if rotated is None:
        s0 = None if state is None else torch.cat([state.s, state.z.unsqueeze(-1)], dim=-1)
        scan = gated_chunk_scan(phi_q, phi_k, torch.cat([v, ones], dim=-1), log_gate, chunk_size, s0, strict=strict,
                                with_count=counted, count0=c0)
        num, den, s, z = scan.out[..., :-1], scan.out[..., -1], scan.state[..., :-1], scan.state[..., -1]
    else:
        num, s = gated_chunk_scan(*rotated, v, log_gate, chunk_size, None if state is None else state.s,
                                  strict=strict)[:2]
        z0 = None if state is None else state.z.unsqueeze(-1)
        scan = gated_chunk_scan(phi_q, phi_k, ones, log_gate, chunk_size, z0, strict=strict, with_count=counted,
                                count0=c0)
        den, z = scan.out[..., 0], scan.state[..., 0]
    b, h, n = den.shape
    if log_gate is None:  # no decay: the count is the number of tokens seen, exactly
        c0 = den.new_zeros(b, h, 1) if state is None else state.count
        count, c = c0 + torch.arange(1 - strict, n + 1 - strict, dtype=den.dtype, device=den.device), c0 + n
    else:  # (B, H, N) per token and (B, H, G) final, from the scan with the denominator
        count, c = scan.count, scan.final_count
    return NormalizedScan(num, den, count, RecurrentState(s, z, c, n + (0 if state is None else state.num_tokens)))


@full_precision
def gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, feature_map: FeatureMapArg = "elu", *,
    normalize: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = 64, state: Optional[RecurrentState] = None,
    return_state: bool = False, backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, RecurrentState]]:
    """Causal gated linear attention, chunked: S_t = diag(gamma_t) S_{t-1} + phi(k_t)^T v_t, gamma_t = exp(log_gate_t).

    q, k: (B, H, N, D); v: (B, H, N, Dv); log_gate: log gamma <= 0 (fp32 is best), (B, H, N) per head or
    (B, H, N, D) per key channel, or any shape broadcasting to one of those (a fixed decay is (1, H, 1)).
    Positive values (gamma > 1) are not checked (that would synchronise a GPU) and make the state grow.
    normalize: divide by the decayed normaliser (module docstring); False gives o_t = phi(q_t) S_t.
    state: the state after earlier tokens (continues a sequence); return_state: also return the final state.
    Per-channel gates form a (chunk, chunk, D) decay tensor per chunk: prefer chunk_size 16-32 for them.
    backend: "auto" (fla's kernels for CUDA tensors where they apply, else PyTorch with a warning once per reason),
    "triton" (the kernels; ImportError or ValueError saying why when they cannot run the call) or "torch" (the
    chunk loop); chunk_size is the PyTorch path's (the kernels chunk by 64).

    Returns (B, H, N, Dv) in q's dtype (and a :class:`RecurrentState`). Raises TypeError for bad dtypes or
    arguments, ValueError for mismatched shapes, a bad chunk_size, eps or backend, or a state that does not fit.
    """
    check_qkv(q, k, v)
    eps, chunk_size = check_eps(eps), check_int("chunk_size", chunk_size, 1)
    return _gated_attention(q, k, v, check_log_gate(log_gate, q), feature_map, normalize, eps, chunk_size, state,
                            return_state, backend, "gated_linear_attention")


@full_precision
def decay_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, decay: DecayArg, feature_map: FeatureMapArg = "elu", *,
    normalize: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = 64, state: Optional[RecurrentState] = None,
    return_state: bool = False, backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, RecurrentState]]:
    """Causal linear attention with a fixed decay gamma in (0, 1] (a float, or a tensor with one per head):
    S_t = gamma * S_{t-1} + phi(k_t)^T v_t. With gamma = 1 and ``normalize`` it is :func:`causal_linear_attention`.
    Other arguments, returns and raises as :func:`gated_linear_attention`; ValueError for a decay out of range."""
    check_qkv(q, k, v)
    log_gate = decay_log_gate(decay, q)
    eps, chunk_size = check_eps(eps), check_int("chunk_size", chunk_size, 1)
    return _gated_attention(q, k, v, check_log_gate(log_gate, q), feature_map, normalize, eps, chunk_size, state,
                            return_state, backend, "gated_linear_attention")


def _gated_attention(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, feature_map: FeatureMapArg, normalize: bool, eps: float,
    chunk_size: int, state: Optional[RecurrentState], return_state: bool, backend: str, op: str,
) -> Union[Tensor, Tuple[Tensor, RecurrentState]]:
    """The causal gated op on checked q, k, v, eps, chunk size and (B, H, N, G) log-gates; checks the state."""
    state = check_state(state, q, v, log_gate.shape[-1] if normalize else None)
    phi_q, phi_k, vc = causal_features(feature_map, q, k, v, op)
    s0, z0, count0 = (None, None, None) if state is None else (state.s, state.z, state.count)
    grad = fla_kernels.needs_grad(phi_q, phi_k, vc, log_gate, s0, z0, count0)
    if fla_kernels.kernel_path(backend, q, v, op, fla_kernels.gated_kernel(log_gate), grad):
        o, s, z, count = fla_kernels.gated_scan(
            phi_q, phi_k, vc, log_gate, dtype=q.dtype, normalize=normalize, eps=eps, s0=s0, z0=z0, count0=count0,
            return_state=return_state,
        )
        out = o.to(q.dtype)
        if not return_state:
            return out
        return out, RecurrentState(s, z, count, q.shape[2] + (0 if state is None else state.num_tokens))
    if normalize:
        num, den, count, final = normalized_gated_chunk_scan(phi_q, phi_k, vc, log_gate, chunk_size, state)
        out = num / (den + count * eps).unsqueeze(-1)
    else:
        out, s = gated_chunk_scan(phi_q, phi_k, vc, log_gate, chunk_size, None if state is None else state.s)[:2]
        final = RecurrentState(s, num_tokens=q.shape[2] + (0 if state is None else state.num_tokens))
    out = out.to(q.dtype)
    return (out, final) if return_state else out


def _unflip(flip: "Reversal", x: Tensor) -> Tensor:
    """A backward scan's per-token result ((B, H, N) or (B, H, N, X)) in the original order."""
    return flip(x.unsqueeze(-1)).squeeze(-1) if x.dim() == 3 else flip(x)


@full_precision
def bidirectional_gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, feature_map: FeatureMapArg = "elu", *,
    normalize: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = 64, backend: str = "auto",
    lengths: Optional[Tensor] = None,
) -> Tensor:
    """Gated linear attention scanned forward and backward over the token order, diagonal counted once.

    Token i weighs token j by the product of the gates crossed from j to i: gamma_{j+1} ... gamma_i for j <= i
    (forward scan) and gamma_i ... gamma_{j-1} for j > i (the backward scan, the same gates reversed). Normalised,
    o_i = sum_j w_ij (phi(q_i).phi(k_j)) v_j / (sum_j w_ij phi(q_i).phi(k_j) + eps * sum_j w_ij) (per-channel
    weights averaged over channels in the eps term); with log_gate = 0 this is non-causal linear attention.
    ``lengths`` (B,): each sample's tokens are its first lengths[b], padding after them (images of different
    sizes in one batch): each sample gets what it gets alone, zeros at the padding.
    Arguments and raises as :func:`gated_linear_attention`; returns (B, H, N, Dv) in q's dtype.
    """
    check_qkv(q, k, v)
    eps, chunk_size = check_eps(eps), check_int("chunk_size", chunk_size, 1)
    log_gate = check_log_gate(log_gate, q)
    lengths = check_lengths(lengths, q)
    flip = Reversal(lengths, q.shape[2])
    q, k, v, log_gate = flip.clean(q, k, v, log_gate)  # before any feature: the padding's gradients are zeros
    phi_q, phi_k, vc = causal_features(feature_map, q, k, v, "bidirectional_gated_linear_attention")
    grad = fla_kernels.needs_grad(phi_q, phi_k, vc, log_gate)
    if fla_kernels.kernel_path(backend, q, v, "bidirectional_gated_linear_attention",
                               fla_kernels.gated_kernel(log_gate), grad):
        return flip.clean(fla_kernels.bidirectional_gated(
            phi_q, phi_k, vc, log_gate, dtype=q.dtype, normalize=normalize, eps=eps, flip=flip))[0].to(q.dtype)

    # one direction after the other: batching the two would double the peak memory of the chunk tensors
    if normalize:
        num_f, den_f, cnt_f, _ = normalized_gated_chunk_scan(phi_q, phi_k, vc, log_gate, chunk_size)
        back = normalized_gated_chunk_scan(*map(flip, (phi_q, phi_k, vc, log_gate)), chunk_size, strict=True)
        num_b, den_b, cnt_b = (_unflip(flip, x) for x in (back.num, back.den, back.count))
        out = (num_f + num_b) / (den_f + den_b + (cnt_f + cnt_b) * eps).unsqueeze(-1)
    else:
        out_f = gated_chunk_scan(phi_q, phi_k, vc, log_gate, chunk_size).out
        out_b = gated_chunk_scan(*map(flip, (phi_q, phi_k, vc, log_gate)), chunk_size, strict=True).out
        out = out_f + flip(out_b)
    return flip.clean(out)[0].to(q.dtype)
