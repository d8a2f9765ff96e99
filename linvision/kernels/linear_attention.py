"""Fused Triton kernels for non-causal linear attention, forward and backward.

Math (the reference is ``linvision.ops.linear_attention``), per batch and head, with R_i the optional 2D RoPE rotation
applied to the numerator only:

    S = (1/Nk) sum_j (R_j phi(k_j))^T v_j     z = (1/Nk) sum_j phi(k_j)
    o_i = ((R_i phi(q_i)) S) / (phi(q_i) . z + eps)

the forward computed with the sums Nk S and Nk z and the eps Nk eps (the same o, no division launched), the
backward with the means:

Four kernels, each one pass over N-sized tensors, so HBM traffic is the minimum the math allows:
- ``_state_fwd_kernel``   reads k, v; writes per-split partial sums of S and z (split-N when B*H is small).
- ``_output_fwd_kernel``  reads q; writes o (from the reduced S and z).
- ``_query_bwd_kernel``   reads q, dO; recomputes den from the saved z and g = dO S^T / den (the gradient of the
  rotated features), takes dden = -(R phi(q) . g) / den without the numerator; writes dq and (summed over the
  splits) dS = (1/Nk) sum_i (R_i phi(q_i) / den_i)^T dO_i and dz = (1/Nk) sum_i dden_i phi(q_i).
- ``_key_bwd_kernel``     reads k, v; writes dk = phi'(k) (R^T (v dS^T) + dz) and dv = (R phi(k)) dS.

Per-split partial sums are added by the last split program of each batch-head to finish (a counter per
batch-head, taken after a barrier with a release-acquire atomic, reset by that program): in split order, from L2,
with no launch of their own; with one split (always when B*H fills the GPU) a program stores its sums directly.
Summing them inside the consumers instead would make every token-block program of the output and key kernels read
all the partials: at B1 H16 N65536 D64 (17 splits on an H100) 4-18x the HBM bytes of its own tile (BLOCK_N 256 to
64) from L2. The 1/Nk of the means is applied by the kernels as they load S, z and dS, dz; no division is launched.
Fused: the feature map (identity, relu, elu+1) and its derivative, and RoPE (axial or mixed, shared
or per head) from separable tables: cos and sin of fx * col per grid column and of fy * row per grid row, O((W + H)
D) values built once per frequency tensors (and their version) and grid, combined per token by angle addition (no
transcendental functions in the kernels). The
head dim is handled as two halves of P = D/2 channels because RoPE pairs channel t with channel t + P; S is kept as
its two row halves.

Precision. Feature maps, rotations, sums and divisions run in fp32. For fp16/bf16 inputs every ``tl.dot`` takes
16-bit operands with fp32 accumulation, so the tensor cores multiply exactly what the kernel formed: N-sized tiles
either as loaded (v, dO) or rounded to nearest in the input dtype (rotated features, R phi(q) / den); the fp32
state (S or dS) is scaled by a power of two to max |S| <= 1 and split into hi + lo 16-bit parts, two dots, which
represent it to 2^-17 relative (bf16) or 2^-22 of max |S| (fp16). ``tests/test_kernels.py`` recomputes the op
with exactly these roundings and asserts the fp16/bf16 tolerances against float64. fp32 inputs use exact fp32
products ("ieee").

On a GPU the kernels are autotuned over block size, warps and stages, keyed on the next power of two of N: N is a
runtime argument, so a new resolution re-tunes only when it enters a new power-of-two bucket and compiles
nothing new beyond Triton's usual integer specialisations. The configurations offered per kernel and head dim
(:func:`offered_configs`) are those that compile for sm_90 without register spills, within 227 KB of shared
memory and with a pipelined token loop (``linvision-check-kernels`` checks them without a GPU). During CUDA-graph
capture, where the autotuner cannot benchmark, the first offered configuration runs. Batch x heads is folded
into grid axes 1 and 2, so it has no 65535 limit. Under ``TRITON_INTERPRET=1`` one fixed configuration is used.

The kernels know only tensors, ints and flags: RoPE arrives as a :class:`~.common.RopeSpec` (frequency tensors,
grid width, prefix, offset) and the feature map as its name. The public entry, :func:`linear_attention_triton`,
goes through the torch custom ops
``linvision::linear_attention_fwd`` / ``linvision::linear_attention_bwd`` (autograd, fake tensors and a FLOP
formula registered), so ``torch.compile`` keeps it in one graph.
"""
from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import register_flop_formula

from .common import (DEFAULT_EPS, FUSED_FEATURE_MAPS, KERNEL_NAMES, RopeSpec, check_eps, check_int, check_qkv,
                     check_rope, check_valid, feature_map_name)

__all__ = ["chosen_configs", "linear_attention_triton", "run_checked", "unsupported_reason", "FUSED_FEATURE_MAPS", "MIN_HEAD_DIM",
           "MAX_HEAD_DIM"]

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 128
MAX_VALUE_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET_BLOCK_N = 64
# LINVISION_KERNEL_AUTOTUNE=0 (read at import): every launch takes the first offered configuration, none benchmarked
# (the CUDA tests: each new shape would otherwise time every configuration); the default is 1, autotuned.
AUTOTUNE_ENV = "LINVISION_KERNEL_AUTOTUNE"
_AUTOTUNE = os.environ.get(AUTOTUNE_ENV, "1") != "0"
_SPLIT_ALIGN = 256  # split lengths are multiples of every autotuned BLOCK_N
# The backward's products with the state (S, dS) take its hi part only: 2^-9 (bf16) / 2^-11 (fp16) relative,
# within the gradients' tolerances (4x the output's), as flash attention's backward rounds P and dS to 16 bits;
# it halves those products and the registers that hold the state. The forward keeps hi + lo.
BACKWARD_LO = tl.constexpr(False)
_MAX_GRID_Y = 65535  # batch x heads runs on grid axes 1 and 2, each at most this long


# (BLOCK_N, num_warps, num_stages): the search space the offered configurations were chosen from with
# linvision-check-kernels (sm_90: no spills, shared memory <= 227 KB, pipelined token loops).
CANDIDATE_CONFIGS = ((16, 8, 2), (32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 4, 2),
                     (128, 8, 2), (128, 8, 3), (256, 8, 2))
_OFFERED = {}  # filled below the kernels: kernel name -> {BLOCK_P: configs}


def offered_configs(kernel: str, d: int, dv: Optional[int] = None) -> Tuple[Tuple[int, int, int], ...]:
    """(BLOCK_N, num_warps, num_stages) the autotuner is offered for ``kernel`` at head dims ``d`` and ``dv``
    (default ``d``): only those that compile for sm_90 without spills, within 227 KB of shared memory and with a
    pipelined token loop, checked at D = Dv = the bucket of the larger of the two (32, 64 or 128)."""
    return _OFFERED[kernel][_dim_bucket(d, d if dv is None else dv)]


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of Python ints (triton.cdiv, a JIT-callable function, costs tens of microseconds per call)."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2, in plain Python."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _dim_bucket(d: int, dv: int) -> int:
    return max(32, _next_pow2(max(d, dv)))


def _block_p(d: int) -> int:
    return max(16, _next_pow2(d // 2))


_TUNE_KEY = ["N_BUCKET", "D_HALF", "DV", "FEATURE", "HAS_ROPE", "MASK", "POSITIONS"]
_JITTED = {}  # kernel name -> jitted function
_TUNED = {}  # (kernel name, BLOCK_P) -> autotuned kernel
_CHOSEN = {}  # (kernel name, head-dim bucket, N_BUCKET, constexprs) -> the configuration the autotuner chose
_ACCUMULATED = ("DF",)  # buffers the key kernel adds into (atomically), not overwrites


# kernel name -> the registers per thread its launches are compiled with at most (Triton's maxnreg); empty by
# default. Set inside :func:`register_cap` only: a cap that spills is outside the compile check's rule.
_REGISTER_CAPS: Dict[str, int] = {}


@contextlib.contextmanager
def register_cap(kernel: str, cap: Optional[int]) -> Iterator[None]:
    """Inside the block, kernel ``kernel`` compiles with at most ``cap`` registers per thread (None: no cap), for
    the GPU report to time (the query kernel holds 176 at D=64, one program per SM; 128 fits two). The
    autotuner's choices for the kernel are forgotten on entry and on exit."""
    def forget():
        for key in [k for k in _TUNED if k[0] == kernel]:
            del _TUNED[key]
        for key in [k for k in _CHOSEN if k[0] == kernel]:
            del _CHOSEN[key]

    before = _REGISTER_CAPS.get(kernel)
    forget()
    if cap is None:
        _REGISTER_CAPS.pop(kernel, None)
    else:
        _REGISTER_CAPS[kernel] = cap
    try:
        yield
    finally:
        forget()
        if before is None:
            _REGISTER_CAPS.pop(kernel, None)
        else:
            _REGISTER_CAPS[kernel] = before


def _kernel(fn):
    """Register a kernel; it is autotuned per head-dim bucket over :func:`offered_configs` (see :func:`_tuned`)."""
    jitted = triton.jit(fn)
    _JITTED[fn.__name__] = jitted
    return jitted


def _tuned(name: str, d: int, dv: int):
    """The autotuned kernel ``name`` for head dims ``d``, ``dv``; one fixed configuration in the interpreter (it
    cannot benchmark)."""
    key = (name, _dim_bucket(d, dv))
    if key not in _TUNED:
        if _INTERPRET:
            configs = [triton.Config({"BLOCK_N": _INTERPRET_BLOCK_N}, num_warps=4)]
        else:
            configs = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s, maxnreg=_REGISTER_CAPS.get(name))
                       for bn, w, s in offered_configs(name, d, dv)]
        # the autotuner runs each configuration several times on the call's own buffers: a buffer a kernel adds
        # into (the key kernel's RoPE-frequency sums) is restored before each of those runs and after them
        restore = [arg for arg in _ACCUMULATED if arg in _JITTED[name].arg_names and name == "_key_bwd_kernel"]
        _TUNED[key] = triton.autotune(configs=configs, key=_TUNE_KEY, restore_value=restore or None)(_JITTED[name])
    return _TUNED[key]


