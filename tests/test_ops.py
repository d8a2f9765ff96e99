"""The reference linear-attention op against explicit O(N^2) formulas in float64."""
import math

import pytest
import torch
import torch.nn.functional as F

from linvision.ops import (
    LinearAttentionState,
    RecurrentState,
    check_grid,
    PerformerFeatureMap,
    Rope,
    apply_rope,
    axial_rope,
    axial_rope_freqs,
    causal_linear_attention,
    get_feature_map,
    interpolate_positions,
    linear_attention,
    linear_attention_step,
    mixed_rope_freqs,
    rope_1d,
    rope_at,
    softmax_attention,
)
from linvision.ops.feature_maps import FocusedFeatureMap
from support import explicit_linear_attention

EPS = 1e-4


def rand_qkv(b, h, n, d, dv, dtype=torch.float64, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, h, n, dv, generator=g, dtype=dtype)
    return q, k, v


def grid_for(n):
    """A non-square grid of n tokens (n = H * W) when n allows it."""
    for h in range(int(math.sqrt(n)), 0, -1):
        if n % h == 0:
            return h, n // h
    return 1, n


FEATURE_MAPS = ["elu", "relu", "exp", "focused", "performer"]


@pytest.mark.parametrize("name", FEATURE_MAPS)
@pytest.mark.parametrize("n", [1, 7, 197])
@pytest.mark.parametrize("use_rope", [False, True])
def test_noncausal_matches_explicit(name, n, use_rope):
    d, dv = 16, 12
    q, k, v = rand_qkv(2, 3, n, d, dv)
    phi = PerformerFeatureMap(d, 32, generator=torch.Generator().manual_seed(1)) if name == "performer" else name
    out_dim = 32 if name == "performer" else d
    rope = Rope(*axial_rope_freqs(out_dim), grid=grid_for(n)) if use_rope else None
    got = linear_attention(q, k, v, phi, rope=rope)
    want = explicit_linear_attention(q, k, v, phi, rope=rope)
    assert got.shape == (2, 3, n, dv)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["elu", "relu", "focused"])
@pytest.mark.parametrize("n,chunk", [(1, 4), (7, 4), (33, 8), (197, 64)])
@pytest.mark.parametrize("use_rope", [False, True])
def test_causal_matches_masked_formula_and_recurrence(name, n, chunk, use_rope):
    d, dv = 8, 6
    q, k, v = rand_qkv(2, 2, n, d, dv, seed=n)
    rope = Rope(*axial_rope_freqs(d), grid=grid_for(n), num_prefix_tokens=0) if use_rope else None
    chunked = causal_linear_attention(q, k, v, name, rope=rope, chunk_size=chunk)
    torch.testing.assert_close(chunked, explicit_linear_attention(q, k, v, name, rope=rope, causal=True))
    state, steps = None, []
    for t in range(n):
        o, state = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, name, rope=rope)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, dim=2), chunked)
    assert isinstance(state, LinearAttentionState) and state.num_tokens == n
    assert linear_attention(q, k, v, name, rope=rope, causal=True, chunk_size=chunk).equal(chunked)


def test_feature_map_values():
    x = torch.linspace(-3, 3, 61, dtype=torch.float64).reshape(1, 1, 61, 1).repeat(1, 1, 1, 4)
    torch.testing.assert_close(get_feature_map("elu+1")(x), torch.where(x > 0, x + 1, torch.exp(x)))
    torch.testing.assert_close(get_feature_map("relu")(x), x.clamp_min(0))
    # exp: the stabiliser is one constant per (batch, head) for keys and per token for queries, so the
    # attention equals the one with raw exp() (eps made negligible against the rescaled denominator).
    q, k, v = rand_qkv(1, 2, 20, 8, 5, scale=3.0)
    raw = explicit_linear_attention(q, k, v, lambda x, is_query: torch.exp(x), eps=1e-300)
    torch.testing.assert_close(linear_attention(q, k, v, "exp", eps=1e-300), raw)
    assert get_feature_map("exp")(torch.full((1, 1, 3, 2), 1e4)).isfinite().all()
    # focused: non-negative, keeps the norm of relu(x), sharpens the direction (power 3)
    y = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    f = FocusedFeatureMap(power=3.0)(y)
    base = F.relu(y) + 1e-6
    assert (f >= 0).all()
    torch.testing.assert_close(f.norm(dim=-1), base.norm(dim=-1))
    torch.testing.assert_close(f / f.norm(dim=-1, keepdim=True), base**3 / (base**3).norm(dim=-1, keepdim=True))
    scale = torch.full((8,), 0.3, dtype=torch.float64)
    scaled = (F.relu(y) + 1e-6) / F.softplus(scale)
    want = scaled**3 / (scaled**3).norm(dim=-1, keepdim=True) * scaled.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(FocusedFeatureMap(3.0, scale)(y), want)


