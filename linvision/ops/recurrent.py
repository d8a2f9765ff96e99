"""Linear attention that forgets or corrects: decay (RetNet), gated (GLA) and delta-rule (DeltaNet) recurrences.

Plain causal linear attention keeps a running sum S_t = S_{t-1} + phi(k_t)^T v_t and never forgets. The three
recurrences here change only the state update (states are (D, Dv), read as o_t = phi(q_t) S_t):

- fixed decay per head (Sun et al. 2023, "Retentive Network", arXiv:2307.08621):
  S_t = gamma * S_{t-1} + phi(k_t)^T v_t
- data-dependent gate (Yang et al. 2023, "Gated Linear Attention", arXiv:2312.06635), per head or per key channel:
  S_t = diag(gamma_t) S_{t-1} + phi(k_t)^T v_t
- delta rule (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule",
  arXiv:2406.06484), one step of online gradient descent on 1/2 ||S^T k_t - v_t||^2:
  S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

Each has a chunked form for training (quadratic inside a chunk, one state handed from chunk to chunk) and a step
form for token-by-token inference; both give the per-token recurrence's outputs.

Normalisation. The decay and gated forms keep the normaliser of :func:`causal_linear_attention`, decayed like the
state: z_t = gamma_t z_{t-1} + phi(k_t) and a decayed token count c_t = gamma_t c_{t-1} + 1, with

    o_t = phi(q_t) S_t / (phi(q_t) . z_t + c_t * eps)

i.e. the decayed mean of the values, and exactly causal linear attention when gamma = 1 (c_t = t). With per-channel
gates c_t is the mean over channels of the per-channel counts. ``normalize=False`` gives the plain o_t = phi(q_t) S_t
(RetNet's retention). The delta rule is unnormalised: its keys (and queries) are L2-normalised after the feature map,
so that with beta in [0, 1] each update is a contraction of the stored value along k_t and the state stays bounded.

Numerical safety: gates enter as log-gates (log gamma <= 0, e.g. ``F.logsigmoid``), cumulated in fp32; every decay
factor formed is exp of a non-positive number, so nothing overflows whatever the chunk size. All accumulation,
the triangular solve of the delta rule and the division run in fp32 (float64 for float64 inputs); outputs have the
input dtype. RoPE is not supported by these recurrences (plain causal linear attention, the zero-gate case, rotates
its numerator through the same scan).

Bidirectional forms (for images, which have no natural order) run the scan forward and backward over the token
order and add the two, with the backward scan strictly anti-causal so that the diagonal counts once; the
normalised forms merge numerators, denominators and counts before dividing, so with gamma = 1 the bidirectional
decay form is exactly non-causal linear attention.

Kernels: the chunked forms take ``backend=`` as :func:`linvision.ops.linear_attention` does: "auto" runs CUDA tensors
on fla-core's chunked Triton kernels where they apply (``linvision.ops.recurrent_kernels`` says what runs where, and
with what precision), "triton" forces them, "torch" is the PyTorch chunk loop here. The step forms are PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from linvision.kernels.common import DEFAULT_EPS, check_eps, check_int, check_qkv, compute_dtype

from . import recurrent_kernels
from .feature_maps import FeatureMapArg, featurize, get_feature_map
from .recurrent_kernels import kernel_path
from .rope import is_exporting

__all__ = [
    "RecurrentState",
    "decay_linear_attention",
    "decay_linear_attention_step",
    "gated_linear_attention",
    "gated_linear_attention_step",
    "bidirectional_gated_linear_attention",
    "delta_rule_attention",
    "delta_rule_step",
    "bidirectional_delta_rule_attention",
]

DecayArg = Union[float, Tensor]


@dataclass
class RecurrentState:
    """State of a causal or recurrent linear attention, in the compute dtype (fp32, or float64 for float64 inputs).

    s: (B, H, D, Dv) state. z: (B, H, D) decayed key sum and count: (B, H, G) decayed token count (G = 1 for
    per-head gates and plain causal attention, D for per-channel gates), both only for the normalised forms (None
    otherwise). num_tokens: tokens seen so far (the position of the next token, e.g. for RoPE).
    """

    s: Tensor
    z: Optional[Tensor] = None
    count: Optional[Tensor] = None
    num_tokens: int = 0


def _check_log_gate(log_gate: Tensor, q: Tensor) -> Tensor:
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


def _decay_log_gate(decay: DecayArg, q: Tensor) -> Tensor:
    """log(gamma) of a fixed decay (a float or one per head, in (0, 1]) as a (1, H, 1) log-gate."""
    h = q.shape[1]
    gamma = torch.as_tensor(decay, dtype=compute_dtype(q.dtype), device=q.device)
    if gamma.dim() > 1 or (gamma.dim() == 1 and gamma.numel() != h):
        raise ValueError(f"decay: expected a float or one value per head ({h}), got shape {tuple(gamma.shape)}")
    if not bool(((gamma > 0) & (gamma <= 1)).all()):
        raise ValueError(f"decay: every value must lie in (0, 1], got {gamma.tolist()}")
    return gamma.log().reshape(-1).expand(h).reshape(1, h, 1)


def to_chunks(x: Tensor, c: int) -> Tensor:
    """(B, H, N, X) -> (B, H, ceil(N/c), c, X), zero-padded at the end (one chunk more while exported with dynamic
    sizes)."""
    b, h, n, _ = x.shape
    # With a symbolic n (torch.export with dynamic sizes) one more chunk of padding: a padding that is never empty
    # keeps the graph from assuming that every size is, like the traced one, a multiple of c.
    extra = c if isinstance(n, torch.SymInt) else 0
    return F.pad(x, (0, 0, 0, (-n) % c + extra)).reshape(b, h, -1, c, x.shape[-1])


def chunk_length(chunk_size: int, n) -> int:
    """The chunk length of a scan over n tokens: chunk_size, or n when shorter. With a symbolic n (torch.export with
    dynamic sizes) always chunk_size, so that the graph holds for every n, shorter ones padded."""
    return chunk_size if isinstance(n, torch.SymInt) else min(chunk_size, n)


def unit_lower_solve(strict_lower: Tensor, rhs: Tensor) -> Tensor:
    """(I + L)^-1 rhs for L strictly lower triangular (..., c, c), by matrix products only: L^c = 0, so
    (I + L)^-1 = sum_{k<c} (-L)^k = prod_{j<m} (I + (-L)^(2^j)) with 2^m >= c, m = ceil(log2 c) factors."""
    power = -strict_lower
    out = rhs + power @ rhs
    for _ in range((strict_lower.shape[-1] - 1).bit_length() - 1):
        power = power @ power
        out = out + power @ out
    return out


def _read_mask(c: int, strict: bool, device: torch.device) -> Tensor:
    """(c, c): which tokens j of its chunk token i reads: j <= i, or j < i with ``strict``."""
    return torch.ones(c, c, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _chunk_states(kv: Tensor, decay: Optional[Tensor], s0: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """States entering each chunk of S_c = decay_c * S_{c-1} + kv_c, and the last state. kv (B, H, nc, D, E);
    decay (B, H, nc, G, 1) with G 1 or D, or None (no decay: an exclusive cumulative sum); s0 (B, H, D, E) or None.
    With decay the loop over chunks is one fused multiply-add each."""
    if decay is None:
        total = kv.cumsum(dim=2)
        if s0 is not None:
            total = total + s0.unsqueeze(2)
        first = s0.unsqueeze(2) if s0 is not None else torch.zeros_like(kv[:, :, :1])
        return torch.cat([first, total[:, :, :-1]], dim=2), total[:, :, -1]
    s = s0 if s0 is not None else kv.new_zeros(kv[:, :, 0].shape)
    return chain(lambda s, decay_c, kv_c: torch.addcmul(kv_c, decay_c, s), s, decay.movedim(2, 0), kv.movedim(2, 0),
                 stack_dim=2)


def chain(step, s: Tensor, *xs: Tensor, stack_dim: int = 0) -> Tuple[Tensor, Tensor]:
    """s <- step(s, x_0[t], x_1[t], ...) for t along the first dim of every x: returns the states entering each step,
    stacked along ``stack_dim`` (T at that position of s's shape), and the last state.

    A Python loop, except when the number of steps is symbolic (torch.export with dynamic sizes, where a loop would
    fix it to the traced size): then torch's scan operator, which keeps it symbolic in the graph."""
    if isinstance(xs[0].shape[0], torch.SymInt):
        from torch._higher_order_ops.scan import scan
        last, entering = scan(lambda c, x: (step(c, *x), c.clone()), s, list(xs))
        return entering.movedim(0, stack_dim), last
    entering = []
    for x in zip(*(t.unbind(0) for t in xs)):
        entering.append(s)
        s = step(s, *x)
    return torch.stack(entering, dim=stack_dim), s


def _gated_scan(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Optional[Tensor], chunk_size: int, s0: Optional[Tensor],
    strict: bool, count0: Optional[Tensor] = None, with_count: bool = False,
) -> Tuple[Tensor, ...]:
    """Unnormalised gated scan, chunked: o_i = q_i S_i with S_i = diag(exp(log_gate_i)) S_{i-1} + k_i^T v_i.

    q, k (B, H, N, D), v (B, H, N, E), log_gate (B, H, N, G) all in the compute dtype; log_gate None is the zero
    log-gate (no decay: plain causal linear attention, without forming any exp); s0 (B, H, D, E) or None.
    ``strict`` drops the token's own term: o_i = q_i (S_i - k_i^T v_i).
    Returns (o (B, H, N, E), final state). Padded tokens have log-gate 0 and zero keys, so the final state is that
    after token N.

    ``with_count`` (log_gate given) also returns the decayed token count c_i = mean_g sum_j w_ij^g (the weights
    of the same decay matrix, so no second scan) and its final per-channel state (B, H, G), starting from
    ``count0`` (B, H, G) or zero: the count rides through the chain of states as one more value column.
    """
    b, h, n, d = q.shape
    e = v.shape[-1]
    c = chunk_length(chunk_size, n)
    q, k, v = (to_chunks(t, c) for t in (q, k, v))
    mask = _read_mask(c, strict, q.device)
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
            attn = (q @ k.transpose(-1, -2)) * weight
        else:
            diff = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~mask.unsqueeze(-1), float("-inf"))
            weight = diff.exp()  # (B, H, nc, c, c, G)
            attn = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, weight)  # (B, H, nc, c, c)
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
        out, s = attn @ v, kv[:, :, 0]
    else:
        entering, s = _chunk_states(kv, chunk_decay, s0)
        out = attn @ v + q_in @ entering[..., :e]
        if count is not None:
            count = count + (cum.exp() * entering[..., :g, e].unsqueeze(3)).mean(-1)
    out = out.reshape(b, h, -1, e)[:, :, :n]
    if count is None:
        return out, s
    return out, s[..., :e], count.reshape(b, h, -1)[:, :, :n], s[..., :g, e]


