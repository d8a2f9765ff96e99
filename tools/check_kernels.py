r"""Compile the fused linear-attention kernels for an H100 (sm_90) without a GPU and print what the GPU would see.

For every kernel x head dim D = Dv x dtype x RoPE (off, on, and "learn": the backward kernels with the gradient
of learnable frequencies) x autotune configuration, and the query backward also in its variant without dq
(queries that need no gradient): registers per thread and spill bytes (Triton's bundled
"ptxas -v --gpu-name sm_90a" on the PTX), shared memory (the compiled kernel's metadata; an H100 block may use
227 KB) and whether the token loop is pipelined (asynchronous copies or TMA in the TTGIR; kernels that handle
one token block per program have no loop). A configuration passes with zero spills, shared memory within
227 KB and, for kernels with a loop, a pipelined loop.

    linvision-check-kernels                              # the configurations the autotuner is offered
    linvision-check-kernels --candidates --d 128         # every candidate (what the offered lists came from)
    linvision-check-kernels --markdown                   # the table of the manual's Triton kernels page

Exit status 1 when an offered configuration fails. Each compilation takes a few seconds on one CPU core.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

H100_SMEM_BYTES = 227 * 1024
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (32, 64, 128)


@dataclass
class CompileResult:
    kernel: str
    d: int
    dtype: str
    rope: str  # "off", "on" or "learn"
    block_n: int
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int  # spill stores + spill loads per thread, as ptxas reports them
    shared_bytes: int
    has_loop: bool
    pipelined: bool
    dq_grad: bool = True  # False: the query backward without dq

    @property
    def name(self) -> str:
        short = self.kernel.strip("_").replace("_kernel", "")
        return short if self.dq_grad else f"{short} (no dq)"

    @property
    def ok(self) -> bool:
        return self.spill_bytes == 0 and self.shared_bytes <= H100_SMEM_BYTES and (self.pipelined or not self.has_loop)


def _is_channel_stride(name: str) -> bool:
    return name.startswith("stride_") and name.endswith("d") and name not in ("stride_th",)


# Integer arguments a typical launch passes as multiples of 16 (Triton specializes those, and ints equal to 1, at run
# time): batch, head and token strides of contiguous or token-major inputs, the halves of D, Dv, table strides.
_DIVISIBLE = {"D_HALF", "DV", "stride_th", "stride_ts"}


def _signature(fn, dtype: str, consts: dict) -> tuple:
    """(signature, constexprs, attrs) of a kernel as a launch specializes it: N-sized tensors in the input dtype,
    state and RoPE tables fp32, channel strides 1, pointers and the ``_DIVISIBLE`` ints 16-divisible."""
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dtype]
    from linvision.kernels import linear_attention as m

    consts = dict(consts, **{name: 1 for name in fn.arg_names if _is_channel_stride(name)})
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name in m.TOKEN_POINTERS:
            sig[name] = "*" + short
        elif name in m.FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in m.FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name in _DIVISIBLE or (name.startswith("stride_") and name != "stride_fh"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _ptxas_usage(ptx: str) -> tuple:
    """(registers, spill bytes) of the PTX's kernel from ``ptxas -v`` for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return regs, int(spills.group(1)) + int(spills.group(2))