def test_performer_approximates_softmax_and_redraws():
    d, m = 8, 8192
    q, k, v = rand_qkv(1, 1, 16, d, 4, scale=0.5)
    phi = PerformerFeatureMap(d, m, generator=torch.Generator().manual_seed(0))
    approx = linear_attention(q, k, v, phi, eps=1e-12)
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v
    assert (approx - exact).abs().max() < 0.05
    before = phi.projection.clone()
    phi.redraw(torch.Generator().manual_seed(5))
    assert phi.projection.shape == before.shape and not torch.equal(phi.projection, before)
    # rows of each orthogonal block are orthogonal
    block = phi.projection[:d]
    gram = block @ block.T
    torch.testing.assert_close(gram - torch.diag(torch.diag(gram)), torch.zeros(d, d), atol=1e-4, rtol=0)


def test_rope_numerator_depends_on_relative_offsets_only():
    d, grid = 16, (5, 7)
    q, k, v = rand_qkv(1, 2, 35, d, 6)
    for freqs in (axial_rope_freqs(d), mixed_rope_freqs(d, 2, generator=torch.Generator().manual_seed(0))):
        base = Rope(*freqs, grid=grid)
        shifted = Rope(*freqs, grid=grid, offset=(3.0, -11.0))
        a = linear_attention(q, k, v, "elu", rope=base)
        b = linear_attention(q, k, v, "elu", rope=shifted)
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, linear_attention(q, k, v, "elu"))  # RoPE does change the output


def test_rope_non_square_prefix_and_mixed_reduces_to_axial():
    d = 16
    fx, fy = axial_rope_freqs(d)
    # mixed per-head frequencies set to the axial ones give exactly the axial rotation
    mixed = Rope(fx.expand(3, -1).clone(), fy.expand(3, -1).clone(), grid=(4, 9))
    x = torch.randn(2, 3, 36, d, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, mixed), apply_rope(x, axial_rope(d, (4, 9))))
    # non-square grid: the rotation angle of token (r, c) for an x-pair is fx*c, for a y-pair fy*r
    cos, sin = axial_rope(d, (4, 9)).tables()
    r, c = 2, 7
    torch.testing.assert_close(cos[0, r * 9 + c], torch.cos(fx * c + fy * r))
    # prefix tokens are left unrotated
    rope = axial_rope(d, (3, 5), num_prefix_tokens=2)
    y = torch.randn(1, 1, 17, d, dtype=torch.float64)
    ry = apply_rope(y, rope)
    torch.testing.assert_close(ry[:, :, :2], y[:, :, :2])
    torch.testing.assert_close(ry.norm(dim=-1), y.norm(dim=-1))  # rotations keep norms
    # tables are cached per grid and device
    assert axial_rope(d, (3, 5), num_prefix_tokens=2) is rope
    # 1D RoPE is the (1, N) grid
    assert rope_1d(d, 10).grid == (1, 10)


def test_gradients_match_explicit_formula():
    d, dv, n = 6, 5, 9
    rope = Rope(*mixed_rope_freqs(8, 2, generator=torch.Generator().manual_seed(0)), grid=(3, 3))
    for name in ["elu", "relu", "exp", "focused"]:
        q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, n, d + 2, dv, seed=3))
        torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, name, rope=rope), (q, k, v))
        for causal in (False, True) if name != "exp" else (False,):  # exp is non-causal only
            out = linear_attention(q, k, v, name, rope=rope, causal=causal, chunk_size=4)
            ref = explicit_linear_attention(q, k, v, name, rope=rope, causal=causal)
            w = torch.randn_like(out)
            g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
            g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
            for a, b in zip(g1, g2):
                torch.testing.assert_close(a, b)


