"""Compile the fused linear-attention kernels (and fla-core's, as a caller runs them) for an H100 (sm_90) without
a GPU, and read what the GPU would see: registers and spills (Triton's bundled ``ptxas -v --gpu-name sm_90a``),
shared memory (the compiled kernel's metadata; an H100 block may use 227 KB) and whether a token loop is pipelined
(asynchronous copies or TMA in the TTGIR).

- :func:`check` / :func:`compile_kernel`: linvision's kernels per head dim, dtype, RoPE form and configuration,
  each a :class:`CompileResult`; a configuration passes with zero spills, shared memory within 227 KB and
  a pipelined token loop (:attr:`CompileResult.ok`; every kernel loops over its tokens).
- :func:`check_fla`: fla-core's kernels as a caller's forms run them, in a process set up by
  :func:`pretend_hopper` (Triton and fla-core then take it for one with an H100; launches only compile), each
  kernel summarised as a :class:`FlaKernel`.

Needs a process in which Triton was imported without ``TRITON_INTERPRET=1``; imports Triton only when called.
The command ``linvision-check-kernels`` prints these results.
"""
from __future__ import annotations

import importlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from typing import Callable, Iterable, List, Sequence

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
    pipelined: bool
    dq_grad: bool = True  # False: the query backward without dq
    epilogue: bool = False  # True: the output kernel with its epilogue (a residual and a SiLU gate)

    @property
    def name(self) -> str:
        short = self.kernel.strip("_").replace("_kernel", "")
        return short + ("" if self.dq_grad else " (no dq)") + (" (epilogue)" if self.epilogue else "")

    @property
    def ok(self) -> bool:
        return self.spill_bytes == 0 and self.shared_bytes <= H100_SMEM_BYTES and self.pipelined


def _is_channel_stride(name: str) -> bool:
    return name.startswith("stride_") and name.endswith("d") and name not in ("stride_th",)


# Integer arguments a typical launch passes as multiples of 16 (Triton specializes those, and ints equal to 1, at run
# time): batch, head and token strides of contiguous or token-major inputs, the halves of D, Dv, table strides.
_DIVISIBLE = {"D_HALF", "DV", "stride_th", "stride_ts"}


