"""The published backbones (MLLA, RAVLT, MAViT): the authors' checkpoint layout loads with every tensor used, the
sizes match the published tables, blocks equal explicit float64 formulas of the authors' definitions (their RoPE
conventions included) at any grid, and checkpoint pickles run no code.

tests/data/published/<model>.txt lists the tensor names, shapes and dtypes of each authors' checkpoint; the files
built here from them hold random values."""
import json
import math
import os

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import linvision
from linvision.utils.checkpoint import load_pretrained
from linvision.benchmark.flops import count_gflops, count_params
from linvision.safe_pickle import NotLoaded, read_checkpoint
from support import (RESOLUTION_BUFFERS, Crafted, authors_layout, run_tool, save_published, serve_downloads_from,
                     sorted_values, write_image_folder)

# Published params (M), GFLOPs at 224 and whether the published count includes the attention products (MLLA's
# does; RAVLT's counts convolutions and projections only).
PUBLISHED = {
    "mlla_tiny": (25, 4.2, True), "mlla_small": (43, 7.3, True), "mlla_base": (96, 16.2, True),
    "ravlt_tiny": (15, 2.4, False), "ravlt_small": (26, 4.6, False), "ravlt_base": (48, 9.9, False),
    "ravlt_large": (95, 16.0, False), "mavit_small": (27, 4.6, False),
}
UNCOUNTED = ("mavit_tiny", "mavit_base", "mavit_large")  # published weights, no published size figures
SLOW = ("mlla_base", "ravlt_base", "ravlt_large", "mavit_base", "mavit_large")
NAMES = [pytest.param(n, id=n, marks=[pytest.mark.slow] if n in SLOW else []) for n in PUBLISHED]
# the files' layouts by default at each family's tiny size (the same mapping at every size), all sizes with --runslow
LAYOUTS = [pytest.param(n, id=n, marks=[] if n.endswith("_tiny") else [pytest.mark.slow])
           for n in (*PUBLISHED, *UNCOUNTED)]
@pytest.mark.parametrize("name", LAYOUTS)
def test_published_layout_loads_every_tensor(name, tmp_path):
    """Every tensor of the file lands in the model (a bijection: the sorted values are equal, so nothing is missing,
    duplicated or changed), from the raw weights, not the EMA copy; the q/k rows follow the pairs of RoPE."""
    state = authors_layout(name)
    path = tmp_path / f"{name}.pth"
    save_published(path, state)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    own = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    used = [v for k, v in state.items() if v.is_floating_point() and not k.endswith(RESOLUTION_BUFFERS)]
    torch.testing.assert_close(sorted_values(own.values()), sorted_values(used), rtol=0, atol=0)
    # interleaved pairs (2t, 2t+1) of each head become (t, t + D/2): q row t of head 0 is the file's row 2t
    attn = model.stages[0].blocks[0].mixer
    attn = attn.attn if hasattr(attn, "attn") else attn
    key = "layers.0.blocks.0.attn.qk.weight" if name.startswith("mlla") else "layers.0.blocks.0.attn.qkvo.weight"
    d = attn.head_dim
    source = state[key].flatten(1)
    for t in range(d // 2):
        torch.testing.assert_close(attn.qkv.weight[t], source[2 * t], rtol=0, atol=0)
        torch.testing.assert_close(attn.qkv.weight[t + d // 2], source[2 * t + 1], rtol=0, atol=0)
        torch.testing.assert_close(attn.qkv.weight[attn.dim + t], source[attn.dim + 2 * t], rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_sizes_match_the_published_tables(name):
    params, gflops, with_attention = PUBLISHED[name]
    with torch.device("meta"):  # shapes only: a CPU build's counts (tests/test_docs.py), without weights
        model = timm.create_model(name)
    assert abs(count_params(model) / 1e6 - params) <= 1.0
    assert count_gflops(model, 224, attention=with_attention) == pytest.approx(gflops, rel=0.03)


def test_files_of_another_model_and_bad_files_fail_in_one_line(tmp_path):
    tiny = tmp_path / "mlla_tiny.pth"
    save_published(tiny, authors_layout("mlla_tiny"))
    with pytest.raises(ValueError, match=r"mlla_tiny\.pth: has no tensor 'stages\.0\.blocks\.2\.cpe1\.proj\.weight'"):
        timm.create_model("mlla_small", pretrained=True, pretrained_cfg_overlay=dict(file=str(tiny)))
    ravlt = tmp_path / "ravlt_tiny.pth"
    save_published(ravlt, authors_layout("ravlt_tiny"))
    with pytest.raises(ValueError, match=r"ravlt_tiny\.pth: has no tensor 'stem\.conv1\.conv\.weight'"):
        timm.create_model("mlla_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(ravlt)))
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(tiny.read_bytes()[:10000])
    with pytest.raises(ValueError, match=r"pretrained file: cannot read .*truncated\.pth"):
        timm.create_model("mlla_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(truncated)))


def test_a_crafted_pickle_runs_no_code(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "crafted.pth"
    save_published(path, authors_layout("ravlt_tiny", blocks=1), payload=Crafted(str(marker)))
    checkpoint = read_checkpoint(str(path))
    assert not marker.exists()
    assert isinstance(checkpoint["payload"], NotLoaded) and checkpoint["payload"].global_name == "io.open"
    assert isinstance(checkpoint["config"], NotLoaded) and isinstance(checkpoint["args"], NotLoaded)
    assert checkpoint["epoch"] == 299 and checkpoint["optimizer"]["param_groups"][0]["lr"] == 0.1
    model = timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1), pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path)))
    assert not marker.exists()
    torch.testing.assert_close(model.stem.convs[0].conv.weight, checkpoint["model"]["patch_embed.proj.0.weight"])
    # the pickle module itself would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_a_torchscript_archive_is_refused_before_its_code_runs(tmp_path):
    """torch.load hands an archive with TorchScript code to torch.jit.load (which runs the archive's code, e.g. a
    scripted __setstate__, whatever the pickle module); the reader refuses such a file in one line."""
    path = tmp_path / "scripted.pth"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    with pytest.raises(ValueError, match=r"cannot read .*scripted\.pth \(a TorchScript archive"):
        read_checkpoint(str(path))
    with pytest.raises(ValueError, match="TorchScript archive"):
        timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1), pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(path)))