def _saved_storages(fn, *args):
    """Data pointers of the storages autograd keeps for the backward of ``fn(*args)``."""
    kept = set()

    def pack(t):
        kept.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, kept


def test_axial_rope_ref_grid_interpolates_positions_and_per_sample_positions_agree():
    """axial_rope(ref_grid=(3, 4)) on a 5 x 7 grid: token (r, c) of an x-pair turns by fx * c * 4 / 7, of a y-pair
    by fy * r * 3 / 5 (float64 reference); on the reference grid it is the very object without the option. The
    same image's tokens at their own positions (rope_at after interpolate_positions, beside a smaller image
    padded with (0, 0)) turn by the same angles, to fp32 rounding."""
    d = 16
    fx, fy = axial_rope_freqs(d)
    cos, sin = axial_rope(d, (5, 7), ref_grid=(3, 4)).tables()
    rows = torch.arange(5, dtype=torch.float64).repeat_interleave(7) * 3 / 5
    cols = torch.arange(7, dtype=torch.float64).repeat(5) * 4 / 7
    ang = cols[:, None] * fx.double() + rows[:, None] * fy.double()
    torch.testing.assert_close(cos[0].double(), ang.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0].double(), ang.sin(), rtol=0, atol=1e-6)
    assert axial_rope(d, (3, 4), ref_grid=(3, 4)) is axial_rope(d, (3, 4))
    positions = torch.zeros(2, 35, 2, dtype=torch.long)
    positions[0, :, 0], positions[0, :, 1] = rows.mul(5 / 3).round().long(), cols.mul(7 / 4).round().long()
    small = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij"), -1).reshape(6, 2)
    positions[1, :6] = small  # a 2 x 3 image, then padding at (0, 0)
    per_sample = rope_at(fx, fy, interpolate_positions(positions, (3, 4)))
    pcos, psin = per_sample.tables()
    torch.testing.assert_close(pcos[0, 0], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(psin[0, 0], sin[0], rtol=0, atol=1e-6)
    want = axial_rope(d, (2, 3), ref_grid=(3, 4)).tables()[0][0]
    torch.testing.assert_close(pcos[1, 0, :6], want, rtol=0, atol=1e-6)
    assert interpolate_positions(positions, None) is positions


@pytest.mark.parametrize("use_rope", [None, "axial", "mixed"])
def test_training_keeps_only_q_k_v_and_gradients_match_the_formula(use_rope):
    """Linear attention (every recomputable feature map) keeps only q, k, v and the learnable leaves for the
    backward, nothing per token of its own; the gradients, the focused map's scale and mixed-RoPE frequencies
    included, equal the explicit formula's in float64 (softmax attention with RoPE too)."""
    d, n = 8, 12
    g = torch.Generator().manual_seed(5)
    fx, fy = (f.double().requires_grad_() for f in mixed_rope_freqs(d, 2, generator=g))
    rope = {None: None, "axial": axial_rope(d, (3, 4)), "mixed": Rope(fx, fy, grid=(3, 4))}[use_rope]
    scale = torch.randn(d, generator=g, dtype=torch.float64).requires_grad_()
    q, k, v = (t.requires_grad_() for t in rand_qkv(2, 2, n, d, 6, seed=4))
    inputs = {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
    leaves = [q, k, v] + ([fx, fy] if use_rope == "mixed" else [])
    for name in ["elu", "relu", "exp", "focused"]:
        phi = FocusedFeatureMap(scale=scale) if name == "focused" else name
        wrt = leaves + ([scale] if name == "focused" else [])
        allowed = inputs | {t.untyped_storage().data_ptr() for t in wrt}
        out, kept = _saved_storages(lambda: linear_attention(q, k, v, phi, rope=rope))
        assert kept <= allowed, name
        ref = explicit_linear_attention(q, k, v, phi, rope=rope)
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad((out * w).sum(), wrt), torch.autograd.grad((ref * w).sum(), wrt)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if rope is None:
        return
    out = softmax_attention(q, k, v, rope=rope)  # SDPA keeps rotated copies of q, k: no storage check
    rq, rk = apply_rope(q, rope), apply_rope(k, rope)
    ref = torch.softmax(rq @ rk.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_learnable_mixed_frequencies_receive_gradients():
    fx, fy = (f.requires_grad_() for f in mixed_rope_freqs(8, 2))
    q, k, v = rand_qkv(1, 2, 12, 8, 4, dtype=torch.float32)
    linear_attention(q, k, v, "elu", rope=Rope(fx, fy, grid=(3, 4))).sum().backward()
    assert fx.grad is not None and fx.grad.abs().sum() > 0 and fy.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_at_64k_tokens_with_large_activations(dtype, tol):
    n, d = 65536, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) * 30 for _ in range(3))
    rope = axial_rope(d, (256, 256))
    for name in ["elu", "relu"]:
        ref = linear_attention(q, k, v, name, rope=rope)
        out = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), name, rope=rope)
        assert out.dtype == dtype and out.isfinite().all()
        # relative to the output scale; the inputs themselves are rounded to dtype
        rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert rel < tol, f"{name} {dtype}: relative error {rel:.3g}"


