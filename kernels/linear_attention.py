"""Fused Triton kernels for non-causal linear attention, forward and backward.

Math (the reference is ``linvision.ops.linear_attention``), per batch and head, with R_i the optional 2D RoPE rotation
applied to the numerator only:

    S = (1/Nk) sum_j (R_j phi(k_j))^T v_j     z = (1/Nk) sum_j phi(k_j)
    o_i = ((R_i phi(q_i)) S) / (phi(q_i) . z + eps)

Four kernels, each one pass over N-sized tensors, so HBM traffic is the minimum the math allows:
- ``_state_fwd_kernel``   reads k, v; writes per-split partial sums of S and z (split-N when B*H is small).
- ``_output_fwd_kernel``  reads q; writes o (from the reduced S and z).
- ``_query_bwd_kernel``   reads q, dO; recomputes num and den from the saved S and z; writes dq and per-split
  partials of dS = (1/Nk) sum_i (R_i phi(q_i))^T dnum_i and dz = (1/Nk) sum_i dden_i phi(q_i).
- ``_key_bwd_kernel``     reads k, v; writes dk = phi'(k) (R^T (v dS^T) + dz) and dv = (R phi(k)) dS.

Fused: the feature map (identity, relu, elu+1) and its derivative, the 1/N mean, and RoPE computed from the
token's grid position and O(D) frequency tables (axial or mixed, shared or per head). One jitted helper of each:
``_rope_freqs`` loads a head's frequencies, ``_rope_cos_sin`` forms the angles of a token block, ``_rotate``
applies R or R^T (the identity without RoPE), ``_token_block`` loads a block of tokens and maps and rotates it. The head dim is handled
as two halves of P = D/2 channels because RoPE pairs channel t with channel t + P; S is kept as its two
row halves. Accumulation, rotation and division are fp32 for every input dtype; matrix products use exact
fp32 for fp32 inputs and tf32 tensor cores for fp16/bf16 inputs (more mantissa than the inputs carry).

On a GPU the kernels are autotuned over block size and warps, keyed on the next power of two of N: N is a
runtime argument, so a new resolution re-tunes only when it enters a new power-of-two bucket and compiles
nothing new beyond Triton's usual integer specialisations. Under ``TRITON_INTERPRET=1`` one fixed
configuration is used.

The kernels know only tensors, ints and flags: RoPE arrives as a :class:`~.common.RopeSpec` (frequency tensors,
grid width, prefix, offset) and the feature map as its name. The public entry, :func:`linear_attention_triton`,
goes through the torch custom ops
``linvision::linear_attention_fwd`` / ``linvision::linear_attention_bwd`` (autograd, fake tensors and a FLOP
formula registered), so ``torch.compile`` keeps it in one graph.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .common import DEFAULT_EPS, RopeSpec, check_eps, check_int, check_qkv, check_rope, feature_map_name

__all__ = ["linear_attention_triton", "unsupported_reason", "FUSED_FEATURE_MAPS", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]

FUSED_FEATURE_MAPS = {"identity": 0, "relu": 1, "elu": 2}
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 128
MAX_VALUE_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET_BLOCK_N = 64
_SPLIT_ALIGN = 256  # split lengths are multiples of every autotuned BLOCK_N
_MAX_GRID_Y = 65535  # batch x heads runs on the second grid axis


def _configs():
    """Autotune space on a GPU; one fixed configuration in the interpreter (it cannot benchmark)."""
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": _INTERPRET_BLOCK_N}, num_warps=4)]
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3), (256, 8, 2))
    ]


_TUNE_KEY = ["N_BUCKET", "D_HALF", "DV", "FEATURE", "HAS_ROPE", "PRECISION"]


def _kernel(fn):
    """A Triton kernel autotuned over :func:`_configs`, keyed on the power-of-two bucket of N and the shapes."""
    return triton.autotune(configs=_configs(), key=_TUNE_KEY)(triton.jit(fn))


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
def _phi_grad(x, FEATURE: tl.constexpr):
    """d phi / dx on fp32 values."""
    if FEATURE == 1:
        g = tl.where(x > 0, 1.0, 0.0)
    elif FEATURE == 2:
        g = tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    else:
        g = tl.full(x.shape, 1.0, tl.float32)
    return g


@triton.jit
def _rope_freqs(FX, FY, h, stride_fh, offs_p, D_HALF, HAS_ROPE: tl.constexpr):
    """Frequencies (fx, fy), each (BLOCK_P,), of head h; zeros (nothing loaded) without RoPE."""
    if HAS_ROPE:
        fx = tl.load(FX + h * stride_fh + offs_p, mask=offs_p < D_HALF, other=0.0)
        fy = tl.load(FY + h * stride_fh + offs_p, mask=offs_p < D_HALF, other=0.0)
    else:
        fx = tl.zeros_like(offs_p).to(tl.float32)
        fy = fx
    return fx, fy


@triton.jit
def _rope_cos_sin(offs_n, fx, fy, prefix, width, off_row, off_col, HAS_ROPE: tl.constexpr):
    """cos, sin (BLOCK_N, BLOCK_P) of angle = fx * col + fy * row; prefix tokens are not rotated. Without RoPE
    the identity rotation (1, 0)."""
    if HAS_ROPE:
        g = offs_n - prefix
        is_grid = g >= 0
        g = tl.where(is_grid, g, 0)
        row = (g // width).to(tl.float32) + off_row
        col = (g % width).to(tl.float32) + off_col
        ang = col[:, None] * fx[None, :] + row[:, None] * fy[None, :]
        ang = tl.where(is_grid[:, None], ang, 0.0)
        cos = tl.cos(ang)
        sin = tl.sin(ang)
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
        y2 = x1 * sin + x2 * cos
    return y1, y2


@triton.jit
def _features(x1, x2, mask, offs_n, fx, fy, prefix, width, off_row, off_col, FEATURE: tl.constexpr,
              HAS_ROPE: tl.constexpr):
    """(cos, sin) of the tokens' rotation, phi(x) and R phi(x) on the channel halves; masked lanes of the
    features are zero (elu(0) + 1 = 1 must not count)."""
    cos, sin = _rope_cos_sin(offs_n, fx, fy, prefix, width, off_row, off_col, HAS_ROPE)
    f1 = tl.where(mask, _phi(x1, FEATURE), 0.0)
    f2 = tl.where(mask, _phi(x2, FEATURE), 0.0)
    r1, r2 = _rotate(f1, f2, cos, sin, HAS_ROPE, False)
    return cos, sin, f1, f2, r1, r2


@triton.jit
def _input_grad(g1, g2, a1, a2, x1, x2, FEATURE: tl.constexpr, cos, sin, HAS_ROPE: tl.constexpr):
    """phi'(x) (R^T g + a) on the channel halves: the gradient of inputs x from the gradient g of their rotated
    features R phi(x) and the gradient a of their features phi(x)."""
    u1, u2 = _rotate(g1, g2, cos, sin, HAS_ROPE, True)
    return (u1 + a1) * _phi_grad(x1, FEATURE), (u2 + a2) * _phi_grad(x2, FEATURE)


@triton.jit
def _numerator_denominator(f1, f2, r1, r2, s1, s2, z1, z2, eps, PRECISION: tl.constexpr):
    """num = (R phi(q)) S (BLOCK_N, BLOCK_DV) and den = phi(q) . z + eps (BLOCK_N,)."""
    num = tl.dot(r1, s1, input_precision=PRECISION)
    num = tl.dot(r2, s2, num, input_precision=PRECISION)
    den = tl.sum(f1 * z1[None, :], axis=1) + tl.sum(f2 * z2[None, :], axis=1) + eps
    return num, den


@triton.jit
def _program(H, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(program index along axis 0, batch-head, batch, head, channel-pair offsets, value offsets)."""
    bh = tl.program_id(1)
    return tl.program_id(0), bh, bh // H, bh % H, tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_DV)