def _gated_pieces(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Optional[Tensor], chunk_size: int,
    state: Optional[RecurrentState], strict: bool, rotated: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor, Tensor, RecurrentState]:
    """Numerator (B, H, N, Dv), denominator (B, H, N), decayed count (B, H, N) and final state of the normalised
    gated scan (log_gate None: no decay). ``rotated``: (R phi(q), R phi(k)) for the numerator (RoPE), the
    denominator keeping phi(q), phi(k). Without it the denominator rides along the numerator as an extra value
    column of ones."""
    ones = v.new_ones(*v.shape[:-1], 1)
    counted = log_gate is not None  # the decayed count comes with the scan that has the denominator
    c0 = None if state is None else state.count
    if rotated is None:
        s0 = None if state is None else torch.cat([state.s, state.z.unsqueeze(-1)], dim=-1)
        out, s, *counts = _gated_scan(phi_q, phi_k, torch.cat([v, ones], dim=-1), log_gate, chunk_size, s0, strict,
                                      c0, counted)
        num, den, s, z = out[..., :-1], out[..., -1], s[..., :-1], s[..., -1]
    else:
        num, s = _gated_scan(*rotated, v, log_gate, chunk_size, None if state is None else state.s, strict)
        z0 = None if state is None else state.z.unsqueeze(-1)
        den, z, *counts = _gated_scan(phi_q, phi_k, ones, log_gate, chunk_size, z0, strict, c0, counted)
        den, z = den[..., 0], z[..., 0]
    b, h, n = den.shape
    if log_gate is None:  # no decay: the count is the number of tokens seen, exactly
        c0 = den.new_zeros(b, h, 1) if state is None else state.count
        count, c = c0 + torch.arange(1 - strict, n + 1 - strict, dtype=den.dtype, device=den.device), c0 + n
    else:
        count, c = counts  # (B, H, N) per token and (B, H, G) final, from the scan with the denominator
    return num, den, count, RecurrentState(s, z, c, n + (0 if state is None else state.num_tokens))