def test_softmax_attention_matches_formula():
    q, k, v = rand_qkv(2, 2, 13, 8, 5)
    want = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v
    torch.testing.assert_close(softmax_attention(q, k, v), want)
    rope = axial_rope(8, (1, 13))
    rq, rk = apply_rope(q, rope), apply_rope(k, rope)
    want = torch.softmax(rq @ rk.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v
    torch.testing.assert_close(softmax_attention(q, k, v, rope=rope), want)
    mask = torch.ones(13, 13, dtype=torch.bool).tril()
    causal = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, -math.inf), -1) @ v
    torch.testing.assert_close(softmax_attention(q, k, v, causal=True), causal)


def test_bad_inputs_raise_clear_errors():
    q, k, v = rand_qkv(1, 2, 6, 8, 4, dtype=torch.float32)
    cases = [
        (lambda: linear_attention(q, k[:, :1], v), ValueError, "batch and head"),
        (lambda: linear_attention(q[:1].expand(2, -1, -1, -1), k, v), ValueError, "batch and head"),
        (lambda: linear_attention(q, k, v[:, :, :5]), ValueError, "v: 5 tokens"),
        (lambda: linear_attention(q, k[..., :4], v), ValueError, "head dim"),
        (lambda: linear_attention(q[:, :, :3], k, v, causal=True), ValueError, "k: 6 tokens, but q has 3"),
        (lambda: linear_attention(q[0], k, v), ValueError, "4 dims"),
        (lambda: linear_attention(q, k, v, "gelu"), ValueError, "unknown name 'gelu'"),
        (lambda: linear_attention(q, k, v, 3), TypeError, "feature_map"),
        (lambda: linear_attention(q.long(), k, v), TypeError, "q: dtype torch.int64"),
        (lambda: linear_attention(q, k.double(), v), TypeError, "mixed dtypes"),
        (lambda: linear_attention(q, k, v.to("meta")), ValueError, "different devices"),
        (lambda: linear_attention(q, k, v, rope=axial_rope(16, (2, 3))), ValueError, "head dim 16"),
        (lambda: linear_attention(q, k, v, rope=axial_rope(8, (3, 3))), ValueError, "9 tokens"),
        (lambda: linear_attention(q, k, v, rope=Rope(*mixed_rope_freqs(8, 3), grid=(2, 3))), ValueError, "3 heads"),
        (lambda: linear_attention(q, k, v, rope="axial"), TypeError, "rope"),
        (lambda: linear_attention(q, k, v, backend="cuda"), ValueError, "backend"),
        (lambda: linear_attention(q, k, v, eps=0), ValueError, "eps"),
        (lambda: linear_attention(q, k, v, causal=True, chunk_size=0), ValueError, "chunk_size"),
        (lambda: linear_attention(q.numpy(), k, v), TypeError, "q: expected a torch.Tensor"),
        (lambda: axial_rope(6, (2, 2)), ValueError, "divisible by 4"),
        (lambda: axial_rope(8, (0, 2)), ValueError, "grid"),
        (lambda: softmax_attention(q, k, v.int()), TypeError, "v: dtype"),
    ]
    for fn, exc, text in cases:
        with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)")):
            fn()


