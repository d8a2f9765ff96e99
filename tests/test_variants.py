"""PolaFormer, InLine, RALA, MALA and Agent attention: each op against its paper's formula written out with the
N x N weight matrix in float64, the fused-kernel route against the same oracle, half precision at 65k tokens, the
registered mixers in both model families, and their option errors."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from linvision.layers import MixerContext, create_mixer, list_mixers, mixer_accepts
from linvision.ops import axial_rope
from linvision.ops.attention_variants import (
    agent_attention,
    injective_linear_attention,
    magnitude_aware_linear_attention,
    polarity_features,
    polarity_linear_attention,
    rank_augmented_linear_attention,
)
from linvision.ops.rope import apply_rope

VARIANTS = ("pola", "inline", "rala", "mala", "agent")


def _qkv(b=2, h=2, n=36, d=16, dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, h, n, dv or d, generator=g, dtype=dtype)
    return q, k, v


def _elu1(x):
    return torch.where(x > 0, x + 1, torch.exp(x))


# ---- explicit float64 oracles: weights W (B, H, N, N), output W @ V ----

def _pola_oracle(q, k, v, p, eps, rope=None):
    qp, qn, kp, kn = q.clamp(min=0) ** p, (-q).clamp(min=0) ** p, k.clamp(min=0) ** p, (-k).clamp(min=0) ** p
    half = v.shape[-1] // 2
    outs = []
    for q_feat, vv in (((qp, qn), v[..., :half]), ((qn, qp), v[..., half:])):
        fq, fk = torch.cat(q_feat, -1), torch.cat([kp, kn], -1)
        den = fq @ fk.transpose(-1, -2)  # same sign: q+.k+ + q-.k-; opposite: q-.k+ + q+.k-
        num = den if rope is None else apply_rope(fq, rope) @ apply_rope(fk, rope).transpose(-1, -2)
        n = k.shape[2]
        outs.append((num @ vv / n) / (den.sum(-1, keepdim=True) / n + eps))
    return torch.cat(outs, -1)


def _inline_weights(q, k, s):
    n = k.shape[2]
    scores = s * q @ k.transpose(-1, -2)
    return (scores - scores.mean(-1, keepdim=True) + 1) / n


def _rala_oracle(q, k, v, s, eps, rope=None):
    fq, fk = _elu1(q), _elu1(k)
    n = k.shape[2]
    alpha = n * torch.softmax(s * fq.mean(2, keepdim=True) @ fk.transpose(-1, -2), dim=-1)  # (B, H, 1, N)
    den = (fq @ fk.transpose(-1, -2)) * alpha
    num = den if rope is None else (apply_rope(fq, rope) @ apply_rope(fk, rope).transpose(-1, -2)) * alpha
    return (num @ v / n) / (den.sum(-1, keepdim=True) / n + eps)


def _mala_weights(q, k, s, eps, rope=None):
    fq, fk = _elu1(q), _elu1(k)
    n = k.shape[2]
    a = s * fq @ fk.transpose(-1, -2)
    m = a.mean(-1, keepdim=True)
    if rope is not None:
        a = s * apply_rope(fq, rope) @ apply_rope(fk, rope).transpose(-1, -2)
    return ((1 + 1 / (m + eps)) * a - m) / n


def _agent_oracle(q, k, v, hw, agent_grid, s):
    b, h, n, d = q.shape
    (gh, gw), (ah, aw) = hw, agent_grid
    agents = q.reshape(b, h, ah, gh // ah, aw, gw // aw, d).mean(dim=(3, 5)).reshape(b, h, ah * aw, d)
    agent_v = torch.softmax(s * agents @ k.transpose(-1, -2), -1) @ v
    return torch.softmax(s * q @ agents.transpose(-1, -2), -1) @ agent_v


def test_polarity_against_formula():
    q, k, v = _qkv()
    power = 1 + 4 * torch.rand(2, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = polarity_linear_attention(q, k, v, power, backend="torch")
    torch.testing.assert_close(out, _pola_oracle(q, k, v, power, 1e-6), rtol=1e-10, atol=1e-10)
    feats = polarity_features(torch.tensor([[-2.0, 3.0]], dtype=torch.float64), 2.0)
    torch.testing.assert_close(feats, torch.tensor([[0.0, 9.0, 4.0, 0.0]], dtype=torch.float64))


def test_polarity_without_gradients_forms_both_features_in_one_pass():
    """Without gradients the features of q and k are formed together (one division, one set of launches): the
    same outputs, bit for bit, as the path with gradients; ``scale`` divides q and k first, as the layer's learned
    softplus scale does."""
    q, k, v = _qkv()
    power = 1 + 4 * torch.rand(2, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    scale = 0.5 + torch.rand(2, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    graded = polarity_linear_attention(q, k, v, power, backend="torch", scale=scale)
    with torch.no_grad():
        joint = polarity_linear_attention(q, k, v, power, backend="torch", scale=scale)
    assert torch.equal(joint, graded)
    torch.testing.assert_close(graded, _pola_oracle(q / scale, k / scale, v, power, 1e-6), rtol=1e-10, atol=1e-10)


def test_polarity_rope_rotates_the_numerator_of_2d_features():
    q, k, v = _qkv(n=36)
    rope = axial_rope(32, (6, 6))  # 2D = 32 feature channels
    out = polarity_linear_attention(q, k, v, 3.0, rope=rope, backend="torch")
    torch.testing.assert_close(out, _pola_oracle(q, k, v, 3.0, 1e-6, rope=rope), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="rope: polarity attention rotates 32-channel"):
        polarity_linear_attention(q, k, v, 3.0, rope=axial_rope(16, (6, 6)))


def test_inline_against_formula_sums_to_one_and_is_injective():
    q, k, v = _qkv()
    s = 16 ** -0.5
    w = _inline_weights(q, k, s)
    torch.testing.assert_close(injective_linear_attention(q, k, v, backend="torch"), w @ v, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    # linear attention with a positive map gives q and 2q the same weights; InLine does not
    out1 = injective_linear_attention(q, k, v, backend="torch")
    out2 = injective_linear_attention(2 * q, k, v, backend="torch")
    assert (out1 - out2).abs().max() > 1e-3
    rope = axial_rope(16, (6, 6))
    w_rope = _inline_weights(apply_rope(q, rope), apply_rope(k, rope), s)
    torch.testing.assert_close(injective_linear_attention(q, k, v, rope=rope, backend="torch"), w_rope @ v,
                               rtol=1e-10, atol=1e-10)


def test_rala_against_formula():
    q, k, v = _qkv()
    s = 16 ** -0.5
    out = rank_augmented_linear_attention(q, k, v, backend="torch")
    torch.testing.assert_close(out, _rala_oracle(q, k, v, s, 1e-6), rtol=1e-10, atol=1e-10)
    rope = axial_rope(16, (6, 6))
    out = rank_augmented_linear_attention(q, k, v, rope=rope, backend="torch")
    torch.testing.assert_close(out, _rala_oracle(q, k, v, s, 1e-6, rope), rtol=1e-10, atol=1e-10)


def test_mala_against_formula_and_magnitude_awareness():
    q, k, v = _qkv()
    s = 16 ** -0.5
    w = _mala_weights(q, k, s, 1e-6)
    torch.testing.assert_close(magnitude_aware_linear_attention(q, k, v, backend="torch"), w @ v,
                               rtol=1e-10, atol=1e-10)
    m = (s * _elu1(q) @ _elu1(k).mean(2, keepdim=True).transpose(-1, -2)).squeeze(-1)
    torch.testing.assert_close(w.sum(-1), m / (m + 1e-6))  # one up to eps
    # a larger query spreads the weights further (softmax-like), which normalised linear attention cannot
    spread = lambda qq: _mala_weights(qq, k, s, 1e-6).std(-1).mean()  # noqa: E731
    assert spread(3 * q) > 1.5 * spread(q)
    rope = axial_rope(16, (6, 6))
    torch.testing.assert_close(magnitude_aware_linear_attention(q, k, v, rope=rope, backend="torch"),
                               _mala_weights(q, k, s, 1e-6, rope) @ v, rtol=1e-10, atol=1e-10)


def test_agent_against_formula():
    q, k, v = _qkv(n=64)
    out = agent_attention(q, k, v, (8, 8), (4, 2))
    torch.testing.assert_close(out, _agent_oracle(q, k, v, (8, 8), (4, 2), 16 ** -0.5), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="hw: grid"):
        agent_attention(q, k, v, (8, 7))
    with pytest.raises(ValueError, match="agent_grid"):
        agent_attention(q, k, v, (8, 8), (0, 2))


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["pola", "inline", "rala", "mala"])
def test_fused_kernel_route_matches_formula(variant):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = _qkv(b=1, h=2, n=64, d=16)
    rope = axial_rope(32 if variant == "pola" else 16, (8, 8))
    s = 16 ** -0.5
    if variant == "pola":
        expected = _pola_oracle(q, k, v, 3.0, 1e-6, rope)
        fn = lambda *t: polarity_linear_attention(*t, 3.0, rope=rope, backend="triton")  # noqa: E731
    elif variant == "inline":
        expected = _inline_weights(q, k, s) @ v
        fn = lambda *t: injective_linear_attention(*t, backend="triton")  # noqa: E731
    elif variant == "rala":
        expected = _rala_oracle(q, k, v, s, 1e-6, rope)
        fn = lambda *t: rank_augmented_linear_attention(*t, rope=rope, backend="triton")  # noqa: E731
    else:
        expected = _mala_weights(q, k, s, 1e-6, rope) @ v
        fn = lambda *t: magnitude_aware_linear_attention(*t, rope=rope, backend="triton")  # noqa: E731
    inputs = [t.float().to(device).requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-4, atol=2e-4)
    # gradients through the kernels' backward = autograd of the float64 PyTorch route
    grads = torch.autograd.grad(out.square().sum(), inputs)
    inputs64 = [t.clone().requires_grad_() for t in (q, k, v)]
    expected_grads = torch.autograd.grad(_route_torch(variant, rope)(*inputs64).square().sum(), inputs64)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def _route_torch(variant, rope):
    return {"pola": lambda *t: polarity_linear_attention(*t, 3.0, rope=rope, backend="torch"),
            "inline": lambda *t: injective_linear_attention(*t, backend="torch"),
            "rala": lambda *t: rank_augmented_linear_attention(*t, rope=rope, backend="torch"),
            "mala": lambda *t: magnitude_aware_linear_attention(*t, rope=rope, backend="torch")}[variant]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_half_precision_finite_at_65k_tokens(variant, dtype):
    """65,536 tokens (a 256 x 256 grid) with activations of +-30: every accumulation and division is fp32, so the
    half-precision output is finite and matches the fp32 computation of the same inputs."""
    g = torch.Generator().manual_seed(0)
    n, d = 256 * 256, 16
    q, k, v = (30 * torch.randn(1, 1, n, d, generator=g) for _ in range(3))
    fn = {"pola": lambda *t: polarity_linear_attention(*t, 5.0, backend="torch"),
          "inline": lambda *t: injective_linear_attention(*t, backend="torch"),
          "rala": lambda *t: rank_augmented_linear_attention(*t, backend="torch"),
          "mala": lambda *t: magnitude_aware_linear_attention(*t, backend="torch"),
          "agent": lambda *t: agent_attention(*t, (256, 256))}[variant]
    half = [t.to(dtype) for t in (q, k, v)]
    out = fn(*half)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = fn(*(t.float() for t in half))
    # measured: fp16 within 4e-4 and bf16 within 3.1e-3 of the largest output (the output's own rounding)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("name", VARIANTS)
def test_mixers_registered_and_trainable_in_both_families(name):
    from linvision.models.linhier import LinHier
    from linvision.models.linvit import LinViT

    assert name in list_mixers()
    torch.manual_seed(0)
    head = {} if mixer_accepts(name, "prefix_tokens") else dict(class_token=False, global_pool="avg")
    for model in (LinViT(img_size=64, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                         token_mixer=name, **head),
                  LinHier(depths=(1, 1, 1, 1), dims=(16, 32, 32, 32), num_heads=(1, 2, 2, 2), num_classes=3,
                          token_mixers=name)):
        x = torch.randn(2, 3, 64, 64)
        out = model(x)
        assert out.shape == (2, 3) and torch.isfinite(out).all()
        out.square().sum().backward()
        mixer = next(m for m in model.modules() if type(m).__name__ == type(create_mixer(name, 32, 2)).__name__)
        grads = [p.grad for p in mixer.qkv.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_mixer_outputs_match_their_ops():
    torch.manual_seed(0)
    x = torch.randn(2, 36, 32, dtype=torch.float64)
    for name in ("mala", "rala", "inline", "pola"):
        m = create_mixer(name, 32, 2, lepe=False, rope=None).double()
        if name == "rala":
            m.gate = None  # the output modulation
        if name == "inline":
            m.local = None
        q, k, v = m.qkv(x).reshape(2, 36, 3, 2, 16).permute(2, 0, 3, 1, 4)
        if name == "pola":
            div = F.softplus(m.qk_scale)
            attn = _pola_oracle(q / div, k / div, v, m.power(), 1e-6)
        elif name == "inline":
            attn = _inline_weights(q, k, 16 ** -0.5) @ v
        elif name == "rala":
            attn = _rala_oracle(q, k, v, 16 ** -0.5, 1e-6)
        else:
            attn = _mala_weights(q, k, 16 ** -0.5, 1e-6) @ v
        expected = m.proj(attn.transpose(1, 2).reshape(2, 36, 32))
        torch.testing.assert_close(m(x, (6, 6)), expected, rtol=1e-9, atol=1e-9)


def test_inline_local_residual_mixes_the_3x3_neighbourhood():
    torch.manual_seed(0)
    m = create_mixer("inline", 8, 2).double()
    x = torch.randn(1, 16, 8, dtype=torch.float64)
    q, k, v = m.qkv(x).reshape(1, 16, 3, 2, 4).permute(2, 0, 3, 1, 4)
    out = m.attend(q, k, v, None, x, MixerContext((4, 4)))
    weights = m.local(x.transpose(1, 2).reshape(1, 8, 4, 4)).reshape(1, 2, 3, 3, 4, 4)  # (B, heads, dy, dx, H, W)
    vg = F.pad(v.reshape(1, 2, 4, 4, 4), (0, 0, 1, 1, 1, 1))  # (B, heads, H+2, W+2, D)
    local = torch.zeros(1, 2, 4, 4, 4, dtype=torch.float64)
    for i in range(4):
        for j in range(4):
            for dy in range(3):
                for dx in range(3):
                    local[:, :, i, j] += weights[:, :, dy, dx, i, j, None] * vg[:, :, i + dy, j + dx]
    expected = _inline_weights(q, k, 4 ** -0.5) @ v + local.reshape(1, 2, 16, 4)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_rala_modulates_after_lepe_and_rala_premod_before():
    """"rala" (RAVLT's RALA): proj((attention + LePE) * W_o x); "rala_premod" (the form the results page measured):
    proj(attention * W_o x + LePE); the same weights, W_o being rala's gate and rala_premod's modulation. RAVLT's
    RALA stages are "rala" with RAVLT's RoPE; its softmax stages share the one output modulation."""
    from linvision.layers.mixers import OutputModulation, RavltSoftmax
    from linvision.layers.rala import RALAttention, RavltRala

    torch.manual_seed(0)
    m = create_mixer("rala", 16, 2, rope=None).double()
    pre = create_mixer("rala_premod", 16, 2, rope=None).double()
    pre.load_state_dict({k.replace("gate.", "modulation."): t for k, t in m.state_dict().items()})
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    q, k, v = m.qkv(x).reshape(1, 9, 3, 2, 8).permute(2, 0, 3, 1, 4)
    attn = _rala_oracle(q, k, v, 8 ** -0.5, 1e-6).transpose(1, 2).reshape(1, 9, 16)
    lepe = m.lepe(v.transpose(1, 2).reshape(1, 3, 3, 16).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
    mod = m.gate(x)
    torch.testing.assert_close(m(x, (3, 3)), m.proj((attn + lepe) * mod), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pre(x, (3, 3)), m.proj(attn * mod + lepe), rtol=1e-10, atol=1e-10)
    assert issubclass(RavltRala, RALAttention) and issubclass(RavltSoftmax, OutputModulation)
    assert create_mixer("rala", 16, 2, gate=False).gate is None


def test_bad_options_raise_one_line_errors():
    with pytest.raises(ValueError, match="alpha: must be > 0"):
        create_mixer("pola", 32, 2, alpha=0)
    with pytest.raises(ValueError, match="even head dim"):
        create_mixer("pola", 30, 2)
    with pytest.raises(ValueError, match="rope: agent attention takes no RoPE"):
        create_mixer("agent", 32, 2, rope="axial")
    with pytest.raises(ValueError, match="agent_grid"):
        create_mixer("agent", 32, 2, agent_grid=(7,))
    with pytest.raises(ValueError, match="feature_map: unknown"):
        create_mixer("rala", 32, 2, feature_map="tanh")
    for name in ("rala", "mala", "bidir_delta"):  # "none" is no feature map: the allowed ones are named
        with pytest.raises(ValueError, match=r"^feature_map: unknown 'none'; allowed: .*relu") as e:
            create_mixer(name, 32, 2, feature_map="none")
        assert "\n" not in str(e.value)
    # the normalised mixers need phi >= 0; the delta rule (L2-normalised keys, no denominator) takes the identity
    for name in ("linear", "rala", "mala", "bidir_gated"):
        with pytest.raises(ValueError, match="'identity' does not fit this mixer .*nonnegative.*allowed: relu, elu"):
            create_mixer(name, 32, 2, feature_map="identity")
    assert create_mixer("bidir_delta", 32, 2, feature_map="identity").feature_map == "identity"
    for name in ("bidir_delta", "bidir_gated", "bidir_decay"):  # scans: exact per prefix only
        with pytest.raises(ValueError, match="'exp' does not fit this mixer .*causal"):
            create_mixer(name, 32, 2, feature_map="exp")
    # one spelling: every mixer with a feature map takes its aliases and keeps the canonical name
    for name in ("linear", "rala", "mala", "bidir_delta", "bidir_gated"):
        assert create_mixer(name, 32, 2, feature_map="ELU+1").feature_map == "elu", name
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale: must be a positive number"):
        injective_linear_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="power: must be >= 1"):
        polarity_linear_attention(q, k, v, 0.5)
    with pytest.raises(ValueError, match="odd count"):
        polarity_linear_attention(q, k, v[..., :15])
    with pytest.raises(ValueError, match="eps: must be a positive number"):
        magnitude_aware_linear_attention(q, k, v, eps=0.0)
    assert math.isfinite(float(rank_augmented_linear_attention(q, k, v).sum()))


@pytest.mark.parametrize("name", ["linear", "rala", "mala", "hybrid"])
def test_performer_projection_is_a_buffer(name):
    """A mixer's Performer projection is fixed: two eval calls agree, it is saved with the weights (a copy loaded
    from the state dict gives the same output), and only redraw_feature_map changes it."""
    torch.manual_seed(0)
    mixer = create_mixer(name, 32, 2, feature_map="performer").eval()
    assert mixer.feature_map == "performer" and "performer_projection" in mixer.state_dict()
    x = torch.randn(2, 36, 32)
    with torch.no_grad():
        first = mixer(x, (6, 6))
        torch.testing.assert_close(mixer(x, (6, 6)), first, rtol=0, atol=0)
        twin = create_mixer(name, 32, 2, feature_map="performer").eval()
        assert not torch.equal(twin.performer_projection, mixer.performer_projection)
        twin.load_state_dict(mixer.state_dict())
        torch.testing.assert_close(twin(x, (6, 6)), first, rtol=0, atol=0)
        before = mixer.performer_projection.clone()
        mixer.redraw_feature_map(torch.Generator().manual_seed(5))
        assert not torch.equal(mixer.performer_projection, before)
        assert not torch.allclose(mixer(x, (6, 6)), first)
    with pytest.raises(ValueError, match="redraw_feature_map: the feature map 'elu'.* draws nothing"):
        create_mixer(name, 32, 2, feature_map="elu").redraw_feature_map()
