"""Decay, gated and delta-rule linear attention: chunked forms against per-token loops and explicit O(N^2) formulas
in float64, special cases (gamma = 1, beta = 0), half-precision safety, and the bidirectional mixers."""
import pytest
import torch
import torch.nn.functional as F

from linvision.layers import create_mixer, list_mixers
from linvision.ops import (
    RecurrentState,
    bidirectional_delta_rule_attention,
    bidirectional_gated_linear_attention,
    causal_linear_attention,
    decay_linear_attention,
    decay_linear_attention_step,
    delta_rule_attention,
    delta_rule_step,
    gated_linear_attention,
    gated_linear_attention_step,
    linear_attention_reference,
)
from support import elu_phi, naive_delta, naive_gated

EPS = 1e-4
CHUNKS = (1, 4, 5, 64)  # 64 > N: a single ragged chunk


def qkv(b=2, h=2, n=13, d=4, dv=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, x, generator=g, dtype=dtype) for x in (d, d, dv))


def log_gates(shape, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 1) * scale


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("gate", ["decay", "head", "channel"])
@pytest.mark.parametrize("normalize", [True, False])
def test_gated_chunked_matches_loop(chunk, gate, normalize):
    q, k, v = qkv()
    b, h, n, d = q.shape
    if gate == "decay":
        decay = torch.tensor([0.9, 0.5], dtype=torch.float64)
        out = decay_linear_attention(q, k, v, decay, normalize=normalize, chunk_size=chunk)
        lg = decay.log().reshape(1, h, 1, 1).expand(b, h, n, 1)
    else:
        lg = log_gates((b, h, n, 1 if gate == "head" else d))
        out = gated_linear_attention(q, k, v, lg if gate == "channel" else lg[..., 0], normalize=normalize, chunk_size=chunk)
    torch.testing.assert_close(out, naive_gated(q, k, v, lg, normalize), rtol=1e-10, atol=1e-10)


def test_gated_matches_quadratic_formula():
    # o_i = sum_{j<=i} w_ij phi(q_i).phi(k_j) v_j / (sum_{j<=i} w_ij phi(q_i).phi(k_j) + eps sum_{j<=i} w_ij),
    # w_ij = prod_{j<l<=i} gamma_l (per head)
    q, k, v = qkv(n=11)
    lg = log_gates(q.shape[:3])
    cum = lg.cumsum(-1)
    w = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).exp().tril()  # (B, H, N, N)
    a = w * (elu_phi(q) @ elu_phi(k).transpose(-1, -2))
    ref = (a @ v) / (a.sum(-1) + EPS * w.sum(-1)).unsqueeze(-1)
    torch.testing.assert_close(gated_linear_attention(q, k, v, lg, chunk_size=4), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("gate", ["decay", "head", "channel"])
def test_gated_step_and_state_continuation(normalize, gate):
    q, k, v = qkv(b=1, n=9)
    b, h, n, d = q.shape
    if gate == "decay":
        decay = 0.8
        lg = torch.full((b, h, n, 1), 0.8, dtype=torch.float64).log()
        full = decay_linear_attention(q, k, v, decay, normalize=normalize, chunk_size=3)
        step = lambda t, st: decay_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], decay, st, normalize=normalize)  # noqa: E731
    else:
        lg = log_gates((b, h, n, 1 if gate == "head" else d))
        full = gated_linear_attention(q, k, v, lg, normalize=normalize, chunk_size=3)
        step = lambda t, st: gated_linear_attention_step(  # noqa: E731
            q[:, :, t], k[:, :, t], v[:, :, t], lg[:, :, t] if gate == "channel" else lg[:, :, t, 0], st, normalize=normalize
        )
    state, outs = None, []
    for t in range(n):
        o, state = step(t, state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 2), full, rtol=1e-10, atol=1e-10)
    # a chunked prefix handing its state to a chunked suffix gives the same outputs and final state
    first, mid = gated_linear_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], lg[:, :, :4], normalize=normalize,
                                        chunk_size=3, return_state=True)
    second, end = gated_linear_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], lg[:, :, 4:], normalize=normalize,
                                         chunk_size=2, state=mid, return_state=True)
    torch.testing.assert_close(torch.cat([first, second], 2), full, rtol=1e-10, atol=1e-10)
    for a, b_ in zip((end.s, end.z, end.count), (state.s, state.z, state.count)):
        if b_ is not None:
            torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-10)
    assert (mid.num_tokens, end.num_tokens, state.num_tokens) == (4, n, n)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_decay_one_is_causal_linear_attention(chunk):
    q, k, v = qkv(n=21)
    ref = causal_linear_attention(q, k, v, "elu", eps=EPS, chunk_size=8)
    torch.testing.assert_close(decay_linear_attention(q, k, v, 1.0, eps=EPS, chunk_size=chunk), ref, rtol=1e-12, atol=1e-12)


