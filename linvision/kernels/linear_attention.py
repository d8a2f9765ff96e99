"""Fused Triton kernels for non-causal linear attention, forward and backward.

The Triton jit code and its tables are in :mod:`.la_kernels` (the math, the four kernels and their precision
are described there), their launches in :mod:`.la_launch` (autotuning, buffers, RoPE tables, grids); this
module registers the custom ops and holds the public entry.

The kernels know only tensors, ints and flags: RoPE arrives as a :class:`~.common.RopeSpec` (frequency tensors,
grid width, prefix, offset) and the feature map as its name. The public entry, :func:`linear_attention_triton`,
goes through the torch custom ops
``linvision::linear_attention_fwd`` / ``linvision::linear_attention_bwd`` (autograd, fake tensors and a FLOP
formula registered), so ``torch.compile`` keeps it in one graph.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import register_flop_formula

from . import la_launch
from .common import (DEFAULT_EPS, FUSED_FEATURE_MAPS, KERNEL_NAMES, RopeSpec, check_eps, check_int, check_qkv,
                     check_rope, check_valid, feature_map_name)
from .la_kernels import (BACKWARD_LO, BYTE_POINTERS, CANDIDATE_CONFIGS, FLOAT_SCALARS,  # noqa: F401
                         FP32_POINTERS, INT_POINTERS, TOKEN_POINTERS, kernel_constexprs, kernel_function,
                         offered_configs)
from .la_launch import AUTOTUNE_ENV, _backward, _forward, chosen_configs, register_cap  # noqa: F401

__all__ = ["chosen_configs", "linear_attention_triton", "run_checked", "unsupported_reason", "FUSED_FEATURE_MAPS", "MIN_HEAD_DIM",
           "MAX_HEAD_DIM"]

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 128
MAX_VALUE_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The custom ops, defined on a torch.library.Library with their autograd as an autograd.Function registered on the
# Autograd key: a forward in grad mode costs about half the host time of torch.library.custom_op with
# register_autograd, whose autograd wrapper rebuilds the schema's argument list once per argument on every call
# (fill_defaults: about 50 us of a 90 us call on a 2-core CPU, launches stubbed). torch.compile and torch.export see
# the same ops: the schema, the fake implementations and the FLOP formulas are registered as before. The schemas
# have no default values (the dispatcher would leave out arguments equal to them): callers pass every argument.
_LIB = torch.library.Library("linvision", "FRAGMENT")  # other fragments may define ops of the namespace too
_LIB.define("linear_attention_fwd(Tensor q, Tensor k, Tensor v, str feature_map, Tensor? freqs_x, Tensor? freqs_y, "
            "int[] rope_ints, float[] rope_offsets, float eps, int split_tokens, Tensor? valid, Tensor? positions) "
            "-> (Tensor, Tensor, Tensor)")
_LIB.define("linear_attention_bwd(Tensor q, Tensor k, Tensor v, Tensor do, Tensor s, Tensor z, str feature_map, "
            "Tensor? freqs_x, Tensor? freqs_y, int[] rope_ints, float[] rope_offsets, float eps, int split_tokens, "
            "bool freq_grad, bool kv_grad, bool q_grad, Tensor? valid, Tensor? positions) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _linear_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, feature_map: str, freqs_x: Optional[Tensor], freqs_y: Optional[Tensor],
    rope_ints: List[int], rope_offsets: List[float], eps: float, split_tokens: int, valid: Optional[Tensor] = None,
    positions: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``linvision::linear_attention_fwd``: (o (B, H, Nq, Dv) in q's dtype, S (B, H, D, Dv) fp32, z (B, H, D)
    fp32); S and z are the sums over the keys (o = (R phi(q)) S / (phi(q) . z + Nk eps), the mean form with the 1/Nk
    moved onto eps: no division launched; with a token mask ``valid`` (B, Nk) the sums and Nk run over each
    sample's valid keys). ``positions`` (B or 1, M, 2): the RoPE (row, col) of each sample's tokens after the
    prefix. o is a view of token-major (B, Nq, H, Dv) memory, so merging its heads back into channels copies
    nothing."""
    return _forward(q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens, valid,
                    positions)


