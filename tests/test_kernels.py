"""Fused Triton kernels (``linvision.kernels``) against the float64 reference path.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported), so shapes stay small; the wider sweep is marked slow.
"""
import importlib
import itertools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from linvision.ops import Rope, axial_rope, linear_attention, linear_attention_reference, mixed_rope_freqs, rope_1d
from linvision.ops.rope import rotate_pairs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs a GPU or TRITON_INTERPRET=1"
)
pytestmark = [pytestmark, pytest.mark.cuda]

pytest.importorskip("triton")
import linvision.kernels as kernels  # noqa: E402
from linvision.kernels import la_kernels, la_launch, linear_attention as kernel_module  # noqa: E402
from linvision.kernels.common import DEFAULT_EPS  # noqa: E402
from linvision.kernels import linear_attention_triton, unsupported_reason  # noqa: E402
from linvision.kernels.traffic import count_traffic, minimal_bytes  # noqa: E402
from support import AtenOps  # noqa: E402

# Max error relative to the largest reference value, per input dtype (fp16/bf16: the inputs are rounded to
# that dtype before both paths see them, so this measures the kernels' arithmetic and the output rounding).
TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _rope(kind, n, d, h):
    """A Rope for n tokens: axial with one prefix token where n - 1 factors nicely, or mixed per-head."""
    if kind is None:
        return None
    grids = {1: (0, (1, 1)), 33: (1, (4, 8)), 197: (1, (14, 14)), 1000: (0, (25, 40)), 64: (0, (8, 8))}
    prefix, grid = grids.get(n, (0, (1, n)))
    if kind == "axial":
        return axial_rope(d, grid, num_prefix_tokens=prefix)
    if kind == "mixed":
        fx, fy = mixed_rope_freqs(d, h, generator=torch.Generator().manual_seed(1))
        return Rope(fx, fy, grid, num_prefix_tokens=prefix, offset=(0.5, -2.0))
    return rope_1d(d, n)


def _inputs(b, h, nq, nk, d, dv, dtype, feature, seed=0):
    g = torch.Generator().manual_seed(seed)
    if feature == "identity":  # the caller's features must be non-negative for a meaningful denominator
        q = torch.rand(b, h, nq, d, generator=g) + 0.05
        k = torch.rand(b, h, nk, d, generator=g) + 0.05
    else:
        q = torch.randn(b, h, nq, d, generator=g)
        k = torch.randn(b, h, nk, d, generator=g)
    v = torch.randn(b, h, nk, dv, generator=g)
    do = torch.randn(b, h, nq, dv, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v, do)]


def _rel_err(a, b, floor=1e-3):
    """Max error over the largest reference value (at least ``floor``)."""
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def _check(q, k, v, do, feature, rope=None, split_tokens=0, tol=None):
    """Kernel forward and q, k, v gradients against the float64 reference on the same (rounded) inputs."""
    tol = tol or TOL[q.dtype]
    qk, kk, vk = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = linear_attention_triton(qk, kk, vk, feature, rope=rope, split_tokens=split_tokens)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    grads = torch.autograd.grad(out, (qk, kk, vk), do)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = linear_attention_reference(qr, kr, vr, feature, rope=rope)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.double())
    assert _rel_err(out, ref) < tol
    # dq and dk can be small by cancellation (at N = 1, o = v up to eps): errors are measured against at
    # least a tenth of the largest gradient entry. For dq, whose numerator and denominator terms cancel, the
    # floor is at least the size of the denominator term phi'(q) z (o . dO) / den (float64), which the 16-bit
    # rounding of the numerator's operands is relative to (relu at N = 1: 5.7 against 0.28 for a tenth).
    floor = 0.1 * max(r.abs().max().item() for r in ref_grads)
    floors = {"q": max(floor, _denominator_term(qr, kr, ref, do, feature)), "k": floor, "v": floor}
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == q.dtype
        assert _rel_err(g, r, floors[name]) < 4 * tol, f"d{name}"


def _denominator_term(q, k, o, do, feature):
    """max |phi'(q) z (o . dO) / den|, the part of dq that comes through the denominator (float64, default eps)."""
    q, k, o, do = (t.detach().double() for t in (q, k, o, do))
    phi = {"identity": lambda x: x, "relu": lambda x: x.clamp_min(0), "elu": lambda x: F.elu(x) + 1}[feature]
    dphi = {"identity": torch.ones_like, "relu": lambda x: (x > 0).double(),
            "elu": lambda x: torch.where(x > 0, torch.ones_like(x), torch.exp(x))}[feature]
    z = phi(k).mean(dim=2, keepdim=True)
    den = (phi(q) * z).sum(-1, keepdim=True) + DEFAULT_EPS
    return (dphi(q) * z * (o * do).sum(-1, keepdim=True) / den).abs().max().item()


# (B, H, N, D, Dv, feature map, rope, split_tokens); split_tokens 0 = one split over all tokens.
CASES = [
    (1, 1, 1, 16, 16, "elu", None, 0),
    (2, 3, 33, 16, 24, "relu", "axial", 0),
    (1, 2, 197, 32, 32, "elu", "axial", 0),
    (2, 2, 197, 32, 48, "identity", "mixed", 64),
    (1, 2, 197, 64, 32, "relu", None, 50),  # split shorter than a block and not a multiple of it
    (1, 1, 1000, 64, 64, "elu", "mixed", 256),
    (1, 2, 1000, 16, 40, "identity", None, 300),
]


@pytest.mark.parametrize("b,h,n,d,dv,feature,rope,split", CASES)
def test_matches_reference_fp32(b, h, n, d, dv, feature, rope, split):
    q, k, v, do = _inputs(b, h, n, n, d, dv, torch.float32, feature)
    _check(q, k, v, do, feature, _rope(rope, n, d, h), split)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", [None, "axial"])
def test_matches_reference_half(dtype, rope):
    q, k, v, do = _inputs(1, 2, 197, 197, 32, 24, dtype, "elu")
    _check(q, k, v, do, "elu", _rope(rope, 197, 32, 2), split_tokens=100)


def _phi(x, feature):
    """Feature map and its derivative on fp32 values, as the kernels compute them."""
    if feature == "relu":
        return x.clamp_min(0), (x > 0).to(x.dtype)
    if feature == "elu":
        return torch.where(x > 0, x + 1, x.clamp_max(0).exp()), torch.where(x > 0, 1.0, x.clamp_max(0).exp())
    return x, torch.ones_like(x)


def _split_state(s, dtype, lo=True):
    """What the tensor cores see of an fp32 state (B, H, D, Dv): s c = hi + lo in ``dtype``, c the power of two
    that brings max |s| of each head to 1; returned as (hi + lo) / c in float64 (hi / c without ``lo``: the
    backward's products)."""
    s = s.float()
    m = s.abs().amax(dim=(-2, -1), keepdim=True)
    c = torch.where(m > 0, torch.exp2(-torch.ceil(torch.log2(m.clamp_min(1e-30)))), torch.ones_like(m))
    a = s * c
    hi = a.to(dtype).float()
    rest = (a - hi).to(dtype).double() if lo else 0.0
    return (hi.double() + rest) / c.double()


