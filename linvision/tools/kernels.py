"""The Triton kernels' commands: their memory traffic and GPU times, and their compile check for an H100 without a
GPU. Each command has a parser and the entry point pyproject.toml names:

    linvision-bench-kernels    bench_parser, bench_main
    linvision-check-kernels    check_parser, check_main

A command's --help opens with its *_HELP text; PARSERS maps each command to its parser. Nothing here imports
Triton before check_main has looked at TRITON_INTERPRET (linvision.kernels.compile_check imports none), and
the benchmark's own imports wait until it runs.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from linvision.kernels.compile_check import (DTYPES, HEAD_DIMS, CompileResult, FlaKernel, check,  # no Triton yet
                                             check_fla)
from linvision.utils.cli import tool_parser


def _markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# --- linvision-bench-kernels ------------------------------------------------------------------------------------

BENCH_HELP = r"""Benchmark the fused linear-attention kernels against their HBM floor.

On a GPU: times forward, backward and forward+backward of the Triton kernels, the PyTorch reference path and
softmax attention (SDPA) for N from 1k to 256k tokens, and prints the kernels' achieved bytes/s (minimal
traffic / time) as a percentage of the HBM bandwidth.

Without a GPU: runs the kernels in the Triton interpreter, counts the distinct bytes each launch loads and
stores (masked lanes excluded) and prints them as a multiple of the minimal traffic.

    linvision-bench-kernels                              # GPU timing, or traffic counting without a GPU
    linvision-bench-kernels --traffic --n 1024 2048 4096 8192 16384 --heads 2
"""


def bench_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-kernels."""
    p = tool_parser("linvision-bench-kernels", BENCH_HELP)
    p.add_argument("--traffic", action="store_true", help="count bytes in the interpreter (default without GPU)")
    p.add_argument("--n", type=int, nargs="+", default=None, help="token counts (default 1k..256k on GPU, "
                   "1k..16k when counting)")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, default=None, help="attention heads H (default 16 on GPU, 2 when counting)")
    p.add_argument("--dim", type=int, default=64, help="head dim D (= Dv)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the queries, keys and values")
    p.add_argument("--feature-map", default="elu", choices=["identity", "relu", "elu"],
                   help="feature map applied to the queries and keys")
    p.add_argument("--rope", action="store_true", help="2D axial RoPE on a grid of N / 64 x 64 tokens")
    p.add_argument("--split-tokens", type=int, nargs="+", default=None,
                   help="split lengths of the N reductions to count (0 = none); default 0 and 1024")
    p.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth in TB/s (default by GPU name)")
    p.add_argument("--sdpa-max-n", type=int, default=65536, help="skip SDPA above this N (quadratic cost)")
    return p


def make_inputs(args, n, device, dtype):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.heads, n, args.dim)
    return [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4)]