def test_other_layouts_fail_in_one_line_and_safetensors_load(tmp_path):
    """A file with more blocks than the model names the first extra tensor (no error from inside the mapping); the
    model's own safetensors loads through the same overlay."""
    full = tmp_path / "RAVLT_T.pth"
    save_published(full, authors_layout("ravlt_tiny"))
    with pytest.raises(ValueError, match=r"has a tensor the model lacks 'stages\.0\.blocks\.1\."):
        timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1), pretrained=True, pretrained_cfg_overlay=dict(file=str(full)))
    from safetensors.torch import save_file

    source = timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1))
    own = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(own))
    loaded = timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1), pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(own)))
    for k, v in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)


# --- the blocks against the authors' definitions, written out in float64 on their layout ---

def _interleaved_rotate(x, angles):
    """Rotate consecutive pairs (2p, 2p+1) of x (..., N, 2P) by angles (N, P)."""
    cos, sin = angles.cos(), angles.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def _grid(h, w):
    rows = torch.arange(h, dtype=torch.float64).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float64).repeat(h)
    return rows, cols


def _dwconv(x_nhwc, weight, bias):
    c = x_nhwc.shape[-1]
    k = weight.shape[-1]
    return F.conv2d(x_nhwc.permute(0, 3, 1, 2), weight, bias, padding=k // 2, groups=c).permute(0, 2, 3, 1)


def _linear_attention_explicit(q, k, v, rq, rk, eps):
    """o_i = sum_j (rq_i . rk_j) v_j / N / (q_i . mean_j k_j + eps), per head, with the N x N matrix."""
    n = k.shape[-2]
    scores = rq @ rk.transpose(-1, -2) / n
    den = q @ k.mean(dim=-2, keepdim=True).transpose(-1, -2) + eps
    return scores @ v / den


def _heads(t, heads):  # (B, N, C) -> (B, heads, N, D)
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


def _merge(t):  # (B, heads, N, D) -> (B, N, C)
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def _published_model(name, tmp_path, **kwargs):
    state = {k: v.double() if v.is_floating_point() else v for k, v in authors_layout(name, blocks=1).items()}
    path = tmp_path / f"{name}.pth"
    torch.save({"model": state}, path)
    model = timm.create_model(name, depths=(1, 1, 1, 1), pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              **kwargs).double().eval()
    return model, state


def test_mlla_block_equals_the_authors_formula_at_any_grid(tmp_path):
    """MLLA's block: RoPE over the whole channel dimension (pairs (2p, 2p+1); the first C/4 pairs turn with the row,
    the rest with the column, frequencies 10000^(-p / (C/4))), numerator only; elu+1; v = the attention input."""
    torch.manual_seed(0)
    model, sd = _published_model("mlla_tiny", tmp_path)
    for stage, (h, w) in ((0, (3, 5)), (1, (4, 4)), (0, (7, 2))):
        p = f"layers.{stage}.blocks.0."
        w_ = lambda n: sd[p + n]  # noqa: E731
        c = w_("norm1.weight").shape[0]
        heads = model.stages[stage].blocks[0].mixer.attn.num_heads
        x = torch.randn(2, h, w, c, dtype=torch.float64)
        y = x + _dwconv(x, w_("cpe1.weight"), w_("cpe1.bias"))
        t = F.layer_norm(y, (c,), w_("norm1.weight"), w_("norm1.bias"), eps=1e-5)
        gate = F.silu(F.linear(t, w_("act_proj.weight"), w_("act_proj.bias"))).reshape(2, h * w, c)
        u = F.silu(_dwconv(F.linear(t, w_("in_proj.weight"), w_("in_proj.bias")), w_("dwc.weight"), w_("dwc.bias")))
        u = u.reshape(2, h * w, c)
        q, k = (F.elu(z) + 1 for z in F.linear(u, w_("attn.qk.weight"), w_("attn.qk.bias")).chunk(2, dim=-1))
        kmax = c // 4
        freqs = 10000.0 ** (-torch.arange(kmax, dtype=torch.float64) / kmax)
        rows, cols = _grid(h, w)
        angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)  # (N, C/2)
        rq, rk = _interleaved_rotate(q, angles), _interleaved_rotate(k, angles)  # whole channel dim, then heads
        att = _merge(_linear_attention_explicit(*(_heads(z, heads) for z in (q, k, u, rq, rk)), eps=1e-6))
        lepe = _dwconv(u.reshape(2, h, w, c), w_("attn.lepe.weight"), w_("attn.lepe.bias")).reshape(2, h * w, c)
        mixed = F.linear((att + lepe) * gate, w_("out_proj.weight"), w_("out_proj.bias")).reshape(2, h, w, c)
        y = y + mixed
        y = y + _dwconv(y, w_("cpe2.weight"), w_("cpe2.bias"))
        t = F.layer_norm(y, (c,), w_("norm2.weight"), w_("norm2.bias"), eps=1e-5)
        expected = y + F.linear(F.gelu(F.linear(t, w_("mlp.fc1.weight"), w_("mlp.fc1.bias"))),
                                w_("mlp.fc2.weight"), w_("mlp.fc2.bias"))
        with torch.no_grad():
            got = model.stages[stage].blocks[0](x)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # RoPE tables are fp32 by design


