"""InLine-DeiT, InLine-PVT and InLine-Swin (the published InLine models): the authors' checkpoint layouts load
with every tensor used, the sizes match the published tables, the blocks equal explicit float64 transcriptions of
the authors' attention at odd grids (with the class token for DeiT, on the map alone for PVT and Swin), and
pretrained=True fetches the published file without running code from it.

tests/data/published/inline_{deit,pvt,swin}_<size>.txt list the tensor names, shapes and dtypes of the authors'
checkpoints; the files built here from them hold random values."""
import functools
import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

import linvision  # noqa: F401  (registers the models)
from linvision.benchmark.flops import count_gflops, count_params
from linvision.layers import create_mixer
from support import (Crafted, assert_same_values, authors_layout, layer_norm, save_training_file,
                     serve_downloads_from)

# The authors' README: params (M), GFLOPs at the training size, the training size.
PUBLISHED = {"inline_deit_tiny": (6.5, 1.1, 224), "inline_deit_small": (16.7, 5.0, 288),
             "inline_deit_base": (23.8, 17.2, 448)}
NAMES = [pytest.param(n, id=n, marks=[pytest.mark.slow] if n == "inline_deit_base" else []) for n in PUBLISHED]


# A file laid out as the authors' main.py saves it (support.save_training_file), with their best accuracy.
save_authors = functools.partial(save_training_file, max_accuracy=74.5)


