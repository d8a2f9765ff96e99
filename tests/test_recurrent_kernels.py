"""The decay, gated and delta-rule recurrences on fla-core's kernels (``backend="triton"``) against the PyTorch path and
per-token float64 loops: outputs, gradients and final states, the bidirectional forms built from causal scans, the
fp32 policy, the dispatch, and a linhier_delta model on the kernel path.

Without a GPU fla's Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), in fp16 (the
interpreter's bf16 arithmetic is not the GPU's); two things the interpreter lacks are bridged here, in the test set-up
only: a benchmarker for the autotuner (each autotuned kernel gets one configuration) and a loop index with ``.to``
(``for i_t in range(NT)`` gives Python ints there)."""
import builtins
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from linvision.ops import (
    RecurrentState,
    bidirectional_delta_rule_attention,
    bidirectional_gated_linear_attention,
    decay_linear_attention,
    delta_rule_attention,
    gated_linear_attention,
    record_backends,
)
from linvision.ops.recurrent import kernels as recurrent_kernels
from support import elu_phi, naive_delta, naive_gated

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:Triton is not supported on current platform"),
]
pytest.importorskip("triton")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla says once that it found no GPU
    pytest.importorskip("fla.ops.delta_rule", reason="fla-core is not installed (pip install 'linvision[kernels]')")
    import fla.ops.gla  # noqa: E402,F401
    import fla.ops.simple_gla  # noqa: E402,F401  (imported here, so that the bridge below reaches their kernels)

EPS = 1e-4
# Largest error relative to the largest reference value, fp16 operands against float64 on the same (fp16) inputs.
TOL_OUT, TOL_GRAD = 3e-3, 1e-2


class _Index(int):
    """A loop index as the compiled kernels see it (``i_t.to(tl.int64)`` is a no-op on a Python int)."""

    def to(self, *args, **kwargs):
        return self


def _interpreter_range(*args):
    return [_Index(i) for i in builtins.range(*args)]


@pytest.fixture(scope="module", autouse=True)
def interpreter_bridge():
    """Under TRITON_INTERPRET=1: one configuration per autotuned fla kernel (the interpreter has no benchmarker) and
    a ``range`` of indices with ``.to`` in fla's kernel modules; undone after this module."""
    if not INTERPRET:
        yield
        return
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    undo, seen = [], set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("fla."):
            continue
        has_kernels = False
        for value in list(vars(module).values()):
            while isinstance(value, KernelInterface) and id(value) not in seen:
                seen.add(id(value))
                has_kernels = True
                if isinstance(value, Autotuner):
                    prune = value.prune_configs
                    value.prune_configs = (lambda prune: lambda kwargs: prune(kwargs)[:1])(prune)
                    undo.append(lambda value=value: vars(value).pop("prune_configs"))
                value = getattr(value, "fn", None)
        if has_kernels and "range" not in vars(module):
            module.range = _interpreter_range
            undo.append(lambda module=module: delattr(module, "range"))
    yield
    for step in undo:
        step()


def _inputs(b=1, h=3, n=100, d=32, dv=32, seed=0, gate=None):
    """float64 q, k, v on the fp16 grid (both paths then see the same inputs), beta in (0, 1) and log-gates
    (None, "head" or "channel"; between log sigmoid(0) and log sigmoid(4))."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, x, generator=g, dtype=torch.float64).half().double() for x in (d, d, dv))
    beta = torch.rand(b, h, n, generator=g, dtype=torch.float64).float().double()
    lg = None
    if gate is not None:
        lg = F.logsigmoid(torch.rand(b, h, n, 1 if gate == "head" else d, generator=g, dtype=torch.float64) * 4)
        lg = lg.float().double()
    return q, k, v, beta, lg


def _rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()  # a kernel's result on the GPU, its reference on the CPU
    return ((x - ref).abs().max() / ref.abs().max()).item()


def _on_device(*tensors):
    """``tensors`` on the device the kernels run on (the GPU; the CPU under the interpreter)."""
    return [t.to(DEVICE) for t in tensors]


def _with_grads(fn, inputs, dtypes, seed=7):
    """fn's output and the gradients of a fixed random projection of it, inputs cast to ``dtypes``."""
    leaves = [t.to(dt).to(DEVICE).requires_grad_() for t, dt in zip(inputs, dtypes)]
    out = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)
    grads = torch.autograd.grad((out.double() * w).sum(), leaves)
    return out.detach().cpu(), [x.cpu() for x in grads]


def _assert_close_to(name, got, want, tol):
    err = _rel(got, want)
    assert err < tol, f"{name}: error {err:.2e} of the largest value, allowed {tol:.0e}"


