r"""Compile the fused linear-attention kernels for an H100 (sm_90) without a GPU and print what the GPU would see.

For every kernel x head dim D = Dv x dtype x RoPE (off, on, and "learn": the backward kernels with the gradient
of learnable frequencies; "naflex" on request: a token mask and RoPE at per-sample positions) x autotune
configuration, and the query backward also in its variant without dq
(queries that need no gradient): registers per thread and spill bytes (Triton's bundled
"ptxas -v --gpu-name sm_90a" on the PTX), shared memory (the compiled kernel's metadata; an H100 block may use
227 KB) and whether the token loop is pipelined (asynchronous copies or TMA in the TTGIR; kernels that handle
one token block per program have no loop). A configuration passes with zero spills, shared memory within
227 KB and, for kernels with a loop, a pipelined loop.

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
import importlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
import types
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
    rope: str  # "off", "on", "learn" or "naflex"
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
        elif name in m.BYTE_POINTERS:
            sig[name] = "*u8"
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
                             capture_output=True, text=True, check=True, timeout=600)
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
    naflex = rope == "naflex"  # a batch of images of different sizes: token mask, RoPE at per-sample positions
    consts = dict(m.kernel_constexprs(dtype, d, d, feature, rope != "off", freq_grad=rope == "learn",
                                       dq_grad=dq_grad, mask=naflex, counted=naflex, positions=naflex),
                  BLOCK_N=block_n)
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


# --- fla-core's kernels, as linvision's recurrences call them ---

FLA_FORMS = ("bidir_delta", "bidir_gated_head", "bidir_gated_channel", "delta_state", "gated_state")


@dataclass
class FlaKernel:
    """One fla kernel of one form, D and dtype, over the configurations it was compiled in (registers and shared
    memory as (min, max))."""

    form: str
    kernel: str
    d: int
    dtype: str
    configs: int
    spilling: int  # configurations with spill stores or loads
    over_shared: int  # configurations needing more than an H100 block's 227 KB
    registers: tuple
    shared_bytes: tuple
    clean: int  # configurations with neither spills nor too much shared memory

    @property
    def usable(self) -> bool:
        """At least one configuration without spills within the shared memory."""
        return self.clean > 0

    @property
    def ok(self) -> bool:
        """At least one configuration that can launch (within the shared memory)."""
        return self.over_shared < self.configs


_FLA_COMPILED: list = []  # (kernel name, compiled kernel), appended by every launch while the check runs


class _HopperDriver:
    """What Triton and fla-core ask of the active driver, answered as for one H100 (sm_90, 227 KB of shared memory
    per block, 132 SMs); launches only compile, and the autotuners' benchmark runs each configuration once (so every
    offered configuration is compiled) and times each alike."""

    class utils:
        @staticmethod
        def get_device_properties(device):
            return dict(max_shared_mem=232448, multiprocessor_count=132, max_num_regs=65536, warpSize=32,
                        sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=5120)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda

    def get_benchmarker(self):
        def bench(kernel_call, quantiles=None, **kwargs):
            kernel_call()
            return [1.0, 1.0, 1.0] if quantiles else 1.0

        return bench

    def get_empty_cache_for_benchmark(self):
        import torch

        return torch.empty(1)

    def clear_cache(self, cache):
        pass


def _pretend_hopper() -> None:
    """Make this process's Triton compile for an H100 and fla-core (imported after this) detect one; launches only
    compile and are recorded in ``_FLA_COMPILED``. Irreversible: for a process that only checks."""
    if "fla" in sys.modules:
        sys.exit("check_kernels --fla: fla-core was imported before the check could set up its sm_90 target")
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_HopperDriver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        _FLA_COMPILED.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                                  shared_memory_per_block_optin=232448, total_memory=80 * 2 ** 30)
    for name, value in dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                            get_device_capability=lambda *a, **k: (9, 0),
                            get_device_name=lambda *a, **k: props.name,
                            get_device_properties=lambda *a, **k: props).items():
        setattr(torch.cuda, name, value)


def _fla_autotuners() -> list:
    """Every autotuner of the fla-core modules imported so far, each set to keep no results on disk."""
    import triton
    from triton.runtime.autotuner import Autotuner

    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("fla."):
            continue
        for value in list(vars(module).values()):
            while isinstance(value, triton.runtime.jit.KernelInterface) and id(value) not in seen:
                seen.add(id(value))
                if isinstance(value, Autotuner):
                    value.cache_results = False
                    found.append(value)
                value = getattr(value, "fn", None)
    return found


def _run_form(form: str, d: int, dtype: str, tokens: int) -> None:
    """One form of linvision's recurrences on fla's kernels, forward and backward, on CPU tensors (launches only
    compile, so the values are never computed)."""
    import torch

    from linvision.ops.recurrent import kernels as rk

    b, h, n = 1, 2, tokens
    dt = getattr(torch, dtype)
    q, k, v = (torch.rand(b, h, n, d, requires_grad=True) for _ in range(3))
    beta = torch.rand(b, h, n, requires_grad=True)
    head = torch.full((b, h, n, 1), -0.01, requires_grad=True)
    channel = torch.full((b, h, n, d), -0.01, requires_grad=True)
    state = dict(s0=torch.rand(b, h, d, d), z0=torch.rand(b, h, d), return_state=True)
    if form == "bidir_delta":
        outs = [rk.bidirectional_delta(q, k, v, beta, dtype=dt)]
    elif form == "delta_state":
        outs = list(rk.delta_scan(q, k, v, beta, dtype=dt, s0=state["s0"], return_state=True))
    elif form in ("bidir_gated_head", "bidir_gated_channel"):
        gate = head if form.endswith("head") else channel
        outs = [rk.bidirectional_gated(q, k, v, gate, dtype=dt, normalize=True, eps=1e-4)]
    else:
        outs = []
        for gate in (head, channel):
            count0 = torch.ones(b, h, gate.shape[-1])
            outs += rk.gated_scan(q, k, v, gate, dtype=dt, normalize=True, eps=1e-4, count0=count0, **state)
    sum(o.float().sum() for o in outs if o is not None).backward()


def check_fla(forms: Iterable[str], dims: Iterable[int], dtypes: Iterable[str], tokens: int = 1024,
              echo=None) -> List[FlaKernel]:
    """Compile fla-core's kernels for sm_90 as each of ``forms`` calls them, forward and backward, at head dims
    ``dims`` and input dtypes ``dtypes``; one :class:`FlaKernel` per kernel, form, D and dtype. Sets up the
    process with :func:`_pretend_hopper` (call it in a process that imported neither Triton with the interpreter
    on nor fla-core)."""
    _pretend_hopper()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ("delta_rule", "gla", "simple_gla"):  # those whose kernels the recurrences call
            importlib.import_module(f"fla.ops.{module}")
    tuners = _fla_autotuners()
    usage = {}  # id(compiled kernel) -> (registers, spill bytes): each compiled kernel through ptxas once
    results = []
    for form, d, dtype in itertools.product(forms, dims, dtypes):
        for tuner in tuners:  # every form benchmarks, and so compiles, every configuration again
            tuner.cache.clear()
        _FLA_COMPILED.clear()
        _run_form(form, d, dtype, tokens)
        kernels = {}
        for name, kernel in _FLA_COMPILED:
            kernels.setdefault(name, {})[id(kernel)] = kernel
        for name, compiled in kernels.items():
            rows = []
            for key, kernel in compiled.items():
                if key not in usage:
                    usage[key] = _ptxas_usage(kernel.asm["ptx"])
                rows.append((*usage[key], kernel.metadata.shared))
            result = FlaKernel(form, name, d, dtype, len(rows), sum(r[1] > 0 for r in rows),
                               sum(r[2] > H100_SMEM_BYTES for r in rows), (min(r[0] for r in rows),
                               max(r[0] for r in rows)), (min(r[2] for r in rows), max(r[2] for r in rows)),
                               sum(r[1] == 0 and r[2] <= H100_SMEM_BYTES for r in rows))
            results.append(result)
            if echo is not None:
                echo(result)
    return results


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
             f"{r.shared_bytes / 1024:.0f}", ("yes" if r.pipelined else "no") if r.has_loop else "no loop",
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
    results = check_fla(args.form, args.d, args.dtype, args.tokens,
                        echo=lambda r: print(_fla_row(r, args.markdown), flush=True))
    print(f"{sum(r.usable for r in results)} of {len(results)} fla kernels have a configuration without spills within "
          f"227 KB of shared memory; {sum(not r.ok for r in results)} have none within 227 KB", file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