@triton.jit
def _head(X, b, h, stride_b, stride_h):
    """Base pointer of the (N, C) slice of batch b, head h of a (B, H, N, C) tensor."""
    return X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _tile_masks(offs_n, hi, offs_p, offs_e, D_HALF, DV):
    """Masks of a token block: channel halves (BLOCK_N, BLOCK_P) and values (BLOCK_N, BLOCK_DV)."""
    mask_n = offs_n < hi
    return mask_n[:, None] & (offs_p < D_HALF)[None, :], mask_n[:, None] & (offs_e < DV)[None, :]


@triton.jit
def _token_block(x_base, y_base, start, hi, offs_p, offs_e, stride_xn, stride_xd, stride_yn, stride_yd, D_HALF, DV,
                 fx, fy, prefix, width, off_row, off_col, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The block of tokens from ``start`` (those < hi) of an (N, D) slice x and an (N, Dv) slice y: x's channel
    halves, y (fp32), their masks, and cos, sin, phi(x), R phi(x) as in :func:`_features`."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_x, mask_y = _tile_masks(offs_n, hi, offs_p, offs_e, D_HALF, DV)
    x1, x2 = _load_halves(x_base, offs_n, offs_p, stride_xn, stride_xd, D_HALF, mask_x)
    y = _load_rows(y_base, offs_n, offs_e, stride_yn, stride_yd, mask_y)
    cos, sin, f1, f2, r1, r2 = _features(x1, x2, mask_x, offs_n, fx, fy, prefix, width, off_row, off_col, FEATURE,
                                         HAS_ROPE)
    return offs_n, x1, x2, y, mask_x, mask_y, cos, sin, f1, f2, r1, r2


@triton.jit
def _split_start(pid_s, split_len, N, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Start of a reduction over one split of the tokens: its range [lo, hi) and fp32 zeros for the row halves of
    a (D, Dv) state and the halves of its (D,) vector."""
    s1 = tl.zeros((BLOCK_P, BLOCK_DV), dtype=tl.float32)
    z1 = tl.zeros((BLOCK_P,), dtype=tl.float32)
    lo = pid_s * split_len
    return lo, tl.minimum(lo + split_len, N), s1, tl.zeros_like(s1), z1, tl.zeros_like(z1)


@triton.jit
def _load_rows(base, offs_n, offs_c, stride_n, stride_c, mask):
    """Tile (BLOCK_N, len(offs_c)) of an (N, C) slice as fp32 (also right for bf16 when interpreting)."""
    ptrs = base + offs_n.to(tl.int64)[:, None] * stride_n + offs_c[None, :] * stride_c
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_halves(base, offs_n, offs_p, stride_n, stride_d, D_HALF, mask):
    """The two channel halves (BLOCK_N, BLOCK_P) of a (N, D) slice, as fp32."""
    x1 = _load_rows(base, offs_n, offs_p, stride_n, stride_d, mask)
    return x1, _load_rows(base, offs_n, offs_p + D_HALF, stride_n, stride_d, mask)


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
def _load_state(S, Z, idx, offs_p, offs_e, D_HALF, DV):
    """Row halves s1, s2 of S and halves z1, z2 of z."""
    s1, s2, z1, z2, mask_s, mask_z = _state_ptrs(S, Z, idx, offs_p, offs_e, D_HALF, DV)
    return (tl.load(s1, mask=mask_s, other=0.0), tl.load(s2, mask=mask_s, other=0.0),
            tl.load(z1, mask=mask_z, other=0.0), tl.load(z2, mask=mask_z, other=0.0))


@triton.jit
def _store_state(S, Z, idx, s1, s2, z1, z2, offs_p, offs_e, D_HALF, DV):
    """Store halves into slot ``idx`` (the inverse of :func:`_load_state`)."""
    s1_ptrs, s2_ptrs, z1_ptrs, z2_ptrs, mask_s, mask_z = _state_ptrs(S, Z, idx, offs_p, offs_e, D_HALF, DV)
    tl.store(s1_ptrs, s1, mask=mask_s)
    tl.store(s2_ptrs, s2, mask=mask_s)
    tl.store(z1_ptrs, z1, mask=mask_z)
    tl.store(z2_ptrs, z2, mask=mask_z)


@_kernel
def _state_fwd_kernel(K, V, FX, FY, S_PART, Z_PART, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
                      stride_vn, stride_vd, stride_fh, H, N, D_HALF, DV, split_len, prefix, width, off_row, off_col,
                      N_BUCKET, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (splits, B*H): partial sums of S (rotated keys) and z over the tokens of one split."""
    pid_s, bh, b, h, offs_p, offs_e = _program(H, BLOCK_P, BLOCK_DV)
    k_base = _head(K, b, h, stride_kb, stride_kh)
    v_base = _head(V, b, h, stride_vb, stride_vh)
    fx, fy = _rope_freqs(FX, FY, h, stride_fh, offs_p, D_HALF, HAS_ROPE)
    lo, hi, s1, s2, z1, z2 = _split_start(pid_s, split_len, N, BLOCK_P, BLOCK_DV)
    for start in range(lo, hi, BLOCK_N):
        _, _, _, v, _, _, _, _, f1, f2, r1, r2 = _token_block(
            k_base, v_base, start, hi, offs_p, offs_e, stride_kn, stride_kd, stride_vn, stride_vd, D_HALF, DV,
            fx, fy, prefix, width, off_row, off_col, FEATURE, HAS_ROPE, BLOCK_N)
        z1 += tl.sum(f1, axis=0)
        z2 += tl.sum(f2, axis=0)
        s1 = tl.dot(tl.trans(r1), v, s1, input_precision=PRECISION)
        s2 = tl.dot(tl.trans(r2), v, s2, input_precision=PRECISION)
    _store_state(S_PART, Z_PART, bh * tl.num_programs(0) + pid_s, s1, s2, z1, z2, offs_p, offs_e, D_HALF, DV)


@_kernel
def _output_fwd_kernel(Q, S, Z, FX, FY, O, stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on,
                       stride_od, stride_fh, eps, H, N, D_HALF, DV, prefix, width, off_row, off_col, N_BUCKET,
                       FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (token blocks, B*H): o = (R phi(q)) S / (phi(q) . z + eps) for one block of queries."""
    pid_n, bh, b, h, offs_p, offs_e = _program(H, BLOCK_P, BLOCK_DV)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_q, mask_o = _tile_masks(offs_n, N, offs_p, offs_e, D_HALF, DV)
    s1, s2, z1, z2 = _load_state(S, Z, bh, offs_p, offs_e, D_HALF, DV)
    q1, q2 = _load_halves(_head(Q, b, h, stride_qb, stride_qh), offs_n, offs_p, stride_qn, stride_qd, D_HALF, mask_q)
    fx, fy = _rope_freqs(FX, FY, h, stride_fh, offs_p, D_HALF, HAS_ROPE)
    _, _, f1, f2, r1, r2 = _features(q1, q2, mask_q, offs_n, fx, fy, prefix, width, off_row, off_col, FEATURE,
                                     HAS_ROPE)
    num, den = _numerator_denominator(f1, f2, r1, r2, s1, s2, z1, z2, eps, PRECISION)
    o_ptrs = _head(O, b, h, stride_ob, stride_oh) + offs_n.to(tl.int64)[:, None] * stride_on + offs_e[None, :] * stride_od
    tl.store(o_ptrs, (num / den[:, None]).to(O.dtype.element_ty), mask=mask_o)


@_kernel
def _query_bwd_kernel(Q, DO, S, Z, FX, FY, DQ, DS_PART, DZ_PART, stride_qb, stride_qh, stride_qn, stride_qd, stride_ob,
                      stride_oh, stride_on, stride_od, stride_fh, eps, H, N, D_HALF, DV, split_len, prefix, width,
                      off_row, off_col, N_BUCKET, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (splits, B*H): dq for the queries of one split and partial sums of dS, dz (without 1/Nk)."""
    pid_s, bh, b, h, offs_p, offs_e = _program(H, BLOCK_P, BLOCK_DV)
    s1, s2, z1, z2 = _load_state(S, Z, bh, offs_p, offs_e, D_HALF, DV)
    fx, fy = _rope_freqs(FX, FY, h, stride_fh, offs_p, D_HALF, HAS_ROPE)
    q_base = _head(Q, b, h, stride_qb, stride_qh)
    do_base = _head(DO, b, h, stride_ob, stride_oh)
    dq_base = DQ + bh.to(tl.int64) * N * 2 * D_HALF  # dq is allocated contiguous (B, H, N, D)
    lo, hi, ds1, ds2, dz1, dz2 = _split_start(pid_s, split_len, N, BLOCK_P, BLOCK_DV)
    for start in range(lo, hi, BLOCK_N):
        offs_n, q1, q2, do, mask_q, _, cos, sin, f1, f2, r1, r2 = _token_block(
            q_base, do_base, start, hi, offs_p, offs_e, stride_qn, stride_qd, stride_on, stride_od, D_HALF, DV,
            fx, fy, prefix, width, off_row, off_col, FEATURE, HAS_ROPE, BLOCK_N)
        num, den = _numerator_denominator(f1, f2, r1, r2, s1, s2, z1, z2, eps, PRECISION)
        dnum = do / den[:, None]  # masked rows: do = 0, so they add nothing below
        dden = -tl.sum(dnum * num, axis=1) / den  # = -(do . o) / den
        g1 = tl.dot(dnum, tl.trans(s1), input_precision=PRECISION)  # grad of the rotated features
        g2 = tl.dot(dnum, tl.trans(s2), input_precision=PRECISION)
        dq1, dq2 = _input_grad(g1, g2, dden[:, None] * z1[None, :], dden[:, None] * z2[None, :], q1, q2, FEATURE,
                               cos, sin, HAS_ROPE)
        _store_rows(dq_base, offs_n, offs_p, 2 * D_HALF, dq1, mask_q)
        _store_rows(dq_base, offs_n, offs_p + D_HALF, 2 * D_HALF, dq2, mask_q)
        ds1 = tl.dot(tl.trans(r1), dnum, ds1, input_precision=PRECISION)
        ds2 = tl.dot(tl.trans(r2), dnum, ds2, input_precision=PRECISION)
        dz1 += tl.sum(dden[:, None] * f1, axis=0)
        dz2 += tl.sum(dden[:, None] * f2, axis=0)
    _store_state(DS_PART, DZ_PART, bh * tl.num_programs(0) + pid_s, ds1, ds2, dz1, dz2, offs_p, offs_e, D_HALF, DV)


@_kernel
def _key_bwd_kernel(K, V, DS, DZ, FX, FY, DK, DV_OUT, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
                    stride_vn, stride_vd, stride_fh, H, N, D_HALF, DV, prefix, width, off_row, off_col, N_BUCKET,
                    FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (token blocks, B*H): dk = phi'(k) (R^T (v dS^T) + dz), dv = (R phi(k)) dS; dS, dz carry the 1/Nk."""
    pid_n, bh, b, h, offs_p, offs_e = _program(H, BLOCK_P, BLOCK_DV)
    ds1, ds2, dz1, dz2 = _load_state(DS, DZ, bh, offs_p, offs_e, D_HALF, DV)
    fx, fy = _rope_freqs(FX, FY, h, stride_fh, offs_p, D_HALF, HAS_ROPE)
    offs_n, k1, k2, v, mask_k, mask_v, cos, sin, f1, f2, r1, r2 = _token_block(
        _head(K, b, h, stride_kb, stride_kh), _head(V, b, h, stride_vb, stride_vh), pid_n * BLOCK_N, N, offs_p, offs_e,
        stride_kn, stride_kd, stride_vn, stride_vd, D_HALF, DV, fx, fy, prefix, width, off_row, off_col, FEATURE,
        HAS_ROPE, BLOCK_N)
    dv = tl.dot(r1, ds1, input_precision=PRECISION)
    dv = tl.dot(r2, ds2, dv, input_precision=PRECISION)
    g1 = tl.dot(v, tl.trans(ds1), input_precision=PRECISION)
    g2 = tl.dot(v, tl.trans(ds2), input_precision=PRECISION)
    dk1, dk2 = _input_grad(g1, g2, dz1[None, :], dz2[None, :], k1, k2, FEATURE, cos, sin, HAS_ROPE)
    dk_base = DK + bh.to(tl.int64) * N * 2 * D_HALF  # dk and dv are allocated contiguous
    _store_rows(dk_base, offs_n, offs_p, 2 * D_HALF, dk1, mask_k)
    _store_rows(dk_base, offs_n, offs_p + D_HALF, 2 * D_HALF, dk2, mask_k)
    _store_rows(DV_OUT + bh.to(tl.int64) * N * DV, offs_n, offs_e, DV, dv, mask_v)


def _meta(q: Tensor, v: Tensor, feature_map: str, has_rope: bool) -> dict:
    d_half = q.shape[-1] // 2
    return dict(
        FEATURE=FUSED_FEATURE_MAPS[feature_map],
        HAS_ROPE=has_rope,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_P=max(16, triton.next_power_of_2(d_half)),
        BLOCK_DV=max(16, triton.next_power_of_2(v.shape[-1])),
    )


def _split_len(n: int, bh: int, device: torch.device, split_tokens: int) -> int:
    """Tokens per split of the reductions over N. ``split_tokens`` > 0 forces it; 0 picks enough splits to
    give about two programs per SM on a GPU (whole-N reductions off GPU), at least 1024 tokens per split."""
    if split_tokens > 0:
        return split_tokens
    if device.type != "cuda":
        return max(n, 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(triton.cdiv(2 * sms, bh), triton.cdiv(n, 4 * _SPLIT_ALIGN)))
    return triton.cdiv(triton.cdiv(n, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN


def _rope_launch_args(q: Tensor, freqs_x: Optional[Tensor], freqs_y: Optional[Tensor], rope_ints: List[int],
                      rope_offsets: List[float]) -> Tuple[Tensor, Tensor, int, int, int, float, float]:
    """(fx, fy, head stride, prefix, width, row offset, col offset); dummies without RoPE (never loaded)."""
    if freqs_x is None or freqs_y is None:
        return q, q, 0, 0, 1, 0.0, 0.0
    stride_fh = 0 if freqs_x.shape[0] == 1 else freqs_x.shape[1]
    return freqs_x, freqs_y, stride_fh, rope_ints[0], rope_ints[1], rope_offsets[0], rope_offsets[1]


def _launch(q: Tensor, v: Tensor, feature_map: str, freqs_x: Optional[Tensor], freqs_y: Optional[Tensor],
            rope_ints: List[int], rope_offsets: List[float], n: int, split_tokens: int):
    """What both passes launch with: RoPE arguments (fx, fy, head stride, (prefix, width, row offset, col offset)),
    the constexprs, the split length of the reduction over ``n`` tokens, its grid and its fp32 partial sums of a
    (D, Dv) state and a (D,) vector."""
    b, h, _, d = q.shape
    fx, fy, stride_fh, *rope_pos = _rope_launch_args(q, freqs_x, freqs_y, rope_ints, rope_offsets)
    split = _split_len(n, b * h, q.device, split_tokens)
    n_splits = triton.cdiv(n, split)
    s_part = torch.empty(b * h, n_splits, d, v.shape[-1], device=q.device, dtype=torch.float32)
    z_part = torch.empty(b * h, n_splits, d, device=q.device, dtype=torch.float32)
    meta = _meta(q, v, feature_map, freqs_x is not None)
    return (fx, fy, stride_fh, rope_pos), meta, split, (n_splits, b * h), s_part, z_part


def _token_grid(n: int, bh: int):
    """Grid of the kernels with one program per block of tokens and (batch, head)."""
    return lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]), bh)


def _forward(q: Tensor, k: Tensor, v: Tensor, feature_map: str, freqs_x: Optional[Tensor],
             freqs_y: Optional[Tensor], rope_ints: List[int], rope_offsets: List[float], eps: float,
             split_tokens: int) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    (fx, fy, stride_fh, rope_pos), meta, split, grid, s_part, z_part = _launch(
        q, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, nk, split_tokens)
    _state_fwd_kernel[grid](k, v, fx, fy, s_part, z_part, *k.stride(), *v.stride(), stride_fh, h, nk, d // 2, dv,
                            split, *rope_pos, triton.next_power_of_2(nk), **meta)
    s = (s_part.sum(dim=1) / nk).view(b, h, d, dv)  # the mean: S and z stay in range for any N
    z = (z_part.sum(dim=1) / nk).view(b, h, d)
    o = torch.empty(b, h, nq, dv, device=q.device, dtype=q.dtype)
    _output_fwd_kernel[_token_grid(nq, b * h)](q, s, z, fx, fy, o, *q.stride(), *o.stride(), stride_fh, eps, h, nq,
                                               d // 2, dv, *rope_pos, triton.next_power_of_2(nq), **meta)
    return o, s, z


def _backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, s: Tensor, z: Tensor, feature_map: str,
              freqs_x: Optional[Tensor], freqs_y: Optional[Tensor], rope_ints: List[int],
              rope_offsets: List[float], eps: float, split_tokens: int) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, nq, d = q.shape
    nk = k.shape[2]
    (fx, fy, stride_fh, rope_pos), meta, split, grid, ds_part, dz_part = _launch(
        q, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, nq, split_tokens)
    dq = torch.empty(b, h, nq, d, device=q.device, dtype=q.dtype)
    _query_bwd_kernel[grid](q, do, s, z, fx, fy, dq, ds_part, dz_part, *q.stride(), *do.stride(), stride_fh, eps, h,
                            nq, d // 2, v.shape[-1], split, *rope_pos, triton.next_power_of_2(nq), **meta)
    ds = ds_part.sum(dim=1) / nk  # (B*H, D, Dv): the 1/Nk of S moves onto its gradient
    dz = dz_part.sum(dim=1) / nk
    dk = torch.empty(b, h, nk, d, device=q.device, dtype=k.dtype)
    dv = torch.empty(b, h, nk, v.shape[-1], device=q.device, dtype=v.dtype)
    _key_bwd_kernel[_token_grid(nk, b * h)](k, v, ds, dz, fx, fy, dk, dv, *k.stride(), *v.stride(), stride_fh, h, nk,
                                            d // 2, v.shape[-1], *rope_pos, triton.next_power_of_2(nk), **meta)
    return dq, dk, dv


@torch.library.custom_op("linvision::linear_attention_fwd", mutates_args=())
def _linear_attention_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, feature_map: str, freqs_x: Optional[Tensor], freqs_y: Optional[Tensor],
    rope_ints: List[int], rope_offsets: List[float], eps: float, split_tokens: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(o (B, H, Nq, Dv) in q's dtype, S (B, H, D, Dv) fp32, z (B, H, D) fp32); S and z are the means."""
    return _forward(q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens)


@_linear_attention_fwd_op.register_fake
def _(q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens):
    b, h, nq, d = q.shape
    dv = v.shape[-1]
    return (
        q.new_empty(b, h, nq, dv),
        q.new_empty(b, h, d, dv, dtype=torch.float32),
        q.new_empty(b, h, d, dtype=torch.float32),
    )


@torch.library.custom_op("linvision::linear_attention_bwd", mutates_args=())
def _linear_attention_bwd_op(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, s: Tensor, z: Tensor, feature_map: str,
    freqs_x: Optional[Tensor], freqs_y: Optional[Tensor], rope_ints: List[int], rope_offsets: List[float],
    eps: float, split_tokens: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the inputs, the output gradient and the saved S, z (nothing N-sized is saved)."""
    return _backward(q, k, v, do, s, z, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens)


@_linear_attention_bwd_op.register_fake
def _(q, k, v, do, s, z, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    ), torch.empty_like(v, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens = inputs
    _, s, z = output
    ctx.save_for_backward(q, k, v, s, z, freqs_x, freqs_y)
    ctx.options = (feature_map, rope_ints, rope_offsets, eps, split_tokens)
    ctx.mark_non_differentiable(s, z)


def _backward_rule(ctx, do, ds, dz):
    q, k, v, s, z, freqs_x, freqs_y = ctx.saved_tensors
    feature_map, rope_ints, rope_offsets, eps, split_tokens = ctx.options
    dq, dk, dv = torch.ops.linvision.linear_attention_bwd(
        q, k, v, do, s, z, feature_map, freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens
    )
    return dq, dk, dv, None, None, None, None, None, None, None


_linear_attention_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


@register_flop_formula(torch.ops.linvision.linear_attention_fwd)
def _fwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Matrix products: S = phi(k)^T v over Nk tokens and num = phi(q) S over Nq tokens."""
    b, h, nq, d = q_shape
    return 2 * b * h * (k_shape[2] + nq) * d * v_shape[-1]


@register_flop_formula(torch.ops.linvision.linear_attention_bwd)
def _bwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Matrix products: num (recomputed), dnum S^T and dS over Nq queries; v dS^T and dv over Nk keys."""
    b, h, nq, d = q_shape
    return 2 * b * h * (3 * nq + 2 * k_shape[2]) * d * v_shape[-1]


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
    if q.shape[0] * q.shape[1] > _MAX_GRID_Y:
        return f"batch x heads = {q.shape[0] * q.shape[1]} exceeds the launch grid limit {_MAX_GRID_Y}"
    if rope is not None and (rope.freqs_x.requires_grad or rope.freqs_y.requires_grad):
        return "rope frequencies require grad (the kernels do not differentiate them)"
    return None


def linear_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, feature_map: str, rope: Optional[RopeSpec] = None, eps: float = DEFAULT_EPS, *,
    split_tokens: int = 0,
) -> Tensor:
    """Fused non-causal linear attention; same semantics as ``linvision.ops.linear_attention_reference``.

    q, k: (B, H, N, D) and v: (B, H, Nk, Dv), float16, bfloat16 or float32, any strides, on CUDA (or on CPU
    with ``TRITON_INTERPRET=1``); D even in 16..128, Dv in 1..128; Nq may differ from Nk without RoPE.
    feature_map: "identity", "relu" or "elu" (elu + 1), aliases of ``common.FEATURE_MAP_ALIASES`` allowed.
    rope: a :class:`~.common.RopeSpec` (``linvision.ops.Rope`` is one), applied in-kernel to the numerator; its
    frequencies must not require grad.
    split_tokens: tokens per split of the reductions over N (0: chosen from the GPU's size).
    Returns (B, H, Nq, Dv) in q's dtype; differentiable in q, k, v.

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
        check_rope(rope, q.shape[-1], q.shape[2], q.shape[1])
    eps = check_eps(eps)
    check_int("split_tokens", split_tokens, 0)
    reason = unsupported_reason(q, k, v, feature_map, rope=rope, causal=False)
    if reason is not None:
        raise ValueError(f"linear_attention_triton: cannot run this call: {reason}")
    freqs_x = freqs_y = None
    rope_ints: List[int] = [0, 1]
    rope_offsets: List[float] = [0.0, 0.0]
    if rope is not None:
        p = rope.dim // 2
        freqs_x = rope.freqs_x.detach().to(device=q.device, dtype=torch.float32).reshape(-1, p).contiguous()
        freqs_y = rope.freqs_y.detach().to(device=q.device, dtype=torch.float32).reshape(-1, p).contiguous()
        rope_ints = [rope.num_prefix_tokens, rope.grid[1]]
        rope_offsets = [float(rope.offset[0]), float(rope.offset[1])]
    o, _, _ = torch.ops.linvision.linear_attention_fwd(
        q, k, v, feature_map_name(feature_map), freqs_x, freqs_y, rope_ints, rope_offsets, eps, split_tokens
    )
    return o