def naive_bidirectional_gated(q, k, v, lg, normalize=True, eps=EPS):
    """Per-token loops of the bidirectional gated form, float64: forward S_i = diag(g_i) S_{i-1} + phi(k_i)^T v_i read
    at i, backward over the reversed order read before token i's own term, q_i diag(g_i) S'_{i+1}; z and the count
    likewise; the pieces added before dividing."""
    b, h, n, d = q.shape
    gates = lg.exp().expand(b, h, n, lg.shape[-1])

    def scan(order, strict):
        s = q.new_zeros(b, h, d, v.shape[-1])
        z, c = q.new_zeros(b, h, d), q.new_zeros(b, h, gates.shape[-1])
        out = [None] * n
        for t in order:
            g, pk, pq = gates[:, :, t], elu_phi(k[:, :, t]), elu_phi(q[:, :, t])
            s, z, c = g.unsqueeze(-1) * s, g * z, g * c
            if strict:
                out[t] = (torch.einsum("bhd,bhde->bhe", pq, s), (pq * z).sum(-1), c.mean(-1))
            s, z, c = s + pk.unsqueeze(-1) * v[:, :, t].unsqueeze(-2), z + pk, c + 1
            if not strict:
                out[t] = (torch.einsum("bhd,bhde->bhe", pq, s), (pq * z).sum(-1), c.mean(-1))
        return [torch.stack(x, 2) for x in zip(*out)]

    (nf, df, cf), (nb, db, cb) = scan(range(n), False), scan(range(n - 1, -1, -1), True)
    if not normalize:
        return nf + nb
    return (nf + nb) / (df + db + eps * (cf + cb)).unsqueeze(-1)


def naive_bidirectional_delta(q, k, v, beta):
    fwd, _ = naive_delta(q, k, v, beta)
    bwd, _ = naive_delta(q.flip(2), k.flip(2), v.flip(2), beta.flip(2), strict=True)
    return fwd + bwd.flip(2)


HALF = (torch.float16, torch.float16, torch.float16, torch.float32)  # q, k, v and the fp32 gate or beta


