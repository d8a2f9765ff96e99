"""The torch custom ops of the fused linear attention, ``linvision::linear_attention_fwd`` and
``linvision::linear_attention_bwd``, registered on import.

Their implementations are :func:`~.la_launch._forward` and :func:`~.la_launch._backward`; registered with them
are fake implementations (shapes and dtypes, for ``torch.compile`` and ``torch.export``), the autograd (the
backward op is the forward's gradient) and FLOP formulas, so ``torch.compile`` keeps a call in one graph. The
public entry, :func:`~.linear_attention.linear_attention_triton`, calls the forward op.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import register_flop_formula

from .la_launch import _backward, _forward

# The custom ops, defined on a torch.library.Library with their autograd as an autograd.Function registered on the
# Autograd key: a forward in grad mode costs about half the host time of torch.library.custom_op with
# register_autograd, whose autograd wrapper rebuilds the schema's argument list once per argument on every call
# (fill_defaults: about 50 us of a 90 us call on a 2-core CPU, launches stubbed). torch.compile and torch.export see
# the same ops: the schema, the fake implementations and the FLOP formulas are registered as before. The schemas
# have no default values (the dispatcher would leave out arguments equal to them): callers pass every argument.
_LIB = torch.library.Library("linvision", "FRAGMENT")  # other fragments may define ops of the namespace too
_LIB.define("linear_attention_fwd(Tensor q, Tensor k, Tensor v, str feature_map, Tensor? freqs_x, Tensor? freqs_y, "
            "int[] rope_ints, float[] rope_offsets, float eps, int split_tokens, Tensor? valid, Tensor? positions, "
            "Tensor? residual, Tensor? gate, int gate_act) -> (Tensor, Tensor, Tensor)")
_LIB.define("linear_attention_bwd(Tensor q, Tensor k, Tensor v, Tensor do, Tensor s, Tensor z, str feature_map, "
            "Tensor? freqs_x, Tensor? freqs_y, int[] rope_ints, float[] rope_offsets, float eps, int split_tokens, "
            "bool freq_grad, bool kv_grad, bool q_grad, Tensor? valid, Tensor? positions) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _linear_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, feature_map: str, freqs_x: Optional[Tensor], freqs_y: Optional[Tensor],
    rope_ints: List[int], rope_offsets: List[float], eps: float, split_tokens: int, valid: Optional[Tensor] = None,
    positions: Optional[Tensor] = None, residual: Optional[Tensor] = None, gate: Optional[Tensor] = None,
    gate_act: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``linvision::linear_attention_fwd``: (o (B, H, Nq, Dv) in q's dtype, S (B, H, D, Dv) fp32, z (B, H, D)
    fp32); S and z are the sums over the keys (o = (R phi(q)) S / (phi(q) . z + Nk eps), the mean form with the 1/Nk
    moved onto eps: no division launched; with a token mask ``valid`` (B, Nk) the sums and Nk run over each
    sample's valid keys). ``positions`` (B or 1, M, 2): the RoPE (row, col) of each sample's tokens after the
    prefix. o is a view of token-major (B, Nq, H, Dv) memory, so merging its heads back into channels copies
    nothing. The epilogue, inference only (the autograd refuses it): o = (attention + ``residual``) * act(``gate``),
    both (B, H, Nq, Dv) of any strides, act by its code ``gate_act`` of ``EPILOGUE_GATES``."""
    return _forward(q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens, valid,
                    positions, residual, gate, gate_act)


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
      positions=None, residual=None, gate=None, gate_act=0):
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
        q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens, valid, positions = \
            inputs[:12]
        if any(t is not None for t in inputs[12:14]):
            raise ValueError("residual, gate: the forward's epilogue runs without gradients (inference); in training "
                             "apply them to the attention's output")
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
            return (None,) * 15
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
                dfx if needs[4] else None, dfy if needs[5] else None, None, None, None, None, None, None, None, None,
                None)


def _linear_attention_fwd_autograd(q, k, v, feature_map, freqs_x, freqs_y, *options):
    """The forward op on the Autograd key: through :class:`_LinearAttention` when a gradient can flow (q, k, v or
    the RoPE frequencies require one, in grad mode), else straight to the implementation."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, freqs_x, freqs_y, *options[6:8])):
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