def _check_state(state: Optional[RecurrentState], q: Tensor, v: Tensor, g: Optional[int]) -> Optional[RecurrentState]:
    """Validate a state against q (B, H, ., D), v (B, H, ., Dv) and gate width g (None: unnormalised); returns it
    in the compute dtype."""
    if state is None:
        return None
    if not isinstance(state, RecurrentState):
        raise TypeError(f"state: expected a RecurrentState or None, got {type(state).__name__}")
    b, h, d, dv = q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]
    cdt = compute_dtype(q.dtype)
    if tuple(state.s.shape) != (b, h, d, dv):
        raise ValueError(f"state: s has shape {tuple(state.s.shape)}, expected {(b, h, d, dv)}")
    if g is None:
        return RecurrentState(state.s.to(cdt), num_tokens=state.num_tokens)
    if state.z is None or state.count is None:
        raise ValueError("state: the normalised form needs z and count; this state has none (normalize=False?)")
    if tuple(state.z.shape) != (b, h, d) or tuple(state.count.shape) != (b, h, g):
        raise ValueError(
            f"state: z {tuple(state.z.shape)} and count {tuple(state.count.shape)} do not match "
            f"expected {(b, h, d)} and {(b, h, g)}"
        )
    return RecurrentState(state.s.to(cdt), state.z.to(cdt), state.count.to(cdt), state.num_tokens)


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
    log_gate = _check_log_gate(log_gate, q)
    state = _check_state(state, q, v, log_gate.shape[-1] if normalize else None)
    phi_q, phi_k, vc = featurize(get_feature_map(feature_map, dim=q.shape[-1]), q, k, v)
    if kernel_path(backend, q, v, "gated_linear_attention", gated=True):
        o, s, z, count = recurrent_kernels.gated_scan(
            phi_q, phi_k, vc, log_gate, dtype=q.dtype, normalize=normalize, eps=eps,
            s0=None if state is None else state.s, z0=None if state is None else state.z,
            count0=None if state is None else state.count, return_state=return_state,
        )
        out = o.to(q.dtype)
        if not return_state:
            return out
        return out, RecurrentState(s, z, count, q.shape[2] + (0 if state is None else state.num_tokens))
    if normalize:
        num, den, count, final = _gated_pieces(phi_q, phi_k, vc, log_gate, chunk_size, state, strict=False)
        out = num / (den + count * eps).unsqueeze(-1)
    else:
        out, s = _gated_scan(phi_q, phi_k, vc, log_gate, chunk_size, None if state is None else state.s, False)
        final = RecurrentState(s, num_tokens=q.shape[2] + (0 if state is None else state.num_tokens))
    out = out.to(q.dtype)
    return (out, final) if return_state else out