def _linear_attention_bwd(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, s: Tensor, z: Tensor, feature_map: str,
    freqs_x: Optional[Tensor], freqs_y: Optional[Tensor], rope_ints: List[int], rope_offsets: List[float],
    eps: float, split_tokens: int, freq_grad: bool, kv_grad: bool, q_grad: bool, valid: Optional[Tensor] = None,
    positions: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``linvision::linear_attention_bwd``: (dq, dk, dv, dfx, dfy) from the inputs, the output gradient and the
    saved S, z (nothing N-sized is saved); dfx, dfy are the RoPE frequencies' gradients with ``freq_grad``, dk and
    dv with ``kv_grad``, dq with ``q_grad``, else empty."""
    return _backward(q, k, v, do, s, z, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens,
                     freq_grad, kv_grad, q_grad, valid, positions)


@torch.library.register_fake("linvision::linear_attention_fwd", lib=_LIB)
def _(q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens, valid=None,
      positions=None):
    b, h, nq, d = q.shape
    dv = v.shape[-1]
    return (
        q.new_empty(b, nq, h, dv).transpose(1, 2),
        q.new_empty(b, h, d, dv, dtype=torch.float32),
        q.new_empty(b, h, d, dtype=torch.float32),
    )


@torch.library.register_fake("linvision::linear_attention_bwd", lib=_LIB)
def _(q, k, v, do, s, z, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens, freq_grad,
      kv_grad, q_grad, valid=None, positions=None):
    grads = freq_grad and freqs_x is not None
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format) if q_grad else q.new_empty(0),
        torch.empty_like(k, memory_format=torch.contiguous_format) if kv_grad else k.new_empty(0),
        torch.empty_like(v, memory_format=torch.contiguous_format) if kv_grad else v.new_empty(0),
        freqs_x.new_empty(freqs_x.shape) if grads else q.new_empty(0, dtype=torch.float32),
        freqs_y.new_empty(freqs_y.shape) if grads else q.new_empty(0, dtype=torch.float32),
    )


class _LinearAttention(torch.autograd.Function):
    """The autograd of ``linvision::linear_attention_fwd``: its backward is ``linvision::linear_attention_bwd``."""

    @staticmethod
    def forward(ctx, *inputs):  # ctx as forward's argument: no separate setup_context, whose call binds the
        # arguments to forward's signature with inspect on every call
        q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens, valid, positions = inputs
        with torch._C._AutoDispatchBelowAutograd():  # to the implementation (or the fake one) of the op itself
            o, s, z = torch.ops.linvision.linear_attention_fwd.default(*inputs)
        ctx.save_for_backward(q, k, v, s, z, freqs_x, freqs_y, valid, positions)
        ctx.options = (feature_map, rope_ints, rope_offsets, eps, split_tokens)
        ctx.mark_non_differentiable(s, z)
        ctx.set_materialize_grads(False)  # no zeros formed (and launched) for the gradients of S and z, never used
        return o, s, z

    @staticmethod
    @once_differentiable  # the backward kernels have no backward of their own
    def backward(ctx, do, ds, dz):
        if do is None:  # o got no gradient (S and z never do)
            return (None,) * 12
        q, k, v, s, z, freqs_x, freqs_y, valid, positions = ctx.saved_tensors
        feature_map, rope_ints, rope_offsets, eps, split_tokens = ctx.options
        needs = ctx.needs_input_grad
        dq, dk, dv, dfx, dfy = torch.ops.linvision.linear_attention_bwd.default(
            q, k, v, do, s, z, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens,
            needs[4] or needs[5], needs[1] or needs[2], needs[0], valid, positions,
        )
        # no key kernel (and no dk, dv) when neither keys nor values need a gradient, unless the frequencies do; no
        # dq (formed or stored) when the queries need none
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None,
                dfx if needs[4] else None, dfy if needs[5] else None, None, None, None, None, None, None)


def _linear_attention_fwd_autograd(q, k, v, feature_map, freqs_x, freqs_y, *options):
    """The forward op on the Autograd key: through :class:`_LinearAttention` when a gradient can flow (q, k, v or
    the RoPE frequencies require one, in grad mode), else straight to the implementation."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, freqs_x, freqs_y)):
        return _LinearAttention.apply(q, k, v, feature_map, freqs_x, freqs_y, *options)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.linvision.linear_attention_fwd.default(q, k, v, feature_map, freqs_x, freqs_y, *options)


_LIB.impl("linear_attention_fwd", _linear_attention_fwd, "CompositeExplicitAutograd")
_LIB.impl("linear_attention_bwd", _linear_attention_bwd, "CompositeExplicitAutograd")
_LIB.impl("linear_attention_fwd", _linear_attention_fwd_autograd, "Autograd")


@register_flop_formula(torch.ops.linvision.linear_attention_fwd)
def _fwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Matrix products: S = phi(k)^T v over Nk tokens and num = phi(q) S over Nq tokens."""
    b, h, nq, d = q_shape
    return 2 * b * h * (k_shape[2] + nq) * d * v_shape[-1]


@register_flop_formula(torch.ops.linvision.linear_attention_bwd)
def _bwd_flops(q_shape, k_shape, v_shape, do_shape, s_shape, z_shape, feature_map, freqs_x, freqs_y, rope_ints,
               rope_offsets, eps, split_tokens, freq_grad, kv_grad, q_grad, valid_shape, positions_shape,
               out_shape=None, **kwargs) -> int:
    """Matrix products: g = dO S^T and dS over Nq queries (the numerator is not recomputed); v dS^T and dv over
    Nk keys, only when the key kernel runs (keys, values or RoPE frequencies need a gradient)."""
    b, h, nq, d = q_shape
    keys = k_shape[2] if (kv_grad or freq_grad) else 0
    return 2 * b * h * (2 * nq + 2 * keys) * d * v_shape[-1]


def unsupported_reason(q: Tensor, k: Tensor, v: Tensor, feature_map: str, rope: Optional[RopeSpec] = None,
                       causal: bool = False) -> Optional[str]:
    """None when the fused kernels can run this call, else a short reason. Inputs already validated (see
    :func:`~.common.check_qkv`); ``feature_map`` is the map's name (aliases allowed)."""
    if causal:
        return "causal attention is not fused (the kernels are non-causal)"
    name = feature_map_name(feature_map)
    if name not in FUSED_FEATURE_MAPS:
        return f"feature map {name!r} is not fused (fused: {', '.join(FUSED_FEATURE_MAPS)})"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
    if q.device.type != "cuda" and not (la_launch._INTERPRET and q.device.type == "cpu"):
        return f"tensors are on {q.device.type} and TRITON_INTERPRET is not set"
    d, dv = q.shape[-1], v.shape[-1]
    if d % 2 or not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return f"head dim {d} not in {MIN_HEAD_DIM}..{MAX_HEAD_DIM} (even)"
    if not 1 <= dv <= MAX_VALUE_DIM:
        return f"value head dim {dv} not in 1..{MAX_VALUE_DIM}"
    return None


def _autocast(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor, Optional[torch.dtype]]:
    """The operands of fp32 inputs under ``torch.autocast`` for their device, and the dtype of the result (None: q's).

    bf16 autocast: bf16 operands (bf16 spans fp32's range, so no input overflows). fp16 autocast: the fp32 inputs
    as they are, since they may be features computed in fp32 on purpose (a power or an exp) that exceed fp16's
    65504. Either way the kernels accumulate in fp32 and the result has the autocast dtype."""
    device = q.device.type
    if q.dtype != torch.float32 or device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return q, k, v, None
    dtype = torch.get_autocast_dtype(device)
    if dtype == torch.bfloat16:
        return q.to(dtype), k.to(dtype), v.to(dtype), dtype
    return q, k, v, (dtype if dtype == torch.float16 else None)


def linear_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, feature_map: str, rope: Optional[RopeSpec] = None, eps: float = DEFAULT_EPS, *,
    split_tokens: int = 0, valid: Optional[Tensor] = None,
) -> Tensor:
    """Fused non-causal linear attention; same semantics as ``linvision.ops.linear_attention_reference``.

    q, k: (B, H, N, D) and v: (B, H, Nk, Dv), float16, bfloat16 or float32, any strides, on CUDA (or on CPU
    with ``TRITON_INTERPRET=1``); D even in 16..128, Dv in 1..128; Nq may differ from Nk without RoPE.
    feature_map: "identity", "relu" or "elu" (elu + 1), aliases of ``common.FEATURE_MAP_ALIASES`` allowed.
    rope: a :class:`~.common.RopeSpec` (``linvision.ops.Rope`` is one), applied in-kernel to the numerator; frequencies
    that require grad (learnable mixed RoPE) get their gradient from the backward kernels.
    split_tokens: tokens per split of the reductions over N (0: chosen from the GPU's size).
    valid: None, or a (B, Nk) bool mask of the keys that count: read in the kernels' token loops, the state,
    normaliser and means run over each sample's valid keys; invalid queries (Nq == Nk) get 0; masked tokens are
    never read, so padding may hold anything. RoPE at per-sample positions (``rope.positions``) rotates each
    token at its own (row, col).
    Returns (B, H, Nq, Dv) in q's dtype (the autocast dtype for fp32 inputs under ``torch.autocast``, which run
    with bf16 operands under bf16 autocast and fp32 operands under fp16 autocast), a view of token-major
    (B, Nq, H, Dv) memory: ``o.transpose(1, 2).reshape(B, Nq, H * Dv)`` is free;
    differentiable in q, k, v and the RoPE frequencies.

    Raises TypeError / ValueError for invalid inputs (see :func:`~.common.check_qkv`) and ValueError with the
    reason when the kernels cannot run the call.
    """
    check_qkv(q, k, v, same_tokens=rope is not None)
    if not isinstance(feature_map, str):
        raise TypeError(f"feature_map: expected the name of a fused map (str), got {type(feature_map).__name__}")
    if feature_map_name(feature_map) not in FUSED_FEATURE_MAPS:
        raise ValueError(f"feature_map: unknown name {feature_map!r} to the kernels; allowed: {', '.join(FUSED_FEATURE_MAPS)}")
    if rope is not None:
        if not isinstance(rope, RopeSpec):
            raise TypeError(f"rope: expected a RopeSpec (e.g. linvision.ops.Rope) or None, got {type(rope).__name__}")
        check_rope(rope, q.shape[-1], q.shape[2], q.shape[1], q.shape[0])
    eps = check_eps(eps)
    check_int("split_tokens", split_tokens, 0)
    valid = check_valid(valid, q, k)
    reason = unsupported_reason(q, k, v, feature_map, rope=rope, causal=False)
    if reason is not None:
        raise ValueError(f"linear_attention_triton: cannot run this call: {reason}")
    return run_checked(q, k, v, feature_map, rope, eps, split_tokens, valid)