def make_rope(args, n, device):
    from linvision.ops import axial_rope

    if not args.rope:
        return None
    width = 64 if n % 64 == 0 else n
    return axial_rope(args.dim, (n // width, width), device=device)


def run_traffic(args):
    import torch

    from linvision.kernels import linear_attention_triton
    from linvision.kernels.traffic import count_traffic, minimal_bytes

    dtype = getattr(torch, args.dtype)
    itemsize = torch.finfo(dtype).bits // 8
    print(f"traffic counted in the interpreter: B={args.batch} H={args.heads} D=Dv={args.dim} {args.dtype} "
          f"phi={args.feature_map} rope={args.rope}")
    print(f"{'N':>7} {'split':>6} {'fwd bytes':>11} {'fwd floor':>11} {'fwd x':>7} {'bwd bytes':>11} "
          f"{'bwd floor':>11} {'bwd x':>7}")
    for n in args.n:
        for split in sorted({min(s or n, n) for s in args.split_tokens}, reverse=True):  # one row per split
            q, k, v, do = (t.requires_grad_() for t in make_inputs(args, n, "cpu", dtype))
            rope = make_rope(args, n, "cpu")
            with count_traffic() as fwd:
                out = linear_attention_triton(q, k, v, args.feature_map, rope=rope, split_tokens=split)
            with count_traffic() as bwd:
                out.backward(do.detach())
            row = []
            for launches, backward in ((fwd, False), (bwd, True)):
                total = sum(t.total for t in launches)
                floor = minimal_bytes(args.batch, args.heads, n, n, args.dim, args.dim, itemsize, backward)
                row += [f"{total:>11d}", f"{floor:>11d}", f"{total / floor:>7.3f}"]
            print(f"{n:>7d} {split:>6d} " + " ".join(row), flush=True)


def time_paths(args, n, device, dtype, bench):
    """Milliseconds per call of each (path, pass) at N = ``n``: the Triton kernels ("triton"), the PyTorch
    reference ("torch ref") and softmax attention through SDPA ("sdpa", up to ``args.sdpa_max_n``), each
    forward, backward and forward+backward ("fwd", "bwd", "fwd+bwd"), as ``bench(fn)`` times them (triton's
    do_bench on a GPU). A path that runs out of memory is left out."""
    from linvision.benchmark import gpu_parts
    from linvision.kernels import linear_attention_triton
    from linvision.ops import linear_attention_reference, softmax_attention

    q, k, v, do = make_inputs(args, n, device, dtype)
    rope = make_rope(args, n, device)
    paths = {
        "triton": lambda q, k, v: linear_attention_triton(q, k, v, args.feature_map, rope=rope),
        "torch ref": lambda q, k, v: linear_attention_reference(q, k, v, args.feature_map, rope=rope),
    }
    if n <= args.sdpa_max_n:
        paths["sdpa"] = lambda q, k, v: softmax_attention(q, k, v, rope=rope)
    timed = gpu_parts.time_paths(paths, (q, k, v), do, device, bench)
    return {(label, step): ms for label, passes in timed.items() if "oom" not in passes for step, ms in passes.items()}


def pass_rows(args, n, times, itemsize, tbps):
    """The rows of the table at N = ``n`` from :func:`time_paths`' times, one per pass: dicts with n, pass, the
    ms of "triton", "torch ref" and "sdpa" (None where not measured) and "hbm_pct", the kernels' minimal bytes
    over their time as a percentage of ``tbps`` TB/s (None without a time)."""
    from linvision.kernels.traffic import minimal_bytes

    rows = []
    for pass_name in ("fwd", "bwd", "fwd+bwd"):
        floor = sum(
            minimal_bytes(args.batch, args.heads, n, n, args.dim, args.dim, itemsize, backward)
            for backward in {"fwd": (False,), "bwd": (True,), "fwd+bwd": (False, True)}[pass_name]
        )
        t = times.get(("triton", pass_name))
        row = {"n": n, "pass": pass_name}
        row.update({label: times.get((label, pass_name)) for label in ("triton", "torch ref", "sdpa")})
        row["hbm_pct"] = 100 * floor / (t * 1e-3) / (tbps * 1e12) if t else None
        rows.append(row)
    return rows


def run_gpu(args):
    """Times the paths on the GPU at each N of ``args.n``, prints the table and returns its rows
    (:func:`pass_rows`)."""
    import torch
    import triton.testing

    from linvision.benchmark.gpu_parts import hbm_tbps

    dtype = getattr(torch, args.dtype)
    itemsize = torch.finfo(dtype).bits // 8
    name = torch.cuda.get_device_name()
    tbps = args.hbm_tbps or hbm_tbps(name)
    if tbps is None:
        sys.exit(f"--hbm-tbps: unknown bandwidth of {name!r}; pass it")
    print(f"{name}, HBM {tbps} TB/s; B={args.batch} H={args.heads} D=Dv={args.dim} {args.dtype} "
          f"phi={args.feature_map} rope={args.rope}; times in ms, % = minimal bytes / time / HBM bandwidth")
    print(f"{'N':>7} {'pass':>8} {'triton':>9} {'% HBM':>6} {'torch ref':>10} {'sdpa':>9}")
    rows = []
    for n in args.n:
        times = time_paths(args, n, "cuda", dtype, triton.testing.do_bench)
        for row in pass_rows(args, n, times, itemsize, tbps):
            pct = f"{row['hbm_pct']:>6.1f}" if row["hbm_pct"] is not None else f"{'-':>6}"
            cols = [f"{row[label]:>9.3f}" if row[label] is not None else f"{'-':>9}"
                    for label in ("triton", "torch ref", "sdpa")]
            print(f"{n:>7d} {row['pass']:>8} {cols[0]} {pct} {cols[1]:>10} {cols[2]}", flush=True)
            rows.append(row)
    return rows


# the process bench_main starts again with the Triton interpreter on (python -c: a module holds two commands)
_BENCH_AGAIN = "from linvision.tools.kernels import bench_main; bench_main()"


def bench_main():
    import torch

    args = bench_parser().parse_args()
    traffic = args.traffic or not torch.cuda.is_available()
    if traffic and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter is chosen when triton is first imported, which importing torch already did: count in a
        # process that starts with it on
        os.execve(sys.executable, [sys.executable, "-c", _BENCH_AGAIN, *sys.argv[1:]],
                  dict(os.environ, TRITON_INTERPRET="1"))
    args.heads = args.heads or (2 if traffic else 16)
    args.n = args.n or ([1024, 2048, 4096, 8192, 16384] if traffic else [1 << e for e in range(10, 19)])
    args.split_tokens = args.split_tokens if args.split_tokens is not None else [0, 1024]
    if traffic:
        run_traffic(args)
    else:
        run_gpu(args)


# --- linvision-check-kernels ------------------------------------------------------------------------------------

CHECK_HELP = """\
Compile the fused linear-attention kernels for an H100 (sm_90) without a GPU and print what the GPU would see.

For every kernel x head dim D = Dv x dtype x RoPE (off, on, and "learn": the backward kernels with the gradient
of learnable frequencies; "naflex" on request: a token mask and RoPE at per-sample positions) x autotune
configuration, and the query backward also in its variant without dq
(queries that need no gradient): registers per thread and spill bytes (Triton's bundled
"ptxas -v --gpu-name sm_90a" on the PTX), shared memory (the compiled kernel's metadata; an H100 block may use
227 KB) and whether the token loop is pipelined (asynchronous copies or TMA in the TTGIR; every kernel loops
over a span or split of token blocks). A configuration passes with zero spills, shared memory within 227 KB and
a pipelined loop.

    linvision-check-kernels                              # the configurations the autotuner is offered
    linvision-check-kernels --candidates --d 128         # every candidate (what the offered lists came from)
    linvision-check-kernels --markdown                   # the table of the manual's Triton kernels page
    linvision-check-kernels --fla --d 64 --dtype float16  # fla-core's kernels of the recurrences

Exit status 1 when an offered configuration fails. Each compilation takes a few seconds on one CPU core.

--fla checks fla-core's chunked kernels instead, as linvision's decay, gated and delta-rule recurrences call
them (linvision.ops.recurrent.kernels): each form (--form) runs forward and backward at linvision's shapes (B 1,
H 2, N --tokens, D = Dv, the gated forms' denominator column included) in a process that Triton and fla-core
take for one with an H100: a driver whose target is sm_90, whose device reports an H100's shared memory and
SMs, and whose launches only compile; the autotuners' benchmark then compiles every configuration they are
offered. Per kernel: the configurations, how many spill registers or need more than 227 KB of shared memory,
the registers and shared memory, and whether at least one configuration has neither (exit status 1 when a
kernel has none that fits in shared memory: it could not launch). About 90 compilations per form, D and dtype.
"""

FLA_FORMS = ("bidir_delta", "bidir_gated_head", "bidir_gated_channel", "delta_state", "gated_state")


def _run_form(form: str, d: int, dtype: str, tokens: int) -> None:
    """One form of linvision's recurrences on fla's kernels, forward and backward, on CPU tensors (launches only
    compile, so the values are never computed)."""
    import torch

    from linvision.ops.recurrent import kernels as rk
    from linvision.ops.recurrent.scan import Reversal

    b, h, n = 1, 2, tokens
    dt = getattr(torch, dtype)
    q, k, v = (torch.rand(b, h, n, d, requires_grad=True) for _ in range(3))
    beta = torch.rand(b, h, n, requires_grad=True)
    head = torch.full((b, h, n, 1), -0.01, requires_grad=True)
    channel = torch.full((b, h, n, d), -0.01, requires_grad=True)
    state = dict(s0=torch.rand(b, h, d, d), z0=torch.rand(b, h, d), return_state=True)
    flip = Reversal(None, n)  # the backward scan's order without lengths
    if form == "bidir_delta":
        outs = [rk.bidirectional_delta(q, k, v, beta, dtype=dt, flip=flip)]
    elif form == "delta_state":
        outs = list(rk.delta_scan(q, k, v, beta, dtype=dt, s0=state["s0"], return_state=True))
    elif form in ("bidir_gated_head", "bidir_gated_channel"):
        gate = head if form.endswith("head") else channel
        outs = [rk.bidirectional_gated(q, k, v, gate, dtype=dt, normalize=True, eps=1e-4, flip=flip)]
    else:
        outs = []
        for gate in (head, channel):
            count0 = torch.ones(b, h, gate.shape[-1])
            outs += rk.gated_scan(q, k, v, gate, dtype=dt, normalize=True, eps=1e-4, count0=count0, **state)
    sum(o.float().sum() for o in outs if o is not None).backward()


FLA_HEADER = ["form", "kernel", "D", "dtype", "configs", "spilling", "over 227 KB", "registers", "shared KB",
              "clean config"]


def _fla_row(r: FlaKernel, markdown: bool) -> str:
    span = lambda lo, hi, f=str: f(lo) if f(lo) == f(hi) else f"{f(lo)}-{f(hi)}"  # noqa: E731
    cells = [r.form, r.kernel, str(r.d), r.dtype, str(r.configs), str(r.spilling), str(r.over_shared),
             span(*r.registers), span(*r.shared_bytes, f=lambda b: f"{b / 1024:.0f}"), "yes" if r.usable else "NO"]
    return _markdown_row(cells) if markdown else " ".join(cells)


CHECK_HEADER = ["kernel", "D", "dtype", "rope", "BN/w/st", "regs", "spill B", "smem KB", "pipelined", ""]
CHECK_WIDTHS = (17, 4, 9, 5, 10, 5, 7, 7, 9, 5)


def _aligned_row(cells: Sequence[str]) -> str:
    return " ".join(c.rjust(w) for c, w in zip(cells, CHECK_WIDTHS))


def _check_row(r: CompileResult, markdown: bool) -> str:
    cells = [r.name, str(r.d), r.dtype, r.rope,
             f"{r.block_n}/{r.num_warps}/{r.num_stages}", str(r.registers), str(r.spill_bytes),
             f"{r.shared_bytes / 1024:.0f}", "yes" if r.pipelined else "no",
             "ok" if r.ok else "FAIL"]
    return _markdown_row(cells) if markdown else _aligned_row(cells)


def check_parser() -> argparse.ArgumentParser:
    """The parser of linvision-check-kernels (imports no Triton)."""
    from linvision.kernels.common import KERNEL_NAMES

    p = tool_parser("linvision-check-kernels", CHECK_HELP)
    p.add_argument("--kernel", nargs="+", default=list(KERNEL_NAMES), choices=list(KERNEL_NAMES),
                   help="kernels to compile (default: all)")
    p.add_argument("--d", type=int, nargs="+", default=list(HEAD_DIMS), help="head dims D = Dv")
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="input dtypes")
    p.add_argument("--rope", nargs="+", default=["off", "on", "learn"], choices=["off", "on", "learn", "naflex"],
                   help="RoPE off, on, and 'learn': the backward kernels with the gradient of learnable frequencies; "
                        "'naflex' (only when named): a batch of images of different sizes, the token mask read in "
                        "the token loops and RoPE at per-sample positions")
    p.add_argument("--candidates", action="store_true", help="every candidate configuration, not only the offered")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--fla", action="store_true",
                   help="check fla-core's kernels as linvision's recurrences call them (--form, --d, --dtype) "
                        "instead of linvision's own")
    p.add_argument("--form", nargs="+", default=list(FLA_FORMS), choices=list(FLA_FORMS),
                   help="with --fla: the recurrences to run, forward and backward (default: all)")
    p.add_argument("--tokens", type=int, default=1024, help="with --fla: the sequence length N")
    return p


