"""Pola-Swin and Pola-PVT (PolaFormer's published models): the authors' checkpoint layouts load with every
parameter used, the blocks equal explicit float64 transcriptions of the authors' attention (polarity-aware linear
attention in stages 1-2 of Swin and everywhere in PVT, Swin's shifted-window softmax in Swin's stages 3-4), the
models run at other sizes, and pretrained=True without a local file says where the weights are in one line.

tests/data/published/pola_{swin,pvt}_<size>.txt list the tensor names, shapes and dtypes of the authors' checkpoint
(their model's state dict, buffers included); the files built here from them hold random values."""
import functools
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import linvision  # noqa: F401  (registers the models)
from linvision.benchmark.flops import count_params
from linvision.layers import create_mixer
from support import Crafted, assert_same_values, authors_layout, layer_norm, save_training_file

NAMES = [pytest.param(n, id=n, marks=[pytest.mark.slow] if n != "pola_swin_tiny" else [])
         for n in ("pola_swin_tiny", "pola_swin_small", "pola_swin_base")]
BUFFERS = (".relative_position_index", ".attn_mask")  # the authors' buffers, recomputed here


# A file laid out as the authors' main.py saves it (support.save_training_file), with their best accuracy.
save_authors = functools.partial(save_training_file, max_accuracy=82.6)