def test_triton_backend_without_kernels_raises_and_auto_falls_back(monkeypatch):
    from linvision.ops import record_backends
    from linvision.ops.attention import dispatch

    q, k, v = rand_qkv(1, 1, 5, 16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="backend: 'triton' cannot run this call"):
        linear_attention(q, k, v, "exp", backend="triton")  # exp is not a fused map
    # "auto" treating CPU tensors as it treats CUDA ones, on a call the kernels cannot run (head dim 6): it must
    # warn once with the reason, run PyTorch, and give the explicit formula's values
    q, k, v = rand_qkv(1, 1, 5, 6, 16, dtype=torch.float32)
    monkeypatch.setattr(dispatch, "_AUTO_DEVICES", ("cpu",))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    with record_backends() as used, pytest.warns(RuntimeWarning, match="not the fused kernels: .*head dim 6"):
        got = linear_attention(q, k, v, "elu", backend="auto")
    assert used == {("linear_attention", "torch")}
    torch.testing.assert_close(got.double(), explicit_linear_attention(q, k, v, "elu"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["exp", "performer"])
def test_causal_forms_refuse_maps_with_a_global_key_stabiliser(name):
    """exp and performer scale every key by one constant, the max over all tokens: in a causal form a late large key
    would push every earlier prefix's keys to underflow (rows 0-4 off by ~1 against the exact formula), so every
    causal, step and recurrent op refuses them and says why; the non-causal op keeps them."""
    from linvision.ops import (bidirectional_delta_rule_attention, bidirectional_gated_linear_attention,
                               decay_linear_attention, decay_linear_attention_step, delta_rule_attention,
                               delta_rule_step, gated_linear_attention)

    q, k, v = rand_qkv(1, 2, 9, 8, 4)
    phi = PerformerFeatureMap(8, generator=torch.Generator().manual_seed(0)) if name == "performer" else name
    gate, beta = torch.full((1, 2, 9), -0.1), torch.full((1, 2, 9), 0.5)
    calls = {
        "causal": lambda: causal_linear_attention(q, k, v, phi),
        "linear_attention(causal=True)": lambda: linear_attention(q, k, v, phi, causal=True),
        "step": lambda: linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, phi),
        "decay": lambda: decay_linear_attention(q, k, v, 0.9, phi),
        "decay step": lambda: decay_linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], 0.9, None, phi),
        "gated": lambda: gated_linear_attention(q, k, v, gate, phi),
        "bidirectional gated": lambda: bidirectional_gated_linear_attention(q, k, v, gate, phi),
        "delta": lambda: delta_rule_attention(q, k, v, beta, phi),
        "delta step": lambda: delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], None, phi),
        "bidirectional delta": lambda: bidirectional_delta_rule_attention(q, k, v, beta, phi),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=f"feature_map: '{name}' is for non-causal attention only"):
            call()
    assert linear_attention(q, k, v, phi).isfinite().all()


