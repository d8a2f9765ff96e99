r"""Compile the fused linear-attention kernels for an H100 (sm_90) without a GPU and print what the GPU would see.

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
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from linvision.kernels.compile_check import (DTYPES, HEAD_DIMS, CompileResult, FlaKernel, check,  # no Triton yet
                                             check_fla)

# --- fla-core's kernels, as linvision's recurrences call them ---

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
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return " ".join(cells)


def _row(r: CompileResult, markdown: bool) -> str:
    cells = [r.name, str(r.d), r.dtype, r.rope,
             f"{r.block_n}/{r.num_warps}/{r.num_stages}", str(r.registers), str(r.spill_bytes),
             f"{r.shared_bytes / 1024:.0f}", "yes" if r.pipelined else "no",
             "ok" if r.ok else "FAIL"]
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return " ".join(c.rjust(w) for c, w in zip(cells, WIDTHS))


HEADER = ["kernel", "D", "dtype", "rope", "BN/w/st", "regs", "spill B", "smem KB", "pipelined", ""]
WIDTHS = (17, 4, 9, 5, 10, 5, 7, 7, 9, 5)


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-check-kernels (imports no Triton)."""
    from linvision.utils.cli import tool_parser
    from linvision.kernels.common import KERNEL_NAMES

    p = tool_parser("linvision-check-kernels", __doc__)
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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line)."""
    return build_parser().parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target: before triton is imported
    elif os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("check_kernels: Triton was imported with TRITON_INTERPRET=1; run this in a process without it")
    args = parse_args(argv)
    if args.fla:
        return _main_fla(args)
    if args.markdown:
        print("| " + " | ".join(HEADER[:-1] + ["result"]) + " |")
        print("|" + "---|" * len(HEADER))
    else:
        print(" ".join(c.rjust(w) for c, w in zip(HEADER, WIDTHS)))
    results = check(args.kernel, args.d, args.dtype, args.rope, args.candidates,
                    echo=lambda r: print(_row(r, args.markdown), flush=True))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} of {len(results)} configurations pass (zero spills, shared memory <= 227 KB, "
          "pipelined token loops)", file=sys.stderr)
    return 1 if failed and not args.candidates else 0


def _main_fla(args: argparse.Namespace) -> int:
    if args.markdown:
        print("| " + " | ".join(FLA_HEADER) + " |")
        print("|" + "---|" * len(FLA_HEADER))
    else:
        print(" ".join(FLA_HEADER))
    results = check_fla(args.form, args.d, args.dtype, _run_form, args.tokens,
                        echo=lambda r: print(_fla_row(r, args.markdown), flush=True))
    print(f"{sum(r.usable for r in results)} of {len(results)} fla kernels have a configuration without spills within "
          f"227 KB of shared memory; {sum(not r.ok for r in results)} have none within 227 KB", file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
