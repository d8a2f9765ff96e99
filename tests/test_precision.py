"""The ops under torch.autocast at the token counts linvision is for, against the same op in float64.

fp32 inputs under autocast: every op turns autocast off around itself (``linvision.ops.common.full_precision``), so
its sums over N tokens, states and normalisers stay fp32 and it returns the autocast dtype. Before, autocast re-ran
the einsums in fp16, and a sum over 131,072 tokens of positive values passed fp16's 65504 (inf, or NaN after a
division). Tolerances are relative to the output's largest value: what remains is the fp16/bf16 rounding of the
result (2^-11 and 2^-8) and fp32's sums."""
import os

import pytest
import torch

from linvision.ops import (
    bidirectional_delta_rule_attention,
    bidirectional_gated_linear_attention,
    causal_linear_attention,
    decay_linear_attention,
    linear_attention,
    linear_attention_step,
    magnitude_aware_linear_attention,
    polarity_linear_attention,
    rank_augmented_linear_attention,
)

AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}
REL_TOL = {"fp16": 2e-3, "bf16": 1.6e-2}


def inputs(n, d=16, dv=16, heads=1, scale=1.0, seed=0):
    """q, k ~ N(0, scale^2), v positive (its sums only grow), fp32, (1, heads, n, .)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g) * scale
    k = torch.randn(1, heads, n, d, generator=g) * scale
    v = torch.rand(1, heads, n, dv, generator=g) + 0.5
    return q, k, v


def check_against_float64(op, amp, *tensors):
    """op(*tensors) under autocast: the autocast dtype, finite, within REL_TOL of op on the float64 tensors."""
    want = op(*(t.double() for t in tensors))
    with torch.autocast("cpu", dtype=AMP[amp]):
        got = op(*tensors)
    assert got.dtype == AMP[amp]
    assert torch.isfinite(got).all()
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < REL_TOL[amp], f"relative error {err:.3g}"


@pytest.mark.parametrize("amp", list(AMP))
def test_noncausal_at_131k_tokens(amp):
    """A 2048 x 1024 image at stride 4: 131,072 tokens (inf under fp16 autocast before)."""
    q, k, v = inputs(131072)
    check_against_float64(lambda q, k, v: linear_attention(q, k, v, "elu"), amp, q, k, v)


@pytest.mark.parametrize("amp", list(AMP))
def test_noncausal_large_activations(amp):
    """Activations of scale 30 at 16,384 tokens (NaN under fp16 autocast before): elu + 1 of 30 and its sums."""
    q, k, v = inputs(16384, scale=30.0, seed=1)
    check_against_float64(lambda q, k, v: linear_attention(q, k, v, "elu"), amp, q, k, v)


@pytest.mark.parametrize("amp", list(AMP))
def test_causal_chunked_and_step(amp):
    """Causal linear attention at 32,768 tokens (NaN under fp16 autocast before), and its step form carrying an fp32
    state: under autocast the output has the autocast dtype and the state stays fp32."""
    q, k, v = inputs(32768, seed=2)
    check_against_float64(lambda q, k, v: causal_linear_attention(q, k, v, "elu"), amp, q, k, v)
    with torch.autocast("cpu", dtype=AMP[amp]):
        out, state = linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, "elu")
    assert out.dtype == AMP[amp] and state.s.dtype == torch.float32


@pytest.mark.parametrize("amp", list(AMP))
def test_recurrences_with_long_memory(amp):
    """The bidirectional gated scan with decay 0.9999 per token at 32,768 tokens (NaN under fp16 autocast before,
    3.5e-3 off in bf16), the causal decay form, and the bidirectional delta rule."""
    q, k, v = inputs(32768, seed=3)
    log_gate = torch.full((1, 1, 32768), float(torch.log(torch.tensor(0.9999))))
    check_against_float64(lambda q, k, v, g: bidirectional_gated_linear_attention(q, k, v, g), amp, q, k, v, log_gate)
    check_against_float64(lambda q, k, v: decay_linear_attention(q, k, v, 0.9999), amp, q, k, v)
    beta = torch.full((1, 1, 32768), 0.5)
    check_against_float64(lambda q, k, v, b: bidirectional_delta_rule_attention(q, k, v, b), amp, q, k, v, beta)


@pytest.mark.parametrize("amp", list(AMP))
def test_attention_variants_with_large_features(amp):
    """PolaFormer's power features of activations of scale 10 (relu(q)^3 past 65504), RALA and MALA at 16,384
    tokens."""
    q, k, v = inputs(16384, scale=10.0, seed=4)
    check_against_float64(lambda q, k, v: polarity_linear_attention(q, k, v, 3.0), amp, q, k, v)
    q, k, v = inputs(16384, seed=5)
    check_against_float64(lambda q, k, v: rank_augmented_linear_attention(q, k, v, "elu"), amp, q, k, v)
    check_against_float64(lambda q, k, v: magnitude_aware_linear_attention(q, k, v, "elu"), amp, q, k, v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("amp", list(AMP))
def test_kernel_path_keeps_features_past_fp16(amp):
    """The fused kernels under autocast with fp32 features past fp16's range (PolaFormer's powers, given to the op
    with the identity map): no fp16 cast of the features (fp32 operands under fp16 autocast, bf16 under bf16), the
    result in the autocast dtype and close to float64 (NaN in fp16 before)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.to(device) for t in inputs(256, scale=10.0, seed=6))
    phi_q, phi_k = torch.relu(q) ** 3, torch.relu(k) ** 3
    assert phi_q.max() > 65504
    want = linear_attention(phi_q.double(), phi_k.double(), v.double(), "identity", backend="torch")
    with torch.autocast(device, dtype=AMP[amp]):
        got = linear_attention(phi_q, phi_k, v, "identity", backend="triton")
    assert got.dtype == AMP[amp] and torch.isfinite(got).all()
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < REL_TOL[amp], f"relative error {err:.3g}"