def run_checked(q: Tensor, k: Tensor, v: Tensor, feature_map: str, rope: Optional[RopeSpec], eps: float,
                split_tokens: int = 0, valid: Optional[Tensor] = None) -> Tensor:
    """:func:`linear_attention_triton` for a caller that has made its checks (inputs, RoPE, eps, token mask, and
    :func:`unsupported_reason` None: ``linvision.ops.linear_attention`` does), so a call validates once."""
    q, k, v, result_dtype = _autocast(q, k, v)
    freqs_x = freqs_y = None
    rope_ints: List[int] = [0, 1]
    rope_offsets: List[float] = [0.0, 0.0]
    positions = None
    if rope is not None:
        p = rope.dim // 2
        # differentiable: learnable (mixed) frequencies get their gradient from the backward kernels
        freqs_x = rope.freqs_x.to(device=q.device, dtype=torch.float32).reshape(-1, p).contiguous()
        freqs_y = rope.freqs_y.to(device=q.device, dtype=torch.float32).reshape(-1, p).contiguous()
        rope_ints = [rope.num_prefix_tokens, rope.grid[1]]
        rope_offsets = [float(rope.offset[0]), float(rope.offset[1])]
        positions = rope.positions
    o, _, _ = torch.ops.linvision.linear_attention_fwd.default(
        q, k, v, feature_map_name(feature_map), freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens,
        valid, positions,
    )
    return o if result_dtype is None else o.to(result_dtype)
