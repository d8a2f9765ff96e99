"""Token mixers against explicit O(N^2) formulas in float64, and their grid behaviour."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linvision.layers import (CONTEXT_PARTS, MixerBlock, MixerContext, TokenLayout, check_prefix_tokens,
                              create_mixer, get_mixer_class, list_mixers, mixer_accepts, mixer_options)
from linvision.layers.mixers import GatedConvMixer, HybridAttention, window_merge, window_partition
from linvision.ops import axial_rope, axial_rope_freqs


def _qkv(mixer, x):
    b, n, c = x.shape
    qkv = mixer.qkv(x).reshape(b, n, 3, mixer.num_heads, mixer.head_dim).permute(2, 0, 3, 1, 4)
    return qkv.unbind(0)  # each (B, heads, N, D)


def _rotate(x, cos, sin):
    p = x.shape[-1] // 2
    return torch.cat([x[..., :p] * cos - x[..., p:] * sin, x[..., :p] * sin + x[..., p:] * cos], dim=-1)


def _axial_tables(d, h, w, centre=False, ref=None):
    """Axial RoPE angles written out: pairs t < D/4 rotate with the column, the others with the row; positions
    counted from the first patch, or from the grid's centre; with ``ref`` (rows, cols), rows scaled by
    rows / h and columns by cols / w (position interpolation)."""
    p = d // 2
    sy, sx = (1.0, 1.0) if ref is None else (ref[0] / h, ref[1] / w)
    mag = 1.0 / 100.0 ** (torch.arange(0, d, 4, dtype=torch.float64) / d)
    rows = (torch.arange(h, dtype=torch.float64).repeat_interleave(w) - ((h - 1) / 2 if centre else 0)) * sy
    cols = (torch.arange(w, dtype=torch.float64).repeat(h) - ((w - 1) / 2 if centre else 0)) * sx
    ang = torch.cat([cols[:, None] * mag[None], rows[:, None] * mag[None]], dim=-1)  # (N, P)
    assert ang.shape[-1] == p
    return ang.cos(), ang.sin()


def _with_prefix_rows(tables, prefix):
    """RoPE tables with ``prefix`` leading rows of the identity rotation (cos 1, sin 0): prefix tokens unrotated."""
    cos, sin = tables
    return (torch.cat([torch.ones_like(cos[:prefix].expand(prefix, -1)), cos]),
            torch.cat([torch.zeros_like(sin[:prefix].expand(prefix, -1)), sin]))


def _explicit_linear(mixer, x, hw, rope_tables=None, causal=False, prefix=0):
    """o_i = sum_j (R_i phi(q_i)).(R_j phi(k_j)) v_j / (sum_j phi(q_i).phi(k_j) + n_i * eps), written as N x N
    matrices; n_i = number of keys token i sees. The first ``prefix`` tokens are plain tokens (``rope_tables`` must
    cover them) that LePE, a convolution of the grid's v, adds nothing to."""
    q, k, v = _qkv(mixer, x)
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    rq, rk = fq, fk
    if rope_tables is not None:
        rq, rk = _rotate(fq, *rope_tables), _rotate(fk, *rope_tables)
    a_num = rq @ rk.transpose(-1, -2)  # (B, heads, N, N)
    a_den = fq @ fk.transpose(-1, -2)
    n = x.shape[1]
    count = torch.full((n,), float(n), dtype=x.dtype)
    if causal:
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        a_num, a_den = a_num.masked_fill(~mask, 0), a_den.masked_fill(~mask, 0)
        count = torch.arange(1, n + 1, dtype=x.dtype)
    out = (a_num @ v) / (a_den.sum(-1, keepdim=True) + count[:, None] * mixer.eps)
    out = out.transpose(1, 2).reshape(x.shape)
    if mixer.lepe is not None:
        b, c = x.shape[0], x.shape[2]
        v_grid = v[:, :, prefix:].transpose(1, 2).reshape(b, *hw, c).permute(0, 3, 1, 2)
        out[:, prefix:] = out[:, prefix:] + mixer.lepe(v_grid).flatten(2).transpose(1, 2)
    if mixer.gate is not None:
        out = out * F.silu(mixer.gate(x))
    return mixer.proj(out)


@pytest.mark.parametrize("name, kwargs, causal", [
    ("linear", {}, False),
    ("linear", dict(gate=True, lepe=True), False),
    ("linear_rope", {}, False),
    ("causal", dict(rope="axial"), True),
])
def test_linear_mixers_match_explicit_formula(name, kwargs, causal):
    torch.manual_seed(0)
    hw = (3, 5)
    mixer = create_mixer(name, 32, 2, **kwargs).double()
    x = torch.randn(2, 15, 32, dtype=torch.float64)
    tables = _axial_tables(16, *hw) if mixer.rope_type == "axial" else None
    expected = _explicit_linear(mixer, x, hw, tables, causal)
    # RoPE tables are fp32 by design (angles of large grids), hence the looser tolerance with RoPE.
    tol = dict(rtol=1e-9, atol=1e-10) if tables is None else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mixer(x, hw), expected, **tol)


@pytest.mark.parametrize("name, kwargs", [("linear", dict(gate=True, lepe=True)), ("linear_rope", {}),
                                          ("linear", dict(rope="axial"))])
def test_linear_mixers_with_prefix_tokens_match_explicit_formula(name, kwargs):
    """Prefix tokens (class / register tokens) are keys and queries like the grid's tokens; RoPE leaves them
    unrotated and LePE adds nothing to them."""
    torch.manual_seed(2)
    hw, prefix = (3, 5), 2
    mixer = create_mixer(name, 32, 2, **kwargs).double()
    x = torch.randn(2, prefix + 15, 32, dtype=torch.float64)
    tables = _with_prefix_rows(_axial_tables(16, *hw), prefix) if mixer.rope_type == "axial" else None
    expected = _explicit_linear(mixer, x, hw, tables, prefix=prefix)
    tol = dict(rtol=1e-9, atol=1e-10) if tables is None else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mixer(x, MixerContext(hw, prefix)), expected, **tol)