def _gated_step(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, gamma: Tensor, state: Optional[RecurrentState], normalize: bool,
    eps: float, rotated: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, RecurrentState]:
    """One token of the gated recurrence: features phi_q, phi_k (B, H, D) and v (B, H, Dv) in the compute dtype,
    gate gamma (B, H, G) (ones: plain causal linear attention), ``rotated`` as in :func:`_gated_pieces`.
    Returns (o (B, H, Dv) in the compute dtype, new state)."""
    rot_q, rot_k = (phi_q, phi_k) if rotated is None else rotated
    s_prev = state.s if state is not None else phi_k.new_zeros(*phi_k.shape, v.shape[-1])
    s = gamma.unsqueeze(-1) * s_prev + rot_k.unsqueeze(-1) * v.unsqueeze(-2)
    num = torch.einsum("bhd,bhde->bhe", rot_q, s)
    seen = 1 + (0 if state is None else state.num_tokens)
    if not normalize:
        return num, RecurrentState(s, num_tokens=seen)
    z_prev = state.z if state is not None else torch.zeros_like(phi_k)
    c_prev = state.count if state is not None else torch.zeros_like(gamma)
    z = gamma * z_prev + phi_k
    count = gamma * c_prev + 1
    den = (phi_q * z).sum(-1) + count.mean(-1) * eps
    return num / den.unsqueeze(-1), RecurrentState(s, z, count, seen)


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
    lg = _check_log_gate(log_gate, q)[:, :, 0]  # (B, H, G)
    state = _check_state(state, q, v, lg.shape[-1] if normalize else None)
    phi_q, phi_k, vc = (t[:, :, 0] for t in featurize(get_feature_map(feature_map, dim=q.shape[-1]), q, k, v))
    out, new_state = _gated_step(phi_q, phi_k, vc, lg.exp(), state, normalize, eps)
    return out.to(q.dtype), new_state


