"""The launches of the fused linear-attention kernels of :mod:`.la_kernels`: autotuning, buffers, RoPE tables,
grids.

On a GPU the kernels are autotuned over block size, warps and stages, keyed on the next power of two of N: N is a
runtime argument, so a new resolution re-tunes only when it enters a new power-of-two bucket and compiles
nothing new beyond Triton's usual integer specialisations. The configurations it is offered per kernel and head
dim are :func:`~.la_kernels.offered_configs`. During CUDA-graph capture, where the autotuner cannot benchmark, the
first offered configuration runs. Batch x heads is folded into grid axes 1 and 2, so it has no 65535 limit.
Under ``TRITON_INTERPRET=1`` one fixed configuration is used.

:func:`_forward` and :func:`_backward`, what the custom ops of :mod:`.la_op` run, allocate the buffers,
take the RoPE table (built once per frequency tensors and grid), choose the token splits and spans and launch
the kernels. The process's caches (the configurations chosen, the register caps, the split counters and the RoPE
tables) live here only.
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
from torch import Tensor

from .la_kernels import _dim_bucket, _next_pow2, kernel_constexprs, kernel_function, offered_configs

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET_BLOCK_N = 64
# LINVISION_KERNEL_AUTOTUNE=0 (read at import): every launch takes the first offered configuration, none benchmarked
# (the CUDA tests: each new shape would otherwise time every configuration); the default is 1, autotuned.
AUTOTUNE_ENV = "LINVISION_KERNEL_AUTOTUNE"
_AUTOTUNE = os.environ.get(AUTOTUNE_ENV, "1") != "0"
_SPLIT_ALIGN = 256  # split lengths are multiples of every autotuned BLOCK_N
_MAX_GRID_Y = 65535  # batch x heads runs on grid axes 1 and 2, each at most this long


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of Python ints (triton.cdiv, a JIT-callable function, costs tens of microseconds per call)."""
    return -(-a // b)


_TUNE_KEY = ["N_BUCKET", "D_HALF", "DV", "FEATURE", "HAS_ROPE", "MASK", "POSITIONS"]
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
        jitted = kernel_function(name)
        restore = [arg for arg in _ACCUMULATED if arg in jitted.arg_names and name == "_key_bwd_kernel"]
        _TUNED[key] = triton.autotune(configs=configs, key=_TUNE_KEY, restore_value=restore or None)(jitted)
    return _TUNED[key]


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
    for name in ("DQ_GRAD", "MASK", "COUNTED", "REDUCE", "HAS_RES", "GATE_ACT"):
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
        kernel_function(name)[grid({"BLOCK_N": bn})](*args, **meta, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                                                     **cap)
        return
    key = (name, _dim_bucket(d, dv), args[_n_bucket_index(name)], *meta.items())
    config = _CHOSEN.get(key)
    if config is None:
        tuned = _tuned(name, d, dv)
        tuned[grid](*args, **meta)
        _CHOSEN[key] = tuned.best_config
    else:
        kernel_function(name)[grid(config.kwargs)](*args, **meta, **config.all_kwargs())


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
    return kernel_function(name).arg_names.index("N_BUCKET")


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
             split_tokens: int, valid: Optional[Tensor] = None, positions: Optional[Tensor] = None,
             residual: Optional[Tensor] = None, gate: Optional[Tensor] = None,
             gate_act: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
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
        res = o if residual is None else residual  # (B, H, Nq, Dv) views; o stands in, never read, when absent
        gt = o if gate is None or not gate_act else gate
        _run("_output_fwd_kernel", d, dv, _spans(nq, b * h, q.device), q, s, z, tab, tok.valid, tok.count,
             tok.pos, o, res, gt, *q.stride(), *o.stride(), *res.stride(), *gt.stride(), stride_th, stride_ts,
             tok.stride_pb, tok.scale(eps, nk), h, b * h, nq, d // 2, dv, prefix, width, _next_pow2(nq), **meta,
             **tok.queries, HAS_RES=residual is not None, GATE_ACT=gate_act if gate is not None else 0)
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