def test_softmax_mixer_with_prefix_tokens_matches_explicit_formula():
    torch.manual_seed(3)
    mixer = create_mixer("softmax", 32, 4, rope="axial").double()
    x = torch.randn(2, 1 + 12, 32, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    cos, sin = _with_prefix_rows(_axial_tables(8, 3, 4), 1)
    scores = _rotate(q, cos, sin) @ _rotate(k, cos, sin).transpose(-1, -2) / math.sqrt(8)
    expected = mixer.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(mixer(x, MixerContext((3, 4), 1)), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rope", ["axial", "mixed"])
def test_rope_origin_centre_puts_the_class_token_at_the_grid_centre(rope):
    """rope_origin='centre': the grid's positions are counted from its centre, so the unrotated class token sits
    there as RoPE sees it (softmax, float64, a 3 x 4 grid). Without prefix tokens nothing changes."""
    torch.manual_seed(3)
    mixer = create_mixer("softmax", 32, 4, rope=rope, rope_origin="centre").double()
    x = torch.randn(2, 1 + 12, 32, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    if rope == "axial":
        cos, sin = _with_prefix_rows(_axial_tables(8, 3, 4, centre=True), 1)
    else:  # per head: col * fx + row * fy from the centre, written out
        rows = torch.arange(3, dtype=torch.float64).repeat_interleave(4) - 1.0
        cols = torch.arange(4, dtype=torch.float64).repeat(3) - 1.5
        ang = cols[None, :, None] * mixer.rope_freqs_x[:, None] + rows[None, :, None] * mixer.rope_freqs_y[:, None]
        ang = torch.cat([ang.new_zeros(4, 1, 4), ang], dim=1)  # (heads, 1 + 12, P)
        cos, sin = ang.cos(), ang.sin()
    scores = _rotate(q, cos, sin) @ _rotate(k, cos, sin).transpose(-1, -2) / math.sqrt(8)
    expected = mixer.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(mixer(x, MixerContext((3, 4), 1)), expected, rtol=1e-5, atol=1e-7)
    corner = create_mixer("softmax", 32, 4, rope=rope).double()
    corner.load_state_dict(mixer.state_dict())
    assert not torch.allclose(corner(x, MixerContext((3, 4), 1)), expected, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(corner(x[:, 1:], (3, 4)), mixer(x[:, 1:], (3, 4)), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="rope_origin: unknown 'middle'"):
        create_mixer("softmax", 32, 4, rope=rope, rope_origin="middle")


@pytest.mark.parametrize("rope", ["axial", "mixed"])
@pytest.mark.parametrize("origin", ["corner", "centre"])
def test_rope_ref_grid_interpolates_the_positions_to_the_reference_grid(rope, origin):
    """rope_ref_grid=(3, 4) on a 5 x 7 grid: a token at (row, col) turns as at (row * 3 / 5, col * 4 / 7), from
    the corner or the centre (softmax with a class token, float64, the angles written out). On the 3 x 4
    reference grid itself the mixer computes exactly what it computes without the option."""
    torch.manual_seed(4)
    mixer = create_mixer("softmax", 32, 4, rope=rope, rope_origin=origin, rope_ref_grid=(3, 4)).double()
    x = torch.randn(2, 1 + 35, 32, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    centre = origin == "centre"
    if rope == "axial":
        cos, sin = _with_prefix_rows(_axial_tables(8, 5, 7, centre=centre, ref=(3, 4)), 1)
    else:  # per head: col * fx + row * fy, the positions scaled, written out
        rows = (torch.arange(5, dtype=torch.float64).repeat_interleave(7) - (2.0 if centre else 0.0)) * 3 / 5
        cols = (torch.arange(7, dtype=torch.float64).repeat(5) - (3.0 if centre else 0.0)) * 4 / 7
        ang = cols[None, :, None] * mixer.rope_freqs_x[:, None] + rows[None, :, None] * mixer.rope_freqs_y[:, None]
        ang = torch.cat([ang.new_zeros(4, 1, 4), ang], dim=1)
        cos, sin = ang.cos(), ang.sin()
    scores = _rotate(q, cos, sin) @ _rotate(k, cos, sin).transpose(-1, -2) / math.sqrt(8)
    expected = mixer.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(mixer(x, MixerContext((5, 7), 1)), expected, rtol=1e-5, atol=1e-7)
    plain = create_mixer("softmax", 32, 4, rope=rope, rope_origin=origin).double()
    plain.load_state_dict(mixer.state_dict())
    assert not torch.allclose(plain(x, MixerContext((5, 7), 1)), expected, rtol=1e-3, atol=1e-4)
    x12 = x[:, :13]
    assert torch.equal(mixer(x12, MixerContext((3, 4), 1)), plain(x12, MixerContext((3, 4), 1)))


def test_rope_ref_grid_reaches_linear_attention_and_is_refused_without_rope():
    """The linear mixer turns its numerator with the interpolated angles (float64, the explicit N x N form); an
    int is a square grid; without RoPE, or with a grid that is no pair of positive ints, one ValueError line."""
    torch.manual_seed(6)
    mixer = create_mixer("linear", 32, 2, rope="axial", rope_ref_grid=4).double()
    assert mixer.rope_ref_grid == (4, 4)
    x = torch.randn(2, 6 * 5, 32, dtype=torch.float64)
    expected = _explicit_linear(mixer, x, (6, 5), _axial_tables(16, 6, 5, ref=(4, 4)))
    torch.testing.assert_close(mixer(x, (6, 5)), expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="rope_ref_grid: position interpolation needs RoPE; rope is None"):
        create_mixer("linear", 32, 2, rope_ref_grid=4)
    with pytest.raises(ValueError, match=r"rope_ref_grid: expected a positive int or \(rows, cols\)"):
        create_mixer("linear", 32, 2, rope="axial", rope_ref_grid=(4, 0))


def test_rope_fraction_turns_only_that_share_of_the_channel_pairs():
    """rope_fraction=0.5 with a head dim of 16: of each axis' 4 pairs, 2 turn with the frequencies of a head dim of
    8 (1 and 100^-1/2), the other 2 carry no position (float64, softmax with a class token, 3 x 4 grid)."""
    torch.manual_seed(5)
    mixer = create_mixer("softmax", 32, 2, rope="axial", rope_fraction=0.5).double()
    x = torch.randn(2, 1 + 12, 32, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    rows = torch.arange(3, dtype=torch.float64).repeat_interleave(4)
    cols = torch.arange(4, dtype=torch.float64).repeat(3)
    mag = torch.tensor([1.0, 0.1], dtype=torch.float64)
    still = torch.zeros(12, 2, dtype=torch.float64)
    ang = torch.cat([cols[:, None] * mag, still, rows[:, None] * mag, still], dim=-1)  # (12, 8 pairs)
    cos, sin = _with_prefix_rows((ang.cos(), ang.sin()), 1)
    scores = _rotate(q, cos, sin) @ _rotate(k, cos, sin).transpose(-1, -2) / math.sqrt(16)
    expected = mixer.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(mixer(x, MixerContext((3, 4), 1)), expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="rope_fraction: only axial RoPE"):
        create_mixer("softmax", 32, 2, rope="mixed", rope_fraction=0.5)
    with pytest.raises(ValueError, match=r"rope_fraction: the fraction .* must be in \(0, 1\], got 0.0"):
        create_mixer("softmax", 32, 2, rope="axial", rope_fraction=0.0)
    with pytest.raises(ValueError, match=r"rotate: the fraction .* must be in \(0, 1\], got 1.5"):
        axial_rope_freqs(16, rotate=1.5)


# mixers that take prefix tokens but whose grid part no option removes (InLine-DeiT's local residual on the patch
# tokens, checked against its formula in test_published_inline)
GRID_BOUND = {"inline_deit"}


@pytest.mark.parametrize("name", list_mixers())
def test_prefix_tokens_taken_or_refused_in_one_line(name):
    """A mixer that takes prefix tokens and has no RoPE or LePE treats them as tokens: the same output as the whole
    sequence on a one-row grid. A mixer that works on the grid refuses them, naming itself."""
    torch.manual_seed(4)
    options = {k: v for k, v in dict(rope=None, lepe=False).items() if k in mixer_options(name)}
    mixer = create_mixer(name, 32, 2, **options).double()
    x = torch.randn(2, 2 + 12, 32, dtype=torch.float64)
    if not mixer_accepts(name, "prefix_tokens"):
        block = MixerBlock(32, 2, name, options).double()
        with pytest.raises(ValueError, match=f"token mixer {name!r} cannot take prefix tokens"):
            block(x, (3, 4), num_prefix_tokens=2)
        return
    if name not in GRID_BOUND:
        torch.testing.assert_close(mixer(x, MixerContext((3, 4), 2)), mixer(x, (1, 14)), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="hw"):
        mixer(x, MixerContext((3, 4), 1))


def test_axial_tables_written_out_match_ops():
    cos, sin = _axial_tables(16, 3, 5)
    ref_cos, ref_sin = axial_rope(16, (3, 5)).tables()
    torch.testing.assert_close(cos.float(), ref_cos[0])
    torch.testing.assert_close(sin.float(), ref_sin[0])


def test_softmax_mixer_matches_explicit_formula():
    torch.manual_seed(1)
    mixer = create_mixer("softmax", 32, 4, rope="axial").double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    cos, sin = _axial_tables(8, 3, 4)
    scores = _rotate(q, cos, sin) @ _rotate(k, cos, sin).transpose(-1, -2) / math.sqrt(8)
    expected = mixer.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(mixer(x, (3, 4)), expected, rtol=1e-5, atol=1e-7)  # fp32 RoPE tables


def test_hybrid_mixer_matches_explicit_formula():
    """Local softmax over same-window tokens (grid 5 x 7 is not a multiple of the window 3) mixed per head with
    global linear attention by sigmoid(mix_logit)."""
    torch.manual_seed(2)
    hw, window = (5, 7), 3
    mixer = HybridAttention(24, 3, window=window).double()
    with torch.no_grad():
        mixer.mix_logit.copy_(torch.tensor([-1.0, 0.3, 2.0]))
    x = torch.randn(2, 35, 24, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    rows = torch.arange(5).repeat_interleave(7)
    cols = torch.arange(7).repeat(5)
    same = ((rows[:, None] // window) == (rows[None] // window)) & ((cols[:, None] // window) == (cols[None] // window))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~same, float("-inf"))
    local = scores.softmax(-1) @ v
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    a = fq @ fk.transpose(-1, -2)
    global_ = (a @ v) / (a.sum(-1, keepdim=True) + 35 * mixer.eps)
    g = torch.sigmoid(mixer.mix_logit)[None, :, None, None]
    expected = mixer.proj((g * local + (1 - g) * global_).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(mixer(x, hw), expected, rtol=1e-9, atol=1e-10)


def test_hybrid_mixer_recomputes_its_windows_in_the_backward():
    """HybridAttention follows the recompute policy: its padded window copies, rotated q, k and both branch outputs
    are not kept for the backward (fewer saved bytes than with recompute off), and the gradients are the same."""
    torch.manual_seed(5)
    mixer = HybridAttention(32, 2, window=3, rope="axial").double()
    x = torch.randn(2, 7 * 8, 32, dtype=torch.float64, requires_grad=True)

    def run(recompute):
        mixer.recompute_attend = recompute  # the class default, or off for this instance
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = mixer(x, (7, 8))
        return sum(saved), torch.autograd.grad(out.square().sum(), [x, *mixer.parameters()])

    assert HybridAttention.recompute_attend
    kept, grads = run(True)
    kept_all, grads_all = run(False)
    assert kept < 0.6 * kept_all
    for a, b in zip(grads, grads_all):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_window_partition_round_trip_and_padding():
    x = torch.randn(1, 2, 5 * 7, 4)
    windows, valid, padded = window_partition(x, (5, 7), 3)
    assert windows.shape == (1, 2, 6, 9, 4) and padded == (6, 9)
    assert valid.sum().item() == 35
    torch.testing.assert_close(window_merge(windows, (5, 7), padded, 3), x)


def test_gated_conv_mixer_formula_and_receptive_field():
    """out = fc2(gelu(g) * [i, dwconv7(c)]): check by hand, and that token (r, c) depends only on tokens
    within the 7 x 7 window around it."""
    torch.manual_seed(3)
    hw = (9, 10)
    mixer = GatedConvMixer(16, 1, conv_ratio=0.5).double()
    x = torch.randn(1, 90, 16, dtype=torch.float64, requires_grad=True)
    g, i, c = torch.split(mixer.fc1(x), (42, 34, 8), dim=-1)
    conv = F.conv2d(c.transpose(1, 2).reshape(1, 8, 9, 10), mixer.conv.weight, mixer.conv.bias, padding=3, groups=8)
    expected = mixer.fc2(F.gelu(g) * torch.cat([i, conv.flatten(2).transpose(1, 2)], dim=-1))
    out = mixer(x, hw)
    torch.testing.assert_close(out, expected)
    (grad,) = torch.autograd.grad(out[0, 4 * 10 + 5].sum(), x)
    touched = grad[0].abs().sum(-1).reshape(9, 10) > 0
    rows, cols = torch.meshgrid(torch.arange(9), torch.arange(10), indexing="ij")
    inside = ((rows - 4).abs() <= 3) & ((cols - 5).abs() <= 3)
    assert torch.equal(touched, inside)


@pytest.mark.parametrize("name", ["linear", "linear_rope", "softmax", "causal", "hybrid", "none"])
def test_every_mixer_any_grid(name):
    """Every mixer maps (B, H*W, C) to the same shape on square, non-square and odd grids, with gradients."""
    torch.manual_seed(4)
    mixer = create_mixer(name, 32, 2)
    for hw in [(4, 4), (3, 7), (1, 5)]:
        x = torch.randn(2, hw[0] * hw[1], 32, requires_grad=True)
        y = mixer(x, hw)
        assert y.shape == x.shape and torch.isfinite(y).all()
        y.square().mean().backward()
        for pname, p in mixer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), pname
            assert p.grad.abs().sum() > 0, pname  # every parameter takes part in the output


def test_mixer_rejects_wrong_grid_and_options():
    mixer = create_mixer("linear", 32, 2)
    with pytest.raises(ValueError, match="hw"):
        mixer(torch.randn(1, 12, 32), (3, 5))
    with pytest.raises(ValueError, match="rope"):
        create_mixer("linear", 32, 2, rope="spiral")
    with pytest.raises(ValueError, match="num_heads"):
        create_mixer("softmax", 30, 4)
    with pytest.raises(ValueError, match="feature_map"):
        create_mixer("linear", 32, 2, feature_map="tanh")


def test_mixer_options_follow_class_hierarchy():
    assert set(list_mixers()) >= {"gated_cnn", "linear", "linear_rope", "softmax", "causal", "hybrid"}
    assert "rope" in mixer_options("linear_rope") and "window" in mixer_options("hybrid")
    assert "rope" not in mixer_options("none") and "kernel_size" in mixer_options("none")


@pytest.mark.parametrize("rope", ["axial", "mixed"])
def test_rope_mixer_output_moves_with_shifted_content(rope):
    """Place the same tokens at a shifted position of a larger grid, the rest being zero tokens (with relu
    features and no qkv bias, zero tokens have zero keys and values and contribute nothing, like the zero
    padding of LePE). With RoPE only relative positions matter, so the output moves with the content.
    eps is tiny because it is the one term that sees the token count (o_i = num_i / (den_i + N eps))."""
    torch.manual_seed(5)
    mixer = create_mixer("linear_rope", 32, 2, rope=rope, feature_map="relu", qkv_bias=False, eps=1e-12).double()
    h, w, dr, dc = 3, 4, 2, 3
    x = torch.randn(1, h * w, 32, dtype=torch.float64)
    big = torch.zeros(1, h + 4, w + 5, 32, dtype=torch.float64)
    big[:, dr:dr + h, dc:dc + w] = x.reshape(1, h, w, 32)
    out_big = mixer(big.reshape(1, -1, 32), (h + 4, w + 5)).reshape(1, h + 4, w + 5, 32)
    shifted = out_big[:, dr:dr + h, dc:dc + w].reshape(1, h * w, 32)
    torch.testing.assert_close(shifted, mixer(x, (h, w)), rtol=1e-5, atol=1e-7)  # fp32 RoPE tables


def test_mixed_rope_frequencies_learn():
    mixer = create_mixer("linear_rope", 32, 2, rope="mixed")
    x = torch.randn(2, 12, 32)
    mixer(x, (3, 4)).square().mean().backward()
    assert mixer.rope_freqs_x.grad.abs().sum() > 0 and mixer.rope_freqs_y.grad.abs().sum() > 0


def _explicit_phi(name, x, is_query, focus_scale=None):
    """The layer feature maps written out in float64 (``exp`` stabilised as linvision.ops documents it: per
    token for queries, one constant per (batch, head) for keys; ``focused`` is FLatten's p = 3 map of
    (relu(x) + 1e-6) / softplus(scale), norm-preserving)."""
    if name == "relu":
        return F.relu(x)
    if name == "exp":
        m = x.amax(-1, keepdim=True) if is_query else x.amax((-2, -1), keepdim=True)
        return torch.exp(x - m)
    r = (F.relu(x) + 1e-6) / F.softplus(focus_scale)
    p = r ** 3
    return p * r.norm(dim=-1, keepdim=True) / p.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("feature_map", ["relu", "exp", "focused"])
def test_linear_attention_feature_maps(feature_map):
    """Each map changes the output (against elu+1 with the same weights) to what its formula gives."""
    torch.manual_seed(0)
    mixer = create_mixer("linear", 32, 2, feature_map=feature_map).double()
    elu = create_mixer("linear", 32, 2).double()
    elu.load_state_dict({k: v for k, v in mixer.state_dict().items() if k != "focus_scale"})
    assert (mixer.focus_scale is not None) == (feature_map == "focused")
    if mixer.focus_scale is not None:
        with torch.no_grad():
            mixer.focus_scale.copy_(torch.linspace(-1, 1, 16))
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    q, k, v = _qkv(mixer, x)
    fq = _explicit_phi(feature_map, q, True, mixer.focus_scale)
    fk = _explicit_phi(feature_map, k, False, mixer.focus_scale)
    a = fq @ fk.transpose(-1, -2)  # (B, heads, N, N)
    expected = (a @ v) / (a.sum(-1, keepdim=True) + 12 * mixer.eps)
    expected = mixer.proj(expected.transpose(1, 2).reshape(x.shape))
    out = mixer(x, (3, 4))
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    assert (out - elu(x, (3, 4))).abs().max() > 1e-3


@pytest.mark.parametrize("mixer_name", ["linear", "causal", "rala", "mala", "hybrid", "bidir_gated"])
def test_every_mixer_keeps_what_its_feature_map_holds(mixer_name):
    """The table FEATURE_MAPS says what a map holds and every mixer that takes maps keeps it: the focused map's
    learnable scale (a parameter that the loss reaches), Performer's projection (a persistent buffer), nothing for
    the others (their map resolved once, at construction)."""
    from linvision.ops.common import FEATURE_MAPS

    torch.manual_seed(0)
    x = torch.randn(2, 12, 32)
    for name, info in FEATURE_MAPS.items():
        try:
            mixer = create_mixer(mixer_name, 32, 2, feature_map=name)
        except ValueError as e:  # a map this mixer refuses: the table's needs say why
            assert "does not fit this mixer" in str(e), e
            continue
        keys = set(mixer.state_dict())
        assert ("focus_scale" in keys) == info.learnable and ("performer_projection" in keys) == info.random
        if not info.stateful:
            assert mixer.phi() is mixer.phi() and mixer.phi().name == name
        if info.learnable:
            mixer(x, (3, 4)).square().mean().backward()
            assert mixer.focus_scale.grad is not None and mixer.focus_scale.grad.abs().sum() > 0


def test_mixer_block_with_cpe_matches_its_formula():
    """x + cpe1(x); + mixer(norm1(x)); + cpe2(x); + mlp(norm2(x)) on channels-last tokens, and without CPE the
    plain pre-norm block (no CPE parameters)."""
    from linvision.layers import MixerBlock

    torch.manual_seed(0)
    block = MixerBlock(16, 2, "linear", cpe=True).double().eval()
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)

    def dwconv(conv, t):
        return F.conv2d(t.permute(0, 3, 1, 2), conv.weight, conv.bias, padding=1, groups=16).permute(0, 2, 3, 1)

    y = x + dwconv(block.cpe1.proj, x)
    y = y + block.mixer(F.layer_norm(y, (16,), block.norm1.weight, block.norm1.bias, eps=1e-6).reshape(2, 15, 16),
                        (3, 5)).reshape(2, 3, 5, 16)
    y = y + dwconv(block.cpe2.proj, y)
    hidden = F.gelu(F.linear(F.layer_norm(y, (16,), block.norm2.weight, block.norm2.bias, eps=1e-6),
                             block.mlp.fc1.weight, block.mlp.fc1.bias))
    y = y + F.linear(hidden, block.mlp.fc2.weight, block.mlp.fc2.bias)
    torch.testing.assert_close(block(x), y, rtol=1e-12, atol=1e-12)
    assert not any("cpe" in k for k in MixerBlock(16, 2, "linear").state_dict())


@pytest.mark.parametrize("name", list_mixers())
def test_every_registered_mixer_keeps_the_token_mixer_contract(name):
    """Each registered mixer is a TokenMixer: built as cls(dim, num_heads) from its name, maps (B, N, C) on a
    non-square grid to (B, N, C) and gives each image what it gives it alone; the grid alone and its context give
    the same; takes prefix tokens and a layout exactly when its class accepts them, refusing the others in one
    line; lists its options; its init_weights and no_weight_decay run."""
    from linvision.layers import TokenMixer, mixer_options

    cls = get_mixer_class(name)
    assert issubclass(cls, TokenMixer) and cls.options() == mixer_options(name)
    assert isinstance(cls.recompute_attend, bool)  # the contract's training-memory policy
    torch.manual_seed(0)
    mixer = create_mixer(name, 32, 2).double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        out = mixer(x, (3, 4))
        alone = mixer(x[1:], (3, 4))
    assert out.shape == x.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], alone, rtol=1e-9, atol=1e-9)
    assert cls.accepts <= set(CONTEXT_PARTS)
    with torch.no_grad():  # the grid alone is the context of the grid; the block's input is read or ignored
        assert torch.equal(mixer(x, MixerContext((3, 4))), out)
        beside = mixer(x, MixerContext((3, 4), block_input=x.reshape(2, 3, 4, 32)))
    if name != "inline_cswin":  # the one mixer that reads the block's input (its local kernels' mean)
        assert torch.equal(beside, out)
    with_prefix = torch.randn(1, 13, 32, dtype=torch.float64)
    if "prefix_tokens" in cls.accepts:
        with torch.no_grad():
            assert mixer(with_prefix, MixerContext((3, 4), 1)).shape == with_prefix.shape
    else:
        with pytest.raises(ValueError, match=f"token mixer {name!r} cannot take prefix tokens"):
            mixer(with_prefix, MixerContext((3, 4), 1))
    if "layout" not in cls.accepts:
        coord = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij"), -1).reshape(1, 12, 2)
        with pytest.raises(ValueError, match=f"token mixer {name!r} cannot take a batch of images of different"):
            mixer(x[:1], MixerContext((3, 4), layout=TokenLayout.from_patches(coord)))
    mixer.init_weights()
    assert isinstance(mixer.no_weight_decay(), set)


def test_recompute_policy_is_stated_by_the_contract_for_every_mixer():
    """recompute_attend is a TokenMixer attribute (False there); the attention mixers start at True and the linear
    and softmax ones turn it off, as before; the registered mixers that are not attention mixers (the Gated CNN,
    MLLA's block) keep the contract's False."""
    from linvision.layers import (AttentionMixer, LinearAttention, SoftmaxAttention, TokenMixer,
                                  mixers as mixer_module)

    assert TokenMixer.recompute_attend is False and "recompute_attend" in TokenMixer.__doc__
    assert "recompute_attend" not in vars(mixer_module.GatedConvMixer)
    assert AttentionMixer.recompute_attend is True and HybridAttention.recompute_attend is True
    assert LinearAttention.recompute_attend is False and SoftmaxAttention.recompute_attend is False
    others = [n for n in list_mixers() if not issubclass(get_mixer_class(n), AttentionMixer)]
    assert {"gated_cnn", "mlla"} <= set(others)
    assert not any(get_mixer_class(n).recompute_attend for n in others)


def test_register_mixer_refuses_a_class_outside_the_contract():
    from linvision.layers import register_mixer

    class Plain(nn.Module):
        def forward(self, x, hw):
            return x

    with pytest.raises(TypeError, match="is not a TokenMixer subclass"):
        register_mixer("plain_test")(Plain)
    assert "plain_test" not in list_mixers()


def test_init_model_weights_honours_a_modules_own_reset_parameters_and_never_pytorchs():
    """After the generic rule: a module's init_weights() when it has one, else a reset_parameters() its own class
    defines (timm's LayerScale, a project module, a TokenMixer through its default init_weights); PyTorch's own
    reset_parameters (Linear, Conv, LayerNorm) is never called, so the generic Linear init and the other layers'
    construction stay."""
    from timm.layers import LayerScale

    from linvision.layers import TokenMixer, init_model_weights, own_reset_parameters

    calls = []

    class OwnReset(nn.Module):  # its own start covers its child Linear
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.zeros(4))
            self.fc = nn.Linear(4, 4)

        def reset_parameters(self):
            calls.append("own reset")
            nn.init.constant_(self.scale, 3.0)
            nn.init.constant_(self.fc.weight, 0.5)

    class Both(nn.Module):  # init_weights wins, as in timm
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.zeros(2))

        def init_weights(self):
            calls.append("init_weights")
            nn.init.constant_(self.p, 1.0)

        def reset_parameters(self):
            calls.append("both reset")

    class ResetMixer(TokenMixer):
        def __init__(self, dim, num_heads):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(dim))

        def reset_parameters(self):
            calls.append("mixer reset")
            nn.init.constant_(self.bias, -1.0)

        def mix(self, x, ctx):
            return x + self.bias

    class OwnLinear(nn.Linear):  # a Linear with its own start keeps it over the generic rule
        def reset_parameters(self):
            if hasattr(self, "weight"):
                nn.init.ones_(self.weight)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Conv2d(3, 4, 3), nn.LayerNorm(4), OwnReset(), Both(),
                          ResetMixer(4, 1), LayerScale(4, init_values=1e-5), OwnLinear(3, 3))
    conv = model[1].weight.detach().clone()
    with torch.no_grad():
        for p in (model[2].weight, model[2].bias, model[6].gamma):
            p.fill_(7.0)  # what a PyTorch reset would undo, and what LayerScale's own resets
    calls.clear()
    init_model_weights(model)
    assert sorted(calls) == ["init_weights", "mixer reset", "own reset"]
    assert 0.015 < model[0].weight.std().item() < 0.025 and not model[0].bias.any()  # generic, not PyTorch's
    assert torch.equal(model[1].weight, conv)  # Conv2d's reset_parameters not called
    assert torch.equal(model[2].weight, torch.full((4,), 7.0)) and torch.equal(model[2].bias, torch.full((4,), 7.0))
    assert torch.equal(model[3].scale, torch.full((4,), 3.0))
    assert torch.equal(model[3].fc.weight, torch.full((4, 4), 0.5))
    assert torch.equal(model[4].p, torch.ones(2)) and torch.equal(model[5].bias, torch.full((4,), -1.0))
    assert torch.equal(model[6].gamma, torch.full((4,), 1e-5)) and torch.equal(model[7].weight, torch.ones(3, 3))
    assert own_reset_parameters(nn.Linear(2, 2)) is None and own_reset_parameters(nn.ReLU()) is None


def test_gated_cnn_is_registered_by_its_name_and_none_is_an_alias():
    """The Gated CNN mixer is "gated_cnn"; "none", the name the ablation configs use, builds the same class (same
    options and parameters) without being listed twice; an unknown name's error names both."""
    from linvision.layers import TokenMixer, mixer_options
    from linvision.layers.registry import register_mixer

    assert get_mixer_class("gated_cnn") is GatedConvMixer and get_mixer_class("none") is GatedConvMixer
    assert "gated_cnn" in list_mixers() and "none" not in list_mixers()
    assert mixer_options("none") == mixer_options("gated_cnn")
    torch.manual_seed(0)
    a = create_mixer("none", 16, 2)
    torch.manual_seed(0)
    b = create_mixer("gated_cnn", 16, 2)
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randn(2, 12, 16)
    torch.testing.assert_close(a(x, (3, 4)), b(x, (3, 4)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^token mixer: unknown 'gcnn'; allowed: .*gated_cnn.*none \(= gated_cnn\)"):
        get_mixer_class("gcnn")
    with pytest.raises(ValueError, match=r"^token mixer 'none' cannot take prefix tokens"):
        check_prefix_tokens("none", 1)  # the name the caller gave; a built mixer by its registered name
    with pytest.raises(ValueError, match=r"^token mixer 'gated_cnn' cannot take prefix tokens"):
        check_prefix_tokens(a, 1)
    with pytest.raises(ValueError, match=r"^name: token mixer 'none' is already registered by GatedConvMixer"):
        register_mixer("another", "none")(type("Other", (TokenMixer,), {}))


def _saved_and_grads(module, x, dtype=None):
    """Bytes kept for the backward by one forward (distinct storages, parameters excluded) and the gradients."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
        out = module(x)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *module.parameters()])
    return sum(saved.values()), out, grads


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float64", "autocast-bf16"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_recompute_mlp_equals_timms_mlp_and_keeps_less(dtype, approximate, caplog):
    """RecomputeMlp has timm Mlp's state dict and its forward and gradients (float64 to rounding; under bf16
    autocast the same bf16 products), in training keeps the hidden pre-activations but not the GELU's output nor
    (autocast) fc2's cast weight, and in eval or without grad is timm's forward; its training step logs nothing
    (torch's ``is_fx_tracing`` warns on its first call)."""
    import logging
    from functools import partial

    import torch.fx._symbolic_trace as fx_trace

    from timm.layers import Mlp

    from linvision.layers import RecomputeMlp
    torch.manual_seed(0)
    act = partial(nn.GELU, approximate=approximate)
    ref = Mlp(24, 96, act_layer=act).double()
    ours = RecomputeMlp(24, 96, act_layer=act).double()
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 5, 7, 24, dtype=torch.float64, requires_grad=True)
    if dtype is not None:
        ref, ours, x = ref.float(), ours.float(), x.detach().float().requires_grad_()
    kept_ref, out_ref, grads_ref = _saved_and_grads(ref, x, dtype)
    if hasattr(fx_trace, "is_fx_tracing_warning"):
        fx_trace.is_fx_tracing_warning.cache_clear()  # as in a fresh process
    with caplog.at_level(logging.WARNING):
        kept, out, grads = _saved_and_grads(ours, x, dtype)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    tol = dict(rtol=1e-10, atol=1e-12) if dtype is None else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, **tol)
    hidden = 2 * 5 * 7 * 96 * (8 if dtype is None else 2)  # one hidden-width tensor: the GELU's output
    assert kept <= kept_ref - hidden
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref.eval()(x), rtol=0, atol=0)


def test_models_train_to_the_same_gradients_with_timms_mlp():
    """A linhier and a linvit with the default RecomputeMlp against the same weights in timm's Mlp: equal loss
    gradients in float64 (the model path, drop path and layer scale included)."""
    import timm
    from timm.layers import Mlp

    import linvision  # noqa: F401
    for name, kwargs, size in [("linhier_tiny_224", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64),
                                                         num_heads=(1, 1, 2, 2)), 64),
                               ("linvit_tiny_patch16_224", dict(depth=2, patch_size=8), 32)]:
        grads = []
        for mlp in (None, Mlp):
            torch.manual_seed(0)
            extra = {} if mlp is None else dict(mlp_layer=mlp)
            model = timm.create_model(name, num_classes=3, img_size=size, **kwargs, **extra).double().train()
            assert any(type(m).__name__ == ("RecomputeMlp" if mlp is None else "Mlp") for m in model.modules())
            x = torch.randn(2, 3, size, size - 8 if name.startswith("linhier") else size, dtype=torch.float64)
            loss = model(x).square().sum()
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mode", ["autocast-fp16", "autocast-bf16", "bf16-weights", "compile"])
def test_recompute_mlp_in_the_modes_people_train(mode):
    """RecomputeMlp against timm's Mlp at batch 1 on an odd non-square grid of 105k tokens, after an
    inference_mode forward: under fp16 and bf16 autocast, with bf16 weights, and compiled (fullgraph, aot_eager):
    the same output and gradients to the dtype's rounding."""
    from timm.layers import Mlp

    from linvision.layers import RecomputeMlp
    torch.manual_seed(0)
    ref, ours = Mlp(8, 32), RecomputeMlp(8, 32)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, 317, 331, 8)
    dtype = {"autocast-fp16": torch.float16, "autocast-bf16": torch.bfloat16}.get(mode)
    if mode == "bf16-weights":
        ref, ours, x = ref.bfloat16(), ours.bfloat16(), x.bfloat16()
    run = torch.compile(ours, fullgraph=True, backend="aot_eager") if mode == "compile" else ours
    with torch.inference_mode():
        torch.testing.assert_close(run.eval()(x), ref.eval()(x), rtol=0, atol=0)
    ours.train(), ref.train()
    x = x.clone().requires_grad_()
    grads = []
    for module in (run, ref):
        with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
            out = module(x)
        grads.append((out, *torch.autograd.grad(out.float().square().mean(), [x, *ref.parameters()]
                                                if module is ref else [x, *ours.parameters()])))
    tol = dict(rtol=0, atol=0) if mode == "compile" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for a, b in zip(grads[0][1:], grads[1][1:]):
        torch.testing.assert_close(a.float(), b.float(), **tol)