def test_bidirectional_decay_one_is_noncausal_linear_attention():
    q, k, v = qkv(n=21)
    out = bidirectional_gated_linear_attention(q, k, v, torch.zeros(1, 1, 1, dtype=torch.float64), chunk_size=4)
    torch.testing.assert_close(out, linear_attention_reference(q, k, v, "elu", eps=EPS), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("normalize", [True, False])
def test_bidirectional_gated_matches_quadratic_formula(gate, normalize):
    # w_ij = prod of gamma_{j+1..i} for j <= i and gamma_{i..j-1} for j > i, per key channel
    q, k, v = qkv(n=10)
    b, h, n, d = q.shape
    lg = log_gates((b, h, n, 1 if gate == "head" else d))
    cum = lg.cumsum(2)  # (B, H, N, G) inclusive
    prev = cum - lg  # exclusive
    ones = torch.ones(n, n, dtype=torch.float64)
    fwd = (cum.unsqueeze(3) - cum.unsqueeze(2)).exp() * ones.tril()[..., None]
    bwd = (prev.unsqueeze(2) - prev.unsqueeze(3)).exp() * ones.triu(1)[..., None]
    w = fwd + bwd  # (B, H, N_i, N_j, G)
    a = torch.einsum("bhid,bhjd,bhijd->bhij", elu_phi(q), elu_phi(k), w.expand(b, h, n, n, d))
    ref = a @ v
    if normalize:
        ref = ref / (a.sum(-1) + EPS * w.mean(-1).sum(-1)).unsqueeze(-1)
    for chunk in (3, 64):
        out = bidirectional_gated_linear_attention(q, k, v, lg, normalize=normalize, chunk_size=chunk)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_delta_chunked_matches_loop(chunk):
    q, k, v = qkv()
    beta = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out, state = delta_rule_attention(q, k, v, beta, chunk_size=chunk, return_state=True)
    ref, s_ref = naive_delta(q, k, v, beta)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.s, s_ref, rtol=1e-10, atol=1e-10)


def test_delta_step_and_state_continuation():
    q, k, v = qkv(b=1, n=9)
    beta = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    full = delta_rule_attention(q, k, v, beta, chunk_size=4)
    state, outs = None, []
    for t in range(q.shape[2]):
        o, state = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 2), full, rtol=1e-10, atol=1e-10)
    first, mid = delta_rule_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], beta[:, :, :5], chunk_size=2, return_state=True)
    second, end = delta_rule_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], beta[:, :, 5:], chunk_size=3, state=mid,
                                       return_state=True)
    torch.testing.assert_close(torch.cat([first, second], 2), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end.s, state.s, rtol=1e-10, atol=1e-10)
    assert (mid.num_tokens, end.num_tokens, state.num_tokens) == (5, 9, 9)


def test_delta_beta_zero_keeps_state():
    q, k, v = qkv()
    s0 = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    out, state = delta_rule_attention(q, k, v, torch.zeros(q.shape[:3], dtype=torch.float64), chunk_size=5,
                                      state=RecurrentState(s0), return_state=True)
    torch.testing.assert_close(state.s, s0, rtol=0, atol=1e-14)
    torch.testing.assert_close(out, F.normalize(q, dim=-1) @ s0, rtol=1e-12, atol=1e-12)