@pytest.mark.parametrize("name", NAMES)
def test_authors_layout_loads_every_tensor(name, tmp_path):
    """Every tensor of the file lands in the model (the sorted values are equal: nothing missing, duplicated or
    changed); the kernel predictor becomes the mixer's ``local``. Built for another size, the position embedding
    is resampled to that grid and the class token's row kept."""
    state = authors_layout(name)
    path = tmp_path / f"{name}.pth"
    save_authors(path, state)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    own = model.state_dict()
    assert len(own) == len(state)
    assert_same_values(own, state)
    for key in ("attn.residual.0.weight", "attn.residual.2.bias", "attn.qkv.weight", "attn.proj.bias"):
        ours = "blocks.5." + key.replace("attn.residual.", "mixer.local.").replace("attn.", "mixer.")
        torch.testing.assert_close(own[ours], state["blocks.5." + key], rtol=0, atol=0)
    if name == "inline_deit_tiny":
        other = timm.create_model(name, pretrained=True, img_size=160, pretrained_cfg_overlay=dict(file=str(path)))
        assert other.pos_embed.shape == (1, 1 + 10 * 10, 192)
        torch.testing.assert_close(other.pos_embed[:, 0], state["pos_embed"][:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_sizes_and_cfg_match_the_published_table(name):
    params, gflops, size = PUBLISHED[name]
    with torch.device("meta"):  # shapes only: a CPU build's counts (tests/test_docs.py), without weights
        model = timm.create_model(name)
    assert model.patch_embed.img_size == (size, size)
    assert round(count_params(model) / 1e6, 1) == params
    assert count_gflops(model, size) == pytest.approx(gflops, rel=0.03)
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, size, size) and not cfg["fixed_input_size"]  # any multiple of 16 by default
    assert (cfg["crop_pct"], cfg["crop_mode"], cfg["interpolation"]) == (0.875, "squash", "bicubic")


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _grouped_1x1(x, weight, bias, groups):
    """x (B, C_in) through a grouped 1x1 convolution: weight (C_out, C_in / groups, 1)."""
    c_out, c_group = weight.shape[:2]
    per = c_out // groups
    return torch.cat([x[:, g * c_group:(g + 1) * c_group] @ weight[g * per:(g + 1) * per, :, 0].T
                      for g in range(groups)], 1) + bias


def _authors_attention(sd, x, heads, grid, prefix=1, mean_of=None, lepe=False):
    """The authors' attention written out: tokens x (B, prefix + H * W, C), the class token first (DeiT; none on
    the Swin models' maps, ``prefix=0``). Weights
    w_ij = (s q_i.k_j - s q_i.kbar + 1) / N over all N tokens; on the patch tokens a 3x3 cross-correlation of v
    (zero padding) with nine weights per image and channel predicted from the mean token (grouped 1x1, GELU,
    grouped 1x1; channel c's weights are outputs 9c..9c+8, row-major over the 3x3 window). CSwin's: the kernels
    from the mean of ``mean_of`` (the block's input before its norm), and with ``lepe`` a 3x3 depthwise
    cross-correlation of v with the ``lepe`` weights and bias (zero padding) added."""
    b, n, c = x.shape
    d, (h, w) = c // heads, grid
    q, k, v = (x @ sd["qkv.weight"].T + sd["qkv.bias"]).split(c, dim=-1)
    out = torch.zeros_like(v)
    s = d ** -0.5
    for e in range(heads):
        cols = slice(e * d, (e + 1) * d)
        scores = s * q[..., cols] @ k[..., cols].transpose(1, 2)  # (B, N, N)
        weights = (scores - scores.mean(dim=-1, keepdim=True) + 1) / n
        out[..., cols] = weights @ v[..., cols]
    mean = (x if mean_of is None else mean_of).mean(1)
    kernels = _grouped_1x1(_gelu(_grouped_1x1(mean, sd["local.0.weight"], sd["local.0.bias"], heads)),
                           sd["local.2.weight"], sd["local.2.bias"], heads).reshape(b, c, 3, 3)
    vg = F.pad(v[:, prefix:].reshape(b, h, w, c), (0, 0, 1, 1, 1, 1))
    for r in range(h):
        for col in range(w):
            window = vg[:, r:r + 3, col:col + 3]  # (B, 3, 3, C)
            out[:, prefix + r * w + col] += torch.einsum("bijc,bcij->bc", window, kernels)
            if lepe:
                out[:, prefix + r * w + col] += (torch.einsum("bijc,cij->bc", window, sd["lepe.weight"][:, 0])
                                                 + sd["lepe.bias"])
    return out @ sd["proj.weight"].T + sd["proj.bias"]


@pytest.mark.parametrize("grid", [(3, 5), (5, 3), (1, 1)])
def test_block_equals_the_authors_formula_at_odd_grids(grid):
    """One InLine-DeiT block (class token + H x W patch tokens, random weights, float64) against the transcription:
    x + attn(LN(x)), then + fc2(GELU(fc1(LN(x)))), LayerNorm eps 1e-6."""
    torch.manual_seed(0)
    heads, c = 3, 24
    model = timm.create_model("inline_deit_tiny", embed_dim=c, num_heads=heads, depth=1, img_size=64,
                              dynamic_img_size=True).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    block = model.blocks[0]
    sd = {k: v for k, v in block.state_dict().items()}
    x = torch.randn(2, 1 + grid[0] * grid[1], c, dtype=torch.float64)
    with torch.no_grad():
        ours = block(x, grid, num_prefix_tokens=1)
    mixer_sd = {k[len("mixer."):]: v for k, v in sd.items() if k.startswith("mixer.")}
    y = x + _authors_attention(mixer_sd, layer_norm(x, sd["norm1.weight"], sd["norm1.bias"], 1e-6), heads, grid)
    hidden = _gelu(layer_norm(y, sd["norm2.weight"], sd["norm2.bias"], 1e-6) @ sd["mlp.fc1.weight"].T
                   + sd["mlp.fc1.bias"])
    expected = y + hidden @ sd["mlp.fc2.weight"].T + sd["mlp.fc2.bias"]
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def test_local_residual_differs_from_the_ablation_inline_mixer():
    """``inline`` and ``inline_deit`` share the injective attention (the same q, k, v give the same output without
    the local residuals) and differ in the residual: the ablation's predicts nine weights per token and head."""
    torch.manual_seed(0)
    x = torch.randn(2, 15, 16, dtype=torch.float64)
    ablation = create_mixer("inline", 16, 2, local=False).double()
    published = create_mixer("inline_deit", 16, 2).double()
    published.qkv.load_state_dict(ablation.qkv.state_dict())
    published.proj.load_state_dict(ablation.proj.state_dict())
    with torch.no_grad():
        for p in published.local.parameters():
            p.zero_()
        torch.testing.assert_close(published(x, (3, 5)), ablation(x, (3, 5)), rtol=1e-12, atol=1e-12)
    assert "local.2.weight" in dict(create_mixer("inline", 16, 2).named_parameters())
    assert create_mixer("inline", 16, 2).local[2].out_channels == 9 * 2  # per head, not per channel


def test_any_grid_with_dynamic_img_size_and_features(tmp_path):
    """Non-square inputs with the embedding resampled per call, from the file's own grid (small: 18 x 18, not
    resampled to 224 px first); forward_intermediates give the patch grid."""
    state = authors_layout("inline_deit_small", blocks=1)
    path = tmp_path / "inline_deit_s.pth"
    save_authors(path, state)
    model = timm.create_model("inline_deit_small", depth=1, dynamic_img_size=True, pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path))).eval()
    torch.testing.assert_close(model.pos_embed, state["pos_embed"], rtol=0, atol=0)
    x = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        assert model(x).shape == (1, 1000)
        final, feats = model.forward_intermediates(x)
    assert feats[-1].shape == (1, 320, 6, 10)


