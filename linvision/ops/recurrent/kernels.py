"""The decay, gated and delta-rule recurrences of :mod:`linvision.ops.recurrent` on fla-core's chunked Triton kernels.

fla-core (the kernel package of flash-linear-attention, ``pip install "linvision[kernels]"``) has forward and
backward kernels for three causal scans, called here on features that :mod:`linvision.ops.recurrent` has already
formed (feature map, L2 normalisation, gates in fp32):

- ``chunk_simple_gla``: S_t = gamma_t S_{t-1} + k_t^T v_t with one gate per head (the decay form and per-head gates),
- ``chunk_gla``: the same with a gate per key channel,
- ``chunk_delta_rule``: S_t = (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,

all read as o_t = q_t S_t. fla has no non-causal form; the bidirectional ops are built from two of its causal scans,
run as one call over 2B sequences: the raster order, and the reversed order with each query moved one token on.
The reversed scan of :mod:`~linvision.ops.recurrent` leaves the token itself out, q_i S'_{i+1} (delta rule) or
q_i diag(gamma_i) S'_{i+1} (gated), which is the inclusive reversed scan's read at the token before, taken with
token i's query (times its gate): so the reversed sequence's queries are shifted by one and its first output is 0.

The normalised gated forms need a denominator phi(q_i) . z_i and a decayed token count c_i. The denominator rides
through the same kernel as one more value column of ones (and a zero column: fla's backward takes even value
widths). The count depends on the gates only, sum_j prod(gates crossed from j to i); it is formed in float64 from
cumulative log-gates, c_i = exp(C_i + logcumsumexp(-C)_i) forwards and likewise backwards, O(N) and exact to fp32.

Precision. fla's operands are fp16 or bf16 (it refuses fp32 for the delta rule) with fp32 accumulation; its chunk
states are stored in the operand dtype. fp16 and bf16 inputs run in their dtype; fp32 inputs run with fp16 operands, fp32
accumulation and an fp32 result and final state (under ``torch.autocast`` too: the ops turn autocast off around
themselves, see :func:`linvision.ops.common.full_precision`, and hand back the autocast dtype); float64 stays in
PyTorch. The gated forms' sums grow with the decayed count, so their operands are scaled by powers of two,
which is exact: keys by 2^-ceil(log2 max c) per (batch, head) (the largest entry of an entering state, if larger,
takes the count's place), so that the state is at most max phi(k) max |v|, and each query by
2^-ceil(log2 |phi(q_i)|_1); the results are divided by the same factors in fp32 (the normalised forms scale the eps
term instead). The delta rule needs no scaling: with unit keys and beta in [0, 1] its state stays of the size of v.

Dispatch (:func:`kernel_path`): ``backend="auto"`` takes the kernels for CUDA tensors when fla-core imports and the
call fits them, else PyTorch with a ``RuntimeWarning`` once per reason (CPU tensors go to PyTorch without one);
``"triton"`` forces them (ImportError without fla-core, ValueError for a call they cannot run, each in one line);
``"torch"`` is the PyTorch path. fla-core is imported on the first call that runs the kernels, never before.
One combination is refused before the forward, where fla would refuse the backward after it
(:func:`gated_backward_refused`, from Triton's package metadata and the device's name and capability): per-head
gates (the decay form too, fla's ``chunk_simple_gla``) on a Hopper GPU with Triton >= 3.4.0 and < 3.7.1 (as torch 2.8.0 to 2.12.0 install), only when a gradient is needed, since
fla's backward kernel for the gate (``chunk_bwd_dqkwg``) is miscompiled there and fla raises in it rather
than return wrong gradients; inference keeps the kernels. The fix is Triton >= 3.7.1 (torch >= 2.12.1).
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import check_backend, is_exporting, note_backend, warn_fallback

if TYPE_CHECKING:
    from .scan import Reversal

__all__ = [
    "REQUIREMENT",
    "kernel_path",
    "kernel_reason",
    "needs_grad",
    "gated_kernel",
    "refuses_gated_backward",
    "gated_backward_refused",
    "operand_dtype",
    "decayed_counts",
    "gated_scan",
    "bidirectional_gated",
    "delta_scan",
    "bidirectional_delta",
    "AUTOTUNE_ENV",
    "pin_rule",
    "pick_config",
    "pin_configs",
    "fla_autotuners",
    "kernel_name",
]

REQUIREMENT = "fla-core>=0.6,<0.7"
MAX_HEAD_DIM = 256  # fla's state kernels take head dims up to 256
_AUTO_DEVICES = ("cuda",)
_HALF = (torch.float16, torch.bfloat16)
_WARNED: Set[str] = set()
_KERNELS = {}  # name -> fla function, filled on the first kernel call
_IMPORT_ERROR: list = []  # the reason fla-core could not be imported, once known


def _kernel(name: str) -> Callable:
    """fla's chunked kernel ``name`` ("delta_rule", "gla", "simple_gla"), imported on first use; its autotuners are
    then pinned (:func:`pin_configs`)."""
    if name not in _KERNELS:
        if name == "delta_rule":
            from fla.ops.delta_rule import chunk_delta_rule as fn
        elif name == "gla":
            from fla.ops.gla import chunk_gla as fn
        else:
            from fla.ops.simple_gla import chunk_simple_gla as fn
        _KERNELS[name] = fn
        pin_configs()
    return _KERNELS[name]


# --- pinned configurations of fla's autotuned kernels ---
#
# Why. fla-core's kernels are wrapped in Triton autotuners (up to 48 configurations each, a dozen kernels per
# recurrence, forward and backward), and several key their choice on the batch and head counts too. On the first
# call with a new key Triton compiles and times every configuration: on an H100 the first forward and backward of a
# bidirectional delta-rule or gated layer did not end within 60 s, and a model's first call (ViG, linhier_delta)
# waits as long again for every new batch size. fla's own cache of tuned configurations (FLA_CACHE_MODE, read once
# when fla is imported) ships no files for these kernels, and Triton's disk cache of timings
# (TRITON_CACHE_AUTOTUNING) only helps the second process, after the first has paid.
#
# What. Every autotuner of the fla modules the recurrences call gets one more pruning step after fla's own: of the
# configurations fla offers on this GPU, keep the one nearest to a rule written per architecture (compute
# capability major) and head size (the kernel's K, else D): ``num_warps`` 4, ``num_stages`` 2 before Hopper and 3
# from Hopper on (its larger shared memory holds a third stage), each block size (BT, BK, BV, BC, BS, BD, ...) the
# largest at most min(64, head size). Triton compiles a single configuration without timing anything, so the
# first call costs one compilation per kernel. The configurations come from fla's own lists (each valid for its
# kernel); tests/test_fla_pinning.py compiles the chosen ones for sm_90 (within the shared memory; docs/kernels.md
# lists the few that spill).
# LINVISION_FLA_AUTOTUNE=1 in the environment (before the first kernel call) keeps fla's full autotuning instead,
# and so does fla's own cache when a user turns it on (FLA_CACHE_MODE).

AUTOTUNE_ENV = "LINVISION_FLA_AUTOTUNE"
_PINNED_MODULES = ("fla.ops.delta_rule", "fla.ops.gla", "fla.ops.simple_gla", "fla.ops.common", "fla.ops.utils",
                   "fla.modules.norm.l2norm")
_PINNED: Set[int] = set()  # ids of the autotuners already pinned


# Kernels whose rule takes 8 warps: at 4 their pinned configuration spills registers when compiled for sm_90 (255
# registers, 1028 and 360 bytes of spill stores per thread at D = 64), at 8 neither spills at D = 64 (the first
# still spills 792 bytes at D = 32). fla offers only 2 warps on Hopper for prepare_wy_repr_bwd_kernel (Triton
# miscompiles it with 4), which spills at D = 32-128 whatever is pinned.
_EIGHT_WARPS = frozenset({"chunk_gla_bwd_kernel_dv", "chunk_gla_bwd_kernel_inter"})


def pin_rule(major: Optional[int], head_dim: int, kernel: str = "") -> dict:
    """The configuration the pinned ``kernel`` aims at on a GPU of compute capability ``major`` (None: unknown, e.g.
    the interpreter) for head size ``head_dim``: num_warps, num_stages and the cap of every block size."""
    block = 64
    while block > 16 and block > head_dim:
        block //= 2
    return {"num_warps": 8 if kernel in _EIGHT_WARPS else 4, "num_stages": 3 if (major or 0) >= 9 else 2,
            "block": block}


def _distance(config, rule: dict) -> tuple:
    """How far a triton.Config is from ``rule``: warps, stages, then each block size (over the cap costs more)."""
    import math

    blocks = 0.0
    for key, value in config.kwargs.items():
        if key.startswith("B") and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            step = math.log2(value) - math.log2(rule["block"])
            blocks += 2 * step if step > 0 else -step
    return (abs(math.log2(config.num_warps) - math.log2(rule["num_warps"])), blocks,
            abs(config.num_stages - rule["num_stages"]))


def pick_config(configs: list, named_args: dict, major: Optional[int], kernel: str = ""):
    """The one configuration of ``configs`` that :func:`pin_rule` picks for a launch of ``kernel`` with
    ``named_args`` (its head size from K, else D, else 64); ties go to the earliest, as fla lists them."""
    head = next((named_args[k] for k in ("K", "D") if isinstance(named_args.get(k), int)), 64)
    rule = pin_rule(major, head, kernel)
    return min(configs, key=lambda c: _distance(c, rule))


def _capability_major() -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def _pinning_prune(original: Optional[Callable], kernel: str) -> Callable:
    """An ``early_config_prune`` that runs fla's own (``original``), then keeps :func:`pick_config`'s choice."""
    def prune(configs, named_args, **kwargs):
        if original is not None:
            configs = original(configs, named_args, **kwargs)
        return [pick_config(list(configs), {**named_args, **kwargs}, _capability_major(), kernel)]

    prune.pinned = True
    return prune


def _is_tuner(value) -> bool:
    """A Triton autotuner, told by what it has (linvision.ops imports nothing of Triton)."""
    return type(value).__module__.startswith(("triton.", "fla.")) and hasattr(value, "early_config_prune") and \
        hasattr(value, "configs")


def fla_autotuners() -> list:
    """Every Triton autotuner of the fla modules the recurrences call (those imported so far), Triton's and fla's
    own (its cached autotuner subclasses Triton's), found through the wrappers (``.fn``) of the modules' kernels."""
    import sys

    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_PINNED_MODULES):
            continue
        for value in list(vars(module).values()):
            while _is_tuner(value) or type(value).__module__.startswith("triton.runtime"):
                if id(value) in seen:
                    break
                seen.add(id(value))
                if _is_tuner(value):
                    found.append(value)
                value = getattr(value, "fn", None)
    return found


def kernel_name(tuner) -> str:
    """The name of the Triton function an autotuner (or a wrapper of one) launches."""
    fn = tuner
    while hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", "")


def pin_configs() -> int:
    """Pin every autotuner of :func:`fla_autotuners` to one configuration per call (see the comment above); returns
    how many were pinned now. Does nothing when LINVISION_FLA_AUTOTUNE=1, nor when fla's own cache of tuned
    configurations is on (FLA_CACHE_MODE other than "disabled"): its choices then stand."""
    if os.environ.get(AUTOTUNE_ENV, "0") == "1" or os.environ.get("FLA_CACHE_MODE", "disabled") != "disabled":
        return 0
    pinned = 0
    for tuner in fla_autotuners():
        if id(tuner) in _PINNED or getattr(tuner.early_config_prune, "pinned", False):
            continue
        tuner.early_config_prune = _pinning_prune(tuner.early_config_prune, kernel_name(tuner))
        _PINNED.add(id(tuner))
        pinned += 1
    return pinned


def _import_reason() -> Optional[str]:
    """None when fla-core's kernels import, else why not (tried once per process)."""
    if _KERNELS:
        return None
    if not _IMPORT_ERROR:
        try:
            for name in ("delta_rule", "gla", "simple_gla"):
                _kernel(name)
            _IMPORT_ERROR.append(None)
        except ImportError as exc:  # fla-core or Triton missing
            _IMPORT_ERROR.append(f"fla-core cannot be imported ({exc}); install {REQUIREMENT!r} "
                                 "(pip install 'linvision[kernels]')")
    return _IMPORT_ERROR[0]


# --- a backward fla refuses: per-head gates on Hopper with Triton >= 3.4.0 and < 3.7.1 ---
#
# fla-core 0.6's chunk_bwd_dqkwg raises a RuntimeError when it is given a gate on a Hopper GPU (its name starts
# "NVIDIA H" or its compute capability is 9.x) with Triton >= 3.4.0 and < 3.7.1, since Triton miscompiles it there
# (fla-org/flash-linear-attention#640). Of the three kernels called here only chunk_simple_gla's backward calls it
# with a gate (chunk_gla has its own chunk_gla_bwd_dqkg, chunk_delta_rule passes g=None), and the error comes after
# the forward has run. fla's message also offers tilelang, but fla 0.6's tilelang backend declines this call: it
# takes the states in the operands' dtype, and simple_gla's backward keeps them in fp32
# (tests/test_recurrent_kernels.py runs fla's own dispatch to check it). So the one fix is Triton >= 3.7.1.

def refuses_gated_backward(triton_version: str, gpu_name: str, capability: Tuple[int, int]) -> bool:
    """fla-core 0.6's condition for refusing the backward of per-head gates: a Hopper GPU (``gpu_name`` with
    "NVIDIA H" or compute ``capability`` 9.x) and ``triton_version`` >= 3.4.0 and < 3.7.1."""
    from torch.torch_version import TorchVersion  # packaging's version order (pre-releases before the release)

    version = TorchVersion(triton_version)
    return ("NVIDIA H" in gpu_name or capability[0] == 9) and version >= (3, 4, 0) and version < (3, 7, 1)


def _triton_version() -> Optional[str]:
    """The installed Triton's version from its package metadata (Triton itself is not imported here), or None."""
    from importlib import metadata

    for name in ("triton", "pytorch-triton"):  # the release, or the build that torch's nightlies bring
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


@functools.lru_cache(maxsize=None)
def gated_backward_refused(device: torch.device) -> Optional[str]:
    """None when fla can run the backward of per-head gates on ``device`` (always off CUDA), else the installed
    Triton and the GPU (:func:`refuses_gated_backward`); asked once per device, without importing fla or Triton."""
    version = _triton_version() if device.type == "cuda" else None
    if version is None:  # no Triton: the import of fla's kernels says so
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    name, capability = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
    if not refuses_gated_backward(version, name, capability):
        return None
    return f"Triton {version} on {name} (compute capability {capability[0]}.{capability[1]})"


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether a backward can run through a call on ``tensors`` (None skipped): grad mode on and one of them
    requiring a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _backward_reason(q: Tensor, kernel: str, grad: bool) -> Optional[str]:
    """Why fla would refuse the backward of this call (None when it would not, or no gradient is needed)."""
    where = gated_backward_refused(q.device) if kernel == "simple_gla" and grad else None
    if where is None:
        return None
    return (f"fla refuses the backward of per-head gates with {where}, where Triton >= 3.4.0 and < 3.7.1 "
            "miscompiles it; install Triton >= 3.7.1 (torch >= 2.12.1 brings it), or run without gradients")


def kernel_reason(q: Tensor, v: Tensor, kernel: str, grad: bool = False) -> Optional[str]:
    """None when fla's ``kernel`` ("simple_gla", "gla" or "delta_rule") can run a recurrence on q (B, H, N, D) and
    v (B, H, N, Dv) (already validated), forward and, when ``grad`` (:func:`needs_grad`), backward; else a short
    reason. The import of fla-core is checked last (and only then attempted)."""
    if is_exporting():
        return "the call is being exported, and fla's kernels are not part of an exported graph"
    if q.dtype not in (*_HALF, torch.float32):
        return f"dtype {q.dtype} runs in PyTorch (the kernels take float16, bfloat16 or float32)"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if q.device.type != "cuda" and not (interpret and q.device.type == "cpu"):
        return f"tensors are on {q.device.type} and TRITON_INTERPRET is not set"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] + 2 > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, Dv={v.shape[-1]} exceed fla's {MAX_HEAD_DIM} (Dv + 2 for the denominator)"
    if kernel != "delta_rule" and q.shape[-1] % 2:
        return f"head dim D={q.shape[-1]} is odd, and fla's gated kernels take even head dims"
    return _backward_reason(q, kernel, grad) or _import_reason()