class _PlainGate(nn.Module):
    """linear(a * act(g)) as autograd records it: the reference of gated_linear."""

    def __init__(self, linear, act):
        super().__init__()
        self.linear, self.act = linear, act

    def forward(self, a, g):
        return self.linear(a * self.act(g))


@pytest.mark.parametrize("mode", ["float64", "autocast-bf16", "autocast-fp16", "bf16-weights"])
@pytest.mark.parametrize("act", ["silu", "identity"])
def test_gated_linear_equals_the_plain_product_and_keeps_less(mode, act):
    """gated_linear (an attention's gate and output projection) against linear(a * act(g)) recorded by autograd:
    the same output, and gradients of a, g, the weight and the bias to the dtype's rounding (float64: 1e-12), while
    keeping at least two tensors of the output's size fewer for the backward (act(g) and the product); at batch 1
    on an odd grid of 105k tokens, after an inference_mode forward, which is the plain computation."""
    from linvision.layers.recompute import gated_linear

    torch.manual_seed(0)
    act_fn = F.silu if act == "silu" else (lambda t: t)
    linear = nn.Linear(8, 8)
    n = (1, 317 * 331, 8) if mode != "float64" else (2, 13, 8)
    a, g = torch.randn(*n), torch.randn(*n)
    dtype = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(mode)
    if mode == "float64":
        linear, a, g = linear.double(), a.double(), g.double()
    if mode == "bf16-weights":
        linear, a, g = linear.bfloat16(), a.bfloat16(), g.bfloat16()
    ref = _PlainGate(linear, act_fn)
    with torch.inference_mode():
        torch.testing.assert_close(gated_linear(a, g, act_fn, linear), ref(a, g), rtol=0, atol=0)
    a, g = a.clone().requires_grad_(), g.clone().requires_grad_()
    results = []
    for run in (lambda: gated_linear(a, g, act_fn, linear), lambda: ref(a, g)):
        params = {p.untyped_storage().data_ptr() for p in linear.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
            out = run()
        grads = torch.autograd.grad(out.float().square().mean(), [a, g, *linear.parameters()])
        results.append((sum(saved.values()), out, grads))
    (kept, out, grads), (kept_ref, out_ref, grads_ref) = results
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    tol = dict(rtol=1e-12, atol=1e-14) if mode == "float64" else dict(rtol=2e-2, atol=2e-3)
    for mine, theirs in zip(grads, grads_ref):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, **tol)
    one = out.numel() * out.element_size()  # a tensor of the output's size in the product's dtype at least
    assert kept <= kept_ref - (2 if act == "silu" else 1) * one