def _conv1x1(x, weight, bias):
    return F.linear(x, weight.flatten(1), bias)


def _authors_attention(q, k, v, d, kind, angles):
    """The token mixing of RAVLT's and MAViT's stages on heads (B, heads, N, D), as the authors compute it."""
    n = q.shape[-2]
    if kind == "rala":
        q, k = F.elu(q) + 1, F.elu(k) + 1
        weights = torch.softmax(d ** -0.5 * q.mean(dim=-2, keepdim=True) @ k.transpose(-1, -2), dim=-1)
        k = k * weights.transpose(-1, -2) * n
        return _linear_attention_explicit(q, k, v, _interleaved_rotate(q, angles), _interleaved_rotate(k, angles),
                                          eps=1e-6)
    if kind == "mala":  # z = s phi(q).mean(phi(k)) before RoPE; (s/N) rq rk^T v (1 + 1/(z + eps)) - z mean(v)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        z = d ** -0.5 * q @ k.mean(dim=-2, keepdim=True).transpose(-1, -2)
        kv = _interleaved_rotate(k, angles).transpose(-1, -2) @ v * (d ** -0.5 / n)
        return _interleaved_rotate(q, angles) @ kv * (1 + 1 / (z + 1e-6)) - z * v.mean(dim=-2, keepdim=True)
    rq, rk = _interleaved_rotate(q, angles), _interleaved_rotate(k, angles)
    return torch.softmax(d ** -0.5 * rq @ rk.transpose(-1, -2), dim=-1) @ v