@pytest.mark.parametrize("name", NAMES)
def test_authors_layout_loads_every_parameter(name, tmp_path):
    """Every tensor of the file but the recomputed buffers lands in the model (the sorted values are equal: nothing
    missing, duplicated or changed); qkvg splits into qkv and the modulation; the scale and the power take the
    heads' shape; the parameter count is the file's."""
    state = authors_layout(name)
    path = tmp_path / f"{name}.pth"
    save_authors(path, state)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    own = model.state_dict()
    weights = {k: v for k, v in state.items() if not k.endswith(BUFFERS)}
    assert count_params(model) == sum(v.numel() for v in weights.values())
    assert_same_values(own, weights)
    mixer = model.stages[1].blocks[1].mixer
    c, heads = mixer.dim, mixer.num_heads
    qkvg = state["layers.1.blocks.1.attn.qkvg.weight"]
    torch.testing.assert_close(mixer.qkv.weight, qkvg[:3 * c], rtol=0, atol=0)
    torch.testing.assert_close(mixer.gate.weight, qkvg[3 * c:], rtol=0, atol=0)
    torch.testing.assert_close(mixer.qk_scale.flatten(), state["layers.1.blocks.1.attn.scale"].flatten(), rtol=0,
                               atol=0)
    assert mixer.power_logit.shape == (heads, 1, c // heads)
    torch.testing.assert_close(mixer.lepe.conv.weight, state["layers.1.blocks.1.attn.dwc.weight"], rtol=0, atol=0)
    torch.testing.assert_close(model.stages[1].downsample.reduction.weight,
                               state["layers.0.downsample.reduction.weight"], rtol=0, atol=0)
    assert model.stages[2].blocks[1].mixer.shift and not model.stages[2].blocks[0].mixer.shift


def _authors_pola(sd, x, heads, grid, alpha=4.0):
    """PolaFormer's attention written out on tokens x (B, H * W, C), the whole grid one window: q, k, v, g from
    qkvg; k plus the position encoding; q, k divided by softplus(scale); features [relu(.)^p, relu(-.)^p] with
    p = 1 + alpha sigmoid(power) per head and channel; the same-sign path (q features [pos, neg]) on the first half
    of each head's v and the opposite-sign path ([neg, pos]) on the second, each normalised by its own q.mean(k)
    + 1e-6; plus the head-shared 5x5 depthwise conv of v (zero padding); times g; the projection."""
    b, n, c = x.shape
    d, (h, w) = c // heads, grid
    q, k, v, g = (x @ sd["qkvg.weight"].T + sd["qkvg.bias"]).split(c, dim=-1)
    k = k + sd["positional_encoding"]
    scale = torch.log1p(torch.exp(sd["scale"]))
    q, k = q / scale, k / scale
    power = 1 + alpha / (1 + torch.exp(-sd["power"]))  # (1, heads, 1, d)
    out = torch.zeros_like(v)
    for e in range(heads):
        cols = slice(e * d, (e + 1) * d)
        p = power[0, e, 0]
        qp, qn = torch.clamp(q[..., cols], min=0) ** p, torch.clamp(-q[..., cols], min=0) ** p
        kp, kn = torch.clamp(k[..., cols], min=0) ** p, torch.clamp(-k[..., cols], min=0) ** p
        kf = torch.cat([kp, kn], -1)
        for part, qf in ((0, torch.cat([qp, qn], -1)), (1, torch.cat([qn, qp], -1))):
            vc = v[..., e * d + part * d // 2: e * d + (part + 1) * d // 2]
            scores = qf @ kf.transpose(1, 2)  # (B, N, N)
            out[..., e * d + part * d // 2: e * d + (part + 1) * d // 2] = (
                (scores / n) @ vc / (scores.mean(-1, keepdim=True) + 1e-6))
    kernel = sd["dwc.weight"][:, 0]  # (d, 5, 5), shared by the heads
    vg = F.pad(v.reshape(b, h, w, c), (0, 0, 2, 2, 2, 2))
    for r in range(h):
        for col in range(w):
            window = vg[:, r:r + 5, col:col + 5].reshape(b, 5, 5, heads, d)
            out[:, r * w + col] += (torch.einsum("bijhd,dij->bhd", window, kernel) + sd["dwc.bias"]).reshape(b, c)
    return (out * g) @ sd["proj.weight"].T + sd["proj.bias"]


def _authors_swin(sd, x, heads, grid, window, shifts):
    """Swin's (shifted) window attention written out, in the order of the authors' block on a map that is not whole
    windows (their detection backbone's, as timm's): the map padded at the bottom and right to whole windows, then
    rolled by -shift, split into windows, softmax(q.k / sqrt(D) + table[offset] + mask) v per window and head,
    where the mask is -100 between tokens of different regions (Swin's slices (0, -w), (-w, -s), (-s, None) of each
    shifted axis of the padded map), rolled back and cropped; the projection. ``shifts``: (rows, columns). The
    padded positions are no keys (linvision's rule; the authors' zeros would take weight)."""
    b, n, c = x.shape
    d, (h, w), (sh, sw) = c // heads, grid, shifts
    hp, wp = math.ceil(h / window) * window, math.ceil(w / window) * window
    real = torch.zeros(hp, wp, dtype=torch.bool)
    real[:h, :w] = True
    real = real.roll((-sh, -sw), (0, 1))

    def padded_rolled(t):
        out = torch.zeros(b, hp, wp, c, dtype=x.dtype)
        out[:, :h, :w] = t.reshape(b, h, w, c)
        return out.roll((-sh, -sw), (1, 2))

    rolled = [padded_rolled(t) for t in (x @ sd["qkv.weight"].T + sd["qkv.bias"]).split(c, dim=-1)]

    def regions(size, shift):
        label = torch.zeros(size)
        if shift:
            label[-window:-shift], label[-shift:] = 1, 2
        return label

    rows, cols = regions(hp, sh), regions(wp, sw)
    out = torch.zeros(b, hp, wp, c, dtype=x.dtype)
    table = sd["relative_position_bias_table"]
    for i, j in real.nonzero().tolist():
        wi, wj = i // window * window, j // window * window
        keys = [(a, e) for a in range(wi, wi + window) for e in range(wj, wj + window) if real[a, e]]
        for hd in range(heads):
            cols_h = slice(hd * d, (hd + 1) * d)
            logits = []
            for a, e in keys:
                offset = (i - a + window - 1) * (2 * window - 1) + (j - e + window - 1)
                same = rows[i] == rows[a] and cols[j] == cols[e]
                logits.append((rolled[0][:, i, j, cols_h] * rolled[1][:, a, e, cols_h]).sum(-1) / math.sqrt(d)
                              + table[offset, hd] + (0.0 if same else -100.0))
            weights = torch.softmax(torch.stack(logits, -1), -1)  # (B, keys)
            values = torch.stack([rolled[2][:, a, e, cols_h] for a, e in keys], 1)  # (B, keys, d)
            out[:, i, j, cols_h] = torch.einsum("bk,bkd->bd", weights, values)
    out = out.roll((sh, sw), (1, 2))[:, :h, :w].reshape(b, n, c)
    return out @ sd["proj.weight"].T + sd["proj.bias"]


def _authors_block(model_block, attention, x, eps=1e-5):
    """x + attention(LN(x)), then + fc2(GELU(fc1(LN(x)))) (LayerNorm eps 1e-5 in Swin, 1e-6 in PVT)."""
    sd = model_block.state_dict()
    y = x + attention(layer_norm(x, sd["norm1.weight"], sd["norm1.bias"], eps))
    hidden = F.gelu(layer_norm(y, sd["norm2.weight"], sd["norm2.bias"], eps) @ sd["mlp.fc1.weight"].T
                    + sd["mlp.fc1.bias"])
    return y + hidden @ sd["mlp.fc2.weight"].T + sd["mlp.fc2.bias"]


def _random_double(module):
    torch.manual_seed(0)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module.eval()


def _to_authors(mixer_sd, heads):
    """The authors' names for a pola_swin mixer's tensors (the test's transcription reads those)."""
    c = mixer_sd["qkv.weight"].shape[1]
    return {"qkvg.weight": torch.cat([mixer_sd["qkv.weight"], mixer_sd["gate.weight"]]),
            "qkvg.bias": torch.cat([mixer_sd["qkv.bias"], mixer_sd["gate.bias"]]),
            "positional_encoding": mixer_sd["key_pos"], "scale": mixer_sd["qk_scale"].reshape(1, 1, c),
            "power": mixer_sd["power_logit"].reshape(1, heads, 1, c // heads),
            "dwc.weight": mixer_sd["lepe.conv.weight"], "dwc.bias": mixer_sd["lepe.conv.bias"],
            "proj.weight": mixer_sd["proj.weight"], "proj.bias": mixer_sd["proj.bias"]}


@pytest.mark.parametrize("grid", [(6, 6), (5, 3)])
def test_linear_block_equals_the_authors_formula(grid):
    """A stage-1 block (float64, random weights, the key encoding trained for this grid) against the transcription:
    x + attn(LN(x)), then + fc2(GELU(fc1(LN(x)))), LayerNorm eps 1e-5. (5, 3): the formula on a grid the
    authors' square window cannot hold, which the model computes the same way."""
    heads, c = 2, 16
    model = timm.create_model("pola_swin_tiny", depths=(1, 1, 1, 1), dims=(c, 32, 32, 32), num_heads=(heads, 2, 2, 2),
                              img_size=(4 * grid[0], 4 * grid[1]))
    block = _random_double(model.stages[0].blocks[0])
    x = torch.randn(2, grid[0] * grid[1], c, dtype=torch.float64)
    mixer_sd = {k[len("mixer."):]: v for k, v in block.state_dict().items() if k.startswith("mixer.")}
    with torch.no_grad():
        ours = block(x.reshape(2, *grid, c)).reshape(2, -1, c)
        expected = _authors_block(block, lambda t: _authors_pola(_to_authors(mixer_sd, heads), t, heads, grid), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grid, shift", [((14, 14), True), ((14, 14), False), ((7, 7), True), ((7, 14), True),
                                         ((9, 11), False), ((9, 11), True), ((10, 8), True)])
def test_window_block_equals_the_authors_formula(grid, shift):
    """A stage-3 block (float64, random weights, window 7) against the transcription of Swin's shifted-window
    attention. Along an axis no longer than the window nothing shifts (the authors' rule for a map no larger than
    the window): (7, 7) is not shifted at all, (7, 14) along its columns only. (9, 11) and (10, 8) are padded to
    14 x 14, shifted along both axes with ``shift``."""
    heads, c = 2, 16
    model = timm.create_model("pola_swin_tiny", depths=(1, 1, 2, 1), dims=(16, 16, c, 32), num_heads=(1, 1, heads, 2))
    block = _random_double(model.stages[2].blocks[1 if shift else 0])
    assert block.mixer.shift == shift
    x = torch.randn(2, grid[0] * grid[1], c, dtype=torch.float64)
    sd = {k[len("mixer."):]: v for k, v in block.state_dict().items() if k.startswith("mixer.")}
    shifts = tuple(3 if shift and n > 7 else 0 for n in grid)
    with torch.no_grad():
        ours = block(x.reshape(2, *grid, c)).reshape(2, -1, c)
        expected = _authors_block(block, lambda u: _authors_swin(sd, u, heads, grid, 7, shifts), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def test_padded_windows_give_padding_no_weight():
    """On a map that is not whole windows (9 x 11, window 7) each token attends to the real tokens of its window
    only: the padded keys (zeros after the projection, whose logits would be the bias alone) take no weight."""
    heads, c = 2, 16
    model = timm.create_model("pola_swin_tiny", depths=(1, 1, 1, 1), dims=(16, 16, c, 32), num_heads=(1, 1, heads, 2))
    block = _random_double(model.stages[2].blocks[0])
    x = torch.randn(1, 9 * 11, c, dtype=torch.float64)
    sd = {k[len("mixer."):]: v for k, v in block.state_dict().items() if k.startswith("mixer.")}
    with torch.no_grad():
        ours = block(x.reshape(1, 9, 11, c)).reshape(1, -1, c)
        expected = _authors_block(block, lambda u: _authors_swin(sd, u, heads, (9, 11), 7, (0, 0)), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def test_pola_swin_and_the_ablation_pola_mixer_differ_by_their_extras():
    """``pola`` (the ablation's) and ``pola_swin`` (the published block) share the polarity attention: with the
    convolutions zero, the key encoding zero and the modulation the identity (W_g = 0, bias 1) they agree."""
    torch.manual_seed(0)
    x = torch.randn(2, 15, 16, dtype=torch.float64)
    ablation = create_mixer("pola", 16, 2, lepe=False).double()
    published = create_mixer("pola_swin", 16, 2, grid=(3, 5)).double()
    with torch.no_grad():
        for name in ("qkv", "proj"):
            getattr(published, name).load_state_dict(getattr(ablation, name).state_dict())
        for p in (ablation.power_logit, ablation.qk_scale):
            p.normal_(0, 0.5)
        published.power_logit.copy_(ablation.power_logit)
        published.qk_scale.copy_(ablation.qk_scale)
        published.lepe.conv.weight.zero_()
        published.lepe.conv.bias.zero_()
        published.gate.weight.zero_()
        published.gate.bias.fill_(1.0)
        torch.testing.assert_close(published(x, (3, 5)), ablation(x, (3, 5)), rtol=1e-12, atol=1e-12)
        published.key_pos.normal_()
        assert not torch.allclose(published(x, (3, 5)), ablation(x, (3, 5)))
    assert published.lepe.conv.weight.shape == (8, 1, 5, 5)  # one 5x5 kernel per head channel, shared by heads


def test_other_sizes_and_a_file_for_224_in_a_model_for_384(tmp_path):
    """The 224 px file in a model built for 384 px: the key encodings resampled to 96 x 96 and 48 x 48 (as the
    model itself resamples them at run time, so its logits at 384 equal the 224 model's); non-square inputs run."""
    state = authors_layout("pola_swin_tiny", blocks=(1, 1, 2, 1))
    path = tmp_path / "pola_swin_t.pth"
    save_authors(path, state)
    args = dict(depths=(1, 1, 2, 1), pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    at_224 = timm.create_model("pola_swin_tiny", **args).eval()
    at_384 = timm.create_model("pola_swin_tiny", img_size=384, **args).eval()
    assert at_384.stages[0].blocks[0].mixer.key_pos.shape == (1, 96 * 96, 96)
    assert at_384.stages[1].blocks[0].mixer.key_pos.shape == (1, 48 * 48, 192)
    x = torch.randn(1, 3, 384, 384, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(at_384(x), at_224(x), rtol=1e-5, atol=1e-5)
        assert at_224(torch.randn(1, 3, 160, 288)).shape == (1, 1000)
        feats = at_224.forward_intermediates(torch.randn(1, 3, 160, 288), intermediates_only=True)
    assert [tuple(f.shape[-2:]) for f in feats] == [(40, 72), (20, 36), (10, 18), (5, 9)]


def test_pretrained_true_without_a_file_names_the_hub_folder(tmp_path):
    """The hub folder's file names are not recorded: pretrained=True says where to get the file and how to pass
    it, in one line; with the file given it loads, running no code from the pickle."""
    for name in ("pola_swin_tiny", "pola_pvt_tiny"):
        with pytest.raises(ValueError, match=r"huggingface\.co/ZachMeng/PolaFormer.*pretrained_cfg_overlay") as info:
            timm.create_model(name, pretrained=True)
        assert "\n" not in str(info.value) and name in str(info.value)
    marker = tmp_path / "marker"
    state = authors_layout("pola_swin_tiny", blocks=1)
    path = tmp_path / "pola_swin_t.pth"
    save_authors(path, state, payload=Crafted(str(marker)))
    model = timm.create_model("pola_swin_tiny", depths=(1, 1, 1, 1), pretrained=True, num_classes=5,
                              pretrained_cfg_overlay=dict(file=str(path)))
    assert not marker.exists() and model.head.fc.weight.shape == (5, 768)
    cfg = model.pretrained_cfg
    assert (cfg["crop_pct"], cfg["interpolation"], cfg["license"]) == (0.875, "bicubic", "mit")
    assert "82.6" in cfg["description"]


def test_the_tools_name_the_way_to_a_local_copy():
    """linvision-train / -validate's --pretrained check: Pola-Swin's published weights load from a local copy
    only, which the one-line error says (and no tool lists them among the downloadable weights)."""
    from linvision.utils.factory import check_pretrained, models_with_weights

    for name in ("pola_swin_tiny", "pola_pvt_small"):
        with pytest.raises(ValueError, match=rf"{name} loads the authors' ImageNet-1k weights.*--pretrained-path") \
                as info:
            check_pretrained(name)
        assert "\n" not in str(info.value) and "docs/models/published.md" in str(info.value)
    assert not any(n.startswith("pola_") for n in models_with_weights())


# Pola-PVT: the authors' PVT (pola_pvt_tiny / small with cfgs/pola_pvt_{t,s}.yaml) on linvision's PVT layout.
PVT_NAMES = [pytest.param(n, id=n, marks=[pytest.mark.slow] if n != "pola_pvt_tiny" else [])
             for n in ("pola_pvt_tiny", "pola_pvt_small")]


@pytest.mark.parametrize("name", PVT_NAMES)
def test_pvt_authors_layout_loads_every_parameter(name, tmp_path):
    """Every tensor of the file but the final norm (built by the authors' PVT, never applied) lands in the model
    unchanged; ``qg`` splits into q and the modulation, q and ``kv`` make ``qkv``; the parameter count is the
    file's without that norm."""
    state = authors_layout(name)
    path = tmp_path / f"{name}.pth"
    save_authors(path, state)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    weights = {k: v for k, v in state.items() if not k.startswith("norm.")}
    assert len(weights) == len(state) - 2
    assert count_params(model) == sum(v.numel() for v in weights.values())
    assert_same_values(model.state_dict(), weights)
    mixer = model.stages[2].blocks[1].mixer
    c = mixer.dim
    qg, kv = state["block3.1.attn.qg.weight"], state["block3.1.attn.kv.weight"]
    torch.testing.assert_close(mixer.qkv.weight, torch.cat([qg[:c], kv]), rtol=0, atol=0)
    torch.testing.assert_close(mixer.gate.bias, state["block3.1.attn.qg.bias"][c:], rtol=0, atol=0)
    torch.testing.assert_close(mixer.key_pos, state["block3.1.attn.positional_encoding"], rtol=0, atol=0)
    torch.testing.assert_close(model.stages[3].downsample.pos_embed, state["pos_embed4"], rtol=0, atol=0)
    assert [b.mlp.fc1.out_features // b.mlp.fc1.in_features for s in model.stages for b in s.blocks[:1]] == [8, 8, 4, 4]


@pytest.mark.parametrize("grid", [(6, 6), (5, 3)])
def test_pvt_block_equals_the_authors_formula(grid):
    """A Pola-PVT block (float64, random weights, the key encoding trained for this grid) against the same
    transcription of the authors' attention (their PVT block computes q, g and k, v with two projections, the
    same numbers), LayerNorm eps 1e-6 and an MLP 8 times as wide."""
    heads, c = 2, 16
    model = timm.create_model("pola_pvt_tiny", depths=(1, 1, 1, 1), dims=(c, 32, 32, 32), num_heads=(heads, 2, 2, 2),
                              img_size=(4 * grid[0], 4 * grid[1]))
    block = _random_double(model.stages[0].blocks[0])
    assert block.mlp.fc1.out_features == 8 * c
    x = torch.randn(2, grid[0] * grid[1], c, dtype=torch.float64)
    mixer_sd = {k[len("mixer."):]: v for k, v in block.state_dict().items() if k.startswith("mixer.")}
    with torch.no_grad():
        ours = block(x.reshape(2, *grid, c)).reshape(2, -1, c)
        expected = _authors_block(block, lambda t: _authors_pola(_to_authors(mixer_sd, heads), t, heads, grid), x,
                                  eps=1e-6)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