def _signature(fn, dtype: str, consts: dict) -> tuple:
    """(signature, constexprs, attrs) of a kernel as a launch specializes it: N-sized tensors in the input dtype,
    state and RoPE tables fp32, channel strides 1, pointers and the ``_DIVISIBLE`` ints 16-divisible."""
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dtype]
    from . import la_kernels as m

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
        elif name in m.INT_POINTERS:
            sig[name] = "*i32"
        elif name in m.FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name in _DIVISIBLE or (name.startswith("stride_") and name != "stride_fh"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def ptxas_usage(ptx: str) -> tuple:
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
                   feature: str = "elu", dq_grad: bool = True, epilogue: bool = False) -> CompileResult:
    """Compile one kernel (by name) for sm_90 with D = Dv = d, RoPE "off", "on" or "learn" and config (BLOCK_N,
    num_warps, num_stages); ``dq_grad`` False: the query backward without dq (queries that need no gradient);
    ``epilogue``: the output kernel adding a residual and multiplying by a SiLU gate (inference)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import la_kernels as m

    block_n, warps, stages = config
    fn = m.kernel_function(kernel)
    naflex = rope == "naflex"  # a batch of images of different sizes: token mask, RoPE at per-sample positions
    consts = dict(m.kernel_constexprs(dtype, d, d, feature, rope != "off", freq_grad=rope == "learn",
                                       dq_grad=dq_grad, mask=naflex, counted=naflex, positions=naflex,
                                       residual=epilogue, gate="silu" if epilogue else None),
                  BLOCK_N=block_n)
    consts = {name: value for name, value in consts.items() if name in fn.arg_names}  # FREQ_GRAD etc.: backward
    sig, consts, attrs = _signature(fn, dtype, consts)
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    regs, spills = ptxas_usage(compiled.asm["ptx"])
    ttgir = compiled.asm["ttgir"]
    return CompileResult(kernel, d, dtype, rope, block_n, warps, stages, regs, spills, compiled.metadata.shared,
                         pipelined=token_loads_pipelined(ttgir, dtype, 2 if epilogue else 0),
                         dq_grad=dq_grad or "DQ_GRAD" not in fn.arg_names, epilogue=epilogue)


def launch_variants(kernel: str) -> List[dict]:
    """The variants a kernel is launched in: the query backward with and without dq, the output kernel without
    and with its epilogue; one for the other kernels."""
    from . import la_kernels as m

    names = m.kernel_function(kernel).arg_names
    if "DQ_GRAD" in names:
        return [{}, {"dq_grad": False}]
    return [{}, {"epilogue": True}] if "HAS_RES" in names else [{}]


def token_loads_pipelined(ttgir: str, dtype: str, plain_loads: int = 0) -> bool:
    """Whether the token loop loads its N-sized (16-bit) tiles by asynchronous copies or TMA: at least one such
    copy and at most ``plain_loads`` synchronous ``tt.load`` of a 16-bit pointer left inside the loop (the output
    kernel's epilogue reads its residual and gate tiles so, where they are used: Triton pipelines only the loads
    that feed its products)."""
    if "scf.for" not in ttgir:
        return False
    ptr = "!tt.ptr<bf16>" if dtype == "bfloat16" else "!tt.ptr<f16>"
    body = ttgir[ttgir.index("scf.for"):ttgir.rindex("scf.yield")]
    copies = [line for line in ttgir.splitlines() if ("async_copy_global_to_local" in line or "async_tma" in line)
              and (ptr in line or "tensordesc" in line)]
    sync = [line for line in body.splitlines() if "tt.load " in line and ptr in line]
    return bool(copies) and len(sync) <= plain_loads


def check(kernels: Iterable[str], dims: Iterable[int], dtypes: Iterable[str], ropes: Iterable[str],
          candidates: bool = False, echo=None) -> List[CompileResult]:
    """Compile every combination; ``candidates`` compiles the whole search space instead of the offered
    configurations. ``echo`` is called with each result as it comes."""
    from . import la_kernels as m

    results = []
    for kernel, d, dtype, rope in itertools.product(kernels, dims, dtypes, ropes):
        if rope == "learn" and "FREQ_GRAD" not in m.kernel_function(kernel).arg_names:
            continue  # the forward kernels compile the same with learnable frequencies
        configs = m.CANDIDATE_CONFIGS if candidates else m.offered_configs(kernel, d)
        for config, variant in itertools.product(configs, launch_variants(kernel)):
            result = compile_kernel(kernel, d, dtype, rope, config, **variant)
            results.append(result)
            if echo is not None:
                echo(result)
    return results


# --- fla-core's kernels, as a caller runs them ---

FLA_MODULES = ("fla.ops.delta_rule", "fla.ops.gla", "fla.ops.simple_gla")  # whose kernels linvision's recurrences call


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


def pretend_hopper() -> None:
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


def fla_autotuners() -> list:
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


def check_fla(forms: Iterable[str], dims: Iterable[int], dtypes: Iterable[str], run_form: Callable, tokens: int = 1024,
              modules: Sequence[str] = FLA_MODULES, echo=None) -> List[FlaKernel]:
    """Compile fla-core's kernels for sm_90 as each of ``forms`` calls them, forward and backward, at head dims
    ``dims`` and input dtypes ``dtypes``: ``run_form(form, d, dtype, tokens)`` runs one form (its launches only
    compile); one :class:`FlaKernel` per kernel, form, D and dtype. ``modules``: the fla-core modules whose kernels
    the forms call. Sets up the process with :func:`pretend_hopper` (call it in a process that imported neither
    Triton with the interpreter on nor fla-core)."""
    pretend_hopper()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in modules:
            importlib.import_module(module)
    tuners = fla_autotuners()
    usage = {}  # id(compiled kernel) -> (registers, spill bytes): each compiled kernel through ptxas once
    results = []
    for form, d, dtype in itertools.product(forms, dims, dtypes):
        for tuner in tuners:  # every form benchmarks, and so compiles, every configuration again
            tuner.cache.clear()
        _FLA_COMPILED.clear()
        run_form(form, d, dtype, tokens)
        kernels = {}
        for name, kernel in _FLA_COMPILED:
            kernels.setdefault(name, {})[id(kernel)] = kernel
        for name, compiled in kernels.items():
            rows = []
            for key, kernel in compiled.items():
                if key not in usage:
                    usage[key] = ptxas_usage(kernel.asm["ptx"])
                rows.append((*usage[key], kernel.metadata.shared))
            result = FlaKernel(form, name, d, dtype, len(rows), sum(r[1] > 0 for r in rows),
                               sum(r[2] > H100_SMEM_BYTES for r in rows), (min(r[0] for r in rows),
                               max(r[0] for r in rows)), (min(r[2] for r in rows), max(r[2] for r in rows)),
                               sum(r[1] == 0 and r[2] <= H100_SMEM_BYTES for r in rows))
            results.append(result)
            if echo is not None:
                echo(result)
    return results