def test_delta_beta_one_stores_value():
    # beta = 1 with a unit key overwrites what the state returns for that key: S_t^T k_t = v_t
    q, k, v = qkv(n=6)
    _, state = delta_rule_attention(q, k, v, torch.ones(q.shape[:3], dtype=torch.float64), return_state=True)
    k_last = F.normalize(k[:, :, -1], dim=-1)
    torch.testing.assert_close(torch.einsum("bhd,bhde->bhe", k_last, state.s), v[:, :, -1], rtol=1e-10, atol=1e-10)


def test_bidirectional_delta_matches_loops():
    q, k, v = qkv(n=11)
    beta = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    fwd, _ = naive_delta(q, k, v, beta)
    bwd, _ = naive_delta(q.flip(2), k.flip(2), v.flip(2), beta.flip(2), strict=True)
    for chunk in (4, 64):
        out = bidirectional_delta_rule_attention(q, k, v, beta, chunk_size=chunk)
        torch.testing.assert_close(out, fwd + bwd.flip(2), rtol=1e-10, atol=1e-10)



def test_delta_compiled_with_dynamic_sizes_on_transposed_inputs():
    """torch.compile(fullgraph=True, dynamic=True) of the chunked delta rule on token-major (transposed) features,
    batch 1: a token count that fills its chunks (an empty padding, where F.pad would keep the transposed strides
    the graph does not expect) and a ragged one, each equal to the loops."""
    fn = torch.compile(lambda q, k, v, beta: delta_rule_attention(q, k, v, beta, chunk_size=4), backend="aot_eager",
                       fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for n in (11, 12):
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(b=1, n=n))
        assert not q.is_contiguous()
        beta = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        torch.testing.assert_close(fn(q, k, v, beta), naive_delta(q, k, v, beta)[0], rtol=1e-10, atol=1e-10)