@triton.jit
def _phi(x, FEATURE: tl.constexpr):
    """Feature map on fp32 values: 0 identity, 1 relu, 2 elu + 1."""
    if FEATURE == 1:
        y = tl.maximum(x, 0.0)
    elif FEATURE == 2:
        y = tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    else:
        y = x
    return y


@triton.jit
def _phi_grad(f, FEATURE: tl.constexpr):
    """d phi / dx from the features f = phi(x) (fp32): relu 1 where f > 0; elu + 1 min(f, 1) (exp(x) for x <= 0,
    1 above); identity 1. The inputs themselves need not stay live."""
    if FEATURE == 1:
        g = tl.where(f > 0, 1.0, 0.0)
    elif FEATURE == 2:
        g = tl.minimum(f, 1.0)
    else:
        g = tl.full(f.shape, 1.0, tl.float32)
    return g


@triton.jit
def _operand(x, DOT: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 values as a tensor-core operand: rounded to nearest in the input's 16-bit dtype (fp32 for fp32
    inputs). In the interpreter, which cannot multiply bf16, bf16 rounding is done on the fp32 bits."""
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DOT)
    return y


@triton.jit
def _native(x, ROUND_BF16: tl.constexpr):
    """A loaded tile as a dot operand as it is (16-bit inputs stay 16-bit); fp32 where the interpreter's bf16 loads
    need it."""
    if ROUND_BF16:
        y = x.to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _split_state(s1, s2, DOT: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT: tl.constexpr, LO: tl.constexpr):
    """The fp32 state halves as tensor-core operands: with SPLIT (16-bit inputs), scaled by a power of two c to
    max |S| <= 1 and rounded to 16 bits (hi), with LO also its remainder (lo: S c = hi + lo up to 2^-17 relative in
    bf16, 2^-22 of max |S| in fp16; hi alone carries 2^-9 / 2^-11 relative); returns (hi1, lo1, hi2, lo2, 1 / c),
    lo = hi (unused) without LO. Without SPLIT (fp32): (s1, s1, s2, s2, 1) and lo unused."""
    if SPLIT:
        m = tl.maximum(tl.max(tl.max(tl.abs(s1), axis=1), axis=0), tl.max(tl.max(tl.abs(s2), axis=1), axis=0))
        e = tl.where(m > 0, tl.ceil(tl.log2(tl.maximum(m, 1e-30))), 0.0)
        c = tl.exp2(-e)
        a1 = s1 * c
        a2 = s2 * c
        hi1 = _operand(a1, DOT, ROUND_BF16)
        hi2 = _operand(a2, DOT, ROUND_BF16)
        if LO:
            lo1 = _operand(a1 - hi1.to(tl.float32), DOT, ROUND_BF16)
            lo2 = _operand(a2 - hi2.to(tl.float32), DOT, ROUND_BF16)
        else:
            lo1 = hi1
            lo2 = hi2
        inv = tl.exp2(e)
    else:
        hi1 = s1
        lo1 = s1
        hi2 = s2
        lo2 = s2
        inv = 1.0
    return hi1, lo1, hi2, lo2, inv


@triton.jit
def _state_dot(a, hi, lo, acc, SPLIT: tl.constexpr, PRECISION: tl.constexpr, LO: tl.constexpr):
    """acc + a @ (hi + lo): a product with the split state (one dot without SPLIT or LO)."""
    acc = tl.dot(a, hi, acc, input_precision=PRECISION)
    if SPLIT and LO:
        acc = tl.dot(a, lo, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grid_pos(offs_n, hi, prefix, width):
    """(row, col, whether on the grid) of tokens: prefix tokens and tokens >= hi are not (row = col = 0)."""
    g = offs_n - prefix
    is_grid = (g >= 0) & (offs_n < hi)
    g = tl.where(is_grid, g, 0)
    row = g // width
    return row, g - row * width, is_grid


@triton.jit
def _sample_pos(pos_row, offs_n, hi, prefix):
    """(row, col, whether rotated) of tokens at their sample's own positions: fp32 (row, col), offsets included,
    read from the sample's (M, 2) positions (token n >= prefix at row n - prefix); prefix tokens and tokens >= hi
    are not rotated (row = col = 0)."""
    g = offs_n - prefix
    is_rot = (g >= 0) & (offs_n < hi)
    ptrs = pos_row + tl.where(is_rot, g, 0).to(tl.int64) * 2
    return tl.load(ptrs, mask=is_rot, other=0.0), tl.load(ptrs + 1, mask=is_rot, other=0.0), is_rot


@triton.jit
def _token_mask(valid_row, offs_n, hi, MASK: tl.constexpr):
    """The tokens of a block that count: those < hi and, with MASK, marked in the sample's (N,) row of the token
    mask (read here, in the token loop: no pass of its own)."""
    keep = offs_n < hi
    if MASK:
        keep = keep & (tl.load(valid_row + offs_n, mask=keep, other=0) != 0)
    return keep


@triton.jit
def _per_sample(x, COUNT, b, COUNTED: tl.constexpr, DIVIDE: tl.constexpr):
    """``x`` times (DIVIDE: over) sample b's number of valid keys with COUNTED (a token mask), at least 1 (as the
    reference counts); ``x`` without."""
    if COUNTED:
        n = tl.maximum(tl.load(COUNT + b), 1.0)
        if DIVIDE:
            y = x / n
        else:
            y = x * n
    else:
        y = x
    return y


@triton.jit
def _freq_grad(dfx, dfy, g1, g2, r1, r2, offs_n, hi, prefix, width, off_row, off_col, pos_row,
               POSITIONS: tl.constexpr):
    """Add a token block's gradient of the RoPE frequencies: with g the gradient of the rotated features r = R phi,
    d loss / d angle = g2 r1 - g1 r2 per pair, and the angle fx (col + off_col) + fy (row + off_row) (with
    POSITIONS: fx col + fy row at the sample's own positions)."""
    dang = g2 * r1 - g1 * r2
    if POSITIONS:
        rowp, colp, _ = _sample_pos(pos_row, offs_n, hi, prefix)
    else:
        row, col, is_grid = _grid_pos(offs_n, hi, prefix, width)
        colp = tl.where(is_grid, col.to(tl.float32) + off_col, 0.0)
        rowp = tl.where(is_grid, row.to(tl.float32) + off_row, 0.0)
    return dfx + tl.sum(dang * colp[:, None], axis=0), dfy + tl.sum(dang * rowp[:, None], axis=0)


@triton.jit
def _rope_cos_sin(TAB, h, stride_th, stride_ts, offs_n, hi, offs_p, prefix, width, D_HALF, pos_row,
                  HAS_ROPE: tl.constexpr, POSITIONS: tl.constexpr):
    """cos, sin (BLOCK_N, BLOCK_P) of the tokens' angles fx * col + fy * row, combined by angle addition from the
    separable tables (no transcendental functions): TAB holds per head cos and sin of fx * col for each grid column,
    then of fy * row for each grid row. Prefix tokens and tokens >= hi are not rotated. Without RoPE the identity
    rotation (1, 0). With POSITIONS each sample's tokens sit at their own (row, col): TAB holds the frequencies
    fx, fy per head, and the angle is formed per token (as the reference does) and its cos and sin taken here."""
    if HAS_ROPE and POSITIONS:
        row, col, is_rot = _sample_pos(pos_row, offs_n, hi, prefix)
        base = TAB + h.to(tl.int64) * stride_th + offs_p
        fx = tl.load(base, mask=offs_p < D_HALF, other=0.0)
        fy = tl.load(base + stride_ts, mask=offs_p < D_HALF, other=0.0)
        ang = col[:, None] * fx[None, :] + row[:, None] * fy[None, :]
        cos = tl.where(is_rot[:, None], tl.cos(ang), 1.0)
        sin = tl.where(is_rot[:, None], tl.sin(ang), 0.0)
    elif HAS_ROPE:
        row, col, is_grid = _grid_pos(offs_n, hi, prefix, width)
        m = is_grid[:, None] & (offs_p < D_HALF)[None, :]
        base = TAB + h.to(tl.int64) * stride_th + offs_p[None, :]
        col_ptrs = base + col[:, None] * D_HALF
        row_ptrs = base + (row + width)[:, None] * D_HALF
        cx = tl.load(col_ptrs, mask=m, other=1.0)
        sx = tl.load(col_ptrs + stride_ts, mask=m, other=0.0)
        cy = tl.load(row_ptrs, mask=m, other=1.0)
        sy = tl.load(row_ptrs + stride_ts, mask=m, other=0.0)
        cos = cx * cy - sx * sy
        sin = sx * cy + cx * sy
    else:
        cos = 1.0
        sin = 0.0
    return cos, sin


@triton.jit
def _rotate(x1, x2, cos, sin, HAS_ROPE: tl.constexpr, INVERSE: tl.constexpr):
    """R x (R^T x with INVERSE) on the channel halves: pair t is (x1[:, t], x2[:, t]). The identity without RoPE."""
    if not HAS_ROPE:
        y1 = x1
        y2 = x2
    elif INVERSE:
        y1 = x1 * cos + x2 * sin
        y2 = x2 * cos - x1 * sin
    else:
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
    return y1, y2


@triton.jit
def _sample_rows(VALID, POS, b, N, stride_pb):
    """Sample b's (N,) row of the token mask and its (M, 2) positions (dummies when unused)."""
    return VALID + b.to(tl.int64) * N, POS + b.to(tl.int64) * stride_pb


@triton.jit
def _program(H, BH, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(program index along axis 0, batch-head, batch, head, whether bh is a real one, channel-pair offsets, value
    offsets). Batch x heads runs on grid axes 1 and 2 (beyond 65535 on the third); programs past B*H compute the
    last head again and store nothing."""
    bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    valid = bh < BH
    bh = tl.minimum(bh, BH - 1)
    return tl.program_id(0), bh, bh // H, bh % H, valid, tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_DV)


@triton.jit
def _head(X, b, h, stride_b, stride_h):
    """Base pointer of the (N, C) slice of batch b, head h of a (B, H, N, C) tensor."""
    return X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _tile_masks(mask_n, offs_p, offs_e, D_HALF, DV):
    """Masks of a token block whose tokens ``mask_n`` count: channel halves (BLOCK_N, BLOCK_P) and values
    (BLOCK_N, BLOCK_DV)."""
    return mask_n[:, None] & (offs_p < D_HALF)[None, :], mask_n[:, None] & (offs_e < DV)[None, :]


@triton.jit
def _load_tile(base, offs_n, offs_c, stride_n, stride_c, mask):
    """Tile (BLOCK_N, len(offs_c)) of an (N, C) slice in the tensor's dtype (masked lanes 0)."""
    ptrs = base + offs_n.to(tl.int64)[:, None] * stride_n + offs_c[None, :] * stride_c
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_tile_t(base, offs_n, offs_c, stride_n, stride_c, mask):
    """The transposed tile (len(offs_c), BLOCK_N) of an (N, C) slice; ``mask`` as for :func:`_load_tile`. Loaded
    so, it feeds a dot as the left operand without a transpose (which would keep the load from being pipelined)."""
    ptrs = base + offs_c[:, None] * stride_c + offs_n.to(tl.int64)[None, :] * stride_n
    return tl.load(ptrs, mask=tl.trans(mask), other=0.0)


@triton.jit
def _features(x_base, offs_n, hi, offs_p, stride_n, stride_d, D_HALF, mask, TAB, h, stride_th, stride_ts, prefix,
              width, pos_row, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr, POSITIONS: tl.constexpr):
    """A token block of an (N, D) slice: its channel halves x1, x2 (fp32), cos and sin of its rotation, phi(x)
    and R phi(x) on the halves (fp32); masked lanes of the features are zero (elu(0) + 1 = 1 must not count)."""
    x1 = _load_tile(x_base, offs_n, offs_p, stride_n, stride_d, mask).to(tl.float32)
    x2 = _load_tile(x_base, offs_n, offs_p + D_HALF, stride_n, stride_d, mask).to(tl.float32)
    cos, sin = _rope_cos_sin(TAB, h, stride_th, stride_ts, offs_n, hi, offs_p, prefix, width, D_HALF, pos_row,
                             HAS_ROPE, POSITIONS)
    f1 = tl.where(mask, _phi(x1, FEATURE), 0.0)
    f2 = tl.where(mask, _phi(x2, FEATURE), 0.0)
    r1, r2 = _rotate(f1, f2, cos, sin, HAS_ROPE, False)
    return x1, x2, cos, sin, f1, f2, r1, r2


@triton.jit
def _input_grad(g1, g2, a1, a2, f1, f2, FEATURE: tl.constexpr, cos, sin, HAS_ROPE: tl.constexpr):
    """phi'(x) (R^T g + a) on the channel halves: the gradient of inputs x from the gradient g of their rotated
    features R phi(x) and the gradient a of their features f = phi(x)."""
    u1, u2 = _rotate(g1, g2, cos, sin, HAS_ROPE, True)
    return (u1 + a1) * _phi_grad(f1, FEATURE), (u2 + a2) * _phi_grad(f2, FEATURE)


@triton.jit
def _span(pid_s, N, BLOCK_N: tl.constexpr):
    """(lo, hi): the tokens of program ``pid_s`` of the output and key kernels, N split evenly over the grid's
    axis 0 in whole blocks (the last programs may get none)."""
    span = tl.cdiv(tl.cdiv(N, tl.num_programs(0)), BLOCK_N) * BLOCK_N
    lo = pid_s * span
    return lo, tl.minimum(lo + span, N)


@triton.jit
def _split_start(pid_s, split_len, N, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr):
    """Start of a reduction over one split of the tokens: its range [lo, hi) and fp32 zeros for the column halves
    (BLOCK_DV, BLOCK_P) of a transposed (Dv, D) state and the halves of its (D,) vector."""
    s1 = tl.zeros((BLOCK_DV, BLOCK_P), dtype=tl.float32)
    z1 = tl.zeros((BLOCK_P,), dtype=tl.float32)
    lo = pid_s * split_len
    return lo, tl.minimum(lo + split_len, N), s1, tl.zeros_like(s1), z1, tl.zeros_like(z1)


@triton.jit
def _store_rows(base, offs_n, offs_c, stride_n, value, mask):
    """Store a tile into a row-major (N, C) slice (column stride 1), in the buffer's dtype."""
    ptrs = base + offs_n.to(tl.int64)[:, None] * stride_n + offs_c[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _state_ptrs(S, Z, idx, offs_p, offs_e, D_HALF, DV):
    """Pointers to the row halves (BLOCK_P, BLOCK_DV) of slot ``idx`` of a contiguous fp32 (..., D, Dv) state and
    to the halves of its (..., D) z, with the masks of both."""
    mask_p = offs_p < D_HALF
    s1 = S + idx.to(tl.int64) * 2 * D_HALF * DV + offs_p[:, None] * DV + offs_e[None, :]
    z1 = Z + idx.to(tl.int64) * 2 * D_HALF + offs_p
    return s1, s1 + D_HALF * DV, z1, z1 + D_HALF, mask_p[:, None] & (offs_e < DV)[None, :], mask_p


@triton.jit
def _load_state(S, Z, idx, offs_p, offs_e, D_HALF, DV, scale):
    """Row halves s1, s2 of S and halves z1, z2 of z, times ``scale`` (the 1/Nk that turns sums into means)."""
    s1, s2, z1, z2, mask_s, mask_z = _state_ptrs(S, Z, idx, offs_p, offs_e, D_HALF, DV)
    return (tl.load(s1, mask=mask_s, other=0.0) * scale, tl.load(s2, mask=mask_s, other=0.0) * scale,
            tl.load(z1, mask=mask_z, other=0.0) * scale, tl.load(z2, mask=mask_z, other=0.0) * scale)


@triton.jit
def _store_state(S, Z, idx, s1, s2, z1, z2, offs_p, offs_e, D_HALF, DV, valid):
    """Store halves into slot ``idx`` (the inverse of :func:`_load_state`); nothing unless ``valid``."""
    s1_ptrs, s2_ptrs, z1_ptrs, z2_ptrs, mask_s, mask_z = _state_ptrs(S, Z, idx, offs_p, offs_e, D_HALF, DV)
    tl.store(s1_ptrs, s1, mask=mask_s & valid)
    tl.store(s2_ptrs, s2, mask=mask_s & valid)
    tl.store(z1_ptrs, z1, mask=mask_z & valid)
    tl.store(z2_ptrs, z2, mask=mask_z & valid)


@triton.jit
def _last_split(LOCK, bh, n_splits, valid):
    """Whether this program is the last of batch-head bh's ``n_splits`` split programs to finish: each takes a ticket
    after storing its partials (a barrier, then a release-acquire atomic at GPU scope, so the others' partials are
    visible to the last); the last one resets the counter for the next launch."""
    tl.debug_barrier()
    ticket = tl.atomic_add(LOCK + bh, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (ticket == n_splits - 1)
    if last:
        tl.atomic_xchg(LOCK + bh, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _sum_partials(PART, OUT, bh, n_splits, offs_p, offs_e, D_HALF, DV, VECTOR: tl.constexpr):
    """Slot bh of OUT: the sum of the split partials bh * n_splits + i of PART, in split order (deterministic), read
    past the SM's L1 (written by other programs). Slots are (2 * D_HALF, DV) states, or with VECTOR (2 * D_HALF,)
    vectors (z, dz, and the frequency gradients' (2, P) rows)."""
    if VECTOR:
        offs = offs_p
        mask = offs_p < D_HALF
        size = 2 * D_HALF
        half = D_HALF
    else:
        offs = offs_p[:, None] * DV + offs_e[None, :]
        mask = (offs_p < D_HALF)[:, None] & (offs_e < DV)[None, :]
        size = 2 * D_HALF * DV
        half = D_HALF * DV
    src = PART + (bh * n_splits).to(tl.int64) * size + offs
    x1 = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
    x2 = tl.load(src + half, mask=mask, other=0.0, cache_modifier=".cg")
    for i in range(1, n_splits):
        x1 += tl.load(src + i * size, mask=mask, other=0.0, cache_modifier=".cg")
        x2 += tl.load(src + i * size + half, mask=mask, other=0.0, cache_modifier=".cg")
    dst = OUT + bh.to(tl.int64) * size + offs
    tl.store(dst, x1, mask=mask)
    tl.store(dst + half, x2, mask=mask)


@triton.jit
def _reduce_splits(S_PART, Z_PART, S, Z, bh, n_splits, offs_p, offs_e, D_HALF, DV):
    """Slot bh of a state S and its vector Z from the splits' partials (see :func:`_sum_partials`)."""
    _sum_partials(S_PART, S, bh, n_splits, offs_p, offs_e, D_HALF, DV, False)
    _sum_partials(Z_PART, Z, bh, n_splits, offs_p, offs_e, D_HALF, DV, True)


@_kernel
def _state_fwd_kernel(K, V, TAB, VALID, POS, S_PART, Z_PART, S, Z, LOCK, stride_kb, stride_kh, stride_kn,
                      stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_th, stride_ts, stride_pb, H, BH,
                      N, D_HALF, DV, split_len, prefix, width, N_BUCKET, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr,
                      MASK: tl.constexpr, POSITIONS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                      ROUND_BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_N: tl.constexpr, REDUCE: tl.constexpr):
    """Grid (splits, B*H): partial sums of S (rotated keys) and z over the tokens of one split (with MASK, its
    valid tokens). The rotated features enter the tensor cores rounded to the input dtype, v as loaded; fp32
    accumulation. With REDUCE (several splits) the last split program of a batch-head sums the partials into S, z
    (no launch of its own); with one split S_PART and Z_PART are S and z."""
    pid_s, bh, b, h, valid, offs_p, offs_e = _program(H, BH, BLOCK_P, BLOCK_DV)
    k_base = _head(K, b, h, stride_kb, stride_kh)
    v_base = _head(V, b, h, stride_vb, stride_vh)
    valid_row, pos_row = _sample_rows(VALID, POS, b, N, stride_pb)
    lo, hi, s1, s2, z1, z2 = _split_start(pid_s, split_len, N, BLOCK_DV, BLOCK_P)  # S^T halves: M = Dv for wgmma
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_k, mask_v = _tile_masks(_token_mask(valid_row, offs_n, hi, MASK), offs_p, offs_e, D_HALF, DV)
        vt = _native(_load_tile_t(v_base, offs_n, offs_e, stride_vn, stride_vd, mask_v), ROUND_BF16)
        _, _, _, _, f1, f2, r1, r2 = _features(k_base, offs_n, hi, offs_p, stride_kn, stride_kd, D_HALF, mask_k, TAB,
                                               h, stride_th, stride_ts, prefix, width, pos_row, FEATURE, HAS_ROPE,
                                               POSITIONS)
        z1 += tl.sum(f1, axis=0)
        z2 += tl.sum(f2, axis=0)
        s1 = tl.dot(vt, _operand(r1, DOT, ROUND_BF16), s1, input_precision=PRECISION)  # v loaded as (Dv, tokens)
        s2 = tl.dot(vt, _operand(r2, DOT, ROUND_BF16), s2, input_precision=PRECISION)
    _store_state(S_PART, Z_PART, bh * tl.num_programs(0) + pid_s, tl.trans(s1), tl.trans(s2), z1, z2, offs_p, offs_e,
                 D_HALF, DV, valid)
    if REDUCE:
        if _last_split(LOCK, bh, tl.num_programs(0), valid):
            _reduce_splits(S_PART, Z_PART, S, Z, bh, tl.num_programs(0), offs_p, offs_e, D_HALF, DV)


@_kernel
def _output_fwd_kernel(Q, S, Z, TAB, VALID, COUNT, POS, O, stride_qb, stride_qh, stride_qn, stride_qd, stride_ob,
                       stride_oh, stride_on, stride_od, stride_th, stride_ts, stride_pb, eps, H, BH, N, D_HALF, DV,
                       prefix, width, N_BUCKET, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr,
                       MASK: tl.constexpr, COUNTED: tl.constexpr, POSITIONS: tl.constexpr, PRECISION: tl.constexpr,
                       DOT: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (spans, B*H): o = (R phi(q)) S / (phi(q) . z + eps) for the queries of one span (:func:`_span`), a
    loop over its token blocks (``eps`` times the sample's valid keys with COUNTED; invalid queries with MASK get
    0); the state is loaded and split once per program. The rotated features enter the tensor cores in the input
    dtype, S as its hi + lo split."""
    pid_s, bh, b, h, valid, offs_p, offs_e = _program(H, BH, BLOCK_P, BLOCK_DV)
    valid_row, pos_row = _sample_rows(VALID, POS, b, N, stride_pb)
    eps = _per_sample(eps, COUNT, b, COUNTED, False)
    s1, s2, z1, z2 = _load_state(S, Z, bh, offs_p, offs_e, D_HALF, DV, 1.0)
    hi1, lo1, hi2, lo2, inv = _split_state(s1, s2, DOT, ROUND_BF16, SPLIT, True)
    q_base = _head(Q, b, h, stride_qb, stride_qh)
    o_base = _head(O, b, h, stride_ob, stride_oh)
    lo, hi = _span(pid_s, N, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_q, _ = _tile_masks(_token_mask(valid_row, offs_n, hi, MASK), offs_p, offs_e, D_HALF, DV)
        _, mask_o = _tile_masks(offs_n < hi, offs_p, offs_e, D_HALF, DV)  # invalid queries are stored: as zeros
        _, _, _, _, f1, f2, r1, r2 = _features(q_base, offs_n, hi, offs_p, stride_qn, stride_qd, D_HALF, mask_q, TAB,
                                               h, stride_th, stride_ts, prefix, width, pos_row, FEATURE, HAS_ROPE,
                                               POSITIONS)
        num = _state_dot(_operand(r1, DOT, ROUND_BF16), hi1, lo1, tl.zeros((BLOCK_N, BLOCK_DV), tl.float32), SPLIT,
                         PRECISION, True)
        num = _state_dot(_operand(r2, DOT, ROUND_BF16), hi2, lo2, num, SPLIT, PRECISION, True)
        den = tl.sum(f1 * z1[None, :], axis=1) + tl.sum(f2 * z2[None, :], axis=1) + eps
        o_ptrs = o_base + offs_n.to(tl.int64)[:, None] * stride_on + offs_e[None, :] * stride_od
        tl.store(o_ptrs, (num * (inv / den)[:, None]).to(O.dtype.element_ty), mask=mask_o & valid)


@_kernel
def _query_bwd_kernel(Q, DO, S, Z, TAB, VALID, COUNT, POS, DQ, DS_PART, DZ_PART, DF_PART, DS, DZ, DF, LOCK,
                      stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
                      stride_th, stride_ts, stride_pb, eps, inv_n, H, BH, N, D_HALF, DV, split_len, prefix, width,
                      off_row, off_col, N_BUCKET, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr, MASK: tl.constexpr,
                      COUNTED: tl.constexpr, POSITIONS: tl.constexpr, FREQ_GRAD: tl.constexpr,
                      PRECISION: tl.constexpr, DOT: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, DQ_GRAD: tl.constexpr,
                      REDUCE: tl.constexpr):
    """Grid (splits, B*H): dq for the queries of one split (only with DQ_GRAD) and partial sums of dS, dz
    (without 1/Nk). S and z are the forward's sums over the keys, made means by ``inv_n`` = 1/Nk on loading (over
    the sample's valid keys with COUNTED). With MASK invalid queries add nothing and get dq = 0. With REDUCE
    (several splits whose sums the key kernel needs) the last split program of a batch-head sums the partials into
    dS, dz and the frequency gradient DF; with one split the partials are those (views).

    With g = dO S^T / den the gradient of the rotated features, dden = -(dO . num) / den^2 = -(R phi(q) . g) / den:
    the numerator is not recomputed. dO enters the tensor cores as loaded, S as its hi + lo split, R phi(q) / den
    rounded to the input dtype."""
    pid_s, bh, b, h, valid, offs_p, offs_e = _program(H, BH, BLOCK_P, BLOCK_DV)
    valid_row, pos_row = _sample_rows(VALID, POS, b, N, stride_pb)
    inv_n = _per_sample(inv_n, COUNT, b, COUNTED, True)
    s1, s2, z1, z2 = _load_state(S, Z, bh, offs_p, offs_e, D_HALF, DV, inv_n)  # the means
    hi1, lo1, hi2, lo2, inv = _split_state(tl.trans(s1), tl.trans(s2), DOT, ROUND_BF16, SPLIT, BACKWARD_LO)
    q_base = _head(Q, b, h, stride_qb, stride_qh)
    do_base = _head(DO, b, h, stride_ob, stride_oh)
    dq_base = DQ + bh.to(tl.int64) * N * 2 * D_HALF  # dq is allocated contiguous (B, H, N, D)
    lo, hi, ds1, ds2, dz1, dz2 = _split_start(pid_s, split_len, N, BLOCK_DV, BLOCK_P)  # dS^T halves
    dfx = tl.zeros_like(dz1)
    dfy = tl.zeros_like(dz1)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_q, mask_o = _tile_masks(_token_mask(valid_row, offs_n, hi, MASK), offs_p, offs_e, D_HALF, DV)
        do = _native(_load_tile(do_base, offs_n, offs_e, stride_on, stride_od, mask_o), ROUND_BF16)
        _, _, cos, sin, f1, f2, r1, r2 = _features(q_base, offs_n, hi, offs_p, stride_qn, stride_qd, D_HALF, mask_q,
                                                     TAB, h, stride_th, stride_ts, prefix, width, pos_row, FEATURE,
                                                     HAS_ROPE, POSITIONS)
        den = tl.sum(f1 * z1[None, :], axis=1) + tl.sum(f2 * z2[None, :], axis=1) + eps
        scale = inv / den
        zero = tl.zeros((BLOCK_N, BLOCK_P), tl.float32)
        # the gradient of the rotated features
        g1 = _state_dot(do, hi1, lo1, zero, SPLIT, PRECISION, BACKWARD_LO) * scale[:, None]
        g2 = _state_dot(do, hi2, lo2, zero, SPLIT, PRECISION, BACKWARD_LO) * scale[:, None]
        dden = -(tl.sum(r1 * g1, axis=1) + tl.sum(r2 * g2, axis=1)) / den
        if DQ_GRAD:
            dq1, dq2 = _input_grad(g1, g2, dden[:, None] * z1[None, :], dden[:, None] * z2[None, :], f1, f2,
                                   FEATURE, cos, sin, HAS_ROPE)
            mask_d, _ = _tile_masks(offs_n < hi, offs_p, offs_e, D_HALF, DV)  # invalid queries: zeros stored
            _store_rows(dq_base, offs_n, offs_p, 2 * D_HALF, dq1, mask_d & valid)
            _store_rows(dq_base, offs_n, offs_p + D_HALF, 2 * D_HALF, dq2, mask_d & valid)
        rd = 1.0 / den
        if BLOCK_DV < 64:  # register-operand dots: dO^T loaded as such (again, from cache) keeps the loop pipelined
            dot = _native(_load_tile_t(do_base, offs_n, offs_e, stride_on, stride_od, mask_o), ROUND_BF16)
        else:  # warp-group dots read dO^T from the same shared-memory copy
            dot = tl.trans(do)
        ds1 = tl.dot(dot, _operand(r1 * rd[:, None], DOT, ROUND_BF16), ds1, input_precision=PRECISION)
        ds2 = tl.dot(dot, _operand(r2 * rd[:, None], DOT, ROUND_BF16), ds2, input_precision=PRECISION)
        dz1 += tl.sum(dden[:, None] * f1, axis=0)
        dz2 += tl.sum(dden[:, None] * f2, axis=0)
        if FREQ_GRAD:
            dfx, dfy = _freq_grad(dfx, dfy, g1, g2, r1, r2, offs_n, hi, prefix, width, off_row, off_col, pos_row,
                                  POSITIONS)
    slot = bh * tl.num_programs(0) + pid_s
    _store_state(DS_PART, DZ_PART, slot, tl.trans(ds1), tl.trans(ds2), dz1, dz2, offs_p, offs_e, D_HALF, DV, valid)
    if FREQ_GRAD:  # (slots, 2, P): per split, d loss / d fx and d loss / d fy of this head
        df_ptrs = DF_PART + slot.to(tl.int64) * 2 * D_HALF + offs_p
        tl.store(df_ptrs, dfx, mask=(offs_p < D_HALF) & valid)
        tl.store(df_ptrs + D_HALF, dfy, mask=(offs_p < D_HALF) & valid)
    if REDUCE:
        if _last_split(LOCK, bh, tl.num_programs(0), valid):
            _reduce_splits(DS_PART, DZ_PART, DS, DZ, bh, tl.num_programs(0), offs_p, offs_e, D_HALF, DV)
            if FREQ_GRAD:  # the splits' (2, P) rows of d loss / d fx, d fy
                _sum_partials(DF_PART, DF, bh, tl.num_programs(0), offs_p, offs_e, D_HALF, DV, True)


@_kernel
def _key_bwd_kernel(K, V, DS, DZ, TAB, VALID, COUNT, POS, DK, DV_OUT, DF, stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd, stride_th, stride_ts, stride_pb, inv_n, H, BH, N,
                    D_HALF, DV, prefix, width, off_row, off_col, N_BUCKET, FEATURE: tl.constexpr,
                    HAS_ROPE: tl.constexpr, MASK: tl.constexpr, COUNTED: tl.constexpr, POSITIONS: tl.constexpr,
                    FREQ_GRAD: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr, ROUND_BF16: tl.constexpr,
                    SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (spans, B*H): dk = phi'(k) (R^T (v dS^T) + dz), dv = (R phi(k)) dS for the keys of one span
    (:func:`_span`), a loop over its token blocks; dS, dz are the sums over the query splits, times ``inv_n`` =
    1/Nk on loading (the gradient of the mean S carries its 1/Nk; over the sample's valid keys with COUNTED), loaded
    and split once per program. With MASK invalid keys get dk = dv = 0.
    v enters the tensor cores as loaded, R phi(k) rounded to the input dtype, dS as its hi + lo split."""
    pid_s, bh, b, h, valid, offs_p, offs_e = _program(H, BH, BLOCK_P, BLOCK_DV)
    valid_row, pos_row = _sample_rows(VALID, POS, b, N, stride_pb)
    inv_n = _per_sample(inv_n, COUNT, b, COUNTED, True)
    ds1, ds2, dz1, dz2 = _load_state(DS, DZ, bh, offs_p, offs_e, D_HALF, DV, inv_n)
    hi1, lo1, hi2, lo2, inv = _split_state(ds1, ds2, DOT, ROUND_BF16, SPLIT, BACKWARD_LO)
    k_base = _head(K, b, h, stride_kb, stride_kh)
    v_base = _head(V, b, h, stride_vb, stride_vh)
    dk_base = DK + bh.to(tl.int64) * N * 2 * D_HALF  # dk and dv are allocated contiguous
    dv_base = DV_OUT + bh.to(tl.int64) * N * DV
    dfx = tl.zeros_like(dz1)
    dfy = tl.zeros_like(dz1)
    lo, hi = _span(pid_s, N, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_k, mask_v = _tile_masks(_token_mask(valid_row, offs_n, hi, MASK), offs_p, offs_e, D_HALF, DV)
        mask_dk, mask_dv = _tile_masks(offs_n < hi, offs_p, offs_e, D_HALF, DV)  # invalid keys: zeros stored
        v = _native(_load_tile(v_base, offs_n, offs_e, stride_vn, stride_vd, mask_v), ROUND_BF16)
        _, _, cos, sin, f1, f2, r1, r2 = _features(k_base, offs_n, hi, offs_p, stride_kn, stride_kd, D_HALF, mask_k,
                                                     TAB, h, stride_th, stride_ts, prefix, width, pos_row, FEATURE,
                                                     HAS_ROPE, POSITIONS)
        dv = _state_dot(_operand(r1, DOT, ROUND_BF16), hi1, lo1, tl.zeros((BLOCK_N, BLOCK_DV), tl.float32), SPLIT,
                        PRECISION, BACKWARD_LO)
        dv = _state_dot(_operand(r2, DOT, ROUND_BF16), hi2, lo2, dv, SPLIT, PRECISION, BACKWARD_LO) * inv
        zero = tl.zeros((BLOCK_N, BLOCK_P), tl.float32)
        g1 = _state_dot(v, tl.trans(hi1), tl.trans(lo1), zero, SPLIT, PRECISION, BACKWARD_LO) * inv
        g2 = _state_dot(v, tl.trans(hi2), tl.trans(lo2), zero, SPLIT, PRECISION, BACKWARD_LO) * inv
        dk1, dk2 = _input_grad(g1, g2, dz1[None, :], dz2[None, :], f1, f2, FEATURE, cos, sin, HAS_ROPE)
        if MASK:  # dz reaches every key (phi' of the identity map is 1 at a zeroed key)
            dk1 = tl.where(mask_k, dk1, 0.0)
            dk2 = tl.where(mask_k, dk2, 0.0)
        _store_rows(dk_base, offs_n, offs_p, 2 * D_HALF, dk1, mask_dk & valid)
        _store_rows(dk_base, offs_n, offs_p + D_HALF, 2 * D_HALF, dk2, mask_dk & valid)
        _store_rows(dv_base, offs_n, offs_e, DV, dv, mask_dv & valid)
        if FREQ_GRAD:
            dfx, dfy = _freq_grad(dfx, dfy, g1, g2, r1, r2, offs_n, hi, prefix, width, off_row, off_col, pos_row,
                                  POSITIONS)
    if FREQ_GRAD:  # (B*H, 2, P), summed over the spans
        df_ptrs = DF + bh.to(tl.int64) * 2 * D_HALF + offs_p
        tl.atomic_add(df_ptrs, dfx, mask=(offs_p < D_HALF) & valid)
        tl.atomic_add(df_ptrs + D_HALF, dfy, mask=(offs_p < D_HALF) & valid)


TOKEN_POINTERS = {"K", "V", "Q", "O", "DO", "DQ", "DK", "DV_OUT"}  # in the input dtype
FP32_POINTERS = {"S", "Z", "DS", "DZ", "S_PART", "Z_PART", "DS_PART", "DZ_PART", "TAB", "DF_PART", "DF", "COUNT", "POS"}
BYTE_POINTERS = {"VALID"}  # the token mask, one byte per token
INT_POINTERS = {"LOCK"}  # int32 counters of the last-split reductions
FLOAT_SCALARS = {"eps", "inv_n", "off_row", "off_col"}
# Chosen from `linvision-check-kernels --candidates` (sm_90, bf16 with RoPE, the heaviest case) and checked for
# fp16/bf16 with RoPE on and off by `linvision-check-kernels` (docs/kernels.md); keyed on the head-dim bucket.
_OFFERED.update({
    "_state_fwd_kernel": {32: ((64, 8, 3), (128, 8, 2)), 64: ((64, 8, 2), (64, 8, 3), (128, 8, 2)),
                          128: ((32, 8, 2), (64, 8, 2), (64, 8, 3))},
    "_output_fwd_kernel": {32: ((64, 4, 2), (128, 8, 2), (128, 8, 3), (256, 8, 2)),
                           64: ((64, 8, 2), (64, 8, 3), (128, 8, 2), (256, 8, 2)), 128: ((32, 8, 2), (64, 8, 2))},
    "_query_bwd_kernel": {32: ((64, 4, 2), (64, 8, 2), (128, 8, 2)), 64: ((16, 8, 2), (64, 8, 2), (64, 8, 3)),
                          128: ((16, 8, 2),)},
    "_key_bwd_kernel": {32: ((64, 8, 2), (64, 8, 3), (128, 8, 2)), 64: ((64, 8, 2), (64, 8, 3)),
                        128: ((16, 8, 2), (32, 8, 2))},
})


def kernel_function(name: str):
    """The jitted function of a kernel (one of ``KERNEL_NAMES``)."""
    return _JITTED[name]


_TL_DTYPES = {"float16": tl.float16, "bfloat16": tl.bfloat16, "float32": tl.float32}


def kernel_constexprs(dtype: str, d: int, dv: int, feature: str, has_rope: bool, interpret: bool = False,
                      freq_grad: bool = False, dq_grad: bool = True, mask: bool = False, counted: bool = False,
                      positions: bool = False, reduce: bool = True) -> dict:
    """The constexprs of a launch (all but BLOCK_N; FREQ_GRAD only for the backward kernels, DQ_GRAD only for the
    query backward, COUNTED not for the state kernel, REDUCE (``reduce``: the last split program sums the splits)
    only for the state kernel and the query backward, see :func:`kernel_function`); ``dtype`` by name
    ("bfloat16", ...). 16-bit inputs: dot operands in that dtype (the fp32 state split hi + lo); fp32 inputs: exact
    fp32 products ("ieee"). ``mask``: the kernel's tokens are read through a token mask; ``counted``: means over
    each sample's valid keys; ``positions``: RoPE at per-sample positions."""
    half = dtype != "float32"
    round_bf16 = interpret and dtype == "bfloat16"
    return dict(
        FEATURE=FUSED_FEATURE_MAPS[feature],
        HAS_ROPE=has_rope,
        PRECISION="tf32" if half else "ieee",  # 16-bit operands: exact products whatever the precision says
        DOT=tl.float32 if round_bf16 else _TL_DTYPES[dtype],
        ROUND_BF16=round_bf16,
        SPLIT=half,
        BLOCK_P=_block_p(d),
        BLOCK_DV=max(16, _next_pow2(dv)),
        FREQ_GRAD=freq_grad,
        DQ_GRAD=dq_grad,
        MASK=mask,
        COUNTED=counted,
        POSITIONS=positions,
        REDUCE=reduce,
    )


def _meta(q: Tensor, v: Tensor, feature_map: str, has_rope: bool, freq_grad: Optional[bool] = None,
          positions: bool = False) -> dict:
    """Constexprs of a launch; ``freq_grad`` None for the forward kernels (which have no FREQ_GRAD); DQ_GRAD
    (True), MASK and COUNTED are left for the caller to set per kernel (see :class:`_Tokens`). Formed once per
    combination (a dict the callers only read)."""
    return _meta_of(q.dtype, q.shape[-1], v.shape[-1], feature_map, has_rope, freq_grad, positions)


@functools.lru_cache(maxsize=256)
def _meta_of(dtype: torch.dtype, d: int, dv: int, feature_map: str, has_rope: bool, freq_grad: Optional[bool],
             positions: bool) -> dict:
    meta = kernel_constexprs(str(dtype).replace("torch.", ""), d, dv, feature_map, has_rope, _INTERPRET,
                             bool(freq_grad), positions=positions)
    for name in ("DQ_GRAD", "MASK", "COUNTED", "REDUCE"):
        del meta[name]
    if freq_grad is None:
        del meta["FREQ_GRAD"]
    return meta


class _Tokens:
    """What the kernels read of a token mask and per-sample positions: the mask as bytes (B, Nk) and each sample's
    number of valid keys (B,) fp32 (one launch; the kernels take at least 1, as the reference counts), the
    positions as fp32 (B or 1, M, 2) with the RoPE offsets added (the angle is then formed exactly as the reference
    forms it); dummies (never read) where absent. ``keys`` and ``queries`` are the MASK / COUNTED constexprs of the
    kernels over keys and queries: queries are masked only when they are the keys' tokens (Nq == Nk)."""

    def __init__(self, q: Tensor, valid: Optional[Tensor], positions: Optional[Tensor], offsets: List[float]):
        self.has_valid = valid is not None
        if valid is None:
            self.valid = self.count = q
        else:
            self.valid = valid.contiguous().view(torch.uint8)
            self.count = valid.sum(dim=1, dtype=torch.float32)
        if positions is None:
            self.pos, self.stride_pb = q, 0
        else:
            pos = positions.to(device=q.device, dtype=torch.float32)
            if any(offsets):  # added column by column: no host-to-device copy of the offsets
                pos = torch.cat([pos[..., :1] + offsets[0], pos[..., 1:] + offsets[1]], dim=-1)
            self.pos = pos.contiguous()
            self.stride_pb = 0 if self.pos.shape[0] == 1 else self.pos.stride(0)
        self.keys = dict(MASK=self.has_valid, COUNTED=self.has_valid)
        self.queries = dict(MASK=self.has_valid and q.shape[2] == valid.shape[1], COUNTED=self.has_valid)

    def scale(self, x: float, n: int) -> float:
        """``x`` times n, the number of keys, when it is the same for every sample (no mask): the kernels multiply
        by each sample's own count otherwise (COUNTED)."""
        return x if self.has_valid else x * n


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, asked once per device (not on every call)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# programs of the state and query kernels per SM (their token splits); on an H200 at B=1, H=16, N=262,144 (the
# GPU report's grid sweep) 4 took the forward from 1.26 to 1.02 ms and the backward from 2.92 to 2.41 ms against 2;
# 8 and 16 were within 3% of 4
_SPLITS_PER_SM = 4


def _split_len(n: int, bh: int, device: torch.device, split_tokens: int) -> int:
    """Tokens per split of the reductions over N (at least 1). ``split_tokens`` > 0 forces it; 0 picks enough
    splits to give about ``_SPLITS_PER_SM`` programs per SM on a GPU (whole-N reductions off GPU), at least
    ``_SPLIT_ALIGN`` tokens per split: at B=1, H=16, N=4096 on 132 SMs 16 splits of 256 tokens (256 programs),
    where a floor of 1,024 tokens left 64 programs and 68 SMs idle."""
    if split_tokens > 0:
        return split_tokens
    if device.type != "cuda" or n == 0:
        return max(n, 1)
    splits = max(1, min(_cdiv(_SPLITS_PER_SM * _sm_count(device), bh), _cdiv(n, _SPLIT_ALIGN)))
    return _cdiv(_cdiv(n, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN


_SPANS_PER_SM = 4  # programs of the output and key kernels per SM
_INTERPRET_SPAN = 2 * _INTERPRET_BLOCK_N  # off GPU: two token blocks per program


def _spans(n: int, bh: int, device: torch.device):
    """Launch grid of the output and key kernels, which loop over a span of token blocks each with the state loaded
    and split once per program: about ``_SPANS_PER_SM`` programs per SM on a GPU, at most one per token block (at
    B=1, H=16 on 132 SMs and BLOCK_N=64: 64 tokens each up to N=2,112, 128 at 4,096, 8,000 at 262,144); off GPU
    (the interpreter) spans of two blocks."""
    if device.type != "cuda":
        spans = _cdiv(n, _INTERPRET_SPAN)
    else:
        spans = _cdiv(_SPANS_PER_SM * _sm_count(device), bh)
    return _grid(lambda cfg: max(1, min(spans, _cdiv(n, cfg["BLOCK_N"]))), bh)


def _rope_table(q: Tensor, n: int, freqs_x: Optional[Tensor], freqs_y: Optional[Tensor], rope_ints: List[int],
                rope_offsets: List[float], positions: bool = False) -> Tuple[Tensor, int, int, int, int]:
    """(table, head stride, cos/sin stride, prefix, width). The table (heads or 1, 2, W + rows, P) holds cos and
    sin of fx * (col + offset) for each grid column, then of fy * (row + offset) for each grid row: O((W + rows) P)
    values, combined in-kernel by angle addition; built once per frequency tensors and grid (see
    :func:`_cached_table`). With per-sample ``positions`` it is the frequencies (heads or 1, 2, P) themselves. A
    dummy (never loaded) without RoPE."""
    if freqs_x is None or freqs_y is None:
        return q, 0, 0, 0, 1
    prefix, width = rope_ints
    if positions:
        tab = torch.stack([freqs_x, freqs_y], dim=1).float().contiguous()  # (heads or 1, 2, P)
        return tab, (0 if tab.shape[0] == 1 else tab.stride(0)), tab.stride(1), prefix, width
    rows = max(1, _cdiv(n - prefix, width))
    tab = _cached_table(freqs_x, freqs_y, width, rows, rope_offsets)
    stride_th = 0 if tab.shape[0] == 1 else tab.stride(0)
    return tab, stride_th, tab.stride(1), prefix, width


@torch.no_grad()
def _build_table(freqs_x: Tensor, freqs_y: Tensor, width: int, rows: int, offsets: List[float]) -> Tensor:
    """cos and sin of the column and row angles (heads or 1, 2, W + rows, P), formed in float64, stored fp32 (no
    autograd history: a kept table holds no reference to the frequencies)."""
    cols = torch.arange(width, device=freqs_x.device, dtype=torch.float64) + offsets[1]
    rows_pos = torch.arange(rows, device=freqs_x.device, dtype=torch.float64) + offsets[0]
    ang = torch.cat([cols[:, None] * freqs_x.double()[:, None, :], rows_pos[:, None] * freqs_y.double()[:, None, :]],
                    dim=1)  # (heads, W + rows, P)
    return torch.stack([ang.cos(), ang.sin()], dim=1).float().contiguous()


_TABLE_CACHE_SIZE = 32  # a model at a few input sizes: one table per stage and size
_TABLES: "OrderedDict[tuple, Tuple[weakref.ref, weakref.ref, Tensor]]" = OrderedDict()


def _version_key(t: Tensor):
    """(the tensor that owns t's memory, a key of t's values): the owner's identity and version counter (bumped by
    every in-place write, an optimizer step included) and t's place in its memory. None where values cannot be
    told apart so (inference tensors keep no version counter)."""
    if t.is_inference():
        return None
    base = t if t._base is None else t._base
    return base, (id(base), base._version, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _cached_table(freqs_x: Tensor, freqs_y: Tensor, width: int, rows: int, offsets: List[float]) -> Tensor:
    """The RoPE table of :func:`_build_table`, kept per (frequency tensors and their versions, grid, offsets): a
    model's forward and backward, and its later calls at the same size, build it once. Entries hold the frequency
    tensors weakly (a freed tensor's entry is never matched) and the last ``_TABLE_CACHE_SIZE`` are kept. Built
    without the cache during CUDA-graph capture (the building ops are then part of the graph, so a replay after an
    update of the frequencies rotates by the new ones) and for inference tensors."""
    kx, ky = _version_key(freqs_x), _version_key(freqs_y)
    capturing = freqs_x.is_cuda and torch.cuda.is_current_stream_capturing()
    if kx is None or ky is None or capturing:
        return _build_table(freqs_x, freqs_y, width, rows, offsets)
    key = (kx[1], ky[1], width, rows, tuple(offsets))
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is kx[0] and hit[1]() is ky[0]:
        _TABLES.move_to_end(key)
        return hit[2]
    tab = _build_table(freqs_x, freqs_y, width, rows, offsets)
    _TABLES[key] = (weakref.ref(kx[0]), weakref.ref(ky[0]), tab)
    while len(_TABLES) > _TABLE_CACHE_SIZE:
        _TABLES.popitem(last=False)
    return tab


def _grid(blocks, bh: int):
    """Launch grid: ``blocks`` (an int or a function of the configuration) on axis 0, batch x heads folded into
    axes 1 and 2 (each at most 65535)."""
    y = min(bh, _MAX_GRID_Y)
    z = _cdiv(bh, y)
    return lambda cfg: (blocks(cfg) if callable(blocks) else blocks, y, z)


def _run(name: str, d: int, dv: int, grid, *args, **meta) -> None:
    """Launch kernel ``name``. During CUDA-graph capture, where benchmarking cannot run, and with
    LINVISION_KERNEL_AUTOTUNE=0, the first offered configuration; else the autotuner's choice: benchmarked on the
    first call of a (head-dim bucket, N bucket, constexprs), then launched directly with the configuration it chose
    (no pass through the autotuner)."""
    if not _AUTOTUNE or (not _INTERPRET and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        bn, warps, stages = offered_configs(name, d, dv)[0]
        cap = {"maxnreg": _REGISTER_CAPS[name]} if name in _REGISTER_CAPS else {}
        _JITTED[name][grid({"BLOCK_N": bn})](*args, **meta, BLOCK_N=bn, num_warps=warps, num_stages=stages, **cap)
        return
    key = (name, _dim_bucket(d, dv), args[_n_bucket_index(name)], *meta.items())
    config = _CHOSEN.get(key)
    if config is None:
        tuned = _tuned(name, d, dv)
        tuned[grid](*args, **meta)
        _CHOSEN[key] = tuned.best_config
    else:
        _JITTED[name][grid(config.kwargs)](*args, **meta, **config.all_kwargs())


def chosen_configs() -> List[Dict[str, Any]]:
    """The configurations the autotuner chose so far in this process, one per (kernel, head-dim bucket, N bucket,
    constexprs): {"kernel", "dim_bucket", "n_bucket", "block_n", "num_warps", "num_stages", "constexprs"}."""
    rows = []
    for (name, bucket, n_bucket, *meta), config in _CHOSEN.items():
        rows.append({"kernel": name, "dim_bucket": bucket, "n_bucket": n_bucket, "block_n": config.kwargs["BLOCK_N"],
                     "num_warps": config.num_warps, "num_stages": config.num_stages,
                     "constexprs": {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in meta}})
    return rows


@functools.lru_cache(maxsize=None)
def _n_bucket_index(name: str) -> int:
    """Position of N_BUCKET (the autotuner's token-count key) among kernel ``name``'s arguments."""
    return _JITTED[name].arg_names.index("N_BUCKET")


def _split_buffers(bh: int, n_splits: int, d: int, dv: int, device: torch.device, reduce: bool):
    """(partials of a state (B*H, splits, D, Dv) and of its vector (B*H, splits, D), the state and the vector, the
    counters of the kernel's last-split reduction): fp32; with one split the state and vector are views of the
    partials (the kernel stores them directly), without ``reduce`` too (nothing reads the sum)."""
    s_part = torch.empty(bh, n_splits, d, dv, device=device, dtype=torch.float32)
    z_part = torch.empty(bh, n_splits, d, device=device, dtype=torch.float32)
    if not (reduce and n_splits > 1):
        return s_part, z_part, s_part.select(1, 0), z_part.select(1, 0), s_part
    s = torch.empty(bh, d, dv, device=device, dtype=torch.float32)
    return s_part, z_part, s, torch.empty(bh, d, device=device, dtype=torch.float32), _counters(device, bh)


_COUNTERS = {}  # (device, stream) -> int32 zeros: the last-split counters, reset by the kernels themselves


def _counters(device: torch.device, count: int) -> Tensor:
    """At least ``count`` int32 counters at zero for the kernels' last-split reductions, one buffer per device and
    stream kept between calls (each launch leaves them at zero again); a fresh one, not kept, during CUDA-graph
    capture when none is large enough (memory of the graph's pool must not outlive it)."""
    cuda = device.type == "cuda"
    key = (device, torch.cuda.current_stream(device).stream_id if cuda else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(count, 256), device=device, dtype=torch.int32)
        if not (cuda and torch.cuda.is_current_stream_capturing()):
            _COUNTERS[key] = buf
    return buf


def _forward(q: Tensor, k: Tensor, v: Tensor, feature_map: str, freqs_x: Optional[Tensor],
             freqs_y: Optional[Tensor], rope_ints: List[int], rope_offsets: List[float], eps: float,
             split_tokens: int, valid: Optional[Tensor] = None,
             positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    has_pos = positions is not None and freqs_x is not None
    meta = _meta(q, v, feature_map, freqs_x is not None, positions=has_pos)
    tab, stride_th, stride_ts, prefix, width = _rope_table(q, nk, freqs_x, freqs_y, rope_ints, rope_offsets, has_pos)
    tok = _Tokens(q, valid, positions if has_pos else None, rope_offsets)
    split = _split_len(nk, b * h, q.device, split_tokens)
    n_splits = _cdiv(nk, split)
    s_part, z_part, s, z, counters = _split_buffers(b * h, n_splits, d, dv, q.device, True)
    _run("_state_fwd_kernel", d, dv, _grid(n_splits, b * h), k, v, tab, tok.valid, tok.pos, s_part, z_part, s, z,
         counters, *k.stride(), *v.stride(), stride_th, stride_ts, tok.stride_pb, h, b * h, nk, d // 2, dv, split,
         prefix, width, _next_pow2(nk), **meta, MASK=tok.has_valid, REDUCE=n_splits > 1)
    s = s.view(b, h, d, dv)  # sums over the keys; the 1/Nk of the mean goes onto eps
    z = z.view(b, h, d)
    o = torch.empty(b, nq, h, dv, device=q.device, dtype=q.dtype).transpose(1, 2)  # token-major memory
    if nq > 0:
        _run("_output_fwd_kernel", d, dv, _spans(nq, b * h, q.device), q, s, z, tab, tok.valid, tok.count,
             tok.pos, o, *q.stride(), *o.stride(), stride_th, stride_ts, tok.stride_pb, tok.scale(eps, nk), h, b * h,
             nq, d // 2, dv, prefix, width, _next_pow2(nq), **meta,
             **tok.queries)
    return o, s, z


def _backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, s: Tensor, z: Tensor, feature_map: str,
              freqs_x: Optional[Tensor], freqs_y: Optional[Tensor], rope_ints: List[int],
              rope_offsets: List[float], eps: float, split_tokens: int, freq_grad: bool,
              kv_grad: bool = True, q_grad: bool = True, valid: Optional[Tensor] = None,
              positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dfx, dfy); the frequency gradients shaped like the frequencies with ``freq_grad`` (and RoPE),
    else empty; dk and dv empty without ``kv_grad``, and the key kernel then runs only for the frequencies; dq
    empty without ``q_grad`` (the query kernel then forms only dS, dz and the frequency partials)."""
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    freq_grad = freq_grad and freqs_x is not None
    has_pos = positions is not None and freqs_x is not None
    meta = _meta(q, v, feature_map, freqs_x is not None, freq_grad, positions=has_pos)
    tab, stride_th, stride_ts, prefix, width = _rope_table(q, nk, freqs_x, freqs_y, rope_ints, rope_offsets, has_pos)
    tok = _Tokens(q, valid, positions if has_pos else None, rope_offsets)
    p = d // 2
    dq = torch.empty(b, h, nq, d, device=q.device, dtype=q.dtype) if q_grad else q.new_empty(0)
    if nq == 0:  # no queries: nothing flows back to the keys, values or frequencies
        df = torch.zeros(b * h, 2, p, device=q.device, dtype=torch.float32) if freq_grad else None
        dk = torch.zeros(b, h, nk, d, device=q.device, dtype=k.dtype)
        return dq, dk, torch.zeros_like(v, memory_format=torch.contiguous_format), *_freq_grads(q, df, freqs_x, h)
    split = _split_len(nq, b * h, q.device, split_tokens)
    n_splits = _cdiv(nq, split)
    reduce = kv_grad or freq_grad  # the key kernel reads the sums
    ds_part, dz_part, ds, dz, counters = _split_buffers(b * h, n_splits, d, dv, q.device, reduce)
    # the frequency gradient: the query kernel stores its sum (reduced by its last split, or its one split's row),
    # the key kernel adds to it; without FREQ_GRAD the kernels never touch it (no buffer allocated)
    df_part = df = dz_part
    if freq_grad:
        df_part = torch.empty(b * h, n_splits, 2, p, device=q.device, dtype=torch.float32)
        df = torch.empty(b * h, 2, p, device=q.device, dtype=torch.float32) if n_splits > 1 else df_part.select(1, 0)
    off_row, off_col = (float(x) for x in rope_offsets)
    # the backward runs on the means (the kernels scale the sums by 1/Nk as they load them, no division is
    # launched): R phi(q) / den, rounded to 16 bits for the dS product, stays a normal fp16 number there (with
    # sums, den grows with Nk and the operand would sink into fp16's subnormals)
    inv_n = 1.0 if tok.has_valid else 1.0 / max(nk, 1)  # with a mask, each sample's own count (COUNTED)
    _run("_query_bwd_kernel", d, dv, _grid(n_splits, b * h), q, do, s, z, tab, tok.valid, tok.count, tok.pos, dq,
         ds_part, dz_part, df_part, ds, dz, df, counters, *q.stride(), *do.stride(), stride_th, stride_ts,
         tok.stride_pb, eps, inv_n, h, b * h, nq, d // 2, dv, split, prefix, width, off_row, off_col,
         _next_pow2(nq), **meta, **tok.queries, DQ_GRAD=q_grad, REDUCE=reduce and n_splits > 1)
    if not reduce:
        return dq, k.new_empty(0), v.new_empty(0), *_freq_grads(q, df if freq_grad else None, freqs_x, h)
    dk = torch.empty(b, h, nk, d, device=q.device, dtype=k.dtype)
    dv_out = torch.empty(b, h, nk, dv, device=q.device, dtype=v.dtype)
    _run("_key_bwd_kernel", d, dv, _spans(nk, b * h, q.device), k, v, ds, dz, tab, tok.valid, tok.count, tok.pos,
         dk, dv_out, df, *k.stride(), *v.stride(), stride_th, stride_ts, tok.stride_pb, inv_n, h, b * h, nk, d // 2,
         dv, prefix, width, off_row, off_col,
         _next_pow2(nk), **meta, **tok.keys)
    if not kv_grad:
        dk, dv_out = k.new_empty(0), v.new_empty(0)
    return dq, dk, dv_out, *_freq_grads(q, df if freq_grad else None, freqs_x, h)


def _freq_grads(q: Tensor, df: Optional[Tensor], freqs_x: Optional[Tensor], heads: int) -> Tuple[Tensor, Tensor]:
    """(dfx, dfy) from per batch-head sums ``df`` (B*H, 2, P): summed over the batch, and over the heads for shared
    frequencies, one sum each (two launches); empty fp32 tensors on q's device where no gradient was formed (None)."""
    if freqs_x is None or df is None:
        return q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
    df = df.view(-1, heads if freqs_x.shape[0] > 1 else 1, 2, df.shape[-1])  # (B or B*H, H or 1, 2, P)
    return df[:, :, 0].sum(dim=0), df[:, :, 1].sum(dim=0)


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
    if q.device.type != "cuda" and not (_INTERPRET and q.device.type == "cpu"):
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