def _authors_block(sd, p, x, heads, kind):
    """One RAVLT / MAViT block (prefix ``p`` of the authors' state dict ``sd``) on x (B, H, W, C), in float64: CPE,
    LayerNorm (eps 1e-6), qkvo 1x1 conv, the mixing with RoPE per head (pairs (2t, 2t+1); the first D/4 pairs turn
    with the row, the rest with the column, frequencies 10000^-linspace(0, 1, D/4)), LePE 5x5 on v,
    (attention + LePE) * o, the projection, layer scale; LayerNorm, the MLP with its residual 3x3 depthwise conv,
    layer scale."""
    w_ = lambda n: sd[p + n]  # noqa: E731
    b, h, w, c = x.shape
    d = c // heads
    y = x + _dwconv(x, w_("pos.weight"), w_("pos.bias"))
    t = F.layer_norm(y, (c,), w_("norm1.norm.weight"), w_("norm1.norm.bias"), eps=1e-6).reshape(b, h * w, c)
    q, k, v, o = _conv1x1(t, w_("attn.qkvo.weight"), w_("attn.qkvo.bias")).chunk(4, dim=-1)
    lepe = _dwconv(v.reshape(b, h, w, c), w_("attn.lepe.weight"), w_("attn.lepe.bias")).reshape(b, h * w, c)
    freqs = 10000.0 ** -torch.linspace(0, 1, d // 4, dtype=torch.float64)
    rows, cols = _grid(h, w)
    angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)  # (N, D/2), every head
    att = _authors_attention(*(_heads(z, heads) for z in (q, k, v)), d, kind, angles)
    mixed = _conv1x1((_merge(att) + lepe) * o, w_("attn.proj.weight"), w_("attn.proj.bias")).reshape(b, h, w, c)
    y = y + w_("gamma_1").flatten() * mixed
    t = F.layer_norm(y, (c,), w_("norm2.norm.weight"), w_("norm2.norm.bias"), eps=1e-6)
    hidden = F.gelu(_conv1x1(t, w_("ffn.fc1.weight"), w_("ffn.fc1.bias")))
    hidden = hidden + _dwconv(hidden, w_("ffn.dwconv.weight"), w_("ffn.dwconv.bias"))
    return y + w_("gamma_2").flatten() * _conv1x1(hidden, w_("ffn.fc2.weight"), w_("ffn.fc2.bias"))


@pytest.mark.parametrize("name, stage, kind", [("ravlt_tiny", 0, "rala"), ("ravlt_tiny", 1, "rala"),
                                               ("ravlt_tiny", 2, "softmax"), ("mavit_tiny", 0, "mala"),
                                               ("mavit_tiny", 1, "mala"), ("mavit_tiny", 3, "softmax")])
def test_ravlt_and_mavit_blocks_equal_the_authors_formulas_at_any_grid(name, stage, kind, tmp_path):
    """RAVLT's and MAViT's blocks (:func:`_authors_block`): RALA reweights the keys by softmax(D^-1/2 qbar.k_j) * N;
    MALA adds the query's magnitude z_i = D^-1/2 phi(q_i).mean(phi(k)); softmax stages rotate q and k."""
    torch.manual_seed(stage)
    model, sd = _published_model(name, tmp_path)
    heads = model.stages[stage].blocks[0].mixer.num_heads
    c = sd[f"layers.{stage}.blocks.0.norm1.norm.weight"].shape[0]
    for h, w in ((3, 5), (6, 4)):
        x = torch.randn(2, h, w, c, dtype=torch.float64)
        expected = _authors_block(sd, f"layers.{stage}.blocks.0.", x, heads, kind)
        with torch.no_grad():
            got = model.stages[stage].blocks[0](x)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # RoPE tables are fp32 by design


def _bn(x, sd, p):
    """The authors' BatchNorm ``p`` in eval mode on a channels-last x."""
    return (x - sd[p + "running_mean"]) / torch.sqrt(sd[p + "running_var"] + 1e-5) * sd[p + "weight"] + sd[p + "bias"]