def test_pretrained_true_downloads_the_published_url_and_runs_no_code(tmp_path, monkeypatch):
    """pretrained=True fetches the TsinghuaCloud link into timm's cache under a file name (only the transfer is
    replaced by a copy of a local file) and reads the raw weights under 'model' without running code from the
    pickle; a new class count keeps the model's head."""
    marker = tmp_path / "marker"
    state = authors_layout("inline_deit_tiny", blocks=1)
    path = tmp_path / "inline_deit_t.pth"
    save_authors(path, state, payload=Crafted(str(marker)))
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    model = timm.create_model("inline_deit_tiny", depth=1, pretrained=True, num_classes=5)
    assert asked == ["https://cloud.tsinghua.edu.cn/f/1d6b8191ad6d4114b291/?dl=1"] and not marker.exists()
    assert (tmp_path / "torch_home" / "hub" / "checkpoints" / "inline_deit_tiny_in1k.pth").is_file()
    torch.testing.assert_close(model.blocks[0].mixer.local[2].weight, state["blocks.0.attn.residual.2.weight"],
                               rtol=0, atol=0)
    assert model.head.weight.shape == (5, 192)
    assert "74.5" in model.pretrained_cfg["description"] and "no licence" in model.pretrained_cfg["license"]
    small = timm.models.get_pretrained_cfg("inline_deit_small.in1k")
    assert small.url[0] == "https://cloud.tsinghua.edu.cn/f/2f3898b07e9247f3beb3/?dl=1"


def test_offline_the_failure_names_the_file_and_the_manual_lists_it(tmp_path, monkeypatch):
    """Without a network pretrained=True stops in one line naming the link, timm's cache name and the page whose
    InLine-DeiT section lists every file (its address and its name in the cache)."""
    import socket
    import urllib.error

    import timm.models._hub as hub
    from linvision.models.published import WeightsDownloadError

    def unreachable(url, dst, hash_prefix=None, progress=True):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(hub, "download_url_to_file", unreachable)
    with pytest.raises(WeightsDownloadError) as e:
        timm.create_model("inline_deit_tiny", pretrained=True, depth=1)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "inline_deit_tiny_in1k.pth" in message
    assert "https://cloud.tsinghua.edu.cn/f/1d6b8191ad6d4114b291/?dl=1" in message
    assert message.endswith("the model cards in docs/models/published.md)")
    page = (Path(__file__).parent.parent / "docs" / "models" / "published.md").read_text()
    section = page.split("## InLine-DeiT (isotropic)", 1)[1].split("\n## ", 1)[0]
    for name in PUBLISHED:
        url, filename = timm.models.get_pretrained_cfg(name + ".in1k").url
        assert f"| `{name}.in1k` | <{url}> | `{filename}` |" in section, name