def _warn_once(op: str, reason: str) -> None:
    warn_fallback(_WARNED, op, "fla's kernels", reason, stacklevel=5)


def kernel_path(backend: str, q: Tensor, v: Tensor, op: str, kernel: str, grad: bool = False) -> bool:
    """Whether the recurrence ``op`` on q, v runs on fla's ``kernel`` (as :func:`kernel_reason`; ``grad``: a
    gradient will be needed): ``backend`` "torch" never, "auto" for CUDA tensors the kernels can take (a warning once
    per reason otherwise), "triton" always (ImportError when fla-core does not import, ValueError when the call does
    not fit the kernels)."""
    check_backend(backend)
    if backend == "torch" or (backend == "auto" and q.device.type not in _AUTO_DEVICES):
        note_backend(op, "torch")
        return False
    reason = kernel_reason(q, v, kernel, grad)
    if reason is None:
        note_backend(op, "fla")
        return True
    if backend == "triton":
        error = ImportError if reason.startswith("fla-core cannot") else ValueError
        raise error(f"backend: 'triton' cannot run {op}: {reason}")
    _warn_once(op, reason)
    note_backend(op, "torch")
    return False


def operand_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The kernels' operand dtype for inputs of ``dtype``: fp16 and bf16 as they are, fp32 as fp16 (more mantissa
    than bf16; the gated sums are scaled into its range). ``device`` is kept for callers; it changes nothing."""
    return dtype if dtype in _HALF else torch.float16


# --- layout: linvision's (B, H, N, X) as fla's (B * H, N, 1, X), heads folded into the batch ---

def _fla(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, H, N, X) -> contiguous (B * H, N, 1, X) in ``dtype`` (one copy at most). ``Tensor.to`` returns a
    tensor already in ``dtype`` as it is, strides and all, whatever ``memory_format`` asks: that case is made
    contiguous on its own (heads split off the channels, a reversed scan's inputs)."""
    b, h, n, c = x.shape
    x = x.to(dtype=dtype, memory_format=torch.contiguous_format) if x.dtype != dtype else x.contiguous()
    return x.view(b * h, n, 1, c)


