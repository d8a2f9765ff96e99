"""Linear attention: non-causal and causal, reference PyTorch path and backend dispatch.

Non-causal, per batch and head, with phi >= 0 (mean-normalised; the 1/N cancels except against eps):

    S = (1/N) sum_j (R_j phi(k_j))^T v_j        (D x Dv)
    z = (1/N) sum_j phi(k_j)                    (D)
    o_i = ((R_i phi(q_i)) S) / (phi(q_i) . z + eps)

R_i is the optional RoPE rotation of token i, applied to the numerator only: rotated features can be
negative, and a denominator that can change sign or vanish is not a normaliser. The numerator then depends on
relative positions only, since (R_i a)^T (R_j b) = a^T R_{j-i} b.

Causal (the RNN view): token i sees tokens j <= i, with S_i, z_i the means over those i tokens. The chunked
form computes it in parallel (quadratic inside a chunk, states passed between chunks); the step API
(:func:`linear_attention_step`) runs token by token with a constant-size state and gives the same outputs.

Accumulation of S and z and the division are fp32 (float64 for float64 inputs) whatever the input dtype; the
output has the input dtype. The default eps (1e-4) is representable in fp16 and bf16 and small against the
denominator of any non-degenerate input (phi(q).z is of order D times the typical feature value).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .feature_maps import FeatureMap, get_feature_map
from .rope import Rope, apply_rope, check_rope

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

DEFAULT_EPS = 1e-4
BACKENDS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

FeatureMapArg = Union[str, Callable, FeatureMap]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_qkv(q: Tensor, k: Tensor, v: Tensor, same_tokens: bool = True) -> None:
    """Validate attention inputs: q, k (B, H, N, D), v (B, H, N, Dv), one floating dtype, one device.

    Raises TypeError for non-tensors and bad or mixed dtypes, ValueError for bad shapes or devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; allowed: float16, bfloat16, float32, float64")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: mixed dtypes {q.dtype}, {k.dtype}, {v.dtype}; all three must share one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: tensors on different devices {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v: batch and head dims must match, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k: head dim {k.shape[-1]} does not match q's head dim {q.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"v: {v.shape[2]} tokens, but k has {k.shape[2]}; keys and values must pair up")
    if same_tokens and q.shape[2] != k.shape[2]:
        raise ValueError(f"k: {k.shape[2]} tokens, but q has {q.shape[2]}; causal or RoPE attention needs equal counts")
    if k.shape[2] == 0:
        raise ValueError("k: zero tokens; attention needs at least one key")


