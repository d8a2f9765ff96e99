"""The Triton jit code of fused non-causal linear attention, forward and backward, and its tables.

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

The configurations offered per kernel and head dim (:func:`offered_configs`) are those that compile for sm_90
without register spills, within 227 KB of shared memory and with a pipelined token loop
(``linvision-check-kernels`` checks them without a GPU, from :func:`kernel_function` and
:func:`kernel_constexprs`). The kernels are launched by :mod:`.la_launch`; this module imports only
Triton and :mod:`.common`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import triton
import triton.language as tl

from .common import EPILOGUE_GATES, FUSED_FEATURE_MAPS

# The backward's products with the state (S, dS) take its hi part only: 2^-9 (bf16) / 2^-11 (fp16) relative,
# within the gradients' tolerances (4x the output's), as flash attention's backward rounds P and dS to 16 bits;
# it halves those products and the registers that hold the state. The forward keeps hi + lo.
BACKWARD_LO = tl.constexpr(False)


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


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2, in plain Python."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _dim_bucket(d: int, dv: int) -> int:
    return max(32, _next_pow2(max(d, dv)))


def _block_p(d: int) -> int:
    return max(16, _next_pow2(d // 2))


_JITTED = {}  # kernel name -> jitted function


def _kernel(fn):
    """Register a kernel; it is autotuned per head-dim bucket over :func:`offered_configs` (see
    :func:`~.la_launch._tuned`)."""
    jitted = triton.jit(fn)
    _JITTED[fn.__name__] = jitted
    return jitted


# The in-kernel codes of the fused maps, from the one table (linvision.kernels.common.FEATURE_MAPS); any other code is
# the identity's.
_RELU = tl.constexpr(FUSED_FEATURE_MAPS["relu"])
_ELU = tl.constexpr(FUSED_FEATURE_MAPS["elu"])
_SILU = tl.constexpr(EPILOGUE_GATES["silu"])  # any other nonzero gate code is the identity's
if set(FUSED_FEATURE_MAPS) != {"identity", "relu", "elu"}:  # a fused row the kernels have no code path for
    raise ImportError(f"FEATURE_MAPS fuses {sorted(FUSED_FEATURE_MAPS)}; the kernels apply identity, relu and elu")


@triton.jit
def _phi(x, FEATURE: tl.constexpr):
    """Feature map on fp32 values, by its code of FEATURE_MAPS' ``fused`` column: relu, elu + 1, else identity."""
    if FEATURE == _RELU:
        y = tl.maximum(x, 0.0)
    elif FEATURE == _ELU:
        y = tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    else:
        y = x
    return y


@triton.jit
def _phi_grad(f, FEATURE: tl.constexpr):
    """d phi / dx from the features f = phi(x) (fp32): relu 1 where f > 0; elu + 1 min(f, 1) (exp(x) for x <= 0,
    1 above); identity 1. The inputs themselves need not stay live."""
    if FEATURE == _RELU:
        g = tl.where(f > 0, 1.0, 0.0)
    elif FEATURE == _ELU:
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
def _output_fwd_kernel(Q, S, Z, TAB, VALID, COUNT, POS, O, RES, GATE, stride_qb, stride_qh, stride_qn, stride_qd,
                       stride_ob, stride_oh, stride_on, stride_od, stride_rb, stride_rh, stride_rn, stride_rd,
                       stride_gb, stride_gh, stride_gn, stride_gd, stride_th, stride_ts, stride_pb, eps, H, BH, N,
                       D_HALF, DV, prefix, width, N_BUCKET, FEATURE: tl.constexpr, HAS_ROPE: tl.constexpr,
                       MASK: tl.constexpr, COUNTED: tl.constexpr, POSITIONS: tl.constexpr, PRECISION: tl.constexpr,
                       DOT: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RES: tl.constexpr, GATE_ACT: tl.constexpr):
    """Grid (spans, B*H): o = (R phi(q)) S / (phi(q) . z + eps) for the queries of one span (:func:`_span`), a
    loop over its token blocks (``eps`` times the sample's valid keys with COUNTED; invalid queries with MASK get
    0); the state is loaded and split once per program. The rotated features enter the tensor cores in the input
    dtype, S as its hi + lo split. The epilogue, in fp32 before the one rounding to O's dtype: with HAS_RES
    o + RES (a LePE branch), with GATE_ACT (a code of ``EPILOGUE_GATES``) that times act(GATE) (an output gate);
    RES and GATE are read with their own strides (views of token-major projections) and never without the flags."""
    pid_s, bh, b, h, valid, offs_p, offs_e = _program(H, BH, BLOCK_P, BLOCK_DV)
    valid_row, pos_row = _sample_rows(VALID, POS, b, N, stride_pb)
    eps = _per_sample(eps, COUNT, b, COUNTED, False)
    s1, s2, z1, z2 = _load_state(S, Z, bh, offs_p, offs_e, D_HALF, DV, 1.0)
    hi1, lo1, hi2, lo2, inv = _split_state(s1, s2, DOT, ROUND_BF16, SPLIT, True)
    q_base = _head(Q, b, h, stride_qb, stride_qh)
    o_base = _head(O, b, h, stride_ob, stride_oh)
    r_base = _head(RES, b, h, stride_rb, stride_rh)
    g_base = _head(GATE, b, h, stride_gb, stride_gh)
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
        out = num * (inv / den)[:, None]
        # the epilogue's tiles, plain loads where they are used (loaded at the top of the iteration, the pair
        # spilled registers at BLOCK_N 256, D 64; Triton pipelines only the loads that feed its products)
        if HAS_RES:
            out += _load_tile(r_base, offs_n, offs_e, stride_rn, stride_rd, mask_o & valid).to(tl.float32)
        if GATE_ACT != 0:
            gate = _load_tile(g_base, offs_n, offs_e, stride_gn, stride_gd, mask_o & valid).to(tl.float32)
            if GATE_ACT == _SILU:
                gate = gate * tl.sigmoid(gate)
            out = out * gate
        o_ptrs = o_base + offs_n.to(tl.int64)[:, None] * stride_on + offs_e[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_o & valid)


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


TOKEN_POINTERS = {"K", "V", "Q", "O", "RES", "GATE", "DO", "DQ", "DK", "DV_OUT"}  # in the input dtype
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
                      positions: bool = False, reduce: bool = True, residual: bool = False,
                      gate: Optional[str] = None) -> dict:
    """The constexprs of a launch (all but BLOCK_N; FREQ_GRAD only for the backward kernels, DQ_GRAD only for the
    query backward, COUNTED not for the state kernel, REDUCE (``reduce``: the last split program sums the splits)
    only for the state kernel and the query backward, see :func:`kernel_function`); ``dtype`` by name
    ("bfloat16", ...). 16-bit inputs: dot operands in that dtype (the fp32 state split hi + lo); fp32 inputs: exact
    fp32 products ("ieee"). ``mask``: the kernel's tokens are read through a token mask; ``counted``: means over
    each sample's valid keys; ``positions``: RoPE at per-sample positions; ``residual``, ``gate`` (an activation
    of ``EPILOGUE_GATES``): the output kernel's epilogue (HAS_RES, GATE_ACT)."""
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
        HAS_RES=residual,
        GATE_ACT=0 if gate is None else EPILOGUE_GATES[gate],
    )