def _operand(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in the operand dtype, contiguous when converted (one copy; :func:`_fla` then copies nothing more)."""
    return x.to(dtype=dtype, memory_format=torch.contiguous_format)


def _gate(log_gate: Tensor) -> Tensor:
    """(B, H, N, G) fp32 log-gates -> (B * H, N, 1) for per-head gates, (B * H, N, 1, G) per key channel."""
    b, h, n, g = log_gate.shape
    x = log_gate.contiguous().view(b * h, n, 1, g)
    return x[..., 0] if g == 1 else x


def _state(s: Optional[Tensor]) -> Optional[Tensor]:
    """(B, H, K, V) -> fp32 (B * H, 1, K, V)."""
    return None if s is None else s.float().contiguous().view(-1, 1, *s.shape[-2:])


def _run(name: str, q: Tensor, k: Tensor, v: Tensor, extra: Tensor, s0: Optional[Tensor], want_state: bool
         ) -> Tuple[Tensor, Optional[Tensor]]:
    """One fla call on (B, H, N, .) tensors already in the operand dtype; ``extra`` the gate or beta in fla's
    layout. Returns (o (B, H, N, V) in the operand dtype, final state (B, H, K, V) fp32 or None)."""
    b, h, n, _ = q.shape
    kwargs = dict(scale=1.0, initial_state=_state(s0), output_final_state=want_state)
    o, s = _kernel(name)(*(_fla(t, q.dtype) for t in (q, k, v)), extra, **kwargs)
    o = o.view(b, h, n, v.shape[-1])
    return o, None if s is None else s.view(b, h, *s.shape[-2:])


def _shift(x: Tensor) -> Tensor:
    """x_{t+1} at t along dim 2, zero at the end: the reversed scan's queries moved one token on."""
    return F.pad(x[:, :, 1:], (0, 0, 0, 1))


def _unshift(x: Tensor, flip: "Reversal") -> Tensor:
    """The reversed scan's reads back in raster order: read t of the reversed sequence is token L - 2 - t's (L the
    sample's length, N without lengths), and the sample's last token (and its padding) reads nothing."""
    out = _shift(flip(x))
    if flip.valid is not None:  # token i reads read L - 2 - i only while i + 1 < L
        out = out.masked_fill(~_shift(flip.valid), 0)
    return out


def _pow2_inverse(x: Tensor) -> Tensor:
    """2^-ceil(log2 x) for x > 0: the power of two p with p * x in (1/2, 1]; no gradient."""
    return torch.exp2(-torch.ceil(torch.log2(x.detach())))


def _pad_even(x: Tensor) -> Tensor:
    """A zero channel more when the last dim is odd (fla's backward takes even widths); exact."""
    return F.pad(x, (0, x.shape[-1] % 2))


# --- gated and decay forms ---

def decayed_counts(log_gate: Tensor, count0: Optional[Tensor] = None, backward: bool = False,
                   valid: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-channel decayed token counts of log-gates (B, H, N, G), float64: the forward scan's
    c_i = sum_{j <= i} exp(C_i - C_j) (+ exp(C_i) count0, count0 (B, H, G)) with C the cumulative log-gate, and with
    ``backward`` the reversed scan's, token i left out: sum_{j > i} exp(C_{j-1} - C_{i-1}), over the real tokens j
    only when ``valid`` (B, 1, N, 1) marks them (padding after them). Both from logcumsumexp, with no exp of a
    positive number; differentiable."""
    # the scans run over the last dim of a (B, H, G, N) copy: CUDA scans a dim that is not the last one column by
    # column, each column's N steps in one thread (on an H200 the forward of bidir_gated took 243 ms at N=262,144,
    # 1 µs per token and scan, against 2.3 ms for linear_rope); over the last dim a block scans a row in parallel
    g = log_gate.double().transpose(2, 3)
    cum = g.cumsum(-1)
    fwd = torch.exp(cum + torch.logcumsumexp(-cum, -1))
    if count0 is not None:
        fwd = fwd + cum.exp() * count0.double().unsqueeze(-1)
    if not backward:
        return fwd.transpose(2, 3), None
    prev = cum - g  # C_{i-1}
    terms = prev if valid is None else prev.masked_fill(~valid.transpose(2, 3), -1e30)  # finite: no NaN in the grad
    after = torch.logcumsumexp(terms.flip(-1), -1).flip(-1)  # log sum_{j >= i} exp(C_{j-1})
    return fwd.transpose(2, 3), F.pad(torch.exp(after[..., 1:] - prev[..., :-1]), (0, 1)).transpose(2, 3)


def _gated_operands(phi_q: Tensor, phi_k: Tensor, v: Tensor, normalize: bool, top_count: Tensor
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Scaled queries and keys, the value columns (with the denominator's ones column when normalised) and the
    scales (per-token query scale (B, H, N, 1), per-head key scale (B, H, 1, 1)), all fp32."""
    key_scale = _pow2_inverse(top_count.float()).view(*top_count.shape[:2], 1, 1)
    query_scale = _pow2_inverse(phi_q.abs().sum(-1, keepdim=True).clamp_min(2.0 ** -100))
    if normalize:
        v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    return phi_q * query_scale, phi_k * key_scale, _pad_even(v), query_scale, key_scale


def gated_kernel(log_gate: Tensor) -> str:
    """fla's kernel for log-gates (B, H, N, G): one gate per head, or per key channel."""
    return "simple_gla" if log_gate.shape[-1] == 1 else "gla"


def _gated_output(out: Tensor, dv: int, normalize: bool, eps: float, count: Optional[Tensor], scale: Tensor
                  ) -> Tensor:
    """fp32 result from the kernels' scaled sums: num / (den + eps c scale), or out / scale."""
    out = out.float()
    if normalize:
        return out[..., :dv] / (out[..., dv] + eps * count * scale[..., 0]).unsqueeze(-1)
    return out[..., :dv] / scale


def gated_scan(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Tensor, *, dtype: torch.dtype, normalize: bool, eps: float,
    s0: Optional[Tensor] = None, z0: Optional[Tensor] = None, count0: Optional[Tensor] = None,
    return_state: bool = False,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The causal gated scan on fla's kernels. Features phi_q, phi_k (B, H, N, D) and v (B, H, N, Dv) and log-gates
    (B, H, N, G) in fp32; ``dtype`` the inputs' dtype (for :func:`operand_dtype`); s0 (B, H, D, Dv), z0 (B, H, D),
    count0 (B, H, G): the state entering (z0 and count0 only when normalised).
    Returns (o (B, H, N, Dv) fp32, s, z, count), the final state's parts (None unless ``return_state``)."""
    dv = v.shape[-1]
    counts, _ = decayed_counts(log_gate if normalize else log_gate.detach(), count0)
    top = counts.detach().amax(dim=(2, 3))
    if s0 is not None:  # the entering state's own size counts too
        top = torch.maximum(top, s0.detach().abs().amax(dim=(2, 3)).double())
    q, k, vv, q_scale, k_scale = _gated_operands(phi_q, phi_k, v, normalize, top)
    if s0 is not None:
        if normalize:
            s0 = torch.cat([s0, z0.unsqueeze(-1)], dim=-1)
        s0 = _pad_even(s0) * k_scale
    op_dtype = operand_dtype(dtype, phi_q.device)
    out, s = _run(gated_kernel(log_gate), *(_operand(t, op_dtype) for t in (q, k, vv)), _gate(log_gate), s0,
                  return_state)
    count = counts.mean(-1).float() if normalize else None
    o = _gated_output(out, dv, normalize, eps, count, q_scale * k_scale)
    if not return_state:
        return o, None, None, None
    s = s / k_scale
    if not normalize:
        return o, s[..., :dv], None, None
    return o, s[..., :dv], s[..., dv], counts[:, :, -1].float()


def bidirectional_gated(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Tensor, *, dtype: torch.dtype,
                        normalize: bool, eps: float, flip: "Reversal") -> Tensor:
    """The bidirectional gated form of :func:`linvision.ops.bidirectional_gated_linear_attention` on fla's kernels:
    both scans as one call over 2B sequences, the backward one in ``flip``'s order (a :class:`.scan.Reversal`:
    with per-sample lengths each sample's real tokens reversed, its padding after them, so that padding, the last
    tokens of both scans, never reaches a real token). Arguments as :func:`gated_scan`; returns (B, H, N, Dv)
    fp32, its padding to be discarded by the caller."""
    b, dv = phi_q.shape[0], v.shape[-1]
    fwd, bwd = decayed_counts(log_gate if normalize else log_gate.detach(), backward=True, valid=flip.valid)
    counts = fwd + bwd
    top = (counts if flip.valid is None else counts.masked_fill(~flip.valid, 0)).detach().amax(dim=(2, 3))
    q, k, vv, q_scale, k_scale = _gated_operands(phi_q, phi_k, v, normalize, top)
    op_dtype = operand_dtype(dtype, phi_q.device)
    gate_b = flip(log_gate)
    # reversed order: token i's query, times its own gate, reads the state after token i + 1
    q_b = _shift(flip(q) * gate_b.exp())
    out, _ = _run(
        gated_kernel(log_gate),
        torch.cat([q.to(op_dtype), q_b.to(op_dtype)]),
        torch.cat([k.to(op_dtype), flip(k).to(op_dtype)]),
        torch.cat([vv.to(op_dtype), flip(vv).to(op_dtype)]),
        _gate(torch.cat([log_gate, gate_b])), None, False,
    )
    both = out[:b].float() + _unshift(out[b:].float(), flip)
    return _gated_output(both, dv, normalize, eps, counts.mean(-1).float() if normalize else None,
                         q_scale * k_scale)


# --- delta rule ---

def delta_scan(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, *, dtype: torch.dtype,
               s0: Optional[Tensor] = None, return_state: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """The causal delta rule on fla's kernels: features (B, H, N, D) (already L2-normalised where wanted), v
    (B, H, N, Dv), beta (B, H, N) in fp32, s0 (B, H, D, Dv) or None. Returns (o fp32, final state or None)."""
    op_dtype = operand_dtype(dtype, phi_q.device)
    b, h, n = beta.shape
    out, s = _run("delta_rule", _operand(phi_q, op_dtype), _operand(phi_k, op_dtype), _operand(v, op_dtype),
                  beta.contiguous().view(b * h, n, 1), s0, return_state)
    return out.float(), s


def bidirectional_delta(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, *, dtype: torch.dtype,
                        flip: "Reversal") -> Tensor:
    """The bidirectional delta rule of :func:`linvision.ops.bidirectional_delta_rule_attention` on fla's kernels,
    both scans as one call over 2B sequences, the backward one in ``flip``'s order (as for
    :func:`bidirectional_gated`). Arguments as :func:`delta_scan`; returns (B, H, N, Dv) fp32, its padding to be
    discarded by the caller."""
    op_dtype = operand_dtype(dtype, phi_q.device)
    b, h, n = beta.shape
    q, k, vv = (_operand(t, op_dtype) for t in (phi_q, phi_k, v))
    beta_b = flip(beta.unsqueeze(-1)).squeeze(-1)
    # reversed order: token i's query reads the state after token i + 1
    out, _ = _run(
        "delta_rule", torch.cat([q, _shift(flip(q))]), torch.cat([k, flip(k)]), torch.cat([vv, flip(vv)]),
        torch.cat([beta, beta_b]).contiguous().view(2 * b * h, n, 1), None, False,
    )
    return out[:b].float() + _unshift(out[b:].float(), flip)