def test_one_table_of_feature_maps():
    """Every list of maps derives from linvision.ops.common.FEATURE_MAPS: the names get_feature_map takes, the
    kernels' fused maps, the mixers' maps; performer by name is refused (it would draw a projection per call)."""
    from linvision.kernels.common import FUSED_FEATURE_MAPS as KERNEL_FUSED
    from linvision.layers.mixers import LAYER_FEATURE_MAPS
    from linvision.ops import FEATURE_MAP_NAMES
    from linvision.ops.common import FEATURE_MAP_ALIASES, FEATURE_MAPS, FUSED_FEATURE_MAPS

    assert set(FEATURE_MAP_NAMES) == set(FEATURE_MAPS) | set(FEATURE_MAP_ALIASES)
    assert FUSED_FEATURE_MAPS is KERNEL_FUSED and set(FUSED_FEATURE_MAPS) == {"identity", "relu", "elu"}
    assert LAYER_FEATURE_MAPS == tuple(n for n, i in FEATURE_MAPS.items() if i.nonnegative)
    from linvision.ops.attention.reference import _RECOMPUTABLE_MAPS

    assert _RECOMPUTABLE_MAPS == tuple(n for n, i in FEATURE_MAPS.items() if i.recompute) and \
        "performer" not in _RECOMPUTABLE_MAPS and "focused" in _RECOMPUTABLE_MAPS
    for name, info in FEATURE_MAPS.items():
        if info.random:
            with pytest.raises(ValueError, match=f"'{name}' by name would draw a new random projection"):
                get_feature_map(name)
            continue
        phi = get_feature_map(name)
        assert phi.name == name
        # a map that holds nothing is one object, resolved once; the others a fresh one per call
        assert (get_feature_map(name.upper()) is phi) == (not info.stateful)


def test_grid_check():
    assert check_grid((4, 9)) == (4, 9) and check_grid([2, 3], num_tokens=6) == (2, 3)
    for bad in ((0, 2), (2,), (2, 3.0), (True, 2), "4x4", None):
        with pytest.raises(ValueError, match=r"grid: expected \(H, W\) with two positive ints"):
            check_grid(bad)
    with pytest.raises(ValueError, match=r"hw: grid \(2, 3\) has 6 cells, but the input has N=7 tokens"):
        check_grid((2, 3), num_tokens=7, name="hw")


def test_one_state_type_carries_the_position():
    assert LinearAttentionState is RecurrentState
    q, k, v = rand_qkv(1, 2, 6, 8, 4)
    rope = axial_rope(8, (2, 3))
    state = None
    for t in range(6):
        _, state = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, "elu", rope=rope)
    # S, z and the token count of the causal state: the sums over all tokens (count = 6 with a zero log-gate)
    rk = apply_rope(get_feature_map("elu")(k), rope)
    torch.testing.assert_close(state.s, torch.einsum("bhnd,bhne->bhde", rk, v))
    torch.testing.assert_close(state.z, get_feature_map("elu")(k).sum(2))
    torch.testing.assert_close(state.count, torch.full((1, 2, 1), 6.0, dtype=torch.float64))
    assert state.num_tokens == 6
    with pytest.raises(ValueError, match="rope: describes 6 tokens, step 6 is past its end"):
        linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state, "elu", rope=rope)


def test_rope_caches_stay_bounded_over_many_grids():
    """A model run at 50 grid sizes keeps the RoPE tables of its last CACHE_SIZE grids only, and what the caches
    return is still the rotation of the formula (angles col * fx + row * fy, in float64)."""
    import timm

    import linvision  # noqa: F401
    from linvision.ops import rope as rope_mod

    model = timm.create_model("linvit_tiny_patch16_rope_224", dynamic_img_size=True, depth=1, embed_dim=32,
                              num_heads=2).eval()
    for i in range(50):
        with torch.no_grad():
            model(torch.randn(1, 3, 16 * (1 + i % 10), 16 * (1 + i // 10)))
    assert 0 < len(rope_mod._AXIAL_CACHE) <= rope_mod.CACHE_SIZE
    assert 0 < len(rope_mod._POSITION_CACHE) <= rope_mod.CACHE_SIZE
    for _ in range(2):  # computed, then from the cache
        rope = axial_rope(8, (3, 5))
        cos, sin = rope.tables()
        fx, fy = rope.freqs_x.double(), rope.freqs_y.double()
        rows, cols = torch.meshgrid(torch.arange(3.0, dtype=torch.float64), torch.arange(5.0, dtype=torch.float64),
                                    indexing="ij")
        angles = cols.reshape(-1, 1) * fx + rows.reshape(-1, 1) * fy
        torch.testing.assert_close(cos[0].double(), angles.cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[0].double(), angles.sin(), rtol=0, atol=1e-6)
    assert rope_mod._AXIAL_CACHE.lookup(next(reversed(rope_mod._AXIAL_CACHE))) is rope
