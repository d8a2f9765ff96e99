"""Linear attention: non-causal and causal, reference PyTorch path and backend dispatch.

Non-causal, per batch and head, with phi >= 0 (mean-normalised; the 1/N cancels except against eps):

    S = (1/N) sum_j (R_j phi(k_j))^T v_j        (D x Dv)
    z = (1/N) sum_j phi(k_j)                    (D)
    o_i = ((R_i phi(q_i)) S) / (phi(q_i) . z + eps)

R_i is the optional RoPE rotation of token i, applied to the numerator only: rotated features can be
negative, and a denominator that can change sign or vanish is not a normaliser. The numerator then depends on
relative positions only, since (R_i a)^T (R_j b) = a^T R_{j-i} b.

Causal (the RNN view): token i sees tokens j <= i, with S_i, z_i the means over those i tokens. It is the gated
recurrence of ``linvision.ops.recurrent`` with a zero log-gate, and runs through the same chunked scan
(quadratic inside a chunk, states passed between chunks) and the same step (:func:`linear_attention_step`, token
by token with a constant-size :class:`RecurrentState`), which give the same outputs.

Dispatch: ``backend="auto"`` runs CUDA tensors through the fused kernels of ``linvision.kernels`` where they
apply; where they do not (or cannot be imported), it says why in a warning, once per reason, and runs PyTorch.

Accumulation of S and z and the division are fp32 (float64 for float64 inputs) whatever the input dtype; the
output has the input dtype. The default eps (1e-4) is representable in fp16 and bf16 and small against the
denominator of any non-degenerate input (phi(q).z is of order D times the typical feature value).
"""
from __future__ import annotations

import warnings
from typing import Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from linvision.kernels.common import DEFAULT_EPS, check_eps, check_int, check_qkv

from .feature_maps import FeatureMap, FeatureMapArg, featurize, get_feature_map
from .recurrent import RecurrentState, _check_state, _gated_pieces, _gated_step
from .rope import Rope, is_exporting, is_tracing, apply_rope, check_rope, rotate_pairs

__all__ = [
    "DEFAULT_EPS",
    "BACKENDS",
    "linear_attention",
    "linear_attention_reference",
    "causal_linear_attention",
    "LinearAttentionState",
    "linear_attention_step",
    "softmax_attention",
    "check_qkv",
]

BACKENDS = ("auto", "torch", "triton")
# Device types whose tensors backend="auto" sends to the kernels (CPU kernels, interpreted, only on request).
_AUTO_DEVICES = ("cuda",)
_WARNED: Set[str] = set()

# The state of causal linear attention is the recurrent state with a zero log-gate: one type for both.
LinearAttentionState = RecurrentState


def _check_options(eps: float, backend: str, rope: Optional[Rope]) -> float:
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope: expected a linvision.ops.rope.Rope or None, got {type(rope).__name__}")
    return check_eps(eps)


def _features(
    q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope]
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """phi(q), phi(k), their rotated versions (the same tensors without RoPE) and v, in the compute dtype."""
    phi_q, phi_k, vc = featurize(phi, q, k, v)
    if rope is None:
        return phi_q, phi_k, phi_q, phi_k, vc
    return phi_q, phi_k, apply_rope(phi_q, rope), apply_rope(phi_k, rope), vc


# Feature maps whose only learnable tensor is ``scale`` (FLatten's focused map): the recomputing backward below
# knows every leaf they can hand a gradient to.
_RECOMPUTABLE_MAPS = ("elu", "relu", "exp", "identity", "focused")


def _leaves(phi: FeatureMap, rope: Optional[Rope]) -> Tuple[Tensor, ...]:
    """The learnable tensors the features depend on besides q, k: a focused map's scale, mixed-RoPE frequencies."""
    found = [getattr(phi, "scale", None)] + ([] if rope is None else [rope.freqs_x, rope.freqs_y])
    return tuple(t for t in found if torch.is_tensor(t) and t.requires_grad)