def decay_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, decay: DecayArg, feature_map: FeatureMapArg = "elu", *,
    normalize: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = 64, state: Optional[RecurrentState] = None,
    return_state: bool = False, backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, RecurrentState]]:
    """Causal linear attention with a fixed decay gamma in (0, 1] (a float, or a tensor with one per head):
    S_t = gamma * S_{t-1} + phi(k_t)^T v_t. With gamma = 1 and ``normalize`` it is :func:`causal_linear_attention`.
    Other arguments, returns and raises as :func:`gated_linear_attention`; ValueError for a decay out of range."""
    check_qkv(q, k, v)
    return gated_linear_attention(
        q, k, v, _decay_log_gate(decay, q), feature_map, normalize=normalize, eps=eps, chunk_size=chunk_size,
        state=state, return_state=return_state, backend=backend,
    )


def decay_linear_attention_step(
    q: Tensor, k: Tensor, v: Tensor, decay: DecayArg, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "elu", *, normalize: bool = True, eps: float = DEFAULT_EPS,
) -> Tuple[Tensor, RecurrentState]:
    """One token of :func:`decay_linear_attention`. q, k: (B, H, D), v: (B, H, Dv). Returns (o, new state)."""
    check_qkv(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))
    log_gate = _decay_log_gate(decay, q.unsqueeze(2)).unsqueeze(-1)  # (1, H, 1, 1)
    return gated_linear_attention_step(q, k, v, log_gate, state, feature_map, normalize=normalize, eps=eps)


def bidirectional_gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, feature_map: FeatureMapArg = "elu", *,
    normalize: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = 64, backend: str = "auto",
) -> Tensor:
    """Gated linear attention scanned forward and backward over the token order, diagonal counted once.

    Token i weighs token j by the product of the gates crossed from j to i: gamma_{j+1} ... gamma_i for j <= i
    (forward scan) and gamma_i ... gamma_{j-1} for j > i (the backward scan, the same gates reversed). Normalised,
    o_i = sum_j w_ij (phi(q_i).phi(k_j)) v_j / (sum_j w_ij phi(q_i).phi(k_j) + eps * sum_j w_ij) (per-channel
    weights averaged over channels in the eps term); with log_gate = 0 this is non-causal linear attention.
    Arguments and raises as :func:`gated_linear_attention`; returns (B, H, N, Dv) in q's dtype.
    """
    check_qkv(q, k, v)
    eps, chunk_size = check_eps(eps), check_int("chunk_size", chunk_size, 1)
    log_gate = _check_log_gate(log_gate, q)
    phi_q, phi_k, vc = featurize(get_feature_map(feature_map, dim=q.shape[-1]), q, k, v)
    if kernel_path(backend, q, v, "bidirectional_gated_linear_attention", gated=True):
        return recurrent_kernels.bidirectional_gated(
            phi_q, phi_k, vc, log_gate, dtype=q.dtype, normalize=normalize, eps=eps).to(q.dtype)

    def flip(x: Tensor) -> Tensor:
        return x.flip(2)

    # one direction after the other: batching the two would double the peak memory of the chunk tensors
    if normalize:
        num_f, den_f, cnt_f, _ = _gated_pieces(phi_q, phi_k, vc, log_gate, chunk_size, None, strict=False)
        pieces_b = _gated_pieces(*map(flip, (phi_q, phi_k, vc, log_gate)), chunk_size, None, strict=True)
        num_b, den_b, cnt_b = (x.flip(2) for x in pieces_b[:3])
        out = (num_f + num_b) / (den_f + den_b + (cnt_f + cnt_b) * eps).unsqueeze(-1)
    else:
        out_f, _ = _gated_scan(phi_q, phi_k, vc, log_gate, chunk_size, None, strict=False)
        out_b, _ = _gated_scan(*map(flip, (phi_q, phi_k, vc, log_gate)), chunk_size, None, strict=True)
        out = out_f + out_b.flip(2)
    return out.to(q.dtype)