def _conv_bn(x, sd, conv, bn, stride):
    """3x3 conv (padding 1) with bias, then BatchNorm, on NCHW x."""
    y = F.conv2d(x, sd[conv + "weight"], sd[conv + "bias"], stride=stride, padding=1)
    return _bn(y.permute(0, 2, 3, 1), sd, bn).permute(0, 3, 1, 2)


def _authors_head(sd, x):
    """1x1 conv (1024 channels for RAVLT, 2048 / 2560 for MAViT), BN, SiLU, average pool, 1x1 conv classifier."""
    z = _bn(_conv1x1(x, sd["proj.weight"], sd["proj.bias"]), sd, "norm.")
    return _conv1x1(F.silu(z).mean(dim=(1, 2)), sd["head.weight"], sd["head.bias"])


@pytest.mark.parametrize("name", ["ravlt_tiny", "mavit_tiny"])
def test_published_head_equals_the_authors_conv_head(name, tmp_path):
    model, sd = _published_model(name, tmp_path)
    x = torch.randn(2, 2, 3, 512, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(model.final(x)), _authors_head(sd, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, kinds", [("ravlt_tiny", ("rala", "rala", "softmax", "softmax")),
                                         ("mavit_tiny", ("mala", "mala", "softmax", "softmax"))])
def test_published_models_equal_the_authors_network(name, kinds, tmp_path):
    """The whole network (one block a stage) loaded from a file in the authors' layout gives the logits of their
    network written out in float64: a stem of four 3x3 conv-BN (strides 2, 1, 1, 2; GELU after the first three),
    each stage's blocks then a 3x3/2 conv-BN to the next stage's width, the conv head; at two input sizes."""
    model, sd = _published_model(name, tmp_path)
    torch.manual_seed(0)
    for size in ((64, 96), (96, 96)):
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        y = x
        for i, stride in enumerate((2, 1, 1, 2)):
            y = _conv_bn(y, sd, f"patch_embed.proj.{3 * i}.", f"patch_embed.proj.{3 * i + 1}.", stride)
            y = F.gelu(y) if i < 3 else y
        for stage, kind in enumerate(kinds):
            heads = model.stages[stage].blocks[0].mixer.num_heads
            y = _authors_block(sd, f"layers.{stage}.blocks.0.", y.permute(0, 2, 3, 1), heads, kind)
            y = y.permute(0, 3, 1, 2)
            if stage < len(kinds) - 1:
                y = _conv_bn(y, sd, f"layers.{stage}.downsample.reduction.", f"layers.{stage}.downsample.norm.", 2)
        expected = _authors_head(sd, y.permute(0, 2, 3, 1))
        with torch.no_grad():
            got = model(x)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * scale)  # RoPE tables are fp32 by design


@pytest.mark.parametrize("name", ["mlla_tiny", "ravlt_tiny", "mavit_tiny"])
def test_published_weights_run_at_any_multiple_of_the_stride(name, tmp_path):
    model, _ = _published_model(name, tmp_path)
    for size in ((224, 224), (320, 320), (256, 384), (96, 160)):
        with torch.no_grad():
            logits = model(torch.randn(1, 3, *size, dtype=torch.float64))
        assert logits.shape == (1, 1000) and torch.isfinite(logits).all(), size