class _LinearAttentionFunction(torch.autograd.Function):
    """Non-causal linear attention (the formula of :func:`linear_attention_reference`) that saves for the
    backward only q, k and v (views of the projection's output, which stays alive anyway): the feature maps,
    rotations, state and denominators are recomputed in the backward instead of being kept for every token (two
    more (N x D x Dv) products), and the gradients of the products are written out:

        dnum_i = do_i / den_i,   dden_i = -(do_i . o_i) / den_i,   d(Rq)_i = dnum_i S^T,   dS = sum_i (Rq)_i^T dnum_i
        dphi(q)_i += dden_i z,   dz = sum_i dden_i phi(q)_i,   d(Rk)_j = v_j dS^T / N,   dv_j = (Rk)_j dS / N,
        dphi(k)_j += dz / N

    The features' own backward (feature map, rotation, casts; learnable scale and frequencies included) runs on
    the recomputed graph. Not differentiable twice."""

    @staticmethod
    def forward(ctx, q, k, v, phi, rope, eps, *leaves):
        ctx.phi, ctx.rope, ctx.eps = phi, rope, eps
        ctx.save_for_backward(q, k, v, *leaves)
        return _linear_attention_pieces(*_features(q, k, v, phi, rope), eps)[0].to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, *leaves = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
        with torch.enable_grad():
            phi_q, phi_k, rot_q, rot_k, vc = _features(*inputs, ctx.phi, ctx.rope)
        with torch.no_grad():
            out, s, z, den = _linear_attention_pieces(phi_q, phi_k, rot_q, rot_k, vc, ctx.eps)
            n = k.shape[2]
            do = grad_out.to(out.dtype)
            dnum = do / den.unsqueeze(-1)
            dden = -(do * out).sum(-1) / den
            ds = torch.einsum("bhnd,bhne->bhde", rot_q, dnum)
            d_rot_q = torch.einsum("bhne,bhde->bhnd", dnum, s)
            d_phi_q = dden.unsqueeze(-1) * z.unsqueeze(2)
            dz = torch.einsum("bhn,bhnd->bhd", dden, phi_q) / n
            d_rot_k = torch.einsum("bhne,bhde->bhnd", vc, ds) / n
            d_vc = torch.einsum("bhnd,bhde->bhne", rot_k, ds) / n
            d_phi_k = dz.unsqueeze(2).expand_as(phi_k)
        if ctx.rope is None:  # the rotated features are the features themselves
            outputs, grads = [phi_q, phi_k, vc], [d_rot_q + d_phi_q, d_rot_k + d_phi_k, d_vc]
        else:
            outputs, grads = [rot_q, phi_q, rot_k, phi_k, vc], [d_rot_q, d_phi_q, d_rot_k, d_phi_k, d_vc]
        wanted = [t for t in (*inputs, *leaves) if t.requires_grad]
        keep = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in keep], wanted, [g for _, g in keep], allow_unused=True)
                     if wanted and keep else [])
        result = [next(found) if t.requires_grad else None for t in (*inputs, *leaves)]
        return (*result[:3], None, None, None, *result[3:])