def _tensor_core_emulation(q, k, v, do, feature, rope=None, eps=1e-4):
    """(o, dq, dk, dv) in float64, before the final rounding to the input dtype, of the 16-bit kernels
    recomputed in PyTorch with exactly their operand roundings: feature maps, rotations and divisions in fp32;
    every tl.dot operand an N-sized tile in the input dtype (rotated features rounded to it, v and dO as given)
    or the fp32 state as its hi + lo split (its hi part in the backward); products and sums exact (float64 here, fp32 accumulation there).
    Like the kernels, the forward keeps S and z as sums over the keys with eps * Nk (the mean form's o) and the
    backward takes their means in fp32."""
    dt, nk = q.dtype, k.shape[2]
    rnd = lambda x: x.to(dt).double()  # noqa: E731 - an fp32 tile rounded to a 16-bit tensor-core operand
    if rope is None:
        rot = inv = lambda x: x  # noqa: E731
    else:
        cos, sin = (t.float().to(q.device) for t in rope.tables())  # the tables are built on the CPU
        rot = lambda x: rotate_pairs(x, cos, sin)  # noqa: E731
        inv = lambda x: rotate_pairs(x, cos, -sin)  # noqa: E731
    (fq, dfq), (fk, dfk) = _phi(q.float(), feature), _phi(k.float(), feature)
    rq, rk = rot(fq), rot(fk)
    vd, dod = v.double(), do.double()
    s = (rk.to(dt).double().transpose(-2, -1) @ vd).float()
    z = fk.double().sum(dim=2).float()
    den = (fq.double() * z[:, :, None].double()).sum(-1, keepdim=True).float().double() + eps * nk
    o = (rnd(rq) @ _split_state(s, dt)) / den
    s, z = (s / nk).double(), (z / nk).double()  # fp32 means
    s_op = _split_state(s, dt, lo=la_kernels.BACKWARD_LO.value)
    den = (fq.double() * z[:, :, None]).sum(-1, keepdim=True).float().double() + eps
    g = (dod @ s_op.transpose(-2, -1)) / den
    dden = -(rq.double() * g).sum(-1, keepdim=True) / den
    dq = (inv(g.float()).double() + dden * z[:, :, None]) * dfq.double()
    ds = rnd(rq * (1 / den.float())).transpose(-2, -1) @ dod / nk
    dz = (dden * fq.double()).sum(dim=2) / nk
    ds_op = _split_state(ds, dt, lo=la_kernels.BACKWARD_LO.value)
    dv = rnd(rk) @ ds_op
    gk = vd @ ds_op.transpose(-2, -1)
    dk = (inv(gk.float()).double() + dz[:, :, None]) * dfk.double()
    return o, dq, dk, dv


def _reference_with_grads(q, k, v, do, feature, rope):
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = linear_attention_reference(qr, kr, vr, feature, rope=rope)
    return (ref, *torch.autograd.grad(ref, (qr, kr, vr), do.double()))


def _assert_emulation_within_tolerances(q, k, v, do, feature, rope):
    """The emulated 16-bit kernels' output and gradients against float64, with the tolerances of _check."""
    dtype = q.dtype
    emulated = [t.to(dtype) for t in _tensor_core_emulation(q, k, v, do, feature, rope)]
    ref = _reference_with_grads(q, k, v, do, feature, rope)
    assert _rel_err(emulated[0], ref[0]) < TOL[dtype]
    floor = 0.1 * max(r.abs().max().item() for r in ref[1:])
    for name, g, r in zip("qkv", emulated[1:], ref[1:]):
        assert _rel_err(g, r, floor) < 4 * TOL[dtype], f"d{name}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,h,n,d,dv,feature,rope", [
    (1, 2, 197, 32, 24, "elu", None),  # the shapes of test_matches_reference_half
    (1, 2, 197, 32, 24, "elu", "axial"),
    (1, 2, 4096, 64, 64, "elu", "axial"),
    (1, 1, 4096, 128, 128, "relu", "mixed"),
    (1, 2, 1000, 64, 64, "identity", None),
])
def test_tensor_core_roundings_meet_the_tolerances(dtype, b, h, n, d, dv, feature, rope):
    """On hardware the tensor cores see 16-bit operands, not the exact fp32 of the interpreter: the op recomputed
    with exactly those operand roundings meets the fp16 / bf16 tolerances against float64."""
    q, k, v, do = (t.cpu() for t in _inputs(b, h, n, n, d, dv, dtype, feature))
    rope = _rope(rope, n, d, h)
    _assert_emulation_within_tolerances(q, k, v, do, feature, rope)


def _store_rounding(x, dtype):
    """float64 values rounded as the interpreter stores them: fp16 to nearest, bf16 toward zero (on hardware both
    round to nearest; the interpreter's fp32 -> bf16 conversion truncates)."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x.to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("feature", ["elu", "relu"])
def test_tensor_core_roundings_at_64k_tokens_with_large_activations(dtype, feature):
    """The setting of test_ops' half-precision test (N = 65536, inputs of scale 30, a 256 x 256 RoPE grid): the
    state is far from 1, which the power-of-two scaling of its hi + lo split absorbs; tolerances hold."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = ((torch.randn(1, 2, 65536, 32, generator=g) * 30).to(dtype) for _ in range(4))
    rope = axial_rope(32, (256, 256))
    _assert_emulation_within_tolerances(q, k, v, do, feature, rope)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_round_operands_as_emulated(dtype):
    """The interpreted kernels (exact products of the operands they form, fp32 sums) agree with the emulation:
    nearly every output element identical after the final rounding, the rest one unit apart. (The same emulation
    without the operand roundings matches 54-71% of the elements here.) So the roundings the emulation asserts
    tolerances for are the kernels' own."""
    q, k, v, do = _inputs(1, 2, 197, 197, 32, 24, dtype, "elu")
    rope = _rope("axial", 197, 32, 2)
    qk, kk, vk = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = linear_attention_triton(qk, kk, vk, "elu", rope=rope, split_tokens=100)
    got = (out, *torch.autograd.grad(out, (qk, kk, vk), do))
    emulated = _tensor_core_emulation(q, k, v, do, "elu", rope)
    for name, a, e in zip(("o", "dq", "dk", "dv"), got, emulated):
        rounded = _store_rounding(e, dtype)
        assert (a == rounded).double().mean() > 0.98, name
        unit = 2 * torch.finfo(dtype).eps * rounded.double().abs() + 1e-3 * e.abs().max()
        assert ((a.double() - rounded.double()).abs() <= unit).all(), name