@pytest.mark.parametrize("d", [32, 64])
def test_bidirectional_delta_on_kernels(d):
    """The bidirectional delta rule on fla's kernels (one call over the forward and the shifted reversed sequences):
    outputs and gradients of q, k, v and beta against float64 loops and the PyTorch path; N = 100 is not a multiple
    of fla's chunk of 64, three heads, Dv != D."""
    inputs = _inputs(n=100, d=d, dv=d // 2 + 8)[:4]
    out, grads = _with_grads(lambda *t: bidirectional_delta_rule_attention(*t, backend="triton"), inputs, HALF)
    assert out.dtype == torch.float16 and out.shape == inputs[2].shape
    ref, ref_grads = _with_grads(naive_bidirectional_delta, inputs, [torch.float64] * 4)
    torch_out = bidirectional_delta_rule_attention(*(t.to(dt) for t, dt in zip(inputs, HALF)), backend="torch")
    _assert_close_to("output", out, ref, TOL_OUT)
    _assert_close_to("output against the PyTorch path", out, torch_out, TOL_OUT)
    for name, x, y in zip(("q", "k", "v", "beta"), grads, ref_grads):
        _assert_close_to(f"d{name}", x, y, TOL_GRAD)


def _refused_here() -> bool:
    """Whether this GPU and Triton are among those fla refuses the backward of per-head gates on (Hopper with
    Triton >= 3.4, < 3.7.1): there a training call on the kernels is refused in one line before it runs, checked
    here, and the comparisons of its gradients cannot run."""
    if DEVICE != "cuda" or recurrent_kernels.gated_backward_refused(torch.device(DEVICE)) is None:
        return False
    q, k, v = (torch.randn(1, 1, 16, 16, device=DEVICE, dtype=torch.half, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="fla refuses the backward of per-head gates"):
        bidirectional_gated_linear_attention(q, k, v, torch.full((1, 1, 16, 1), -0.1, device=DEVICE), backend="triton")
    return True


@pytest.mark.parametrize("gate,d", [("head", 32), ("head", 64), ("channel", 32),
                                    pytest.param("channel", 64, marks=pytest.mark.slow)])
def test_bidirectional_gated_on_kernels(gate, d):
    """The normalised bidirectional gated form (simple GLA per head, GLA per key channel; the denominator a value
    column, the decayed count from the log-gates): outputs and gradients of q, k, v and the log-gates against
    float64 loops and the PyTorch path."""
    q, k, v, _, lg = _inputs(n=100, d=d, dv=d, gate=gate)
    inputs = (q, k, v, lg)
    if gate == "head" and _refused_here():
        pytest.skip("fla refuses this GPU's per-head gated backward (the refusal was checked)")
    out, grads = _with_grads(lambda *t: bidirectional_gated_linear_attention(*t, backend="triton"), inputs, HALF)
    ref, ref_grads = _with_grads(naive_bidirectional_gated, inputs, [torch.float64] * 4)
    torch_out = bidirectional_gated_linear_attention(*(t.to(dt) for t, dt in zip(inputs, HALF)), backend="torch")
    _assert_close_to("output", out, ref, TOL_OUT)
    _assert_close_to("output against the PyTorch path", out, torch_out, TOL_OUT)
    for name, x, y in zip(("q", "k", "v", "log_gate"), grads, ref_grads):
        _assert_close_to(f"d{name}", x, y, TOL_GRAD)


@pytest.mark.parametrize("form", [pytest.param("delta", marks=pytest.mark.slow), "gated_head",
                                  pytest.param("gated_channel", marks=pytest.mark.slow)])
def test_bidirectional_scans_with_lengths_on_kernels(form):
    """Images of different sizes padded into one batch (``lengths``) on fla's kernels: each sample's backward scan
    runs over its own tokens reversed, the padding (here inf) after them, so each sample's outputs and gradients
    are those of its float64 loops alone, the padding's zero; N = 70, lengths 70, 33 and 1."""
    b, n = 3, 70
    lengths = torch.tensor([70, 33, 1])
    q, k, v, beta, lg = _inputs(b=b, n=n, d=32, dv=24, gate=None if form == "delta" else form.split("_")[1])
    extra = beta if form == "delta" else lg
    if form == "gated_head" and _refused_here():
        pytest.skip("fla refuses this GPU's per-head gated backward (the refusal was checked)")
    pad = torch.arange(n)[None, :] >= lengths[:, None]  # (B, N)
    for t in (q, k, v):
        t.masked_fill_(pad[:, None, :, None], float("inf"))
    if form == "delta":
        op, naive = bidirectional_delta_rule_attention, naive_bidirectional_delta
    else:  # a large eps, so that the decayed counts (each sample's own tokens only) weigh in the output
        op = functools.partial(bidirectional_gated_linear_attention, eps=0.5)
        naive = functools.partial(naive_bidirectional_gated, eps=0.5)
    inputs = (q, k, v, extra)
    out, grads = _with_grads(lambda *t: op(*t, backend="triton", lengths=lengths.to(DEVICE)), inputs, HALF)
    assert not out.masked_select(pad[:, None, :, None]).any()
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    refs = []
    for i, length in enumerate(lengths.tolist()):
        leaves = [t[i:i + 1, :, :length].clone().requires_grad_() for t in inputs]
        ref = naive(*leaves)
        refs.append((ref, torch.autograd.grad((ref * w[i:i + 1, :, :length]).sum(), leaves)))
        _assert_close_to(f"sample {i} output", out[i:i + 1, :, :length], ref, TOL_OUT)
    for j, name in enumerate(("q", "k", "v", "extra")):
        # relative to the batch's largest gradient: a one-token sample's dq is ~eps (o = v up to eps)
        scale = max(ref_grads[j].abs().max().item() for _, ref_grads in refs)
        for i, length in enumerate(lengths.tolist()):
            err = (grads[j][i:i + 1, :, :length].double() - refs[i][1][j]).abs().max().item() / scale
            assert err < TOL_GRAD, f"sample {i} d{name}: error {err:.2e} of the largest value"
            assert not grads[j][i, :, length:].any(), f"sample {i} d{name} at the padding"


def test_bidirectional_gated_unnormalised_and_decay_on_kernels():
    """normalize=False (retention) with per-channel gates, and the fixed decay per head through the bidirectional op
    (the bidir_decay mixer's call), against float64 loops."""
    q, k, v, _, lg = _inputs(b=2, n=70, gate="channel")
    half = _on_device(q.half(), k.half(), v.half())
    out = bidirectional_gated_linear_attention(*half, lg.float().to(DEVICE), normalize=False, backend="triton")
    _assert_close_to("unnormalised", out, naive_bidirectional_gated(q, k, v, lg, normalize=False), TOL_OUT)
    decay = torch.tensor([0.5, 0.9, 1 - 2.0 ** -10], dtype=torch.float64)
    lg = decay.log().view(1, 3, 1)
    out = bidirectional_gated_linear_attention(*half, lg.float().to(DEVICE), backend="triton")
    _assert_close_to("decay", out, naive_bidirectional_gated(q, k, v, lg.unsqueeze(-1)), TOL_OUT)


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_causal_gated_on_kernels_with_state(gate):
    """The causal gated form on the kernels, normalised and not, handing its state from a first to a second part:
    outputs and the final state (S, z, decayed count) against a float64 loop and the PyTorch path."""
    q, k, v, _, lg = _inputs(n=90, gate=gate)
    head, tail = (_on_device(*(t[:, :, part].half() for t in (q, k, v)), lg[:, :, part].float())
                  for part in (slice(0, 40), slice(40, None)))
    for normalize in (True, False):
        ref = naive_gated(q, k, v, lg, normalize)
        first, mid = gated_linear_attention(*head, normalize=normalize, return_state=True, backend="triton")
        second, end = gated_linear_attention(*tail, normalize=normalize, state=mid, return_state=True,
                                             backend="triton")
        _assert_close_to(f"normalize={normalize}", torch.cat([first, second], 2), ref, TOL_OUT)
        _, want = gated_linear_attention(q, k, v, lg, normalize=normalize, return_state=True, backend="torch")
        assert (mid.num_tokens, end.num_tokens) == (40, 90)
        for name in ("s", "z", "count") if normalize else ("s",):
            got = getattr(end, name)
            assert got.dtype == torch.float32
            _assert_close_to(f"state.{name}", got, getattr(want, name), TOL_OUT)


def test_causal_delta_and_decay_on_kernels():
    """The causal delta rule with an entering state and its final state, its gradients, and the decay form, on the
    kernels against float64 loops."""
    q, k, v, beta, _ = _inputs(n=80, d=64, dv=48)
    s0 = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.1
    out, state = delta_rule_attention(*_on_device(q.half(), k.half(), v.half(), beta.float()),
                                      state=RecurrentState(s0.float().to(DEVICE)), return_state=True, backend="triton")
    ref, s_ref = naive_delta(q, k, v, beta, s0=s0)
    _assert_close_to("delta", out, ref, TOL_OUT)
    _assert_close_to("delta state", state.s, s_ref, TOL_OUT)
    out, grads = _with_grads(lambda *t: delta_rule_attention(*t, backend="triton"), (q, k, v, beta), HALF)
    ref, ref_grads = _with_grads(lambda *t: naive_delta(*t)[0], (q, k, v, beta), [torch.float64] * 4)
    for name, x, y in zip(("q", "k", "v", "beta"), grads, ref_grads):
        _assert_close_to(f"d{name}", x, y, TOL_GRAD)
    decay = torch.tensor([0.8, 0.97, 1.0], dtype=torch.float64)
    out = decay_linear_attention(*_on_device(q.half(), k.half(), v.half(), decay), backend="triton")
    lg = decay.log().view(1, 3, 1, 1).expand(1, 3, 80, 1)
    _assert_close_to("decay", out, naive_gated(q, k, v, lg), TOL_OUT)


def test_fp32_inputs_run_with_fp16_operands():
    """fp32 inputs run with fp16 operands, fp32 accumulation and an fp32 result, within the fp16 tolerance of
    float64; under bf16 autocast the same (the ops turn autocast off around themselves) with a bf16 result."""
    q, k, v, beta, lg = _inputs(n=100, gate="head")
    x = _on_device(*(t.float() for t in (q, k, v)))
    out = bidirectional_delta_rule_attention(*x, beta.float().to(DEVICE), backend="triton")
    assert out.dtype == torch.float32
    _assert_close_to("delta fp32", out, naive_bidirectional_delta(q, k, v, beta), TOL_OUT)
    out = bidirectional_gated_linear_attention(*x, lg.float().to(DEVICE), backend="triton")
    assert out.dtype == torch.float32
    _assert_close_to("gated fp32", out, naive_bidirectional_gated(q, k, v, lg), TOL_OUT)
    assert recurrent_kernels.operand_dtype(torch.float32, torch.device(DEVICE)) == torch.float16
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        amp = bidirectional_gated_linear_attention(*x, lg.float().to(DEVICE), backend="triton")
    assert amp.dtype == torch.bfloat16
    torch.testing.assert_close(amp, out.bfloat16(), rtol=0, atol=0)
    assert recurrent_kernels.operand_dtype(torch.bfloat16, torch.device(DEVICE)) == torch.bfloat16


def test_half_precision_range_of_the_gated_sums():
    """Keys and queries are scaled by powers of two so that fp16 sums over 2048 tokens of gates equal to 1 stay
    finite: unscaled, the state (count x phi(k) x v ~ 1e5) and the outputs (~3e6) would overflow fp16."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.rand(1, 1, 2048, 16, generator=g, dtype=torch.float64) * 2 + 1 for _ in range(2))
    v = torch.rand(1, 1, 2048, 16, generator=g, dtype=torch.float64) * 16 + 16
    lg = torch.zeros(1, 1, 1, dtype=torch.float64)  # gamma = 1
    ref = bidirectional_gated_linear_attention(q.half().double(), k.half().double(), v.half().double(), lg,
                                               normalize=False, feature_map="identity", backend="torch")
    assert ref.abs().max() > 1e6  # the output itself is past fp16: the caller's fp16 output saturates
    out = bidirectional_gated_linear_attention(*_on_device(q.float(), k.float(), v.float(), lg.float()),
                                               normalize=False, feature_map="identity", backend="triton")
    _assert_close_to("fp32 result of fp16 operands", out, ref, TOL_OUT)
    out = bidirectional_gated_linear_attention(*_on_device(q.half(), k.half(), v.half(), lg.float()),
                                               feature_map="identity", backend="triton")
    ref = bidirectional_gated_linear_attention(q.half().double(), k.half().double(), v.half().double(), lg,
                                               feature_map="identity", backend="torch")
    assert torch.isfinite(out).all()
    _assert_close_to("normalised fp16", out, ref, TOL_OUT)


def test_dispatch():
    """backend validation, "triton" refusing what the kernels cannot run in one line, "auto" leaving CPU tensors to
    PyTorch without a word (and with a warning, once per reason, for tensors it would send to the kernels)."""
    q, k, v, beta, lg = _inputs(n=20)
    with pytest.raises(ValueError, match="backend: unknown 'cuda'"):
        bidirectional_delta_rule_attention(q, k, v, beta, backend="cuda")
    with pytest.raises(ValueError, match=r"backend: 'triton' cannot run bidirectional_delta_rule_attention: dtype "
                                         r"torch.float64"):
        bidirectional_delta_rule_attention(q, k, v, beta, backend="triton")
    with pytest.raises(ValueError, match="odd"):
        gated_linear_attention(*_on_device(*(t[..., :5].half() for t in (q, k, v)), torch.zeros(1, 3, 20)),
                               backend="triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = bidirectional_delta_rule_attention(q.half(), k.half(), v.half(), beta, backend="auto")  # CPU: PyTorch
    if DEVICE == "cpu":
        torch.testing.assert_close(out, bidirectional_delta_rule_attention(q.half(), k.half(), v.half(), beta,
                                                                           backend="torch"), rtol=0, atol=0)


def test_auto_warns_once_per_reason(monkeypatch):
    """Where "auto" would take the kernels (CUDA tensors; here the test's device), a call they cannot run warns once
    per reason and runs PyTorch; one they can run takes them."""
    monkeypatch.setattr(recurrent_kernels, "_AUTO_DEVICES", (DEVICE,))
    monkeypatch.setattr(recurrent_kernels, "_WARNED", set())
    q, k, v, beta, lg = (t.to(DEVICE) for t in _inputs(n=20, gate="head"))
    with pytest.warns(RuntimeWarning, match="runs this call in PyTorch, not fla's kernels: dtype torch.float64"):
        bidirectional_delta_rule_attention(q, k, v, beta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bidirectional_gated_linear_attention(q, k, v, lg)  # the same reason: no second warning
    calls = []
    monkeypatch.setattr(recurrent_kernels, "bidirectional_delta",
                        lambda *a, **kw: calls.append(1) or torch.zeros(q.shape[:3] + v.shape[-1:]))
    with record_backends() as used:
        bidirectional_delta_rule_attention(q.half(), k.half(), v.half(), beta.float())
    assert calls == [1] and used == {("bidirectional_delta_rule_attention", "fla")}
    with record_backends() as used:  # the fallback of "auto" is recorded as what ran
        bidirectional_delta_rule_attention(q, k, v, beta)
        gated_linear_attention(q, k, v, lg, backend="torch")
    assert used == {("bidirectional_delta_rule_attention", "torch"), ("gated_linear_attention", "torch")}


def test_missing_fla_core(monkeypatch):
    """Without fla-core, "triton" raises ImportError saying what to install, and "auto" falls back."""
    monkeypatch.setattr(recurrent_kernels, "_KERNELS", {})
    monkeypatch.setattr(recurrent_kernels, "_IMPORT_ERROR", [])
    monkeypatch.setitem(sys.modules, "fla.ops.delta_rule", None)  # import of it fails
    q, k, v, beta = (t.to(DEVICE) for t in _inputs(n=10)[:4])
    with pytest.raises(ImportError, match=r"fla-core cannot be imported .*linvision\[kernels\]"):
        bidirectional_delta_rule_attention(q.half(), k.half(), v.half(), beta, backend="triton")


# fla-core 0.6 refuses the backward of per-head gates on Hopper with Triton >= 3.4.0 and < 3.7.1 (kernels.py)
AFFECTED = "Triton 3.6.0 on NVIDIA H200 (compute capability 9.0)"


@pytest.mark.parametrize("version,name,capability,refused", [
    ("3.3.1", "NVIDIA H100 80GB HBM3", (9, 0), False), ("3.4.0rc1", "NVIDIA H100 80GB HBM3", (9, 0), False),
    ("3.4.0", "NVIDIA H100 80GB HBM3", (9, 0), True), ("3.6.0", "NVIDIA H200", (9, 0), True),
    ("3.7.0", "NVIDIA GH200 480GB", (9, 0), True), ("3.7.1", "NVIDIA H100 80GB HBM3", (9, 0), False),
    ("3.7.1+git9f2b1c0", "NVIDIA H100 80GB HBM3", (9, 0), False), ("3.8.0", "NVIDIA H200", (9, 0), False),
    ("3.6.0", "NVIDIA A100-SXM4-80GB", (8, 0), False), ("3.6.0", "NVIDIA B200", (10, 0), False),
    ("3.6.0", "NVIDIA GeForce RTX 4090", (8, 9), False),
])
def test_refuses_gated_backward(version, name, capability, refused):
    """The condition under which fla refuses the backward of per-head gates: Hopper and Triton in [3.4.0, 3.7.1),
    in packaging's version order (a release candidate comes before its release)."""
    assert recurrent_kernels.refuses_gated_backward(version, name, capability) is refused


def test_refuses_gated_backward_agrees_with_fla():
    """For the installed Triton on a Hopper GPU, the condition is fla's own (its flags in fla.utils), and the version
    read from the package metadata is the module's."""
    import triton
    from fla import utils as fla_utils

    assert recurrent_kernels._triton_version() == triton.__version__
    want = fla_utils.TRITON_ABOVE_3_4_0 and not fla_utils.TRITON_ABOVE_3_7_1
    assert recurrent_kernels.refuses_gated_backward(triton.__version__, "NVIDIA H100 80GB HBM3", (9, 0)) is want


@pytest.mark.parametrize("version,want", [("3.6.0", AFFECTED), ("3.8.0", None)])
def test_gated_backward_refused_reads_triton_and_the_gpu(monkeypatch, version, want):
    """On a CUDA device the check reads Triton's version and the device's name and capability (faked here), and
    says which; off CUDA it is None without asking."""
    monkeypatch.setattr(recurrent_kernels, "_triton_version", lambda: version)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: {1: "NVIDIA H200"}[index])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {1: (9, 0)}[index])
    check = recurrent_kernels.gated_backward_refused.__wrapped__  # past the cache
    assert check(torch.device("cuda", 1)) == want
    assert check(torch.device("cpu")) is None
    monkeypatch.setattr(recurrent_kernels, "_triton_version", lambda: None)  # no Triton: fla's import says so
    assert check(torch.device("cuda", 1)) is None


def _affected(monkeypatch, where=AFFECTED):
    """The dispatch as on an affected GPU (``where``: the check's answer for every device; None: unaffected), and
    "auto" taking this test's device; returns a record of the calls of fla's kernels."""
    monkeypatch.setattr(recurrent_kernels, "gated_backward_refused", lambda device: where)
    monkeypatch.setattr(recurrent_kernels, "_AUTO_DEVICES", (DEVICE,))
    monkeypatch.setattr(recurrent_kernels, "_WARNED", set())
    calls = []
    run = recurrent_kernels._run
    monkeypatch.setattr(recurrent_kernels, "_run", lambda name, *a: calls.append(name) or run(name, *a))
    return calls


def test_gated_backward_refusal_dispatch(monkeypatch):
    """Where fla would refuse the backward of per-head gates (faked here): with a gradient to come, "auto" runs
    PyTorch with one warning naming Triton, the GPU and the fix, and "triton" raises a one-line ValueError before
    any kernel runs; per-channel gates and the delta rule keep the kernels."""
    calls = _affected(monkeypatch)
    q, k, v, beta, lg = (t.to(DEVICE) for t in _inputs(n=20, d=16, dv=16, gate="head"))
    x = [t.half().requires_grad_() for t in (q, k, v)]
    reason = recurrent_kernels.kernel_reason(x[0], x[2], "simple_gla", grad=True)
    assert reason.startswith(f"fla refuses the backward of per-head gates with {AFFECTED}")
    assert "install Triton >= 3.7.1" in reason
    with pytest.warns(RuntimeWarning, match=r"not fla's kernels: fla refuses .* Triton 3\.6\.0 on NVIDIA H200"):
        with record_backends() as used:
            out = bidirectional_gated_linear_attention(*x, lg.float())
    assert used == {("bidirectional_gated_linear_attention", "torch")} and calls == []
    ref = bidirectional_gated_linear_attention(*(t.detach() for t in x), lg.float(), backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.float().sum().backward()  # the PyTorch path's backward
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        decay_linear_attention(*x, 0.9)
    for call in (lambda: gated_linear_attention(*x, lg.float(), backend="triton"),
                 lambda: decay_linear_attention(*x, 0.9, backend="triton")):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and message.startswith("backend: 'triton' cannot run gated_linear_attention: ")
        assert AFFECTED in message and "Triton >= 3.7.1" in message
    assert calls == []  # refused before the forward
    channel = F.logsigmoid(torch.randn(1, 3, 20, 16, generator=torch.Generator().manual_seed(3))).to(DEVICE)
    assert recurrent_kernels.kernel_reason(x[0], x[2], "gla", grad=True) is None
    assert recurrent_kernels.kernel_reason(x[0], x[2], "delta_rule", grad=True) is None
    with record_backends() as used:
        gated_linear_attention(*x, channel, backend="auto")
        bidirectional_delta_rule_attention(*x, beta.float())
    assert used == {("gated_linear_attention", "fla"), ("bidirectional_delta_rule_attention", "fla")}
    assert calls == ["gla", "delta_rule"]


def test_gated_backward_refusal_spares_inference(monkeypatch):
    """Without a gradient to come (grad mode off, or no input requiring one) per-head gates keep the kernels on an
    affected GPU (the forward is fine there); with a gradient only through the entering state they do not; and an
    unaffected GPU keeps them with gradients."""
    refused_here = _refused_here()
    calls = _affected(monkeypatch)
    q, k, v, _, lg = (t.to(DEVICE) for t in _inputs(n=20, d=16, dv=16, gate="head"))
    x = [t.half() for t in (q, k, v)]
    leaves = [t.clone().requires_grad_() for t in x]
    assert not recurrent_kernels.needs_grad(*x, lg.float())
    assert recurrent_kernels.kernel_reason(x[0], x[2], "simple_gla", grad=False) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with record_backends() as used:
            bidirectional_gated_linear_attention(*x, lg.float())  # nothing requires a gradient
            with torch.no_grad():
                bidirectional_gated_linear_attention(*leaves, lg.float(), backend="triton")
            with torch.inference_mode():
                gated_linear_attention(*leaves, lg.float(), backend="triton")
    assert used == {("bidirectional_gated_linear_attention", "fla"), ("gated_linear_attention", "fla")}
    assert calls == ["simple_gla"] * 3
    _, state = gated_linear_attention(*x, lg.float(), return_state=True, backend="torch")
    state.s.requires_grad_()
    with pytest.raises(ValueError, match="fla refuses the backward of per-head gates"):
        gated_linear_attention(*x, lg.float(), state=state, backend="triton")
    if refused_here:  # fla's own check refuses the backward on this GPU: the unaffected case cannot be played
        return
    calls = _affected(monkeypatch, where=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with record_backends() as used:
            bidirectional_gated_linear_attention(*leaves, lg.float(), backend="triton").float().sum().backward()
    assert used == {("bidirectional_gated_linear_attention", "fla")} and calls == ["simple_gla"]
    assert all(t.grad is not None for t in leaves)


def test_gated_backward_refusal_spares_vig(monkeypatch):
    """ViG's vig_gla mixers scan with per-channel gates (fla's chunk_gla): a training step of vig_tiny (one block,
    48 wide, 64 px) keeps the kernels where per-head gates would not, without a warning."""
    import timm

    import linvision  # noqa: F401

    calls = _affected(monkeypatch)
    model = timm.create_model("vig_tiny", depth=1, embed_dim=48, num_heads=2, num_classes=10).to(DEVICE)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with record_backends() as used:
            model(x).square().mean().backward()
    assert used == {("gated_linear_attention", "fla")} and set(calls) == {"gla"}
    assert all(p.grad is not None for p in model.parameters())


def test_gated_backward_refusal_in_a_model_as_users_run_it(monkeypatch):
    """On an affected GPU (faked) a bidir_gated ViT as users run it: batch 1, an odd non-square image (7 x 13
    patches), fp16 autocast (the interpreter's bf16 arithmetic is not the GPU's: see the module's docstring). An
    inference_mode forward keeps fla's kernels; the training step after it runs the PyTorch path with one
    warning, its logits those of the kernels' forward within 5% of their largest, and every parameter gets a
    finite gradient."""
    import timm

    import linvision  # noqa: F401

    calls = _affected(monkeypatch)
    model = timm.create_model("linvit_tiny_patch16_224", token_mixer="bidir_gated", class_token=False,
                              global_pool="avg", rope="none", depth=2, dynamic_img_size=True,
                              num_classes=5).to(DEVICE)
    x = torch.randn(1, 3, 7 * 16, 13 * 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    autocast = torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16)
    with record_backends() as used, torch.inference_mode(), autocast:
        first = model(x)
    assert used == {("bidirectional_gated_linear_attention", "fla")} and calls == ["simple_gla"] * 2
    with pytest.warns(RuntimeWarning, match="fla refuses the backward of per-head gates"):
        with record_backends() as used, autocast:
            out = model(x)
    assert used == {("bidirectional_gated_linear_attention", "torch")} and calls == ["simple_gla"] * 2
    assert out.dtype == first.dtype == torch.float16
    torch.testing.assert_close(out.float(), first.float(), rtol=0.05, atol=0.05 * first.float().abs().max().item())
    out.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_fla_refuses_only_the_per_head_gated_backward(monkeypatch):
    """fla's own refusal, made to fire here by setting the flags it reads (Hopper, Triton 3.4 to 3.7.0) with its
    tilelang backend available and switched on: per-head gates raise fla's RuntimeError in the backward, after the
    forward ran (tilelang declines the call: simple_gla's backward keeps its states in fp32), while per-channel gates
    and the delta rule run forward and backward. What kernels.py refuses ahead, and why tilelang is no fix."""
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    for flag, value in (("IS_NVIDIA_HOPPER", True), ("TRITON_ABOVE_3_4_0", True), ("TRITON_ABOVE_3_7_1", False)):
        monkeypatch.setattr(chunk_o, flag, value)
    monkeypatch.setattr(CommonTileLangBackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setenv("FLA_TILELANG", "1")
    monkeypatch.setattr(recurrent_kernels, "gated_backward_refused", lambda device: None)  # let the call through
    q, k, v, beta, lg = (t.to(DEVICE) for t in _inputs(n=20, d=16, dv=16, gate="head"))
    x = [t.half().requires_grad_() for t in (q, k, v)]
    out = gated_linear_attention(*x, lg.float(), backend="triton")
    with pytest.raises(RuntimeError, match=r"Triton >= 3\.4\.0 and < 3\.7\.1 on Hopper GPUs"):
        out.float().sum().backward()
    channel = F.logsigmoid(torch.randn(1, 3, 20, 16, generator=torch.Generator().manual_seed(3))).to(DEVICE)
    gated_linear_attention(*x, channel, backend="triton").float().sum().backward()
    delta_rule_attention(*x, beta.float(), backend="triton").float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x)


def test_cpu_calls_import_no_fla():
    """The PyTorch path never imports fla-core: a CPU call with the default backend, in a fresh process."""
    code = ("import sys, torch; from linvision.ops import bidirectional_delta_rule_attention as f; "
            "x = torch.randn(1, 2, 9, 8); f(x, x, x, torch.rand(1, 2, 9)); import linvision.models; "
            "assert not any(m == 'fla' or m.startswith('fla.') for m in sys.modules), 'fla imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_linhier_delta_on_kernels():
    """linhier_delta_femto_224 (one block per stage) at 64 px in fp32 (fp16 operands), forward and backward, its
    bidir_delta mixers forced onto the kernels, against the same weights on the PyTorch path: every mixer's output
    (head dims 24 and 32, 256 to 4 tokens), the features, the input's gradient and every parameter's gradient. The
    mixers' own parameters sum their gradients over all tokens with much cancellation: measured here, the largest
    normwise error is 2.7% (stage 1's beta weight; with batch 2, 6%, where fp16 operands alone give 2%)."""
    import timm

    import linvision  # noqa: F401

    results = []
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        model = timm.create_model("linhier_delta_femto_224", depths=(1, 1, 1, 1), num_classes=10,
                                  mixer_kwargs=dict(backend=backend)).to(DEVICE)
        mixers = {name: m for name, m in model.named_modules() if type(m).__name__ == "BidirDeltaAttention"}
        assert len(mixers) == 4 and {m.backend for m in mixers.values()} == {backend}
        outputs = {}

        def keep(module, args, out, outputs=outputs):  # the first call's output (the backward recomputes it)
            outputs.setdefault(module, out.detach())  # returns None: the output itself goes on unchanged

        for m in mixers.values():
            m.register_forward_hook(keep)
        x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
        feats = model.forward_features(x)
        w = torch.randn(feats.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        (model.forward_head(feats).square().mean() + (feats * w).mean()).backward()
        outputs = {name: outputs[m] for name, m in mixers.items()}
        results.append((outputs, feats.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}))
    (outputs, feats, x_grad, grads), (ref_outputs, ref_feats, ref_x_grad, ref_grads) = results
    for name in ref_outputs:
        _assert_close_to(f"{name} output", outputs[name], ref_outputs[name], TOL_OUT)
    _assert_close_to("features", feats, ref_feats, 2e-4)  # 1.19e-4 measured on an H200
    _assert_close_to("input gradient", x_grad, ref_x_grad, 1e-3)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ref is not None and ref.norm() > 0 and grads[name] is not None, name
        err = ((grads[name] - ref).norm() / ref.norm()).item()
        assert err < 0.1, f"{name}: gradient error {err:.3f}"


def test_vig_on_kernels():
    """ViG (vig_tiny, one block, 48 wide) at 64 px (16 tokens) in fp32, forward and backward, its vig_gla mixer on
    fla-core's chunk_gla kernels (the path of CUDA tensors) against the same weights on the PyTorch scan: the
    logits, the input's gradient and every parameter's gradient (fp16 operands on the kernels)."""
    import timm

    import linvision  # noqa: F401

    results = []
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        model = timm.create_model("vig_tiny", depth=1, embed_dim=48, num_heads=2, num_classes=10,
                                  mixer_kwargs=dict(backend=backend)).to(DEVICE)
        assert {m.backend for m in model.modules() if type(m).__name__ == "VigGatedAttention"} == {backend}
        x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
        logits = model(x)
        logits.square().mean().backward()
        results.append((logits.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}))
    (logits, x_grad, grads), (ref_logits, ref_x_grad, ref_grads) = results
    _assert_close_to("logits", logits, ref_logits, TOL_OUT)
    _assert_close_to("input gradient", x_grad, ref_x_grad, TOL_GRAD)
    for name, ref in ref_grads.items():
        assert ref is not None and ref.norm() > 0 and grads[name] is not None, name
        err = ((grads[name] - ref).norm() / ref.norm()).item()
        assert err < 0.05, f"{name}: gradient error {err:.3f}"


def test_mixers_and_dit_take_the_backend_option():
    """Every bidir_* mixer and the DiT's self-attention pass ``backend`` on; an unknown one fails at construction."""
    from linvision.diffusion import create_dit
    from linvision.layers import create_mixer

    for name in ("bidir_decay", "bidir_gated", "bidir_delta"):
        assert create_mixer(name, 32, 2, backend="triton").backend == "triton"
        with pytest.raises(ValueError, match="backend"):
            create_mixer(name, 32, 2, backend="fla")
    dit = create_dit("digits", self_attn="bidir_delta", self_attn_options=dict(backend="torch"))
    backends = {m.backend for m in dit.modules() if hasattr(m, "backend") and type(m).__name__.startswith("Bidir")}
    assert backends == {"torch"}


@pytest.mark.slow
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("form", ["delta", "head", "channel"])
def test_longer_sequences_on_kernels(form, d):
    """N = 1000 (16 chunks, the last ragged), two batches, four heads, D 32/64/128: outputs and gradients against
    the PyTorch path in float64 (slow in the interpreter)."""
    q, k, v, beta, lg = _inputs(b=2, h=4, n=1000, d=d, dv=d, gate=None if form == "delta" else form, seed=d)
    if form == "delta":
        fn, inputs = bidirectional_delta_rule_attention, (q, k, v, beta)
    else:
        fn, inputs = bidirectional_gated_linear_attention, (q, k, v, lg)
    out, grads = _with_grads(lambda *t: fn(*t, backend="triton"), inputs, HALF)
    # (chunks of 16 for the reference: per-channel gates form a (chunk, chunk, D) decay tensor per chunk)
    ref, ref_grads = _with_grads(lambda *t: fn(*t, backend="torch", chunk_size=16), inputs, [torch.float64] * 4)
    _assert_close_to("output", out, ref, TOL_OUT)
    for name, x, y in zip(("q", "k", "v", "gate"), grads, ref_grads):
        _assert_close_to(f"d{name}", x, y, TOL_GRAD)


@pytest.mark.slow
def test_fla_kernels_compile_for_hopper():
    """linvision-check-kernels --fla compiles every configuration of fla's kernels that the bidirectional delta rule
    runs (forward and backward, D 32, fp16) for sm_90 without a GPU, and reports each kernel: in a process without
    the interpreter, as a GPU would compile them."""
    from support import command_argv

    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    args = ["--fla", "--form", "bidir_delta", "--d", "32", "--dtype", "float16"]
    result = subprocess.run([*command_argv("linvision-check-kernels"), *args], env=env,
                            capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = {line.split()[1]: line.split() for line in result.stdout.splitlines() if line.startswith("bidir_delta ")}
    assert {"chunk_scaled_dot_kkt_fwd_kernel", "recompute_w_u_fwd_kernel", "chunk_fwd_kernel_o",
            "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
            "chunk_bwd_kernel_dqkwg", "prepare_wy_repr_bwd_kernel"} <= set(rows)
    for name, (form, kernel, d, dtype, configs, spilling, over, *_) in rows.items():
        assert (d, dtype) == ("32", "float16") and int(configs) >= 1 and int(over) == 0, name