def test_gated_attention_trains_to_the_plain_gradients_and_keeps_less(monkeypatch):
    """A linhier (MLLA's gated linear attention) and RALA's output modulation train to the gradients of the plain
    gate (gated_linear switched off) in float64, and keep less for the backward."""
    import timm

    import linvision  # noqa: F401
    from linvision.layers import recompute

    for name, kwargs in [("linhier_tiny_224", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64), num_heads=(1, 1, 2, 2))),
                         ("ravlt_tiny", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64), num_heads=(1, 1, 2, 2)))]:
        results = []
        for plain in (False, True):
            if plain:
                monkeypatch.setattr(recompute, "_recomputes", lambda: False)
            torch.manual_seed(0)
            model = timm.create_model(name, num_classes=3, **kwargs).double().train()
            x = torch.randn(2, 3, 64, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                            requires_grad=True)
            kept, _, grads = _saved_and_grads(model, x)
            results.append((kept, grads))
        monkeypatch.undo()
        (kept, grads), (kept_plain, grads_plain) = results
        for mine, theirs in zip(grads, grads_plain):
            torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-11)
        assert kept < kept_plain, name


def test_gated_linear_with_a_frozen_projection():
    """A frozen projection (linear probing, a frozen backbone): gated_linear gives a and g the plain product's
    gradients and the weight none."""
    from linvision.layers.recompute import gated_linear

    torch.manual_seed(0)
    linear = nn.Linear(8, 8).double().requires_grad_(False)
    a, g = (torch.randn(1, 37, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = torch.autograd.grad(gated_linear(a, g, F.silu, linear).square().sum(), [a, g])
    want = torch.autograd.grad(linear(a * F.silu(g)).square().sum(), [a, g])
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    assert linear.weight.grad is None


def test_mixer_context_is_the_one_call_form():
    """A mixer takes tokens and one context: the grid alone stands for its context, anything else is refused in
    one line; a tensor that is not (B, N, dim) tokens is refused before any work; the InLine-CSwin mixer reads the
    block's input from the context (its local kernels from that input's mean), as a block hands it on."""
    mixer = create_mixer("linear", 8, 2)
    x = torch.randn(1, 6, 8)
    with pytest.raises(TypeError, match="ctx: expected a MixerContext or the grid"):
        mixer(x, (1, 2, 3))
    with pytest.raises(TypeError, match="ctx: expected a MixerContext or the grid"):
        mixer(x, 6)
    with pytest.raises(ValueError, match="x: the 'linear' mixer takes tokens"):
        mixer(x[..., :4], (2, 3))
    with pytest.raises(ValueError, match="part: unknown 'grid'"):
        mixer_accepts("linear", "grid")
    assert MixerContext.of([2, 3]) == MixerContext((2, 3)) and MixerContext((2, 3), 1).parts() == ("prefix_tokens",)
    torch.manual_seed(0)
    block = MixerBlock(8, 2, "inline_cswin").double().eval()
    grid = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    seen = {}
    block.mixer.register_forward_pre_hook(lambda m, args: seen.update(ctx=args[1]))
    with torch.no_grad():
        out = block(grid)
        tokens = grid.reshape(2, 12, 8)
        expected = block.mixer(block.norm1(tokens), MixerContext((3, 4), block_input=tokens))
    assert seen["ctx"].block_input is not None and seen["ctx"].hw == (3, 4)
    with torch.no_grad():
        kernels = block.mixer.local_kernels(tokens)  # from the block's input, not the normalised tokens
        assert not torch.allclose(kernels, block.mixer.local_kernels(block.norm1(tokens)))
        torch.testing.assert_close(out, (grid + expected.reshape(2, 3, 4, 8)) +
                                   block.mlp(block.norm2(grid + expected.reshape(2, 3, 4, 8))), rtol=0, atol=0)