def _check_beta(beta: Tensor, q: Tensor) -> Tensor:
    """Broadcast beta to (B, H, N) in the compute dtype."""
    if not isinstance(beta, Tensor) or not beta.is_floating_point():
        raise TypeError(f"beta: expected a floating-point torch.Tensor, got {type(beta).__name__}")
    try:
        return beta.to(device=q.device, dtype=compute_dtype(q.dtype)).expand(q.shape[:3])
    except RuntimeError:
        raise ValueError(f"beta: shape {tuple(beta.shape)} does not broadcast to (B, H, N) = {tuple(q.shape[:3])}") from None


def _delta_features(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg, l2_normalize: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    """phi(q), phi(k) (L2-normalised by default) and v in the compute dtype."""
    phi_q, phi_k, vc = featurize(get_feature_map(feature_map, dim=q.shape[-1]), q, k, v)
    if l2_normalize:
        phi_q, phi_k = F.normalize(phi_q, dim=-1), F.normalize(phi_k, dim=-1)
    return phi_q, phi_k, vc


def _delta_scan(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, chunk_size: int, s0: Optional[Tensor], strict: bool
) -> Tuple[Tensor, Tensor]:
    """Delta-rule scan, chunked with the WY/UT form: o_i = q_i S_i, S_i = (I - b_i k_i^T k_i) S_{i-1} + b_i k_i^T v_i.

    Inside a chunk with entering state S0, S_i = S0 + sum_{j<=i} k_j^T u_j with u_i = b_i (v_i - k_i S_{i-1}), i.e.
    (I + tril(diag(b) K K^T, -1)) U = diag(b) (V - K S0): one unit-triangular solve per chunk gives U~ and W with
    U = U~ - W S0, independent of S0. So the chunk maps its entering state affinely, S = (I - K^T W) S0 + K^T U~,
    and reads O = (Q - A W) S0 + A U~ (A the masked Q K^T): everything but the chain of states is batched over
    chunks, and the chain is one fused multiply-add of a (D, D) and a (D, Dv) matrix per chunk.
    ``strict``: o_i = q_i S_{i-1} (the token's own update left out). Padded tokens (k = 0, b = 0) change nothing.
    """
    b, h, n, d = q.shape
    e = v.shape[-1]
    c = chunk_length(chunk_size, n)
    q, k, v, beta = (to_chunks(t, c) for t in (q, k, v, beta.unsqueeze(-1)))
    kb = k * beta  # (B, H, nc, c, D)
    strict_lower = (kb @ k.transpose(-1, -2)).tril(-1)
    # the same solve posed on the transposes (X A^T = R^T, A^T upper), which LAPACK reads without copies:
    # 2.5x faster on CPU for 1024 chunks of 32
    rhs = torch.cat([v * beta, kb], dim=-1)
    if is_exporting():  # ONNX has no triangular solve: the same solution from products alone
        u_w = unit_lower_solve(strict_lower, rhs)
    else:
        lower = torch.eye(c, dtype=q.dtype, device=q.device) + strict_lower
        u_w = torch.linalg.solve_triangular(lower.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
        del lower
    del kb, strict_lower, rhs, v, beta  # (the names only: without autograd this frees them before the next products)
    attn = (q @ k.transpose(-1, -2)).masked_fill(~_read_mask(c, strict, q.device), 0)
    # products sharing an operand are formed as one: A [U~ W] and K^T [U~ W]
    read = attn @ u_w  # [A U~, A W]
    del attn
    kt_uw = k.transpose(-1, -2) @ u_w  # (B, H, nc, D, Dv + D): [K^T U~, K^T W]
    del u_w
    if s0 is None and q.shape[2] == 1:  # one chunk, nothing entering it
        return read[..., :e].reshape(b, h, -1, e)[:, :, :n], kt_uw[:, :, 0, :, :e]
    # the chain over chunks: (nc, B*H, D, Dv+D) contiguous, so each step is one batched multiply-add
    nc = q.shape[2]
    maps = torch.cat([kt_uw[..., :e], torch.eye(d, dtype=q.dtype, device=q.device) - kt_uw[..., e:]], dim=-1)
    del kt_uw
    maps = maps.permute(2, 0, 1, 3, 4).reshape(nc, b * h, d, e + d)
    s = s0.reshape(b * h, d, e) if s0 is not None else q.new_zeros(b * h, d, e)
    entering, s = chain(lambda s, m: torch.baddbmm(m[..., :e], m[..., e:], s), s, maps, stack_dim=1)
    entering = entering.reshape(b, h, nc, d, e)
    out = read[..., :e] + (q - read[..., e:]) @ entering
    return out.reshape(b, h, -1, e)[:, :, :n], s.reshape(b, h, d, e)


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
    beta = _check_beta(beta, q)
    state = _check_state(state, q, v, None)
    phi_q, phi_k, vc = _delta_features(q, k, v, feature_map, l2_normalize)
    s0 = None if state is None else state.s
    if kernel_path(backend, q, v, "delta_rule_attention", gated=False):
        out, s = recurrent_kernels.delta_scan(phi_q, phi_k, vc, beta, dtype=q.dtype, s0=s0, return_state=return_state)
    else:
        out, s = _delta_scan(phi_q, phi_k, vc, beta, chunk_size, s0, False)
    out = out.to(q.dtype)
    final = RecurrentState(s, num_tokens=q.shape[2] + (0 if state is None else state.num_tokens))
    return (out, final) if return_state else out


def delta_rule_step(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "identity", *, l2_normalize: bool = True,
) -> Tuple[Tensor, RecurrentState]:
    """One token of :func:`delta_rule_attention`. q, k: (B, H, D), v: (B, H, Dv), beta: (B, H).
    Returns (o (B, H, Dv) in q's dtype, new state)."""
    check_qkv(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))
    beta = _check_beta(beta.unsqueeze(-1) if isinstance(beta, Tensor) else beta, q.unsqueeze(2))[:, :, 0]
    state = _check_state(state, q.unsqueeze(2), v.unsqueeze(2), None)
    phi_q, phi_k, vc = _delta_features(q, k, v, feature_map, l2_normalize)
    s_prev = state.s if state is not None else phi_k.new_zeros(*phi_k.shape, v.shape[-1])
    err = vc - torch.einsum("bhd,bhde->bhe", phi_k, s_prev)  # what the state gets wrong for k
    s = s_prev + phi_k.unsqueeze(-1) * (beta.unsqueeze(-1) * err).unsqueeze(-2)
    seen = 1 + (0 if state is None else state.num_tokens)
    return torch.einsum("bhd,bhde->bhe", phi_q, s).to(q.dtype), RecurrentState(s, num_tokens=seen)


def bidirectional_delta_rule_attention(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, feature_map: FeatureMapArg = "identity", *,
    l2_normalize: bool = True, chunk_size: int = 64, backend: str = "auto",
) -> Tensor:
    """Delta-rule attention scanned forward (o_i = q_i S_i) and backward over the reversed order, the backward
    read strictly before token i's own update (q_i S'_{i+1}), so the diagonal counts once; the two are added.
    Arguments and raises as :func:`delta_rule_attention`; returns (B, H, N, Dv) in q's dtype."""
    check_qkv(q, k, v)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    beta = _check_beta(beta, q)
    phi_q, phi_k, vc = _delta_features(q, k, v, feature_map, l2_normalize)
    if kernel_path(backend, q, v, "bidirectional_delta_rule_attention", gated=False):
        return recurrent_kernels.bidirectional_delta(phi_q, phi_k, vc, beta, dtype=q.dtype).to(q.dtype)
    out_f, _ = _delta_scan(phi_q, phi_k, vc, beta, chunk_size, None, strict=False)
    flipped = (phi_q.flip(2), phi_k.flip(2), vc.flip(2), beta.flip(2))
    out_b, _ = _delta_scan(*flipped, chunk_size, None, strict=True)
    return (out_f + out_b.flip(2)).to(q.dtype)