def _check_options(eps: float, backend: str, rope: Optional[Rope]) -> None:
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: must be a positive number, got {eps!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope: expected a linvision.ops.rope.Rope or None, got {type(rope).__name__}")


def _features(q: Tensor, k: Tensor, phi: FeatureMap, rope: Optional[Rope]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """phi(q), phi(k) in the compute dtype, and their rotated versions (the same tensors without RoPE)."""
    cdt = _compute_dtype(q.dtype)
    phi_q = phi(q.to(cdt), True)
    phi_k = phi(k.to(cdt), False)
    if rope is None:
        return phi_q, phi_k, phi_q, phi_k
    return phi_q, phi_k, apply_rope(phi_q, rope), apply_rope(phi_k, rope)


def linear_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """Non-causal linear attention in plain PyTorch; memory O(N*D + D*Dv), no N x N matrix."""
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    phi_q, phi_k, rot_q, rot_k = _features(q, k, phi, rope)
    vc = v.to(phi_k.dtype)
    n = k.shape[2]
    s = torch.einsum("bhnd,bhne->bhde", rot_k, vc) / n  # (B, H, D, Dv)
    z = phi_k.mean(dim=2)  # (B, H, D)
    num = torch.einsum("bhnd,bhde->bhne", rot_q, s)
    den = torch.einsum("bhnd,bhd->bhn", phi_q, z) + eps
    return (num / den.unsqueeze(-1)).to(q.dtype)


def causal_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    eps: float = DEFAULT_EPS, chunk_size: int = 64,
) -> Tensor:
    """Causal linear attention, chunked: o_i = (R_i phi(q_i)) S_i / (phi(q_i) . z_i + eps), with S_i and z_i the
    means over tokens j <= i. Only one state per chunk (N / chunk_size of them) is formed, never one per token."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    phi_q, phi_k, rot_q, rot_k = _features(q, k, phi, rope)
    vc = v.to(phi_k.dtype)
    b, h, n, _ = phi_q.shape
    c = min(chunk_size, n)
    pad = (-n) % c

    def chunks(x: Tensor) -> Tensor:  # (B, H, N, X) -> (B, H, nc, C, X); padded tokens are zero
        return F.pad(x, (0, 0, 0, pad)).reshape(b, h, -1, c, x.shape[-1])

    phi_q, phi_k, rot_q, rot_k, vc = map(chunks, (phi_q, phi_k, rot_q, rot_k, vc))
    # States entering each chunk: exclusive prefix sums over chunks.
    kv = torch.einsum("bhncd,bhnce->bhnde", rot_k, vc)  # (B, H, nc, D, Dv)
    s_prev = kv.cumsum(dim=2) - kv
    k_sum = phi_k.sum(dim=3)  # (B, H, nc, D)
    z_prev = k_sum.cumsum(dim=2) - k_sum
    mask = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    a_num = torch.einsum("bhnid,bhnjd->bhnij", rot_q, rot_k).masked_fill(~mask, 0)
    a_den = torch.einsum("bhnid,bhnjd->bhnij", phi_q, phi_k).masked_fill(~mask, 0)
    num = a_num @ vc + torch.einsum("bhnid,bhnde->bhnie", rot_q, s_prev)
    den = a_den.sum(-1) + torch.einsum("bhnid,bhnd->bhni", phi_q, z_prev)
    count = torch.arange(1, n + pad + 1, dtype=num.dtype, device=q.device).reshape(-1, c)  # tokens seen by i
    out = num / (den + count * eps).unsqueeze(-1)  # = (num / i) / (den / i + eps)
    return out.reshape(b, h, n + pad, -1)[:, :, :n].to(q.dtype)


@dataclass
class LinearAttentionState:
    """Recurrent state of causal linear attention: sums S (B, H, D, Dv), z (B, H, D) and tokens seen so far."""

    s: Tensor
    z: Tensor
    num_tokens: int = 0


def linear_attention_step(
    q: Tensor, k: Tensor, v: Tensor, state: Optional[LinearAttentionState] = None,
    feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None, eps: float = DEFAULT_EPS,
) -> Tuple[Tensor, LinearAttentionState]:
    """One token of causal linear attention. q, k: (B, H, D), v: (B, H, Dv). Returns (o (B, H, Dv), new state).

    With ``rope``, the token's position is ``state.num_tokens`` in the sequence the rope describes.
    """
    check_qkv(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))
    _check_options(eps, "torch", rope)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    cdt = _compute_dtype(q.dtype)
    phi_q = phi(q.to(cdt).unsqueeze(2), True)  # (B, H, 1, D)
    phi_k = phi(k.to(cdt).unsqueeze(2), False)
    if state is None:
        b, h, _, d = phi_k.shape
        state = LinearAttentionState(
            phi_k.new_zeros(b, h, d, v.shape[-1]), phi_k.new_zeros(b, h, d), 0
        )
    t = state.num_tokens
    rot_q, rot_k = phi_q, phi_k
    if rope is not None:
        if t >= rope.num_tokens:
            raise ValueError(f"rope: describes {rope.num_tokens} tokens, step {t} is past its end")
        cos, sin = rope.tables()
        p = rope.dim // 2
        cos_t = cos[:, t : t + 1].to(device=q.device, dtype=cdt)
        sin_t = sin[:, t : t + 1].to(device=q.device, dtype=cdt)

        def rotate(x: Tensor) -> Tensor:
            x1, x2 = x[..., :p], x[..., p:]
            return torch.cat([x1 * cos_t - x2 * sin_t, x1 * sin_t + x2 * cos_t], dim=-1)

        rot_q, rot_k = rotate(phi_q), rotate(phi_k)
    s = state.s + rot_k.squeeze(2).unsqueeze(-1) * v.to(cdt).unsqueeze(-2)
    z = state.z + phi_k.squeeze(2)
    t = t + 1
    num = torch.einsum("bhd,bhde->bhe", rot_q.squeeze(2), s)
    den = torch.einsum("bhd,bhd->bh", phi_q.squeeze(2), z) + t * eps
    return (num / den.unsqueeze(-1)).to(q.dtype), LinearAttentionState(s, z, t)


def _kernels():
    try:
        from linvision import kernels
    except ImportError:
        return None
    return kernels if hasattr(kernels, "linear_attention_triton") else None


def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    causal: bool = False, eps: float = DEFAULT_EPS, backend: str = "auto", chunk_size: int = 64,
) -> Tensor:
    """Linear attention of q, k (B, H, N, D) and v (B, H, N, Dv); returns (B, H, N, Dv) in q's dtype.

    feature_map: a name of :func:`linvision.ops.feature_maps.get_feature_map`, a callable or a FeatureMap.
    rope: a :class:`linvision.ops.rope.Rope` for the N tokens, applied to the numerator only.
    causal: token i attends to tokens j <= i (raster order for images); chunked with ``chunk_size``.
    backend: "torch" (reference), "triton" (fused kernels; raises if they cannot run this call) or "auto"
    (kernels where they apply, e.g. non-causal on CUDA with a fusable feature map; torch otherwise).

    Raises TypeError for non-tensors, integer or mixed dtypes; ValueError for mismatched shapes, devices,
    RoPE tables that do not fit, unknown feature-map names or backends.
    """
    check_qkv(q, k, v, same_tokens=causal or rope is not None)
    _check_options(eps, backend, rope)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    if rope is not None:
        check_rope(rope, phi.output_dim(q.shape[-1]), q.shape[2], q.shape[1])
    if backend == "triton" or (backend == "auto" and q.is_cuda):  # CPU kernels (interpreter) only on request
        kern = _kernels()
        reason = "the Triton kernels are not available" if kern is None else kern.unsupported_reason(
            q, k, v, phi, rope=rope, causal=causal
        )
        if reason is None:
            return kern.linear_attention_triton(q, k, v, phi.name, rope=rope, eps=eps)
        if backend == "triton":
            raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
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
