"""Fused Triton kernels for non-causal linear attention, forward and backward: the public entry.

The kernels know only tensors, ints and flags: RoPE arrives as a :class:`~.common.RopeSpec` (frequency tensors,
grid width, prefix, offset) and the feature map as its name. The public entry, :func:`linear_attention_triton`,
goes through the torch custom ops
``linvision::linear_attention_fwd`` / ``linvision::linear_attention_bwd`` (autograd, fake tensors and a FLOP
formula registered), so ``torch.compile`` keeps it in one graph.

Below it, one job each: :mod:`.la_kernels` holds the Triton jit code and its tables (the math, the four kernels
and their precision are described there), :mod:`.la_launch` their launches (autotuning, buffers, RoPE tables,
grids) and :mod:`.la_op` the custom ops (fake implementations, autograd, FLOP formulas). Their public names
(:func:`~.la_launch.chosen_configs`, :func:`~.la_launch.register_cap`, ``AUTOTUNE_ENV``,
:func:`~.la_kernels.offered_configs`, ...) import from here as before.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import la_launch, la_op  # noqa: F401  (la_op registers the custom ops)
from .common import (DEFAULT_EPS, EPILOGUE_GATES, FUSED_FEATURE_MAPS, KERNEL_NAMES, RopeSpec, check_epilogue,
                     check_eps, check_int, check_qkv, check_rope, check_valid, feature_map_name)
from .la_kernels import (BACKWARD_LO, BYTE_POINTERS, CANDIDATE_CONFIGS, FLOAT_SCALARS,  # noqa: F401
                         FP32_POINTERS, INT_POINTERS, TOKEN_POINTERS, kernel_constexprs, kernel_function,
                         offered_configs)
from .la_launch import AUTOTUNE_ENV, chosen_configs, register_cap  # noqa: F401

__all__ = ["chosen_configs", "linear_attention_triton", "run_checked", "unsupported_reason", "FUSED_FEATURE_MAPS", "MIN_HEAD_DIM",
           "MAX_HEAD_DIM"]

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 128
MAX_VALUE_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    split_tokens: int = 0, valid: Optional[Tensor] = None, residual: Optional[Tensor] = None,
    gate: Optional[Tensor] = None, gate_activation: str = "identity",
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

    residual, gate: the output kernel's epilogue, for inference: (attention + residual) * act(gate), act one of
    ``EPILOGUE_GATES`` (``gate_activation``), each (B, H, Nq, Dv) of any strides (a LePE branch, an output gate),
    added and multiplied in fp32 before the one rounding to the output dtype; no launch of their own. ValueError
    when a gradient would flow (the epilogue has no backward; apply them to the output in training).

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
    check_epilogue(q, v, residual, gate, gate_activation)
    return run_checked(q, k, v, feature_map, rope, eps, split_tokens, valid, residual, gate, gate_activation)


def run_checked(q: Tensor, k: Tensor, v: Tensor, feature_map: str, rope: Optional[RopeSpec], eps: float,
                split_tokens: int = 0, valid: Optional[Tensor] = None, residual: Optional[Tensor] = None,
                gate: Optional[Tensor] = None, gate_activation: str = "identity") -> Tensor:
    """:func:`linear_attention_triton` for a caller that has made its checks (inputs, RoPE, eps, token mask, the
    epilogue and :func:`unsupported_reason` None: ``linvision.ops.linear_attention`` does), so a call validates
    once."""
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
        valid, positions, residual, gate, EPILOGUE_GATES[gate_activation] if gate is not None else 0,
    )
    return o if result_dtype is None else o.to(result_dtype)