def _grads(fn, *inputs):
    """Gradients of a fixed random projection of fn(*inputs) with respect to every input."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_bidirectional_gated_gradients_match_quadratic_formula(gate):
    """The chunked scans' backward (autograd through the chain of chunk states, the count riding along) equals the
    gradient of the explicit O(N^2) formula, float64, ragged last chunk."""
    q, k, v = qkv(n=10)
    b, h, n, d = q.shape
    lg = log_gates((b, h, n, 1 if gate == "head" else d))

    def reference(q, k, v, lg):
        cum = lg.cumsum(2)
        prev = cum - lg
        ones = torch.ones(n, n, dtype=torch.float64)
        w = ((cum.unsqueeze(3) - cum.unsqueeze(2)).exp() * ones.tril()[..., None]
             + (prev.unsqueeze(2) - prev.unsqueeze(3)).exp() * ones.triu(1)[..., None])
        a = torch.einsum("bhid,bhjd,bhijd->bhij", elu_phi(q), elu_phi(k), w.expand(b, h, n, n, d))
        return (a @ v) / (a.sum(-1) + EPS * w.mean(-1).sum(-1)).unsqueeze(-1)

    want = _grads(reference, q, k, v, lg)
    got = _grads(lambda *t: bidirectional_gated_linear_attention(*t, chunk_size=3), q, k, v, lg)
    for name, x, y in zip("qkvg", got, want):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9, msg=name)


def test_bidirectional_delta_gradients_match_loops():
    """The delta rule's backward (through the transposed triangular solve and the chain of affine chunk maps)
    equals the gradient of the per-token loops, float64, ragged last chunk."""
    q, k, v = qkv(n=11)
    beta = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def reference(q, k, v, beta):
        fwd, _ = naive_delta(q, k, v, beta)
        bwd, _ = naive_delta(q.flip(2), k.flip(2), v.flip(2), beta.flip(2), strict=True)
        return fwd + bwd.flip(2)

    want = _grads(reference, q, k, v, beta)
    got = _grads(lambda *t: bidirectional_delta_rule_attention(*t, chunk_size=4), q, k, v, beta)
    for name, x, y in zip(("q", "k", "v", "beta"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_strong_decay_and_long_memory(dtype):
    # strong per-channel forgetting (cumulated log-decay far below fp16/fp32 exp range within one chunk) and
    # gamma = 1 over many tokens: finite and close to float64
    q, k, v = qkv(b=1, h=2, n=300, d=8, dv=8, seed=7)
    lg = log_gates(q.shape, scale=8.0)  # down to about -40 per token
    for gate in (lg, torch.zeros(1, 1, 1, dtype=torch.float64)):
        ref = gated_linear_attention(q, k, v, gate, chunk_size=64)
        out = gated_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), gate.float(), chunk_size=64)
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)
    beta = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ref = delta_rule_attention(q, k, v, beta)
    out = delta_rule_attention(q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)


def test_argument_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="decay"):
        decay_linear_attention(q, k, v, 1.5)
    with pytest.raises(ValueError, match="log_gate"):
        gated_linear_attention(q, k, v, torch.zeros(2, 2, 13, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule_attention(q, k, v, torch.zeros(2, 2, 13, dtype=torch.float64), chunk_size=0)
    with pytest.raises(ValueError, match="state"):
        gated_linear_attention(q, k, v, torch.zeros(2, 2, 13, dtype=torch.float64), state=RecurrentState(torch.zeros(2, 2, 4, 3)))


MIXERS = ["bidir_decay", "bidir_gated", "bidir_delta"]


def test_mixers_registered():
    assert set(MIXERS) <= set(list_mixers())


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("name", MIXERS)
def test_mixer_sees_both_sides(name, column_major):
    torch.manual_seed(0)
    mixer = create_mixer(name, 16, 2, column_major=column_major, chunk_size=4).double()
    x = torch.randn(2, 5 * 3, 16, dtype=torch.float64, requires_grad=True)
    out = mixer(x, (5, 3))
    assert out.shape == x.shape
    i = 7
    (grad,) = torch.autograd.grad(out[0, i].sum(), x)
    influence = grad[0].abs().sum(-1)  # (N,)
    assert influence[:i].min() > 0 and influence[i + 1 :].min() > 0
    assert grad[1].abs().max() == 0  # batch elements do not mix


@pytest.mark.parametrize("name", MIXERS)
def test_mixer_column_major_is_transpose_equivariant(name):
    # raster order of the transposed grid is the column-major order of the original: with both orders scanned,
    # transposing the image commutes with the mixer
    torch.manual_seed(0)
    mixer = create_mixer(name, 8, 2, column_major=True, chunk_size=4).double()
    h, w = 3, 5
    x = torch.randn(1, h * w, 8, dtype=torch.float64)
    xt = x.reshape(1, h, w, 8).transpose(1, 2).reshape(1, h * w, 8)
    out_t = mixer(xt, (w, h)).reshape(1, w, h, 8).transpose(1, 2).reshape(1, h * w, 8)
    torch.testing.assert_close(out_t, mixer(x, (h, w)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", MIXERS)
def test_mixer_bf16_autocast_and_backward(name):
    torch.manual_seed(0)
    kwargs = {"forget_per_channel": True, "gate": True, "lepe": True} if name == "bidir_gated" else {}
    mixer = create_mixer(name, 32, 4, **kwargs)
    x = torch.randn(2, 8 * 8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mixer(x, (8, 8))
    out.float().square().mean().backward()
    assert torch.isfinite(out.float()).all() and torch.isfinite(x.grad).all()
    for pname, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("c", [1, 2, 3, 5, 8, 32, 33])
def test_unit_lower_solve_is_the_triangular_solve(c):
    """The product form of (I + L)^-1 rhs (used where a graph cannot hold a triangular solve) against LAPACK's
    solve, float64."""
    from linvision.ops.recurrent import unit_lower_solve
    g = torch.Generator().manual_seed(c)
    strict = torch.randn(3, c, c, generator=g, dtype=torch.float64).tril(-1)
    rhs = torch.randn(3, c, 5, generator=g, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(torch.eye(c, dtype=torch.float64) + strict, rhs, upper=False,
                                             unitriangular=True)
    torch.testing.assert_close(unit_lower_solve(strict, rhs), expected, rtol=1e-12, atol=1e-12)


def _forget_gate_start(num_heads, width=1, temperature=16.0, decay_range=(3.0, 10.0)):
    """b_h = logit(gamma_h^T) for gamma_h = 1 - 2^-e_h, e_h evenly spaced over decay_range, in float64."""
    e = torch.linspace(decay_range[0], decay_range[1], num_heads, dtype=torch.float64)
    gamma = 1 - 2.0 ** -e
    return torch.logit(gamma ** temperature).repeat_interleave(width)


def test_models_keep_the_gated_mixers_own_start():
    """The forget gate starts at W = 0 and b = logit(gamma_h^T) alone and inside every model family (linhier,
    linvit, the DiT): the models' generic Linear init runs before each module's own init_weights, not after."""
    import timm

    import linvision  # noqa: F401
    from linvision.diffusion import create_dit
    from linvision.layers.recurrent import BidirGatedAttention

    alone = create_mixer("bidir_gated", 64, 4)
    models = [timm.create_model("linhier_tiny_224", token_mixers="bidir_gated"),
              timm.create_model("linvit_tiny_patch16_rope_224", token_mixer="bidir_gated", rope="none",
                                class_token=False, global_pool="avg"),
              create_dit("digits", self_attn="bidir_gated")]
    gates = [alone] + [m for model in models for m in model.modules() if isinstance(m, BidirGatedAttention)]
    assert len(gates) > 1 + 12 + 4
    for gate in gates:
        expected = _forget_gate_start(gate.num_heads).float()
        assert torch.equal(gate.forget_gate.weight, torch.zeros_like(gate.forget_gate.weight))
        torch.testing.assert_close(gate.forget_gate.bias, expected, rtol=1e-6, atol=1e-6)
    # the generic init still reaches every other Linear: trunc-normal std 0.02 in linhier, not PyTorch's default
    qkv = next(m for m in models[0].modules() if isinstance(m, BidirGatedAttention)).qkv.weight
    assert 0.015 < qkv.std().item() < 0.025


@pytest.mark.parametrize("gates", [1, 5])
def test_decayed_counts_against_their_sums(gates):
    """The decayed token counts the kernels' gated forms normalise with (per head and per channel), against their
    sums written out in float64: forwards c_i = sum_{j <= i} exp(C_i - C_j) + exp(C_i) count0, backwards
    sum_{j > i, j real} exp(C_{j-1} - C_{i-1}), with padding after each sample's real tokens."""
    from linvision.ops.recurrent.kernels import decayed_counts

    b, h, n = 2, 3, 37
    g = torch.Generator().manual_seed(0)
    log_gate = F.logsigmoid(torch.randn(b, h, n, gates, generator=g, dtype=torch.float64) + 2)
    count0 = torch.rand(b, h, gates, generator=g, dtype=torch.float64) * 3
    valid = (torch.arange(n) < torch.tensor([n, 20])[:, None]).view(b, 1, n, 1)
    cum = log_gate.cumsum(2)
    fwd_want = torch.zeros_like(log_gate)
    bwd_want = torch.zeros_like(log_gate)
    for i in range(n):
        fwd_want[:, :, i] = (cum[:, :, i:i + 1] - cum[:, :, :i + 1]).exp().sum(2) + cum[:, :, i].exp() * count0
        prev_i = cum[:, :, i] - log_gate[:, :, i]
        for j in range(i + 1, n):
            term = (cum[:, :, j - 1] - prev_i).exp()
            bwd_want[:, :, i] += torch.where(valid[:, :, j], term, torch.zeros_like(term))
    fwd, _ = decayed_counts(log_gate, count0)
    torch.testing.assert_close(fwd, fwd_want, rtol=1e-12, atol=0)
    fwd, bwd = decayed_counts(log_gate, backward=True, valid=valid)
    torch.testing.assert_close(fwd, fwd_want - cum.exp() * count0.unsqueeze(2), rtol=1e-12, atol=0)
    torch.testing.assert_close(bwd, bwd_want, rtol=1e-12, atol=1e-300)
    assert fwd.shape == bwd.shape == log_gate.shape