@pytest.mark.slow
def test_onnx_runtime_matches_eager_at_other_sizes_and_batches(tmp_path):
    """The local residual is nine shifted products, not a convolution with a group per image and channel (whose
    group count follows the batch, which ONNX cannot export): the exported graph runs at other sizes and batches."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from linvision.export.program import compare_with_eager, export_onnx, load_exported

    torch.manual_seed(0)
    model = timm.create_model("inline_deit_tiny", embed_dim=32, num_heads=2, depth=2, dynamic_img_size=True).eval()
    path = str(tmp_path / "inline.onnx")
    export_onnx(model, (64, 96), path)
    for row in compare_with_eager(model, load_exported(path, "onnx"), [(64, 96), (96, 48)], batch=3):
        assert row["max_abs_diff"] <= 1e-4 * max(1.0, row["max_abs_output"]), row


# InLine-Swin: the authors' Swin models (their InLineSwin with cfgs/inline_swin_{t,s,b}.yaml) on linvision's
# Swin layout; the README's params (M) and GFLOPs at 224 px.
SWIN_PUBLISHED = {"inline_swin_tiny": (30, 4.5), "inline_swin_small": (50, 8.7), "inline_swin_base": (88, 15.4)}
SWIN_NAMES = [pytest.param(n, id=n, marks=[] if n == "inline_swin_tiny" else [pytest.mark.slow])
              for n in SWIN_PUBLISHED]
SWIN_BUFFERS = (".relative_position_index", ".attn_mask")


@pytest.mark.parametrize("name", SWIN_NAMES)
def test_swin_authors_layout_loads_every_parameter_and_matches_the_table(name, tmp_path):
    """Every tensor of the file but the recomputed buffers lands in the model unchanged; the kernel predictor
    becomes the mixer's ``local``; params and GFLOPs are the README's (within 1 M and 2%); B's third stage starts
    with two InLine blocks, then shifts every second window block."""
    state = authors_layout(name)
    path = tmp_path / f"{name}.pth"
    save_authors(path, state)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    weights = {k: v for k, v in state.items() if not k.endswith(SWIN_BUFFERS)}
    own = model.state_dict()
    assert len(own) == len(weights)
    assert_same_values(own, weights)
    torch.testing.assert_close(own["stages.1.blocks.1.mixer.local.2.weight"],
                               state["layers.1.blocks.1.attn.residual.2.weight"], rtol=0, atol=0)
    params, gflops = SWIN_PUBLISHED[name]
    assert abs(count_params(model) / 1e6 - params) <= 1
    assert count_gflops(model.to("meta"), 224) == pytest.approx(gflops, rel=0.02)  # shapes only: the same count
    kinds = [type(b.mixer).__name__ for b in model.stages[2].blocks]
    if name == "inline_swin_base":
        assert kinds[:3] == ["InLineDeitAttention", "InLineDeitAttention", "SwinWindowAttention"]
        assert [b.mixer.shift for b in model.stages[2].blocks[2:6]] == [False, True, False, True]


@pytest.mark.parametrize("name, eps, ratio", [("inline_swin_tiny", 1e-5, 4), ("inline_pvt_tiny", 1e-6, 8)],
                         ids=["swin", "pvt"])
@pytest.mark.parametrize("grid", [(6, 6), (3, 5)])
def test_hierarchical_linear_block_equals_the_authors_formula(name, eps, ratio, grid):
    """An InLine-Swin / InLine-PVT stage-1 block (float64, random weights) against the authors' attention written
    out on a map without a class token (the transcription above with no prefix token); LayerNorm eps 1e-5 and an
    MLP 4 times as wide in Swin, 1e-6 and 8 times in PVT."""
    heads, c = 2, 16
    model = timm.create_model(name, depths=(1, 1, 1, 1), dims=(c, 32, 32, 32), num_heads=(heads, 2, 2, 2)
                              ).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    block = model.stages[0].blocks[0]
    sd = block.state_dict()
    mixer_sd = {k[len("mixer."):]: v for k, v in sd.items() if k.startswith("mixer.")}
    x = torch.randn(2, grid[0] * grid[1], c, dtype=torch.float64)

    def norm(t, key):
        return layer_norm(t, sd[key + ".weight"], sd[key + ".bias"], eps)

    with torch.no_grad():
        ours = block(x.reshape(2, *grid, c)).reshape(2, -1, c)
        y = x + _authors_attention(mixer_sd, norm(x, "norm1"), heads, grid, prefix=0)
        hidden = _gelu(norm(y, "norm2") @ sd["mlp.fc1.weight"].T + sd["mlp.fc1.bias"])
        expected = y + hidden @ sd["mlp.fc2.weight"].T + sd["mlp.fc2.bias"]
    assert sd["mlp.fc1.weight"].shape == (ratio * c, c)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


# InLine-PVT: the authors' PVT models (inline_pvt_tiny/small/medium/large) on linvision's PVT layout; the README's
# params (M) and GFLOPs at 224 px (L: their model has 51.2 M parameters, the README says 50.2).
PVT_PUBLISHED = {"inline_pvt_tiny": (12.0, 2.0), "inline_pvt_small": (21.6, 3.9), "inline_pvt_medium": (37.6, 6.9),
                 "inline_pvt_large": (50.2, 10.2)}
PVT_NAMES = [pytest.param(n, id=n, marks=[] if n == "inline_pvt_tiny" else [pytest.mark.slow]) for n in PVT_PUBLISHED]


@pytest.mark.parametrize("name", PVT_NAMES)
def test_pvt_authors_layout_loads_every_tensor_and_matches_the_table(name, tmp_path):
    """Every tensor of the file lands in the model unchanged (q and kv joined as ``qkv``, the kernel predictor as
    ``local``); params and GFLOPs are the README's (within 1 M and 2%)."""
    state = authors_layout(name)
    path = tmp_path / f"{name}.pth"
    save_authors(path, state)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    own = model.state_dict()
    assert_same_values(own, state)
    assert count_params(model) == sum(v.numel() for v in state.values())
    joined = torch.cat([state["block2.1.attn.q.bias"], state["block2.1.attn.kv.bias"]])
    torch.testing.assert_close(own["stages.1.blocks.1.mixer.qkv.bias"], joined, rtol=0, atol=0)
    torch.testing.assert_close(own["stages.1.blocks.1.mixer.local.0.weight"],
                               state["block2.1.attn.residual.0.weight"], rtol=0, atol=0)
    params, gflops = PVT_PUBLISHED[name]
    assert abs(count_params(model) / 1e6 - params) <= 1
    assert count_gflops(model.to("meta"), 224) == pytest.approx(gflops, rel=0.02)  # shapes only: the same count