@pytest.mark.parametrize("shared,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_learnable_rope_frequencies(shared, dtype):
    """Mixed RoPE with learnable frequencies (per head or shared by the heads) trains on the kernels: their
    gradients, summed over queries, keys and the batch, match autograd of the float64 reference."""
    q, k, v, do = _inputs(2, 2, 33, 33, 16, 8, dtype, "elu")
    fx, fy = mixed_rope_freqs(16, 2, generator=torch.Generator().manual_seed(1))
    if shared:
        fx, fy = fx[0], fy[0]
    grads = {}
    for kind, cast in (("kernel", torch.float32), ("reference", torch.float64)):
        fxl, fyl = fx.to(cast).requires_grad_(), fy.to(cast).requires_grad_()
        rope = Rope(fxl, fyl, (4, 8), num_prefix_tokens=1, offset=(0.5, -2.0))
        if kind == "kernel":
            qk, kk, vk = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out = linear_attention_triton(qk, kk, vk, "elu", rope=rope, split_tokens=16)
            grads[kind] = torch.autograd.grad(out, (fxl, fyl, qk), do)
        else:
            qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
            out = linear_attention_reference(qr, kr, vr, "elu", rope=rope)
            grads[kind] = torch.autograd.grad(out, (fxl, fyl, qr), do.double())
    for name, g, r in zip(("freqs_x", "freqs_y", "q"), grads["kernel"], grads["reference"]):
        assert g.shape == r.shape
        assert _rel_err(g, r) < 4 * TOL[dtype], name


def test_programs_past_the_last_span_add_nothing(monkeypatch):
    """On a GPU the output and key kernels get about four programs per SM whatever N is, so at small N the
    trailing programs have no tokens: here 33 programs for 300 tokens in blocks of 64 (5 spans, 28 programs
    empty). Outputs, q, k, v gradients and the learnable frequencies' gradient (added atomically by every key
    program) match the float64 reference as with spans of their own."""
    monkeypatch.setattr(la_launch, "_spans", lambda n, bh, device: la_launch._grid(lambda cfg: 33, bh))
    q, k, v, do = _inputs(1, 2, 300, 300, 16, 8, torch.float32, "elu")
    fx, fy = mixed_rope_freqs(16, 2, generator=torch.Generator().manual_seed(1))
    grads = {}
    for kind, cast in (("kernel", torch.float32), ("reference", torch.float64)):
        fxl, fyl = fx.to(cast).requires_grad_(), fy.to(cast).requires_grad_()
        rope = Rope(fxl, fyl, (15, 20), offset=(0.5, -2.0))
        inputs = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        attend = linear_attention_triton if kind == "kernel" else linear_attention_reference
        out = attend(*inputs, "elu", rope=rope)
        grads[kind] = (out, *torch.autograd.grad(out, (*inputs, fxl, fyl), do.to(cast)))
    for name, g, r in zip(("o", "q", "k", "v", "freqs_x", "freqs_y"), grads["kernel"], grads["reference"]):
        assert _rel_err(g, r) < 4 * TOL[torch.float32], name


def test_no_key_kernel_without_key_or_value_gradients(monkeypatch):
    """Frozen keys and values (no RoPE frequencies to train): the backward runs the query kernel only; dq as the
    reference's."""
    launched = []
    real_run = la_launch._run

    def run(name, *args, **kwargs):
        launched.append(name)
        real_run(name, *args, **kwargs)

    monkeypatch.setattr(la_launch, "_run", run)
    q, k, v, do = _inputs(1, 2, 40, 40, 16, 16, torch.float32, "elu")
    qk = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(linear_attention_triton(qk, k, v, "elu", rope=rope_1d(16, 40)), qk, do)
    assert launched == ["_state_fwd_kernel", "_output_fwd_kernel", "_query_bwd_kernel"]
    qr = q.double().requires_grad_()
    (ref,) = torch.autograd.grad(linear_attention_reference(qr, k.double(), v.double(), "elu", rope=rope_1d(16, 40)),
                                 qr, do.double())
    assert _rel_err(dq, ref) < 4 * TOL[torch.float32]


def test_no_query_gradient_formed_for_frozen_queries(monkeypatch):
    """Queries that need no gradient: the query kernel runs without DQ_GRAD (no dq formed or stored, no dq buffer);
    dk and dv as the reference's, over two token splits."""
    launched = []
    real_run = la_launch._run

    def run(name, *args, **kwargs):
        launched.append((name, kwargs.get("DQ_GRAD")))
        if name == "_query_bwd_kernel":
            assert args[11].numel() == 0  # DQ (after d, dv, grid, Q, DO, S, Z, TAB, VALID, COUNT, POS): no buffer
        real_run(name, *args, **kwargs)

    monkeypatch.setattr(la_launch, "_run", run)
    q, k, v, do = _inputs(1, 2, 40, 40, 16, 16, torch.float32, "elu")
    kk, vk = k.clone().requires_grad_(), v.clone().requires_grad_()
    grads = torch.autograd.grad(linear_attention_triton(q, kk, vk, "elu", rope=rope_1d(16, 40), split_tokens=32),
                                (kk, vk), do)
    assert launched == [("_state_fwd_kernel", None), ("_output_fwd_kernel", None), ("_query_bwd_kernel", False),
                        ("_key_bwd_kernel", None)]
    kr, vr = k.double().requires_grad_(), v.double().requires_grad_()
    refs = torch.autograd.grad(linear_attention_reference(q.double(), kr, vr, "elu", rope=rope_1d(16, 40)), (kr, vr),
                               do.double())
    for name, g, r in zip(("k", "v"), grads, refs):
        assert _rel_err(g, r) < 4 * TOL[torch.float32], name


def test_split_partials_summed_in_the_kernels_and_no_division_launched():
    """Around the kernel launches, the forward and backward implementations (what the custom ops run) do no torch
    arithmetic, with several token splits or one: the last split program of each batch-head sums the partials
    (S, z forward; dS, dz backward) and the 1/Nk of the means is applied inside the kernels. Values as the
    reference's, on repeated calls (the kernels leave their split counters at zero)."""
    arithmetic = {"sum", "div", "mul", "add", "sub", "add_", "div_", "mul_", "mean", "reciprocal"}
    q, k, v, do = _inputs(1, 2, 100, 100, 16, 16, torch.float32, "elu")
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = linear_attention_reference(qr, kr, vr, "elu")
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.double())
    no_rope = (None, None, [0, 1], [0.0, 0.0])
    for split_tokens in (32, 0, 32):  # 4 splits; one split; 4 again
        with AtenOps() as fwd:
            out, s, z = la_launch._forward(q, k, v, "elu", *no_rope, DEFAULT_EPS, split_tokens)
        with AtenOps() as bwd:
            grads = la_launch._backward(q, k, v, do, s, z, "elu", *no_rope, DEFAULT_EPS, split_tokens, False,
                                            True, True)[:3]
        assert len(fwd.names) > 0 and len(bwd.names) > 0  # the mode sees the implementations' torch calls
        assert not set(fwd.names) & arithmetic and not set(bwd.names) & arithmetic, split_tokens
        assert _rel_err(out, ref) < TOL[torch.float32]
        for name, g, r in zip("qkv", grads, ref_grads):
            assert _rel_err(g, r) < 4 * TOL[torch.float32], name
    assert la_launch._COUNTERS and not any(c.any() for c in la_launch._COUNTERS.values())  # left at zero


def test_later_calls_launch_the_chosen_configuration(monkeypatch):
    """The autotuner runs on the first call of a (kernel, head-dim bucket, N bucket, constexprs); a later call of
    the same bucket launches the configuration it chose without it, with the same output."""
    monkeypatch.setattr(la_launch, "_CHOSEN", {})  # as in a fresh process
    monkeypatch.setattr(la_launch, "_AUTOTUNE", True)  # whatever LINVISION_KERNEL_AUTOTUNE says
    q, k, v, _ = _inputs(1, 2, 40, 40, 16, 16, torch.float32, "relu", seed=5)
    first = linear_attention_triton(q, k, v, "relu", split_tokens=16)

    def no_tuning(*args):
        raise AssertionError("autotuner used again")

    monkeypatch.setattr(la_launch, "_tuned", no_tuning)
    torch.testing.assert_close(linear_attention_triton(q, k, v, "relu", split_tokens=16), first, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="autotuner used again"):  # a new N bucket tunes
        linear_attention_triton(*(torch.cat([t, t], dim=2) for t in (q, k, v)), "relu", split_tokens=16)


# What one call of the forward and of the backward implementation does on the host at B=1, H=16, N=4096, D=64 with
# the GPU's 16 token splits: Triton launches and aten ops (allocations and views included), after a first call that
# built the RoPE table. docs/kernels.md ("The host path") has the counts before the caches.
HOST_OPS = {"forward": (["_state_fwd_kernel", "_output_fwd_kernel"], 8),
            "backward": (["_query_bwd_kernel", "_key_bwd_kernel"], 9)}
TABLE_OPS = {"arange", "cos", "sin", "cat", "stack"}


@pytest.mark.parametrize("rope", [False, True])
def test_host_ops_of_one_call(monkeypatch, rope):
    """The launches and aten ops of one forward and one backward call (launches recorded, not run): no more than
    ``HOST_OPS``; the second call with RoPE builds no table. Counts, not times: deterministic on any machine."""
    monkeypatch.setattr(la_launch, "_sm_count", lambda device: 132)
    assert la_launch._split_len(4096, 16, torch.device("cuda"), 0) == 256  # 16 splits, 256 programs
    launched = []
    monkeypatch.setattr(la_launch, "_run", lambda name, *args, **kwargs: launched.append(name))
    q, k, v, do = (torch.randn(1, 16, 4096, 64).bfloat16() for _ in range(4))
    r = axial_rope(64, (64, 64)) if rope else None
    args = (r.freqs_x.reshape(-1, 32), r.freqs_y.reshape(-1, 32), [0, 64]) if rope else (None, None, [0, 1])
    counts = []
    for _ in range(2):
        with AtenOps() as fwd:
            out, s, z = la_launch._forward(q, k, v, "elu", *args, [0.0, 0.0], DEFAULT_EPS, 256)
        with AtenOps() as bwd:
            la_launch._backward(q, k, v, do, s, z, "elu", *args, [0.0, 0.0], DEFAULT_EPS, 256, False, True, True)
        counts.append((fwd.names, bwd.names))
    assert launched == 2 * (HOST_OPS["forward"][0] + HOST_OPS["backward"][0])
    (fwd0, _), (fwd1, bwd1) = counts
    assert (sum(fwd1.values()), sum(bwd1.values())) <= (HOST_OPS["forward"][1], HOST_OPS["backward"][1]), counts[1]
    assert not TABLE_OPS & (set(fwd1) | set(bwd1)), counts[1]  # the table is built once, on the first call
    assert bool(TABLE_OPS & set(fwd0)) == rope