def test_engine_and_train_fine_tune_from_a_published_file(tmp_path):
    """linvision-train --pretrained-path with a published-layout file: the backbone starts from the file's raw
    weights (a learning rate of 1e-12 keeps them), the head is new (4 classes)."""
    kwargs = {"depths": [1, 1, 1, 1]}
    state = authors_layout("ravlt_tiny", blocks=1)
    path = tmp_path / "RAVLT_T.pth"
    save_published(path, state)
    model = timm.create_model("ravlt_tiny", num_classes=4, **kwargs)
    report = load_pretrained(model, str(path))
    # the new head is counted once: skipped for its shape, not also missing
    assert report["skipped"] == ["head.fc.weight", "head.fc.bias"] and not report["missing"] and not report["unexpected"]
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}

    data = write_image_folder(tmp_path / "data", classes=4)
    run_tool("train.py", "--dataset", "folder", "--data-dir", data, "--img-size", "32", "--model", "ravlt_tiny",
             "--model-kwargs", '{"depths": [1, 1, 1, 1]}', "--batch-size", "4", "--output", str(tmp_path),
             "--no-progress", "--device", "cpu", "--epochs", "1", "--experiment", "ft", "--lr", "1e-12",
             "--warmup-lr", "1e-12", "--min-lr", "1e-12", "--pretrained-path", str(path))
    tuned = load_file(str(tmp_path / "ft" / "last" / "model.safetensors"))
    assert tuned["head.fc.weight"].shape == (4, 1024)
    params = [k for k in expected if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(params) > 100
    for key in params:
        torch.testing.assert_close(tuned[key], expected[key], rtol=0, atol=1e-6, msg=key)
    assert not math.isnan(float(tuned["stem.convs.0.conv.weight"].sum()))


def test_model_table_says_what_pretrained_loads():
    out = run_tool("model_table.py", "--filter", "ravlt_tiny", "linvit_tiny_patch16_224").stdout.splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in out[2:]}
    assert ("| 14.9 | 2.61 | 2.41 | any multiple of 32 | `.in1k`: the authors' ImageNet-1k weights (top-1 82.8% as "
            "published) |") in rows["ravlt_tiny"]
    assert "an error (no trained weights); `.deit_fb_in1k` loads DeiT's softmax weights" in rows[
        "linvit_tiny_patch16_224"]


@pytest.mark.parametrize("family", ["mlla", "ravlt", "mavit"])
def test_published_attention_runs_on_the_fused_kernels(family):
    """The families' linear attention with their RoPE conventions (MLLA: one table across heads, per-head
    frequency tensors; RAVLT: per-head linspace table, RALA's reweighted keys through the identity map; MAViT: the
    same table, MALA's augmented q and k) gives the PyTorch path's output and gradients on the fused kernels
    (Triton interpreter on CPU)."""
    pytest.importorskip("triton")
    from linvision.ops import axial_rope, linear_attention, magnitude_aware_linear_attention
    from linvision.ops import rank_augmented_linear_attention

    torch.manual_seed(0)
    heads, d, grid = 2, 32, (3, 5)
    q, k, v = (torch.randn(1, heads, 15, d, requires_grad=True) for _ in range(3))
    if family == "mlla":
        rope = axial_rope(heads * d, grid, theta=1e4, row_first=True, num_heads=heads)
        assert rope.freqs_x.shape == (heads, d // 2)

        def run(backend):
            return linear_attention(q, k, v, "elu", rope=rope, eps=1e-6, backend=backend)
    else:
        rope = axial_rope(d, grid, theta=1e4, row_first=True, endpoint=True)
        attention = rank_augmented_linear_attention if family == "ravlt" else magnitude_aware_linear_attention

        def run(backend):
            return attention(q, k, v, rope=rope, backend=backend)
    outs, grads = [], []
    for backend in ("torch", "triton"):
        out = run(backend)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, d)).sum(), (q, k, v)))
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    for g_kernel, g_ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_kernel, g_ref, rtol=1e-4, atol=1e-5)


def test_pretrained_true_downloads_the_published_url_and_adapts_head_and_channels(tmp_path, monkeypatch):
    """pretrained=True fetches the cfg's url into timm's cache under a file name (only the network transfer is
    replaced by a copy of a local file here); a new class count keeps the model's head, no classifier drops it,
    one input channel gets the RGB kernel summed (timm's adapt_input_conv)."""
    state = authors_layout("mlla_tiny", blocks=1)
    path = tmp_path / "mlla_t.pth"
    save_published(path, state)
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    model = timm.create_model("mlla_tiny", depths=(1, 1, 1, 1), pretrained=True, num_classes=5, in_chans=1)
    assert asked == ["https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1"]
    assert (tmp_path / "torch_home" / "hub" / "checkpoints" / "mlla_tiny_in1k.pth").is_file()
    headless = timm.create_model("mlla_tiny", depths=(1, 1, 1, 1), pretrained=True, num_classes=0)
    assert len(asked) == 1  # the cached file is used
    torch.testing.assert_close(headless.final.weight, state["norm.weight"], rtol=0, atol=0)
    assert model.pretrained_cfg["license"] == "mit" and "83.5" in model.pretrained_cfg["description"]
    torch.testing.assert_close(model.stem.conv1.conv.weight, state["patch_embed.conv1.conv.weight"].sum(1, True))
    torch.testing.assert_close(model.final.weight, state["norm.weight"], rtol=0, atol=0)
    assert model.head.fc.weight.shape == (5, 512)
    assert model(torch.randn(1, 1, 64, 96)).shape == (1, 5)