# InLine-CSwin: the authors' CSWin models (inline_cswin_tiny/small/base, attn_type IISS) on linvision's CSWin
# layout; the README's GFLOPs at 224 px (its params, 25 / 43 / 96 M, are not those of the authors' own models of
# these configs: 20.6 / 33.0 / 73.4 M, as here).
CSWIN_GFLOPS = {"inline_cswin_tiny": 4.3, "inline_cswin_small": 6.8, "inline_cswin_base": 14.9}
CSWIN_NAMES = [pytest.param(n, id=n, marks=[] if n == "inline_cswin_tiny" else [pytest.mark.slow])
               for n in CSWIN_GFLOPS]


@pytest.mark.parametrize("name", CSWIN_NAMES)
def test_cswin_authors_layout_loads_the_ema_copy_and_matches_the_table(name, tmp_path):
    """The file holds the raw weights under 'model' and the EMA copy under 'state_dict_ema': every tensor of the
    EMA copy lands in the model unchanged; the stripes' two LePE convs (half the channels each) join as one, a
    single branch's becomes ``lepe``, the kernel predictor ``local``; the GFLOPs are the README's (within 2%)."""
    raw, ema = authors_layout(name, seed=1), authors_layout(name, seed=2)
    path = tmp_path / f"{name}.pth"
    save_authors(path, raw, state_dict_ema=ema, max_accuracy_e=83.2)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    own = model.state_dict()
    assert count_params(model) == sum(v.numel() for v in ema.values())
    assert_same_values(own, ema)
    joined = torch.cat([ema["stage3.0.attns.0.get_v.weight"], ema["stage3.0.attns.1.get_v.weight"]])
    torch.testing.assert_close(own["stages.2.blocks.0.mixer.stripe_lepe.weight"], joined, rtol=0, atol=0)
    torch.testing.assert_close(own["stages.3.blocks.0.mixer.lepe.bias"], ema["stage4.0.attns.0.get_v.bias"],
                               rtol=0, atol=0)
    torch.testing.assert_close(own["stages.0.blocks.1.mixer.local.2.weight"],
                               ema["stage1.1.attns.0.residual.2.weight"], rtol=0, atol=0)
    torch.testing.assert_close(own["stages.1.downsample.conv.weight"], ema["merge1.conv.weight"], rtol=0, atol=0)
    assert count_gflops(model.to("meta"), 224) == pytest.approx(CSWIN_GFLOPS[name], rel=0.02)  # the same count
    assert [type(s.blocks[0].mixer).__name__ for s in model.stages] == [
        "InLineCswinAttention", "InLineCswinAttention", "CswinStripeAttention", "SoftmaxAttention"]