class _DeviceWork(AtenOps):
    """The torch ops of a call that do work on the device, inside the custom ops and the autograd engine included
    (allocations and views left out), and the Triton launches (run in the interpreter; its own torch calls during a
    launch left out)."""

    SHAPE_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "as_strided", "select", "slice",
                  "transpose", "t", "unsqueeze", "squeeze", "expand", "alias", "detach", "unbind"}

    def __init__(self, monkeypatch):
        super().__init__()
        self.launched, self.launching = [], False
        real_run = la_launch._run

        def run(name, *args, **kwargs):
            self.launched.append(name)
            self.launching = True
            try:
                real_run(name, *args, **kwargs)
            finally:
                self.launching = False

        monkeypatch.setattr(la_launch, "_run", run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "linvision":  # look inside the custom ops: their implementations, under this mode
            implementation = {"linear_attention_fwd": la_launch._forward,
                              "linear_attention_bwd": la_launch._backward}[func.overloadpacket.__name__]
            with self:
                return implementation(*args, **(kwargs or {}))
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # reached below autograd: what it decomposes into (nothing for .to of the same dtype)
                return func.decompose(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.launching and name not in self.SHAPE_ONLY:
            self.names[name] += 1
        return func(*args, **(kwargs or {}))

    def take(self):
        """(Triton launches, torch ops with device work) since the last take, the ops as a sorted list."""
        out = (self.launched[:], sorted(self.names.elements()))
        self.launched.clear()
        self.names.clear()
        return out


# A training step's device work (forward, backward) after a first step, by case: Triton launches and torch ops.
STEP_WORK = {
    "plain": ((["_state_fwd_kernel", "_output_fwd_kernel"], []), (["_query_bwd_kernel", "_key_bwd_kernel"], [])),
    "mask": ((["_state_fwd_kernel", "_output_fwd_kernel"], ["sum"]), (["_query_bwd_kernel", "_key_bwd_kernel"], ["sum"])),
    "rope": ((["_state_fwd_kernel", "_output_fwd_kernel"], []), (["_query_bwd_kernel", "_key_bwd_kernel"], [])),
    "mask and positions": ((["_state_fwd_kernel", "_output_fwd_kernel"], ["stack", "sum"]),
                           (["_query_bwd_kernel", "_key_bwd_kernel"], ["stack", "sum"])),
    "learnable rope": ((["_state_fwd_kernel", "_output_fwd_kernel"], []),
                       (["_query_bwd_kernel", "_key_bwd_kernel"], ["sum", "sum"])),
}


@pytest.mark.parametrize("case", list(STEP_WORK))
def test_device_work_of_a_training_step(monkeypatch, case):
    """The device work of one forward and one backward through the public call and the autograd engine (two token
    splits, so the last-split reductions run): the Triton launches and the torch ops that launch anything, exactly
    ``STEP_WORK``, on the second step (the first builds the RoPE table)."""
    q, k, v, do = _inputs(2, 2, 64, 64, 16, 16, torch.bfloat16, "elu")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    options = {}
    if case == "mask":
        options["valid"] = (torch.arange(64) < torch.tensor([[50], [64]])).to(DEVICE)
    elif case == "rope":
        options["rope"] = axial_rope(16, (8, 8), device=DEVICE)
    elif case == "mask and positions":  # a NaFlex batch: each sample's own grid
        q, k, v, do, options["valid"], positions = _masked_batch(2, 2, 64, 16, 16, torch.bfloat16, "elu", prefix=1)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        freqs = (f.to(DEVICE) for f in mixed_rope_freqs(16, 2))
        options["rope"] = Rope(*freqs, (1, 63), num_prefix_tokens=1, positions=positions)
    elif case == "learnable rope":
        fx, fy = (f.to(DEVICE).requires_grad_()
                  for f in mixed_rope_freqs(16, 2, generator=torch.Generator().manual_seed(1)))
        options["rope"] = Rope(fx, fy, (8, 8))
        leaves += [fx, fy]
    with _DeviceWork(monkeypatch) as work:
        for _ in range(2):
            out = linear_attention_triton(*leaves[:3], "elu", split_tokens=32, **options)
            forward = work.take()
            torch.autograd.grad(out, leaves, do)
            backward = work.take()
    assert (forward, backward) == STEP_WORK[case]


def test_rope_table_cached_per_frequencies_and_version(monkeypatch):
    """The RoPE table is built once for a forward and backward and the calls after them; an in-place update of the
    frequencies (an optimizer step) or other frequency tensors build a new one, and the outputs follow the new
    frequencies (float64 reference)."""
    built = []
    real_build = la_launch._build_table
    monkeypatch.setattr(la_launch, "_build_table", lambda *args: built.append(1) or real_build(*args))
    q, k, v, do = _inputs(1, 2, 33, 33, 16, 8, torch.float32, "elu")
    fx, fy = mixed_rope_freqs(16, 2, generator=torch.Generator().manual_seed(1))
    fx, fy = fx.to(DEVICE).requires_grad_(), fy.to(DEVICE).requires_grad_()
    rope = Rope(fx, fy, (4, 8), num_prefix_tokens=1)

    def step():
        qk = q.clone().requires_grad_()
        out = linear_attention_triton(qk, k, v, "elu", rope=rope)
        torch.autograd.grad(out, (qk, fx), do)
        ref = linear_attention_reference(q.double(), k.double(), v.double(), "elu",
                                         rope=Rope(fx.detach().double(), fy.detach().double(), (4, 8), 1))
        assert _rel_err(out, ref) < TOL[torch.float32]

    step()
    step()
    assert len(built) == 1
    with torch.no_grad():
        fx.mul_(1.5)  # a new version: the cached table is stale
    step()
    assert len(built) == 2
    other = Rope(fx.detach().clone(), fy.detach().clone(), (4, 8), num_prefix_tokens=1)
    linear_attention_triton(q, k, v, "elu", rope=other)
    assert len(built) == 3


def test_cross_attention_token_counts_differ():
    """Nq != Nk (no RoPE), with a head dim that is not a power of two."""
    q, _, _, do = _inputs(2, 1, 45, 45, 48, 16, torch.float32, "relu", seed=1)
    _, k, v, _ = _inputs(2, 1, 130, 130, 48, 16, torch.float32, "relu", seed=2)
    _check(q, k, v, do, "relu", split_tokens=64)


def test_strided_inputs():
    """q, k, v as views of a (B, N, H, D) layout and a non-contiguous output gradient."""
    b, n, h, d, dv = 2, 70, 3, 32, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, n, 3, h, d, generator=g).to(DEVICE)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D), stride over N = 3 * H * D
    assert not q.is_contiguous()
    out = linear_attention_triton(q, k, v, "elu")
    assert out.transpose(1, 2).is_contiguous()  # token-major: heads merge back into channels without a copy
    do = torch.randn(b, n, h, dv, generator=g).to(DEVICE).transpose(1, 2)
    _check(q, k, v, do, "elu", None, split_tokens=32)
    _check(q, k, v, do, "elu", rope_1d(d, n), split_tokens=0)


def test_batch_heads_folded_into_the_grid(monkeypatch):
    """B x H beyond the grid-axis limit runs on two grid axes; the programs past B x H store nothing (the
    outputs start as NaN). The limit is lowered to 3 so that 2 x 4 heads need a 3 x 3 grid."""
    monkeypatch.setattr(la_launch, "_MAX_GRID_Y", 3)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    q, k, v, do = _inputs(2, 4, 40, 40, 16, 16, torch.float32, "relu")
    _check(q, k, v, do, "relu", _rope("mixed", 40, 16, 4), split_tokens=16)


