r"""Benchmark the fused linear-attention kernels against their HBM floor.

On a GPU: times forward, backward and forward+backward of the Triton kernels, the PyTorch reference path and
softmax attention (SDPA) for N from 1k to 256k tokens, and prints the kernels' achieved bytes/s (minimal
traffic / time) as a percentage of the HBM bandwidth.

Without a GPU: runs the kernels in the Triton interpreter, counts the distinct bytes each launch loads and
stores (masked lanes excluded) and prints them as a multiple of the minimal traffic.

    linvision-bench-kernels                              # GPU timing, or traffic counting without a GPU
    linvision-bench-kernels --traffic --n 1024 2048 4096 8192 16384 --heads 2
"""
import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from linvision.benchmark import gpu_parts
from linvision.benchmark.gpu_parts import hbm_tbps
from linvision.utils.cli import tool_parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-kernels."""
    p = tool_parser("linvision-bench-kernels", __doc__)
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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line), as given (main fills in the defaults that depend on
    the device)."""
    return build_parser().parse_args(argv)


def make_inputs(args, n, device, dtype):
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
    import triton.testing

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


def main():
    args = parse_args()
    traffic = args.traffic or not torch.cuda.is_available()
    if traffic and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter is chosen when triton is first imported, which importing torch already did: count in a
        # process that starts with it on
        os.execve(sys.executable, [sys.executable, "-m", "linvision.tools.bench_kernels", *sys.argv[1:]],
                  dict(os.environ, TRITON_INTERPRET="1"))
    args.heads = args.heads or (2 if traffic else 16)
    args.n = args.n or ([1024, 2048, 4096, 8192, 16384] if traffic else [1 << e for e in range(10, 19)])
    args.split_tokens = args.split_tokens if args.split_tokens is not None else [0, 1024]
    if traffic:
        run_traffic(args)
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