def test_mavit_pretrained_true_reads_the_hub_file_and_runs_no_code(tmp_path, monkeypatch):
    """pretrained=True takes MAViT's file from the authors' Hugging Face hub repository (only the transfer is
    replaced by a local file here) and reads it as the other published files: the raw weights under 'model', no
    code from the pickle run."""
    import timm.models._hub as hub

    marker = tmp_path / "marker"
    state = authors_layout("mavit_tiny", blocks=1)
    path = tmp_path / "MAViT_T.pth"
    save_published(path, state, payload=Crafted(str(marker)))
    asked = []

    def download(repo_id, filename, revision=None, cache_dir=None):
        asked.append((repo_id, filename))
        return str(path)

    monkeypatch.setattr(hub, "hf_hub_download", download)
    model = timm.create_model("mavit_tiny", depths=(1, 1, 1, 1), pretrained=True)
    assert asked == [("aldjalkdf/MAViT", "MAViT_T.pth")] and not marker.exists()
    torch.testing.assert_close(model.final.conv.weight, state["proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(model.head.fc.weight, state["head.weight"].flatten(1), rtol=0, atol=0)
    small = timm.models.get_pretrained_cfg("mavit_small.in1k")
    assert small.hf_hub_filename == "MAViT_S.pth" and "84.7" in small.description
    assert (small.crop_pct, small.interpolation) == (0.875, "bicubic")


def test_train_pretrained_fine_tunes_from_the_downloaded_weights_and_resumes(tmp_path, monkeypatch):
    """linvision-train --config finetune_mlla_tiny (--pretrained): the model's published file comes through timm's
    cache, two fine-tuning
    steps start from exactly its weights (a learning rate of 1e-12 keeps them; every tensor but the new head
    and BatchNorm's running statistics compared), the head is new (4 classes), and the run resumes from its own
    checkpoint without downloading again."""
    state = authors_layout("mlla_tiny", blocks=1)
    path = tmp_path / "mlla_t.pth"
    save_published(path, state)
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    kwargs = '{"depths": [1, 1, 1, 1]}'
    expected = timm.create_model("mlla_tiny", depths=(1, 1, 1, 1), pretrained=True, num_classes=4,
                                 pretrained_cfg_overlay=dict(file=str(path))).state_dict()
    data = write_image_folder(tmp_path / "data", classes=4, size=32)
    # the shipped recipe (RandAugment, random erasing, smoothing, layer decay, clipping, EMA), at a tiny size
    flags = ["--config", "finetune_mlla_tiny", "--data-dir", data, "--img-size", "32", "--model-kwargs", kwargs,
             "--batch-size", "4", "--output", str(tmp_path), "--no-progress", "--device", "cpu", "--epochs", "2",
             "--experiment", "ft", "--lr", "1e-12", "--warmup-lr", "1e-12", "--min-lr", "1e-12",
             "--weight-decay", "0"]
    out = run_tool("train.py", *flags, "--stop-after-steps", "2").stdout
    assert asked == ["https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1"]
    assert (tmp_path / "torch_home" / "hub" / "checkpoints" / "mlla_tiny_in1k.pth").is_file()
    assert "pretrained: mlla_tiny.in1k from" in out and "a new classifier for 4 classes (the weights' has 1000)" in out
    tuned = load_file(str(tmp_path / "ft" / "last" / "model.safetensors"))
    assert tuned["head.fc.weight"].shape == (4, 512) and tuned["head.fc.bias"].shape == (4,)
    compared = 0
    for key, value in expected.items():
        if key.startswith("head.") or key.endswith(("running_mean", "running_var", "num_batches_tracked")) \
                or not value.is_floating_point() or key.endswith(RESOLUTION_BUFFERS):
            continue
        torch.testing.assert_close(tuned[key], value, rtol=0, atol=1e-7, msg=key)
        compared += 1
    assert compared > 50
    torch.testing.assert_close(tuned["final.weight"], state["norm.weight"], rtol=0, atol=1e-7)

    resumed = run_tool("train.py", "--resume", str(tmp_path / "ft"), "--no-progress").stdout
    assert "resume:" in resumed and "pretrained:" not in resumed and len(asked) == 1
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["num_classes"] == 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "step"]
    assert steps[-1] == 8 and steps == sorted(set(steps))  # 4 steps an epoch, none twice


def test_train_pretrained_refuses_a_model_without_weights_in_one_line(tmp_path):
    data = write_image_folder(tmp_path / "data", classes=2, size=32)
    proc = run_tool("train.py", "--dataset", "folder", "--data-dir", data, "--img-size", "32", "--model",
                    "linhier_delta_femto_224", "--pretrained", "--output", str(tmp_path), "--no-progress",
                    "--device", "cpu", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: pretrained: linhier_delta_femto_224 has no trained weights")
    assert "mlla_tiny.in1k" in proc.stderr and "ravlt_small.in1k" in proc.stderr
    assert not (tmp_path / "torch_home").exists() and not list(tmp_path.glob("linhier*"))  # no run folder left
    both = run_tool("train.py", "--dataset", "folder", "--data-dir", data, "--model", "mlla_tiny", "--pretrained",
                    "--pretrained-path", str(tmp_path / "w.pth"), "--output", str(tmp_path), check=False)
    assert both.returncode == 2 and "not both" in both.stderr


def test_validate_pretrained_evaluates_the_downloaded_weights(tmp_path, monkeypatch):
    """linvision-validate --model mlla_tiny.in1k --pretrained: the weights come through timm's cache and the
    reported loss and top-1 are those of the model built from the same file, on the same images transformed as
    its pretrained cfg says (bicubic, crop 0.875, ImageNet mean and std)."""
    from linvision.data.datasets import build_transform, create_dataset

    state = authors_layout("mlla_tiny")
    path = tmp_path / "mlla_t.pth"
    save_published(path, state)
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    data = write_image_folder(tmp_path / "data", classes=3, size=48)
    out = run_tool("validate.py", "--model", "mlla_tiny.in1k", "--pretrained", "--data-dir", data,
                   "--img-size", "32", "--device", "cpu").stdout
    result = json.loads(out)["results"][0]
    assert len(asked) == 1 and result["img_size"] == 32 and result["count"] == 6

    model = timm.create_model("mlla_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    cfg = model.pretrained_cfg
    assert (cfg["interpolation"], cfg["crop_pct"]) == ("bicubic", 0.875)
    assert (result["interpolation"], result["crop_pct"]) == ("bicubic", 0.875)
    val = create_dataset("folder", data, "val", transform=build_transform(32, False, list(cfg["mean"]),
                                                                         list(cfg["std"]), crop_pct=0.875,
                                                                         interpolation="bicubic"))
    images = torch.stack([val[i][0] for i in range(len(val))])
    targets = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        logits = model(images)
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-5)
    assert result["top1"] == pytest.approx(100 * (logits.argmax(1) == targets).float().mean().item())

    none = run_tool("validate.py", "--model", "linhier_tiny_224", "--pretrained", "--data-dir", data, check=False)
    assert none.returncode == 2 and "has no trained weights" in none.stderr and "mlla_tiny.in1k" in none.stderr


@pytest.mark.parametrize("config", ["finetune_mlla_tiny", "finetune_ravlt_small"])
def test_fine_tuning_recipes_name_weights_and_decay_by_layer(config):
    """The shipped fine-tuning configs parse with linvision-train's parser, start from weights that exist, and
    their layer-wise decay gives the stem the smallest and the head the full learning rate."""
    import importlib

    from timm.optim import create_optimizer_v2

    from linvision.utils.config import parse_args
    from linvision.utils.factory import check_pretrained

    parser = importlib.import_module("linvision.tools.train").build_parser()
    args = parse_args(parser, ["--config", config, "--data-dir", "/data/pets"])
    assert args.pretrained and args.dataset == "folder" and args.layer_decay == 0.8
    check_pretrained(args.model)  # raises for a model without weights
    model = timm.create_model(args.model.split(".")[0], depths=(1, 1, 1, 1), num_classes=5)
    groups = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                 layer_decay=args.layer_decay).param_groups
    scales = {g["lr_scale"] for g in groups}
    assert max(scales) == 1.0 and min(scales) == pytest.approx(0.8 ** (len(scales) - 1)) and len(scales) >= 5