def _linear_attention_pieces(phi_q: Tensor, phi_k: Tensor, rot_q: Tensor, rot_k: Tensor, vc: Tensor, eps: float
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(output, S, z, denominators) of non-causal linear attention from its features, in their dtype."""
    n = phi_k.shape[2]
    s = torch.einsum("bhnd,bhne->bhde", rot_k, vc) / n  # (B, H, D, Dv)
    z = phi_k.mean(dim=2)  # (B, H, D)
    den = torch.einsum("bhnd,bhd->bhn", phi_q, z) + eps
    return torch.einsum("bhnd,bhde->bhne", rot_q, s) / den.unsqueeze(-1), s, z, den


def _recomputing(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope]) -> bool:
    """Whether the call goes through :class:`_LinearAttentionFunction`: a gradient is wanted, the feature map
    is one it knows, and no graph is being traced (compile and export see the plain formula)."""
    wanted = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or bool(_leaves(phi, rope)))
    return wanted and phi.name in _RECOMPUTABLE_MAPS and not is_tracing(*q.shape)


def linear_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """Non-causal linear attention in plain PyTorch; memory ``O(N*D + D*Dv)``, no N x N matrix. With a gradient
    wanted, the features are recomputed in the backward (:class:`_LinearAttentionFunction`) rather than kept."""
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    if _recomputing(q, k, v, phi, rope):
        return _LinearAttentionFunction.apply(q, k, v, phi, rope, eps, *_leaves(phi, rope))
    return _linear_attention_pieces(*_features(q, k, v, phi, rope), eps)[0].to(q.dtype)


def causal_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    eps: float = DEFAULT_EPS, chunk_size: int = 64,
) -> Tensor:
    """Causal linear attention, chunked: o_i = (R_i phi(q_i)) S_i / (phi(q_i) . z_i + eps), with S_i and z_i the
    means over tokens j <= i. The gated scan with a zero log-gate: one state per chunk (N / chunk_size of them)
    is formed, never one per token."""
    chunk_size = check_int("chunk_size", chunk_size, 1)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    phi_q, phi_k, rot_q, rot_k, vc = _features(q, k, v, phi, rope)
    rotated = None if rope is None else (rot_q, rot_k)
    num, den, count, _ = _gated_pieces(phi_q, phi_k, vc, None, chunk_size, None, False, rotated)
    return (num / (den + count * eps).unsqueeze(-1)).to(q.dtype)  # = (num / i) / (den / i + eps)


def linear_attention_step(
    q: Tensor, k: Tensor, v: Tensor, state: Optional[RecurrentState] = None,
    feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None, eps: float = DEFAULT_EPS,
) -> Tuple[Tensor, RecurrentState]:
    """One token of causal linear attention. q, k: (B, H, D), v: (B, H, Dv). Returns (o (B, H, Dv), new state).

    With ``rope``, the token's position is ``state.num_tokens`` in the sequence the rope describes.
    """
    q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)  # (B, H, 1, D): one token
    check_qkv(q, k, v)
    eps = _check_options(eps, "torch", rope)
    state = _check_state(state, q, v, 1)
    phi_q, phi_k, vc = (t[:, :, 0] for t in featurize(get_feature_map(feature_map, dim=q.shape[-1]), q, k, v))
    rotated = None
    if rope is not None:
        t = 0 if state is None else state.num_tokens
        if t >= rope.num_tokens:
            raise ValueError(f"rope: describes {rope.num_tokens} tokens, step {t} is past its end")
        cos, sin = (x[:, t].to(device=q.device, dtype=phi_q.dtype) for x in rope.tables())  # (heads or 1, P)
        rotated = (rotate_pairs(phi_q, cos, sin), rotate_pairs(phi_k, cos, sin))
    out, new_state = _gated_step(phi_q, phi_k, vc, phi_q.new_ones(*phi_q.shape[:2], 1), state, True, eps, rotated)
    return out.to(q.dtype), new_state


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"linear_attention: backend='auto' runs this call in PyTorch, not the fused kernels: {reason} "
            "(said once per reason; backend='torch' chooses PyTorch without this warning)",
            RuntimeWarning, stacklevel=3,
        )


def _fused(
    q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope], causal: bool, eps: float, backend: str
) -> Optional[Tensor]:
    """The fused kernels' output, or None where PyTorch serves the call: ``backend="torch"``, tensors ``"auto"``
    leaves to PyTorch, or (with a warning once per reason) a call the kernels cannot run. ValueError with the
    reason when ``backend="triton"`` is forced on such a call."""
    if backend == "torch" or (backend == "auto" and q.device.type not in _AUTO_DEVICES):
        return None
    if is_exporting():
        reason = "the call is being exported, and the fused kernels are not part of an exported graph"
        if backend == "triton":
            raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
        _warn_once(reason)
        return None
    try:
        from linvision.kernels import linear_attention as fused  # needs Triton
    except ImportError as exc:
        reason = f"the Triton kernels cannot be imported ({exc})"
    else:
        reason = fused.unsupported_reason(q, k, v, phi.name, rope=rope, causal=causal)
    if reason is None:
        return fused.linear_attention_triton(q, k, v, phi.name, rope=rope, eps=eps)
    if backend == "triton":
        raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
    _warn_once(reason)
    return None


def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    causal: bool = False, eps: float = DEFAULT_EPS, backend: str = "auto", chunk_size: int = 64,
) -> Tensor:
    """Linear attention of q, k (B, H, N, D) and v (B, H, N, Dv); returns (B, H, N, Dv) in q's dtype.

    feature_map: a name of :func:`linvision.ops.feature_maps.get_feature_map`, a callable or a FeatureMap.
    rope: a :class:`linvision.ops.rope.Rope` for the N tokens, applied to the numerator only.
    causal: token i attends to tokens j <= i (raster order for images); chunked with ``chunk_size``.
    backend: "torch" (reference), "triton" (fused kernels; raises if they cannot run this call) or "auto"
    (kernels for CUDA tensors where they apply, e.g. non-causal with a fusable feature map; PyTorch otherwise,
    with a RuntimeWarning once per reason when a CUDA call cannot run in the kernels).

    Raises TypeError for non-tensors, integer or mixed dtypes; ValueError for mismatched shapes, devices,
    RoPE tables that do not fit, unknown feature-map names or backends, a bad eps or chunk_size.
    """
    check_qkv(q, k, v, same_tokens=causal or rope is not None)
    eps = _check_options(eps, backend, rope)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    if rope is not None:
        check_rope(rope, phi.output_dim(q.shape[-1]), q.shape[2], q.shape[1])
    out = _fused(q, k, v, phi, rope, causal, eps, backend)
    if out is not None:
        return out
    if causal:
        return causal_linear_attention(q, k, v, phi, rope=rope, eps=eps, chunk_size=chunk_size)
    return linear_attention_reference(q, k, v, phi, rope=rope, eps=eps)


def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, *, rope: Optional[Rope] = None, causal: bool = False,
    scale: Optional[float] = None, attn_mask: Optional[Tensor] = None,
) -> Tensor:
    """Softmax attention with the call shape of :func:`linear_attention` (through
    ``scaled_dot_product_attention``). RoPE, when given, rotates both q and k (the usual softmax form)."""
    check_qkv(q, k, v, same_tokens=causal or rope is not None)
    _check_options(DEFAULT_EPS, "torch", rope)
    if rope is not None:
        q = apply_rope(q, rope).to(v.dtype)
        k = apply_rope(k, rope).to(v.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)