def _print_header(header: Sequence[str], markdown: bool, plain: str) -> None:
    """A table's header: a Markdown header row and its rule, or the ``plain`` line."""
    if markdown:
        print(_markdown_row(header))
        print("|" + "---|" * len(header))
    else:
        print(plain)


def check_main(argv: Optional[Sequence[str]] = None) -> int:
    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target: before triton is imported
    elif os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("check_kernels: Triton was imported with TRITON_INTERPRET=1; run this in a process without it")
    args = check_parser().parse_args(argv)
    if args.fla:
        return _check_fla(args)
    _print_header(CHECK_HEADER[:-1] + ["result"], args.markdown, _aligned_row(CHECK_HEADER))
    results = check(args.kernel, args.d, args.dtype, args.rope, args.candidates,
                    echo=lambda r: print(_check_row(r, args.markdown), flush=True))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} of {len(results)} configurations pass (zero spills, shared memory <= 227 KB, "
          "pipelined token loops)", file=sys.stderr)
    return 1 if failed and not args.candidates else 0


def _check_fla(args: argparse.Namespace) -> int:
    _print_header(FLA_HEADER, args.markdown, " ".join(FLA_HEADER))
    results = check_fla(args.form, args.d, args.dtype, _run_form, args.tokens,
                        echo=lambda r: print(_fla_row(r, args.markdown), flush=True))
    print(f"{sum(r.usable for r in results)} of {len(results)} fla kernels have a configuration without spills within "
          f"227 KB of shared memory; {sum(not r.ok for r in results)} have none within 227 KB", file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


PARSERS = {"linvision-bench-kernels": bench_parser, "linvision-check-kernels": check_parser}

if __name__ == "__main__":
    sys.exit(f"linvision/tools/kernels.py holds the commands {', '.join(PARSERS)}: run one of them")
