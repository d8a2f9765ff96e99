"""Bad input at the boundaries: the right answer (checked against float64 formulas) or one line naming the
argument, the value and what is allowed."""
import re

import pytest
import torch

import linvision.ops as O
from support import ONE_PER_FAMILY, small_model
from linvision.ops.feature_maps import PerformerFeatureMap


def _rand(*shape, shift=0.0, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift


def _stabilised_map(name):
    if name == "exp":
        return "exp"
    return PerformerFeatureMap(16, generator=torch.Generator().manual_seed(0)).to("cpu")


def _exp_formula(q, k, v, eps=1e-4):
    """Non-causal linear attention with the exp map, as written in the manual: phi(q) per-token stabilised, phi(k)
    stabilised by one max over all of the sample's keys (which cancels except against eps)."""
    fq = torch.exp(q - q.amax(-1, keepdim=True))
    fk = torch.exp(k - k.amax(dim=(-2, -1), keepdim=True))
    s, z = torch.einsum("bhnd,bhne->bhde", fk, v) / k.shape[2], fk.mean(2)
    return torch.einsum("bhnd,bhde->bhne", fq, s) / (torch.einsum("bhnd,bhd->bhn", fq, z) + eps)[..., None]


@pytest.mark.parametrize("name", ["exp", "performer"])
def test_a_padded_sample_gets_what_it_gets_alone_with_a_stabilised_map(name):
    """Keys far below zero (exp) or spread wide (performer): a padded key must not enter the keys' max."""
    d = 4 if name == "exp" else 16
    q, k, v = _rand(2, 2, 10, d, seed=1), _rand(2, 2, 10, d, shift=-10 if name == "exp" else -3, seed=2), \
        _rand(2, 2, 10, 3, seed=3)
    k[1, :, 6:] = float("nan")  # the padding may hold anything
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 6:] = False
    phi = _stabilised_map(name)
    k.requires_grad_(True)
    out = O.linear_attention(q, k, v, phi, valid=valid)
    alone_k = k[1:, :, :6].detach().clone().requires_grad_(True)
    alone = O.linear_attention(q[1:, :, :6], alone_k, v[1:, :, :6], phi)
    torch.testing.assert_close(out[1:, :, :6], alone, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[1, :, 6:], torch.zeros_like(out[1, :, 6:]))
    if name == "exp":
        torch.testing.assert_close(alone, _exp_formula(q[1:, :, :6], alone_k.detach(), v[1:, :, :6]))
    out[1:, :, :6].sum().backward()
    alone.sum().backward()
    torch.testing.assert_close(k.grad[1:, :, :6], alone_k.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(k.grad[1, :, 6:], torch.zeros_like(k.grad[1, :, 6:]))


def _later_nonfinite_ops():
    g = -torch.rand(1, 2, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    gd = -torch.rand(1, 2, 16, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    beta = torch.rand(1, 2, 16, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    return {
        "causal": lambda q, k, v: O.linear_attention(q, k, v, causal=True, chunk_size=8),
        "gated": lambda q, k, v: O.gated_linear_attention(q, k, v, g, chunk_size=8, backend="torch"),
        "gated_per_channel": lambda q, k, v: O.gated_linear_attention(q, k, v, gd, chunk_size=8, backend="torch"),
        "unnormalised": lambda q, k, v: O.decay_linear_attention(q, k, v, 0.9, normalize=False, chunk_size=8),
        "delta": lambda q, k, v: O.delta_rule_attention(q, k, v, beta, chunk_size=8, backend="torch"),
    }


@pytest.mark.parametrize("op", sorted(_later_nonfinite_ops()))
@pytest.mark.parametrize("where,value", [("v", float("nan")), ("v", float("inf")), ("k", float("inf")),
                                         ("k", float("nan"))])
def test_a_non_finite_later_token_never_reaches_an_earlier_output(op, where, value):
    """Token 13 (inside the second chunk of 8) holds a NaN or inf: outputs before it are those of the clean input."""
    fn = _later_nonfinite_ops()[op]
    q, k, v = _rand(1, 2, 16, 4, seed=7), _rand(1, 2, 16, 4, seed=8), _rand(1, 2, 16, 4, seed=9)
    clean = fn(q, k, v)
    bad = {"k": k.clone(), "v": v.clone()}
    bad[where][0, 0, 13, 1] = value
    out = fn(q, bad["k"], bad["v"])
    torch.testing.assert_close(out[:, :, :13], clean[:, :, :13], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, 1], clean[:, 1], rtol=1e-12, atol=1e-12)  # the other head
    assert not torch.isfinite(out[0, 0, 13:]).all()


def _empty(*tail):
    return torch.randn(0, 2, 5, *tail)


@pytest.mark.parametrize("op", ["causal", "gated", "decay", "delta", "bidirectional_gated", "bidirectional_delta",
                                "noncausal"])
def test_an_empty_batch_gives_an_empty_batch(op):
    q, k, v, gate = _empty(4), _empty(4), _empty(3), torch.zeros(0, 2, 5)
    run = {
        "causal": lambda: O.linear_attention(q, k, v, causal=True),
        "noncausal": lambda: O.linear_attention(q, k, v),
        "gated": lambda: O.gated_linear_attention(q, k, v, gate),
        "decay": lambda: O.decay_linear_attention(q, k, v, 0.9),
        "delta": lambda: O.delta_rule_attention(q, k, v, gate),
        "bidirectional_gated": lambda: O.bidirectional_gated_linear_attention(q, k, v, gate),
        "bidirectional_delta": lambda: O.bidirectional_delta_rule_attention(q, k, v, gate),
    }[op]
    assert run().shape == (0, 2, 5, 3)


@pytest.mark.parametrize("lengths,bad", [([13, 20], 20), ([13, -2], -2), ([0, 13], 0)])
@pytest.mark.parametrize("op", ["gated", "delta"])
def test_lengths_out_of_range_are_refused_in_one_line(op, lengths, bad):
    q, k, v = _rand(2, 2, 13, 4), _rand(2, 2, 13, 4), _rand(2, 2, 13, 4)
    fn = O.bidirectional_gated_linear_attention if op == "gated" else O.bidirectional_delta_rule_attention
    gate = torch.zeros(2, 2, 13, dtype=torch.float64) if op == "gated" else torch.ones(2, 2, 13, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(f"lengths: every value must lie in 1..N = 1..13, got {bad}")):
        fn(q, k, v, gate, lengths=torch.tensor(lengths))


def test_a_decay_of_the_wrong_type_is_refused_in_one_line():
    q = _rand(1, 2, 5, 4)
    with pytest.raises(TypeError, match=re.escape("decay: expected a float in (0, 1] or a tensor with one per "
                                                  "head, got '0.9'")):
        O.decay_linear_attention(q, q, q, "0.9")


# --- mixers: options checked at construction, tokens checked before any work

@pytest.mark.parametrize("mixer,options,error,line", [
    ("gated_cnn", {"kernel_size": 2}, ValueError, "kernel_size: must be an odd int >= 1, got 2"),
    ("gated_cnn", {"kernel_size": 0}, ValueError, "kernel_size: must be an odd int >= 1, got 0"),
    ("gated_cnn", {"expansion_ratio": 0}, ValueError, "expansion_ratio: must lie in (0.0, inf), got 0"),
    ("gated_cnn", {"expansion_ratio": "2"}, TypeError, "expansion_ratio: expected a number, got '2'"),
    ("gated_cnn", {"expansion_ratio": 0.01}, ValueError,
     "expansion_ratio: 0.01 gives 0 hidden channels at dim=32; need at least 1"),
    ("swin_window", {"window": 2.5}, ValueError, "window: must be an int >= 1, got 2.5"),
    ("hybrid", {"window": 0}, ValueError, "window: must be an int >= 1, got 0"),
    ("cswin_stripes", {"stripe": True}, ValueError, "stripe: must be an int >= 1, got True"),
    ("agent", {"agent_grid": (7, 0)}, ValueError,
     "agent_grid: expected a positive int or (rows, cols) of positive ints, got (7, 0)"),
    ("linear", {"lepe": True, "lepe_kernel": 4}, ValueError, "lepe_kernel: must be an odd int >= 1, got 4"),
    ("linear", {"proj_drop": 1.5}, ValueError, "proj_drop: must lie in [0.0, 1.0], got 1.5"),
])
def test_a_bad_mixer_option_is_refused_at_construction_in_one_line(mixer, options, error, line):
    from linvision.layers import create_mixer
    with pytest.raises(error, match="^" + re.escape(line) + "$"):
        create_mixer(mixer, 32, 2, **options)


def test_an_agent_grid_of_one_int_is_a_square_grid():
    from linvision.layers import create_mixer
    torch.manual_seed(0)
    one, pair = create_mixer("agent", 32, 2, agent_grid=3), create_mixer("agent", 32, 2, agent_grid=(3, 3))
    pair.load_state_dict(one.state_dict())
    x = torch.randn(2, 36, 32)
    assert one.agent_grid == (3, 3)
    torch.testing.assert_close(one(x, (6, 6)), pair(x, (6, 6)))


@pytest.mark.parametrize("mixer", ["linear", "gated_cnn", "mlla", "vig_gla", "swin_window"])
@pytest.mark.parametrize("shape", [(64, 32), (1, 64, 16), (1, 1, 64, 32)])
def test_tokens_of_the_wrong_rank_or_width_are_refused_by_every_mixer_in_one_line(mixer, shape):
    from linvision.layers import create_mixer
    m = create_mixer(mixer, 32, 2)
    line = f"x: the {mixer!r} mixer takes tokens (B, N, C) with C = 32, got shape {shape}"
    with pytest.raises(ValueError, match="^" + re.escape(line) + "$"):
        m(torch.randn(*shape), (8, 8))
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor of tokens"):
        m([[0.0] * 32], (8, 8))


# --- models: images checked at the entry, empty batches, the sizes the manual promises

@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_every_family_checks_its_images_in_one_line_and_takes_an_empty_batch(name):
    model = small_model(name)
    for shape in [(3, 64, 64), (1, 4, 64, 64)]:
        line = f"x: expected images (B, 3, H, W) with H, W >= 1 (in_chans=3), got shape {shape}"
        with pytest.raises(ValueError, match="^" + re.escape(line) + "$"):
            model(torch.randn(*shape))
    with pytest.raises(TypeError, match=re.escape("x: expected floating-point images, got dtype torch.uint8")):
        model(torch.zeros(1, 3, 64, 64, dtype=torch.uint8))
    with torch.no_grad():
        assert model(torch.randn(0, 3, 64, 64)).shape == (0, 5)


def test_a_fixed_size_or_patch_grid_is_said_in_one_line():
    fixed = small_model("linvit_tiny_patch16_224", img_size=64)
    with pytest.raises(ValueError, match=re.escape("x: this model takes 64x64 images (a fixed position embedding; "
                                                   "dynamic_img_size=True resamples it), got 32x64")):
        fixed(torch.randn(1, 3, 32, 64))
    with pytest.raises(ValueError, match=re.escape("x: height and width must be multiples of the patch size 16x16, "
                                                   "got 31x17")):
        small_model("linvit_tiny_patch16_rope_224")(torch.randn(1, 3, 31, 17))


@pytest.mark.parametrize("name", ["linvit_tiny_patch16_224", "linvit_tiny_patch16_pola_224",
                                  "linvit_tiny_patch16_rope_224", "inline_deit_tiny"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_size_the_patch_grid_cannot_cover_is_refused_at_build_in_one_line(name, dynamic):
    """Every isotropic variant, with a fixed or a resampled position embedding or RoPE, refuses an img_size the
    16 px patch grid leaves pixels of, as the RoPE variant refuses such an input: no 6x6 grid for 100 px."""
    import timm

    line = ("img_size: height and width must be multiples of the patch size 16x16, got 100x100 (the patch grid "
            "would leave out 4 rows and 4 columns of pixels); use 96x96 or 112x112")
    with torch.device("meta"), pytest.raises(ValueError, match="^" + re.escape(line) + "$"):
        timm.create_model(name, img_size=100, dynamic_img_size=dynamic)
    with torch.device("meta"):
        model = timm.create_model(name, img_size=96, dynamic_img_size=dynamic)
    assert tuple(model.patch_embed.grid_size) == (6, 6)
    if dynamic:  # an input the grid cannot cover is refused at forward too
        with pytest.raises(ValueError, match=re.escape("multiples of the patch size 16x16, got 100x100")):
            model(torch.randn(1, 3, 100, 100, device="meta"))


def test_vigs_convolutional_stem_still_takes_any_size():
    import timm

    import linvision  # noqa: F401
    model = timm.create_model("vig_tiny", img_size=100, num_classes=3).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 100, 100)).shape == (1, 3)


@pytest.mark.parametrize("name", ["pola_swin_tiny", "inline_pvt_tiny", "pola_pvt_tiny", "inline_cswin_tiny",
                                  "vig_tiny"])
def test_the_layouts_run_at_the_sizes_their_page_promises(name):
    """An image smaller than a stem's or stage entry's kernel is padded to it with zeros at the bottom and right:
    the logits are those of the image placed by hand on a zero canvas of the kernel's size (float64)."""
    model = small_model(name).double()
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))  # the stem's first conv
    least = [k - 2 * p for k, p in zip(conv.kernel_size, conv.padding)]
    for size in [(1, 1), (2, 3), (15, 15), (31, 17)]:
        x = _rand(1, 3, *size, seed=10)
        canvas = torch.zeros(1, 3, max(size[0], least[0]), max(size[1], least[1]), dtype=torch.float64)
        canvas[:, :, :size[0], :size[1]] = x
        with torch.no_grad():
            out = model(x)
            assert out.shape == (1, 5) and torch.isfinite(out).all()
            torch.testing.assert_close(model(canvas), out, rtol=1e-12, atol=1e-12)


def test_pad_to_kernel_pads_only_what_is_smaller_than_the_kernel():
    from linvision.layers.options import pad_to_kernel
    conv = torch.nn.Conv2d(1, 1, 9, stride=8, padding=1)
    x = torch.randn(1, 1, 3, 8)
    padded = pad_to_kernel(x, conv)
    assert padded.shape == (1, 1, 7, 8) and torch.equal(padded[:, :, :3], x) and not padded[:, :, 3:].any()
    big = torch.randn(1, 1, 7, 7)
    assert pad_to_kernel(big, conv) is big