def _cswin_model(**kwargs):
    model = timm.create_model("inline_cswin_tiny", depths=(1, 1, 1, 1), dims=(16, 16, 16, 16),
                              num_heads=(2, 2, 4, 2), **kwargs).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _block(block, attention, x):
    """x + attention(LN(x), x), then + fc2(GELU(fc1(LN(x)))), LayerNorm eps 1e-5."""
    sd = block.state_dict()

    def norm(t, key):
        return layer_norm(t, sd[key + ".weight"], sd[key + ".bias"], 1e-5)

    y = x + attention(norm(x, "norm1"), x)
    hidden = _gelu(norm(y, "norm2") @ sd["mlp.fc1.weight"].T + sd["mlp.fc1.bias"])
    return y + hidden @ sd["mlp.fc2.weight"].T + sd["mlp.fc2.bias"]


@pytest.mark.parametrize("grid", [(6, 6), (3, 5)])
def test_cswin_inline_block_equals_the_authors_formula(grid):
    """An InLine-CSwin stage-1 block (float64, random weights) against the authors' attention written out: the
    injective attention over the map, the local residual with kernels from the mean of the block's input before
    its norm (not of the normalised tokens, as DeiT's), and the 3x3 LePE of v."""
    heads = 2
    block = _cswin_model().stages[0].blocks[0]
    mixer_sd = {k[len("mixer."):]: v for k, v in block.state_dict().items() if k.startswith("mixer.")}
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    with torch.no_grad():
        ours = block(x.reshape(2, *grid, 16)).reshape(2, -1, 16)
        expected = _block(block, lambda t, raw: _authors_attention(mixer_sd, t, heads, grid, prefix=0, mean_of=raw,
                                                                   lepe=True), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def _authors_stripes(sd, x, heads, grid, stripe):
    """CSWin's cross-shaped window attention written out per token (tokens x (B, H * W, C)): q, k, v from qkv;
    the first half of the heads attend to the keys of their vertical stripe (the columns of the token's block of
    ``stripe`` columns, every row), the second half to those of their horizontal stripe (its block of ``stripe``
    rows, every column), softmax(q.k / sqrt(D)); plus the 3x3 depthwise cross-correlation of v inside the stripe
    (neighbours outside the stripe or the map count as zero) with weights ``stripe_lepe`` (first half of the
    channels for the vertical stripes) and its bias; the projection. A stripe at the map's edge holds the map's
    tokens only."""
    b, n, c = x.shape
    d, (h, w) = c // heads, grid
    q, k, v = (t.reshape(b, h, w, c) for t in (x @ sd["qkv.weight"].T + sd["qkv.bias"]).split(c, dim=-1))
    out = torch.zeros(b, h, w, c, dtype=x.dtype)
    for i in range(h):
        for j in range(w):
            for hd in range(heads):
                cols = slice(hd * d, (hd + 1) * d)
                vertical = hd < heads // 2
                rows_in = range(h) if vertical else range(i // stripe * stripe, min(i // stripe * stripe + stripe, h))
                cols_in = range(j // stripe * stripe, min(j // stripe * stripe + stripe, w)) if vertical else range(w)
                keys = [(a, e) for a in rows_in for e in cols_in]
                logits = torch.stack([(q[:, i, j, cols] * k[:, a, e, cols]).sum(-1) / math.sqrt(d)
                                      for a, e in keys], -1)
                values = torch.stack([v[:, a, e, cols] for a, e in keys], 1)
                out[:, i, j, cols] = torch.einsum("bk,bkd->bd", torch.softmax(logits, -1), values)
                for di in (-1, 0, 1):
                    for dj in (-1, 0, 1):
                        a, e = i + di, j + dj
                        if a in rows_in and e in cols_in:
                            out[:, i, j, cols] += sd["stripe_lepe.weight"][cols, 0, di + 1, dj + 1] * v[:, a, e, cols]
                out[:, i, j, cols] += sd["stripe_lepe.bias"][cols]
    return out.reshape(b, n, c) @ sd["proj.weight"].T + sd["proj.bias"]


@pytest.mark.parametrize("grid", [(14, 14), (9, 11)])
def test_cswin_stripe_block_equals_the_authors_formula(grid):
    """A stage-3 block (float64, random weights, stripes 7 wide, 4 heads: 2 vertical, 2 horizontal) against the
    transcription of CSWin's attention: at 14 x 14 (224 px) as the authors compute it, at 9 x 11 with stripes
    cut by the map's edge (padded keys take no weight, the LePE sees zeros beyond the map)."""
    block = _cswin_model().stages[2].blocks[0]
    sd = {k[len("mixer."):]: v for k, v in block.state_dict().items() if k.startswith("mixer.")}
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    with torch.no_grad():
        ours = block(x.reshape(2, *grid, 16)).reshape(2, -1, 16)
        expected = _block(block, lambda t, raw: _authors_stripes(sd, t, 4, grid, 7), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


# The hierarchical models' published files (the tiny ones): the link, the README's top-1, a non-square size the
# model runs at (CSWin's no multiple of its stripes), a tensor of the model and the file's tensor it holds, and
# whether the file's EMA copy (beside the raw weights) is what loads.
DOWNLOADS = {
    "inline_swin_tiny": ("https://cloud.tsinghua.edu.cn/f/32810869fcc34410966b/?dl=1", "82.4", (160, 224),
                         "stages.3.blocks.0.mixer.relative_position_bias_table",
                         "layers.3.blocks.0.attn.relative_position_bias_table", False),
    "inline_pvt_tiny": ("https://cloud.tsinghua.edu.cn/f/90ac52b1555b401eb5e6/?dl=1", "78.2", (160, 224),
                        "stem.pos_embed", "pos_embed1", False),
    "inline_cswin_tiny": ("https://cloud.tsinghua.edu.cn/f/49fa2ecc543647c4b970/?dl=1", "83.2", (160, 288),
                          "stem.proj.weight", "stage1_conv_embed.0.weight", True),
}


@pytest.mark.parametrize("name", list(DOWNLOADS))
def test_hierarchical_pretrained_true_downloads_the_published_url(name, tmp_path, monkeypatch):
    """pretrained=True fetches InLine-Swin-T's, -PVT-T's and -CSwin-T's TsinghuaCloud link into timm's cache under
    a file name and runs no code from the pickle (CSWin's file holds an EMA copy, which loads); the model runs at a
    non-square size."""
    url, top1, size, ours, theirs, ema = DOWNLOADS[name]
    marker = tmp_path / "marker"
    raw = authors_layout(name, seed=1, blocks=1)
    state = authors_layout(name, seed=2, blocks=1) if ema else raw
    path = tmp_path / f"{name}.pth"
    save_authors(path, raw, payload=Crafted(str(marker)), **(dict(state_dict_ema=state) if ema else {}))
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    model = timm.create_model(name, depths=(1, 1, 1, 1), pretrained=True).eval()
    assert asked == [url] and not marker.exists()
    assert (tmp_path / "torch_home" / "hub" / "checkpoints" / f"{name}_in1k.pth").is_file()
    torch.testing.assert_close(model.state_dict()[ours], state[theirs], rtol=0, atol=0)
    with torch.no_grad():
        assert model(torch.randn(1, 3, *size)).shape == (1, 1000)
    cfg = model.pretrained_cfg
    assert (cfg["crop_pct"], cfg["interpolation"]) == (0.875, "bicubic") and top1 in cfg["description"]