def compile_kernel(kernel: str, d: int, dtype: str, rope: str, config: Sequence[int],
                   feature: str = "elu", dq_grad: bool = True) -> CompileResult:
    """Compile one kernel (by name) for sm_90 with D = Dv = d, RoPE "off", "on" or "learn" and config (BLOCK_N,
    num_warps, num_stages); ``dq_grad`` False: the query backward without dq (queries that need no gradient)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from linvision.kernels import linear_attention as m

    block_n, warps, stages = config
    fn = m.kernel_function(kernel)
    consts = dict(m.kernel_constexprs(dtype, d, d, feature, rope != "off", freq_grad=rope == "learn",
                                       dq_grad=dq_grad), BLOCK_N=block_n)
    consts = {name: value for name, value in consts.items() if name in fn.arg_names}  # FREQ_GRAD etc.: backward
    sig, consts, attrs = _signature(fn, dtype, consts)
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    regs, spills = _ptxas_usage(compiled.asm["ptx"])
    ttgir = compiled.asm["ttgir"]
    return CompileResult(kernel, d, dtype, rope, block_n, warps, stages, regs, spills, compiled.metadata.shared,
                         has_loop="split_len" in fn.arg_names, pipelined=_token_loads_pipelined(ttgir, dtype),
                         dq_grad=dq_grad or "DQ_GRAD" not in fn.arg_names)


def _grad_variants(kernel: str) -> List[dict]:
    """The gradient variants a kernel is launched in: the query backward with and without dq; one for the
    other kernels."""
    from linvision.kernels import linear_attention as m

    return [{}, {"dq_grad": False}] if "DQ_GRAD" in m.kernel_function(kernel).arg_names else [{}]


def _token_loads_pipelined(ttgir: str, dtype: str) -> bool:
    """Whether the token loop loads its N-sized (16-bit) tiles only by asynchronous copies or TMA: at least one
    such copy and no synchronous ``tt.load`` of a 16-bit pointer left inside the loop."""
    if "scf.for" not in ttgir:
        return False
    ptr = "!tt.ptr<bf16>" if dtype == "bfloat16" else "!tt.ptr<f16>"
    body = ttgir[ttgir.index("scf.for"):ttgir.rindex("scf.yield")]
    copies = [line for line in ttgir.splitlines() if ("async_copy_global_to_local" in line or "async_tma" in line)
              and (ptr in line or "tensordesc" in line)]
    sync = [line for line in body.splitlines() if "tt.load " in line and ptr in line]
    return bool(copies) and not sync


def check(kernels: Iterable[str], dims: Iterable[int], dtypes: Iterable[str], ropes: Iterable[str],
          candidates: bool = False, echo=None) -> List[CompileResult]:
    """Compile every combination; ``candidates`` compiles the whole search space instead of the offered
    configurations. ``echo`` is called with each result as it comes."""
    from linvision.kernels import linear_attention as m

    results = []
    for kernel, d, dtype, rope in itertools.product(kernels, dims, dtypes, ropes):
        if rope == "learn" and "FREQ_GRAD" not in m.kernel_function(kernel).arg_names:
            continue  # the forward kernels compile the same with learnable frequencies
        configs = m.CANDIDATE_CONFIGS if candidates else m.offered_configs(kernel, d)
        for config, grads in itertools.product(configs, _grad_variants(kernel)):
            result = compile_kernel(kernel, d, dtype, rope, config, **grads)
            results.append(result)
            if echo is not None:
                echo(result)
    return results


def _row(r: CompileResult, markdown: bool) -> str:
    cells = [r.name, str(r.d), r.dtype, r.rope,
             f"{r.block_n}/{r.num_warps}/{r.num_stages}", str(r.registers), str(r.spill_bytes),
             f"{r.shared_bytes / 1024:.0f}", ("yes" if r.pipelined else "no") if r.has_loop else "no loop",
             "ok" if r.ok else "FAIL"]
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return " ".join(c.rjust(w) for c, w in zip(cells, WIDTHS))


HEADER = ["kernel", "D", "dtype", "rope", "BN/w/st", "regs", "spill B", "smem KB", "pipelined", ""]
WIDTHS = (17, 4, 9, 5, 10, 5, 7, 7, 9, 5)


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-check-kernels (imports no Triton)."""
    from linvision.engine.cli import tool_parser
    from linvision.kernels.common import KERNEL_NAMES

    p = tool_parser("linvision-check-kernels", __doc__)
    p.add_argument("--kernel", nargs="+", default=list(KERNEL_NAMES), choices=list(KERNEL_NAMES),
                   help="kernels to compile (default: all)")
    p.add_argument("--d", type=int, nargs="+", default=list(HEAD_DIMS), help="head dims D = Dv")
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="input dtypes")
    p.add_argument("--rope", nargs="+", default=["off", "on", "learn"], choices=["off", "on", "learn"],
                   help="RoPE off, on, and 'learn': the backward kernels with the gradient of learnable frequencies")
    p.add_argument("--candidates", action="store_true", help="every candidate configuration, not only the offered")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
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


if __name__ == "__main__":
    sys.exit(main())