def test_zero_query_tokens():
    """Cross attention with no queries: an empty output, and zero gradients for keys and values."""
    q, _, _, do = _inputs(1, 2, 0, 0, 16, 8, torch.float32, "elu")
    _, k, v, _ = _inputs(1, 2, 30, 30, 16, 8, torch.float32, "elu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = linear_attention_triton(q, k, v, "elu")
    assert out.shape == (1, 2, 0, 8)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert dq.shape == q.shape and not dk.any() and not dv.any() and dk.shape == k.shape and dv.shape == v.shape


def test_autocast_runs_in_the_autocast_dtype():
    """fp32 inputs under torch.autocast run (and return) in the autocast dtype, as if given in it."""
    q, k, v, do = _inputs(1, 2, 64, 64, 16, 16, torch.float32, "elu")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = linear_attention_triton(q, k, v, "elu", rope=_rope("axial", 64, 16, 2))
    assert out.dtype == torch.bfloat16
    expected = linear_attention_triton(*(t.bfloat16() for t in (q, k, v)), "elu", rope=_rope("axial", 64, 16, 2))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _spy_launches(monkeypatch, name, capturing, why):
    """Kernel ``name``'s launches recorded (grid, keyword arguments) instead of run, as on a GPU (``capturing``:
    inside CUDA-graph capture); the autotuner fails the test with ``why`` if it is used."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    class NoTuning:
        def __getitem__(self, grid):
            raise AssertionError(why)

    monkeypatch.setattr(la_launch, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(la_kernels, "_JITTED", {name: Recorder()})
    monkeypatch.setattr(la_launch, "_tuned", lambda *args: NoTuning())
    return launches


def test_cuda_graph_capture_launches_a_fixed_configuration(monkeypatch):
    """During CUDA-graph capture the autotuner (which benchmarks) is not used: the first offered configuration
    is launched directly, with its block size in the grid."""
    launches = _spy_launches(monkeypatch, "_key_bwd_kernel", True, "autotuned during capture")
    la_launch._run("_key_bwd_kernel", 128, 64, la_launch._grid(lambda cfg: -(-1000 // cfg["BLOCK_N"]), 6),
                       "args", FEATURE=1)
    bn, warps, stages = la_kernels.offered_configs("_key_bwd_kernel", 128)[0]
    assert launches == [((-(-1000 // bn), 6, 1), dict(FEATURE=1, BLOCK_N=bn, num_warps=warps, num_stages=stages))]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: CUDA graphs")
def test_cuda_graph_replays_a_training_call_on_new_inputs():
    """A forward and backward with 2D RoPE captured in a CUDA graph (as torch.compile's "reduce-overhead" does),
    then replayed on new inputs copied into its buffers: outputs and gradients as an eager call on those inputs
    gives (the capture launches the first offered configurations, eager the autotuned ones: fp32 tolerances)."""
    q, k, v, do = _inputs(2, 2, 300, 300, 32, 32, torch.float32, "elu")
    rope = axial_rope(32, (15, 20), device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first calls (autotuning, the RoPE table) outside the capture
        for _ in range(2):
            torch.autograd.grad(linear_attention_triton(*leaves, "elu", rope=rope), leaves, do)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_attention_triton(*leaves, "elu", rope=rope)
        grads = torch.autograd.grad(out, leaves, do)
    for seed in (1, 2):
        new = _inputs(2, 2, 300, 300, 32, 32, torch.float32, "elu", seed=seed)
        with torch.no_grad():
            for buffer, value in zip([*leaves, do], new):
                buffer.copy_(value)
        graph.replay()
        eager = [t.clone().requires_grad_() for t in new[:3]]
        want = linear_attention_triton(*eager, "elu", rope=rope)
        want_grads = torch.autograd.grad(want, eager, new[3])
        for got, expected in zip([out, *grads], [want, *want_grads]):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_register_cap_reaches_the_launch_inside_its_block_only(monkeypatch):
    """``register_cap`` (the GPU report's sweep): inside the block the capped kernel is compiled with Triton's
    ``maxnreg``, after it without; other kernels never."""
    launches = _spy_launches(monkeypatch, "_query_bwd_kernel", True, "autotuned during capture")
    grid = la_launch._grid(4, 2)
    with la_launch.register_cap("_query_bwd_kernel", 128):
        la_launch._run("_query_bwd_kernel", 64, 64, grid, "args", FEATURE=2)
        assert la_launch._REGISTER_CAPS == {"_query_bwd_kernel": 128}
    la_launch._run("_query_bwd_kernel", 64, 64, grid, "args", FEATURE=2)
    assert [kwargs.get("maxnreg") for _, kwargs in launches] == [128, None]
    assert la_launch._REGISTER_CAPS == {}


def test_autotuning_switched_off_launches_the_first_offered_configuration(monkeypatch):
    """LINVISION_KERNEL_AUTOTUNE=0 (read at import; the GPU report's CUDA tests set it): outside CUDA-graph capture
    too, every launch takes the first offered configuration directly, and the autotuner is never used."""
    launches = _spy_launches(monkeypatch, "_state_fwd_kernel", False, "autotuned with LINVISION_KERNEL_AUTOTUNE=0")
    monkeypatch.setattr(la_launch, "_AUTOTUNE", False)
    monkeypatch.setattr(la_launch, "_CHOSEN", {})
    grid = la_launch._grid(lambda cfg: -(-1000 // cfg["BLOCK_N"]), 6)
    for _ in range(2):
        la_launch._run("_state_fwd_kernel", 64, 64, grid, "args", FEATURE=2)
    bn, warps, stages = la_kernels.offered_configs("_state_fwd_kernel", 64)[0]
    assert launches == 2 * [((-(-1000 // bn), 6, 1), dict(FEATURE=2, BLOCK_N=bn, num_warps=warps, num_stages=stages))]
    assert la_launch._CHOSEN == {}
    code = "import linvision.kernels.la_launch as m; print(m.AUTOTUNE_ENV, m._AUTOTUNE)"
    env = dict(os.environ, LINVISION_KERNEL_AUTOTUNE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["LINVISION_KERNEL_AUTOTUNE", "False"], out.stderr[-2000:]


def test_first_offered_configurations_match_the_reference(monkeypatch):
    """With autotuning off, the first offered configuration of each kernel (forward and backward, RoPE, token
    splits) gives the float64 reference's output and gradients."""
    monkeypatch.setattr(la_launch, "_AUTOTUNE", False)
    monkeypatch.setattr(la_launch, "_tuned", lambda *args: pytest.fail("autotuned"))
    q, k, v, do = _inputs(1, 2, 197, 197, 32, 24, torch.float32, "elu", seed=2)
    _check(q, k, v, do, "elu", rope=_rope("axial", 197, 32, 2), split_tokens=100)


# --- token masks and per-sample RoPE positions (batches of images of different sizes)

def _masked_batch(b, h, n, d, dv, dtype, feature, prefix=1, pad=float("nan")):
    """Inputs of ``b`` images of different grids padded to ``n`` tokens (``prefix`` leading tokens each), the
    padding filled with ``pad`` (the kernels must never read it): (q, k, v, do, valid, positions)."""
    q, k, v, do = _inputs(b, h, n, n, d, dv, dtype, feature, seed=3)
    grids = [(3, 5), (n - prefix, 1), (2, 2), (1, 1)][:b]
    valid = torch.zeros(b, n, dtype=torch.bool, device=DEVICE)
    positions = torch.zeros(b, n - prefix, 2, device=DEVICE)
    for i, (rows, cols) in enumerate(grids):
        m = rows * cols
        valid[i, :prefix + m] = True
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions[i, :m] = torch.stack([r.flatten(), c.flatten()], -1).float()
        for t in (q, k, v):
            t[i, :, prefix + m:] = pad
    return q, k, v, do, valid, positions


@pytest.mark.parametrize("feature,rope,split,dtype", [
    ("elu", None, 0, torch.float32),
    ("relu", "positions", 0, torch.float32),
    ("identity", "positions", 8, torch.float32),  # splits that end inside the padding
    ("elu", "learned positions", 16, torch.float32),
    ("elu", "positions", 0, torch.bfloat16),
])
def test_token_mask_and_positions_match_the_reference(feature, rope, split, dtype):
    """A padded batch (NaN in the padding) with the token mask read in the kernels' token loops, and RoPE at each
    sample's own positions: output and the gradients of q, k, v (and of learnable frequencies) equal the float64
    reference with the same mask; masked queries output 0 and masked tokens get zero gradients."""
    b, h, n, d, dv = 4, 2, 40, 16, 8
    q, k, v, do, valid, positions = _masked_batch(b, h, n, d, dv, dtype, feature)
    fx, fy = mixed_rope_freqs(d, h, generator=torch.Generator().manual_seed(2))
    learn = rope is not None and rope.startswith("learned")
    results = {}
    for kind, cast in (("kernel", dtype), ("reference", torch.float64)):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        freqs = [f.to(DEVICE, torch.float64 if kind == "reference" else torch.float32).requires_grad_(learn)
                 for f in (fx, fy)]
        spec = None if rope is None else Rope(*freqs, (1, n - 1), num_prefix_tokens=1, offset=(0.5, -1.0),
                                              positions=positions)
        if kind == "kernel":
            out = linear_attention_triton(*leaves, feature, rope=spec, split_tokens=split, valid=valid)
        else:
            out = linear_attention_reference(*leaves, feature, rope=spec, valid=valid)
        wrt = leaves + (freqs if learn else [])
        results[kind] = (out, *torch.autograd.grad(out, wrt, do.to(cast)))
    out, ref = results["kernel"][0], results["reference"][0]
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel_err(out, ref) < TOL[dtype]
    assert not out.masked_select(~valid[:, None, :, None]).any()  # masked queries: exactly 0
    names = ["q", "k", "v", "freqs_x", "freqs_y"]
    for name, g, r in zip(names, results["kernel"][1:], results["reference"][1:]):
        assert torch.isfinite(g).all(), name
        floor = 0.1 * r.abs().max().item()
        assert _rel_err(g, r, floor) < 4 * TOL[dtype], name
        if name in "qkv":
            assert not g.masked_select(~valid[:, None, :, None]).any(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_token_mask_and_positions_under_autocast_batch_one_odd_grid(dtype):
    """As users run a NaFlex model: batch 1, one odd non-square image (41 x 97 patches and a class token, 3,978
    tokens, padded to 4,100 with inf; the interpreter's size: test_variable_length runs the PyTorch path at 131k),
    fp32 inputs under autocast, a forward under inference_mode, then one with gradients: the output (in the
    autocast dtype) and the gradients against the float64 reference on the operands autocast gives the kernels
    (bf16-rounded under bf16, the fp32 inputs under fp16)."""
    rows, cols, n = 41, 97, 4100
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(DEVICE) for _ in range(3))
    valid = torch.zeros(1, n, dtype=torch.bool, device=DEVICE)
    valid[0, :1 + rows * cols] = True
    for t in (q, k, v):
        t[~valid[:, None, :, None].expand_as(t)] = float("inf")
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    positions = torch.zeros(1, n - 1, 2, device=DEVICE)
    positions[0, :rows * cols] = torch.stack([r.flatten(), c.flatten()], -1).float()
    fx, fy = mixed_rope_freqs(16, 2, generator=torch.Generator().manual_seed(6))
    spec = Rope(fx.to(DEVICE), fy.to(DEVICE), (1, n - 1), num_prefix_tokens=1, positions=positions)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with torch.inference_mode(), torch.autocast(device_type, dtype=dtype):
        first = linear_attention_triton(q, k, v, "elu", rope=spec, valid=valid)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast(device_type, dtype=dtype):
        out = linear_attention_triton(*leaves, "elu", rope=spec, valid=valid)
    assert out.dtype == first.dtype == dtype and torch.equal(out.detach(), first)
    do = torch.randn(out.shape, generator=g).to(DEVICE)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    operand = dtype if dtype == torch.bfloat16 else torch.float32
    ref_leaves = [t.to(operand).double().requires_grad_() for t in (q, k, v)]
    ref = linear_attention_reference(*ref_leaves, "elu", rope=spec, valid=valid)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    assert _rel_err(out, ref) < TOL[dtype]
    assert not out.masked_select(~valid[:, None, :, None]).any()
    for name, gr, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(gr).all(), name
        assert _rel_err(gr, r, 0.1 * r.abs().max().item()) < 4 * TOL[dtype], name


def test_token_mask_with_fewer_queries_than_keys():
    """Cross attention (Nq != Nk): the mask drops keys from the state and the means; every query is computed."""
    q, k, v, do = _inputs(2, 2, 5, 37, 16, 8, torch.float32, "elu")
    valid = torch.arange(37, device=DEVICE)[None, :] < torch.tensor([[20], [37]], device=DEVICE)
    k[0, :, 20:] = float("inf")
    out = linear_attention_triton(q, k, v, "elu", valid=valid)
    ref = linear_attention_reference(q.double(), k.double(), v.double(), "elu",
                                     valid=valid)
    assert _rel_err(out, ref) < TOL[torch.float32]
    alone = linear_attention_reference(q[:1].double(), k[:1, :, :20].double(), v[:1, :, :20].double(), "elu")
    assert _rel_err(out[:1], alone) < TOL[torch.float32]


def test_a_sample_with_no_valid_key_counts_one_as_the_reference_does():
    """A sample whose keys are all masked (cross attention, Nq != Nk): the kernels take its key count as 1 (the
    reference's floor), so its outputs are zero and every gradient finite, as the float64 reference gives; the
    other sample is untouched."""
    q, k, v, do = _inputs(2, 2, 5, 37, 16, 8, torch.float32, "elu")
    valid = torch.arange(37, device=DEVICE)[None, :] < torch.tensor([[0], [23]], device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = linear_attention_triton(*leaves, "elu", valid=valid)
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = linear_attention_reference(*ref_leaves, "elu", valid=valid)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    assert not out[0].any() and _rel_err(out, ref) < TOL[torch.float32]
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert _rel_err(g, r, 0.1 * r.abs().max().item()) < 4 * TOL[torch.float32], name


def test_token_mask_from_linear_attention_reaches_the_kernels():
    """``linear_attention(valid=, backend="triton")`` runs the masked kernels and agrees with backend="torch"."""
    q, k, v, _, valid, positions = _masked_batch(3, 2, 24, 16, 16, torch.float32, "elu", prefix=0, pad=0.0)
    fx, fy = mixed_rope_freqs(16, 2, generator=torch.Generator().manual_seed(4))
    from linvision.ops.rope import rope_at
    rope = rope_at(fx.to(DEVICE), fy.to(DEVICE), positions)
    fused = linear_attention(q, k, v, "elu", rope=rope, valid=valid, backend="triton")
    ref = linear_attention(q, k, v, "elu", rope=rope, valid=valid, backend="torch")
    torch.testing.assert_close(fused, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "identity"])
@pytest.mark.parametrize("rope", [None, "axial"])
def test_epilogue_adds_the_residual_and_gates_in_the_output_pass(dtype, activation, rope):
    """Without gradients the output kernel's epilogue gives (attention + residual) * act(gate) of the float64
    formula, residual and gate read as strided views of token-major tensors (a LePE branch, a gate sliced from a
    wider projection), with no launch of its own; linvision.ops.linear_attention hands it to the kernels there and
    applies it after the attention where a gradient flows, with the same values."""
    from linvision.ops import GATE_ACTIVATIONS

    b, h, n, d, dv = 2, 2, 33, 16, 24
    q, k, v, do = _inputs(b, h, n, n, d, dv, dtype, "elu")
    g = torch.Generator().manual_seed(3)
    residual = torch.randn(b, n, h, dv, generator=g).to(DEVICE, dtype).transpose(1, 2)
    gate = torch.randn(b, n, 2 * h * dv, generator=g).to(DEVICE, dtype)[..., :h * dv].unflatten(-1, (h, dv))
    gate = gate.transpose(1, 2)
    spec = _rope(rope, n, d, h)
    expected = (linear_attention_reference(q.double(), k.double(), v.double(), "elu", rope=spec)
                + residual.double()) * GATE_ACTIVATIONS[activation](gate.double())

    with torch.no_grad(), AtenOps() as ops:
        out = linear_attention(q, k, v, "elu", rope=spec, backend="triton", residual=residual, gate=gate,
                               gate_activation=activation)
    assert out.dtype == dtype and _rel_err(out, expected) < TOL[dtype]
    assert ops.names["linear_attention_fwd"] == 1 and not {"add", "mul", "silu"} & set(ops.names), ops.names
    with torch.no_grad():
        direct = linear_attention_triton(q, k, v, "elu", rope=spec, residual=residual, gate=gate,
                                         gate_activation=activation)
    assert _rel_err(direct, expected) < TOL[dtype]
    # a gradient wanted: the kernels' attention, then the epilogue in PyTorch, differentiable
    qg = q.detach().clone().requires_grad_()
    trained = linear_attention(qg, k, v, "elu", rope=spec, backend="triton", residual=residual, gate=gate,
                               gate_activation=activation)
    assert _rel_err(trained, expected) < TOL[dtype]
    trained.float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    with pytest.raises(ValueError, match="the forward's epilogue runs without gradients"):
        linear_attention_triton(qg, k, v, "elu", residual=residual)


def test_epilogue_inputs_checked_in_one_line():
    q, k, v, _ = _inputs(1, 2, 8, 8, 16, 16, torch.float32, "elu")
    with pytest.raises(ValueError, match=r"residual: expected shape \(1, 2, 8, 16\) \(B, H, Nq, Dv\)"):
        linear_attention(q, k, v, residual=torch.zeros(1, 8, 2, 16))
    with pytest.raises(TypeError, match="gate: expected a floating tensor, got torch.int64"):
        linear_attention(q, k, v, gate=torch.zeros(1, 2, 8, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="gate_activation: unknown 'gelu'; allowed: identity, silu"):
        linear_attention(q, k, v, gate=torch.zeros_like(q), gate_activation="gelu")


def test_every_output_element_written(monkeypatch):
    """Every buffer the launcher allocates (outputs, split partials) starts as NaN; results must be clean."""
    real_empty = torch.empty
    poisoned = []

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            poisoned.append(t.shape)
            t.fill_(float("nan"))
        return t

    q, k, v, do = _inputs(2, 2, 197, 197, 32, 24, torch.float32, "elu")
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    _check(q, k, v, do, "elu", _rope("axial", 197, 32, 2), split_tokens=60)
    assert len(poisoned) >= 7  # o, S and z partials, dq, dS and dz partials, dk, dv


def test_traffic_is_the_minimum():
    """Each kernel touches every element of its N-sized tensors exactly once, masked lanes excluded."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("traffic is counted in the interpreter")
    b, h, n, d, dv, split = 1, 2, 197, 32, 24, 64
    splits = -(-n // split)
    q, k, v, do = _inputs(b, h, n, n, d, dv, torch.float16, "elu")
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    with count_traffic() as fwd:
        out = linear_attention_triton(q, k, v, "elu", split_tokens=split)
    with count_traffic() as bwd:
        out.backward(do)
    state = b * h * (d * dv + d) * 4  # one fp32 (S, z) or (dS, dz)
    # the splits' partials are stored, read back by each batch-head's last split program (from L2 on a GPU) and
    # their sum stored once
    partials = (splits * state, splits * state + state)
    expected = {
        "_state_fwd_kernel": (b * h * n * (d + dv) * 2 + partials[0], partials[1]),
        "_output_fwd_kernel": (b * h * n * d * 2 + state, b * h * n * dv * 2),
        "_query_bwd_kernel": (b * h * n * (d + dv) * 2 + state + partials[0], b * h * n * d * 2 + partials[1]),
        "_key_bwd_kernel": (b * h * n * (d + dv) * 2 + state, b * h * n * (d + dv) * 2),
    }
    got = {t.kernel: (t.bytes_loaded, t.bytes_stored) for t in fwd + bwd}
    assert got == expected
    floor_fwd = minimal_bytes(b, h, n, n, d, dv, 2, backward=False)
    assert sum(t.total for t in fwd) - (2 * splits + 2) * state == floor_fwd


def test_traffic_counter_refuses_an_interpreter_it_does_not_know(monkeypatch):
    """The counter patches the interpreter's load/store; a release that renames their leading parameters gets
    one line naming the Triton version instead of a TypeError deep inside a launch."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("traffic is counted in the interpreter")
    from triton.runtime import interpreter

    def renamed(self, pointers, mask, *args):
        raise AssertionError("never called")

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", renamed)
    with pytest.raises(RuntimeError, match=r"Triton .*create_masked_load.*tested with Triton"):
        with count_traffic():
            pass


def test_dispatch_from_linear_attention(monkeypatch):
    q, k, v, _ = _inputs(1, 2, 40, 40, 16, 16, torch.float32, "elu")
    ref = linear_attention_reference(q, k, v, "elu")
    out = linear_attention(q, k, v, "elu", backend="triton")
    assert _rel_err(out, ref.double()) < TOL[torch.float32]
    if DEVICE == "cpu":  # "auto" keeps CPU tensors on the torch path even when interpreting

        def fail(*args, **kwargs):
            raise AssertionError("auto selected the kernels for CPU tensors")

        monkeypatch.setattr(kernel_module, "linear_attention_triton", fail)
        torch.testing.assert_close(linear_attention(q, k, v, "elu", backend="auto"), ref)


def test_auto_says_once_why_the_kernels_cannot_serve_a_call(monkeypatch):
    """backend="auto" on the kernels' device: kernels where they apply (no warning), PyTorch with one
    RuntimeWarning per reason where they do not, including a failed import of the Triton kernels."""
    dispatch = importlib.import_module("linvision.ops.attention.dispatch")
    monkeypatch.setattr(dispatch, "_AUTO_DEVICES", (DEVICE,))  # CPU tensors stand for CUDA ones when interpreting
    monkeypatch.setattr(dispatch, "_WARNED", set())
    q, k, v, _ = _inputs(1, 2, 24, 24, 16, 16, torch.float32, "elu")
    ref = linear_attention_reference(q.double(), k.double(), v.double(), "elu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = linear_attention(q, k, v, "elu")
    assert _rel_err(out, ref) < TOL[torch.float32]
    for kwargs, reason in ((dict(feature_map="exp"), "feature map 'exp' is not fused"),
                           (dict(causal=True), "causal attention is not fused")):
        with pytest.warns(RuntimeWarning, match=f"backend='auto' runs this call in PyTorch.*{reason}"):
            out = linear_attention(q, k, v, **kwargs)
        torch.testing.assert_close(out, linear_attention(q, k, v, backend="torch", **kwargs), rtol=0, atol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per reason
            linear_attention(q, k, v, **kwargs)
    monkeypatch.delattr(kernels, "linear_attention")
    monkeypatch.setitem(sys.modules, "linvision.kernels.linear_attention", None)  # as if Triton were missing
    with pytest.warns(RuntimeWarning, match="the Triton kernels cannot be imported"):
        out = linear_attention(q, k, v, "elu")
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="backend: 'triton' cannot run this call: the Triton kernels cannot be imported"):
        linear_attention(q, k, v, "elu", backend="triton")


def _reason(q, k, v, feature="elu", rope=None, causal=False):
    return unsupported_reason(q, k, v, feature, rope=rope, causal=causal)


def test_unsupported_reasons(monkeypatch):
    q, k, v, _ = _inputs(1, 1, 8, 8, 16, 16, torch.float32, "elu")
    assert _reason(q, k, v) is None
    assert "causal" in _reason(q, k, v, causal=True)
    assert "'exp' is not fused" in _reason(q, k, v, feature="exp")
    assert "float64" in _reason(q.double(), k.double(), v.double())
    assert "head dim 8 not in 16..128" in _reason(q[..., :8], k[..., :8], v)
    assert "head dim 17 not in" in _reason(q.new_zeros(1, 1, 8, 17), k.new_zeros(1, 1, 8, 17), v)
    assert "head dim 130" in _reason(q.new_zeros(1, 1, 8, 130), k.new_zeros(1, 1, 8, 130), v)
    assert "value head dim 200" in _reason(q, k, v.new_zeros(1, 1, 8, 200))
    many = [t.expand(256, 257, 8, 16) for t in (q, k, v)]  # zero strides: no memory behind them
    assert _reason(*many) is None  # batch x heads beyond 65535 is folded into the grid
    fx, fy = mixed_rope_freqs(16, 1)
    assert _reason(q, k, v, rope=Rope(fx.requires_grad_(), fy, (2, 4))) is None  # learnable: differentiated
    if DEVICE == "cpu":
        monkeypatch.setattr(la_launch, "_INTERPRET", False)
        reason = _reason(q, k, v)
        assert reason == "tensors are on cpu and TRITON_INTERPRET is not set"
        with pytest.raises(ValueError, match="TRITON_INTERPRET is not set"):
            linear_attention(q, k, v, "elu", backend="triton")
        with pytest.raises(ValueError, match="TRITON_INTERPRET is not set"):
            linear_attention_triton(q, k, v, "elu")


def test_forced_backend_raises_and_auto_falls_back():
    q, k, v, _ = _inputs(1, 1, 8, 8, 16, 16, torch.float32, "elu")
    with pytest.raises(ValueError, match="backend: 'triton' cannot run this call: causal"):
        linear_attention(q, k, v, "elu", causal=True, backend="triton")
    with pytest.raises(ValueError, match="'exp' is not fused"):
        linear_attention(q, k, v, "exp", backend="triton")
    torch.testing.assert_close(
        linear_attention(q, k, v, "exp", backend="auto"), linear_attention_reference(q, k, v, "exp")
    )


def test_bad_inputs_raise():
    q, k, v, _ = _inputs(1, 2, 8, 8, 16, 16, torch.float32, "elu")
    with pytest.raises(ValueError, match="head dim 8 not in 16..128"):
        linear_attention_triton(q[..., :8], k[..., :8], v, "elu")
    with pytest.raises(ValueError, match="k: head dim 32 does not match"):
        linear_attention_triton(q, torch.cat([k, k], dim=-1), v, "elu")
    with pytest.raises(ValueError, match="v: 9 tokens"):
        linear_attention_triton(q, k, torch.cat([v, v[:, :, :1]], dim=2), "elu")
    with pytest.raises(ValueError, match="batch and head dims must match"):
        linear_attention_triton(q, k[:, :1], v[:, :1], "elu")
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        linear_attention_triton(q.cpu().numpy(), k, v, "elu")
    with pytest.raises(ValueError, match="rope: table is for 16 tokens"):
        linear_attention_triton(q, k, v, "elu", rope=axial_rope(16, (4, 4)))
    with pytest.raises(ValueError, match="split_tokens: must be an int >= 0"):
        linear_attention_triton(q, k, v, "elu", split_tokens=-1)
    with pytest.raises(ValueError, match="feature_map: unknown name 'gelu'"):
        linear_attention_triton(q, k, v, "gelu")


def test_custom_op_registration():
    q, k, v, _ = _inputs(1, 1, 20, 20, 16, 16, torch.float32, "relu")
    fx, fy = mixed_rope_freqs(16, 1)
    fx, fy = (f.reshape(1, -1).to(DEVICE) for f in (fx, fy))  # the op takes the frequencies on q's device
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), "relu", fx.requires_grad_(), fy, [0, 5],
            [0.0, 0.0], 1e-4, 8, None, None, None, None, 0)
    torch.library.opcheck(
        torch.ops.linvision.linear_attention_fwd.default, args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    # the epilogue (inference): a residual and a SiLU gate, strided views
    residual, gate = (torch.randn(1, 20, 1, 16, device=DEVICE).transpose(1, 2) for _ in range(2))
    args = (q.detach(), k.detach(), v.detach(), "relu", fx.detach(), fy, [0, 5], [0.0, 0.0], 1e-4, 8, None, None,
            residual, gate, 2)
    torch.library.opcheck(torch.ops.linvision.linear_attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_keeps_one_graph():
    q, k, v, do = _inputs(1, 2, 50, 50, 16, 16, torch.float32, "elu")
    rope = rope_1d(16, 50, device=DEVICE)

    def fn(q, k, v):
        return linear_attention(q * 2, k, v, "elu", rope=rope, backend="triton") + 1

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    out = compiled(qc, kc, vc)
    grads = torch.autograd.grad(out, (qc, kc, vc), do)
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    ref = linear_attention_reference(qe * 2, ke, ve, "elu", rope=rope) + 1
    ref_grads = torch.autograd.grad(ref, (qe, ke, ve), do)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    # inference with the epilogue: still one graph, the kernels' output pass adding and gating
    residual, gate = (t.transpose(1, 2) for t in torch.randn(2, 1, 50, 2, 16, device=DEVICE))

    def epilogue(q, k, v):
        return linear_attention(q, k, v, "elu", rope=rope, backend="triton", residual=residual, gate=gate,
                                gate_activation="silu")

    with torch.no_grad():
        out = torch.compile(epilogue, backend="aot_eager", fullgraph=True)(q, k, v)
    ref = (linear_attention_reference(q, k, v, "elu", rope=rope) + residual) * F.silu(gate)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_flop_formula():
    b, h, nq, nk, d, dv = 2, 2, 24, 40, 16, 32
    q, _, _, do = _inputs(b, h, nq, nq, d, dv, torch.float32, "elu")
    _, k, v, _ = _inputs(b, h, nk, nk, d, dv, torch.float32, "elu")
    q.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        out = linear_attention_triton(q, k, v, "elu")
    assert counter.get_total_flops() == 2 * b * h * (nq + nk) * d * dv
    with FlopCounterMode(display=False) as counter:
        out.backward(do)
    assert counter.get_total_flops() == 2 * b * h * 2 * nq * d * dv  # only q needs a gradient: no key kernel
    k.requires_grad_()
    out = linear_attention_triton(q, k, v, "elu")
    with FlopCounterMode(display=False) as counter:
        out.backward(do)
    assert counter.get_total_flops() == 2 * b * h * (2 * nq + 2 * nk) * d * dv


@pytest.mark.slow
@pytest.mark.parametrize(
    "n,d,dv,feature,rope,dtype",
    list(itertools.product(
        [1, 33, 197, 1000], [16, 32, 64], [24], ["identity", "relu", "elu"], [None, "axial", "mixed"],
        [torch.float32, torch.float16],
    )),
)
def test_sweep(n, d, dv, feature, rope, dtype):
    for split in (0, 128):
        q, k, v, do = _inputs(2, 2, n, n, d, dv, dtype, feature, seed=n + d)
        _check(q, k, v, do, feature, _rope(rope, n, d, 2), split)


def test_offered_configurations_are_candidates():
    """Every kernel has configurations for every head dim, all from the candidate space the compile check
    chose them from, and their block sizes divide the split alignment."""
    for name in kernel_module.KERNEL_NAMES:
        for d in (16, 32, 48, 64, 96, 128):
            offered = la_kernels.offered_configs(name, d)
            assert offered and set(offered) <= set(la_kernels.CANDIDATE_CONFIGS), (name, d)
            assert all(la_launch._SPLIT_ALIGN % bn == 0 for bn, _, _ in offered)


def test_compile_check_verdicts():
    """The pass rule of linvision-check-kernels: zero spills, shared memory within 227 KB, and a token loop whose
    16-bit loads are all asynchronous copies (every kernel loops over its tokens)."""
    from linvision.kernels.compile_check import CompileResult, token_loads_pipelined as _token_loads_pipelined

    def result(**kw):
        base = dict(kernel="k", d=64, dtype="bfloat16", rope="on", block_n=64, num_warps=4, num_stages=2,
                    registers=200, spill_bytes=0, shared_bytes=64 * 1024, pipelined=True)
        return CompileResult(**{**base, **kw})

    assert result().ok
    assert not result(spill_bytes=8).ok
    assert not result(shared_bytes=228 * 1024).ok and result(shared_bytes=227 * 1024).ok
    assert not result(pipelined=False).ok
    copy = "%a = ttg.async_copy_global_to_local %p : tensor<64x32x!tt.ptr<bf16>, #b> -> <64x32xbf16>"
    sync = "%b = tt.load %q : tensor<64x32x!tt.ptr<bf16>, #b>"
    loop = "scf.for %i = %lo to %hi {{\n{}\n scf.yield %x"
    assert _token_loads_pipelined(copy + "\n" + loop.format("%c = arith.addf"), "bfloat16")
    assert not _token_loads_pipelined(copy + "\n" + loop.format(sync), "bfloat16")
    assert not _token_loads_pipelined(loop.format("%c = arith.addf"), "bfloat16")
    assert not _token_loads_pipelined(copy, "bfloat16")  # no loop
    # the epilogue's two plain loads (residual and gate) are allowed to it, a third is not
    two = copy + "\n" + loop.format(sync + "\n" + sync)
    assert _token_loads_pipelined(two, "bfloat16", 2) and not _token_loads_pipelined(two, "bfloat16", 1)
    assert not _token_loads_pipelined(loop.format(sync), "bfloat16", 2)  # and at least one copy


# Compiles kernels for an sm_90 target with Triton's bundled ptxas (no GPU needed), in a process without
# TRITON_INTERPRET: GPU-only constraints (dot shapes, types) are checked and the offered configurations of a
# subset are held to the rule above. The full table: linvision-check-kernels (docs/kernels.md).
@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--d", "64", "--dtype", "bfloat16", "--rope", "on"],
    ["--d", "128", "--dtype", "float16", "--rope", "off", "--kernel", "_query_bwd_kernel", "_key_bwd_kernel"],
])
def test_kernels_compile_for_hopper(args):
    from support import command_argv

    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([*command_argv("linvision-check-kernels"), *args], env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.rstrip().endswith(" ok")]
    kernels = args[args.index("--kernel") + 1:] if "--kernel" in args else kernel_module.KERNEL_NAMES
    d = int(args[1])
    from linvision.kernels.compile_check import launch_variants as _launch_variants

    # the query backward also without dq (queries that need no gradient), the output kernel with its epilogue
    assert len(rows) == sum(len(la_kernels.offered_configs(k, d)) * len(_launch_variants(k)) for k in kernels)
    assert any(" (no dq) " in row for row in rows) == ("_query_bwd_kernel" in kernels)
    assert any(" (epilogue) " in row for row in rows) == ("_output_fwd_kernel" in kernels)
