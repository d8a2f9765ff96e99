"""The published ViG (hustvl/ViG, isotropic T/S/B, and the hierarchical ViG-H T/S/B): the authors' checkpoint
layouts load with every tensor used, the sizes match their README, the mixer and the whole networks equal a float64
transcription of the authors' evaluation formulas (direction-wise gated scans, the 2D gating locality injection,
their stems, ViG's position-embedding resampling, ViG-H's downsampling and gated MLP) at odd grids, and the hub
files are read without running code from them.

tests/data/published/vig_<size>.txt and vig_h_<size>.txt list the tensor names, shapes and dtypes of the authors'
checkpoints; the files built here from them hold random values."""
import re

import pytest
import timm
import torch
import torch.nn.functional as F

import linvision  # noqa: F401  (registers the models)
from linvision.benchmark.flops import count_params
from linvision.layers.recurrent import VigGatedAttention
from support import Crafted, assert_same_values, authors_layout, serve_hub_downloads_from

README_PARAMS = {"vig_tiny": 6, "vig_small": 23, "vig_base": 89}  # M, the authors' README
SLOW = ("vig_small", "vig_base")  # seconds to tens of seconds each on two cores
SIZES = [pytest.param(n, id=n, marks=[pytest.mark.slow] if n in SLOW else []) for n in README_PARAMS]


VIG_ONES = r"norm|proj\.[14]\.weight"  # the norms' weights and biases, the projections' norm weights: about 1
H_ONES = r"norm.*weight$|patch_embed\.[27]\.weight$|downsample\.3\.weight$"  # ViG-H's norm weights


# ---- the authors' evaluation formulas, transcribed in float64 (their names, their order of operations) ----

def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _authors_mixer(sd, p, x, hw, heads, local_act, out_act, halve_again=True):
    """ViG's GatedLinearAttention (``p``: its prefix in ``sd``) in evaluation on x (B, N, C): depthwise conv (SiLU
    for ViG-T), q, k, v and both directions' gates from it; each direction an inclusive recurrence over the
    tokens with its own per-channel gates, token by token; the mean of the two, halved again (ViG's evaluation;
    not ViG-H's, ``halve_again=False``); per-head RMSNorm of it and of the conv branch mixed by sigmoid(g_proj);
    SiLU (ViG-T); o_proj."""
    b, n, c = x.shape
    h, w = hw
    local = F.conv2d(x.transpose(1, 2).reshape(b, c, h, w), sd[p + "in_proj.0.weight"], padding=1, groups=c)
    local = local.flatten(2).transpose(1, 2)
    local = F.silu(local) if local_act else local
    kd = (sd[p + "qkv_proj.weight"].shape[0] - c) // 2
    q, k, v = (local @ sd[p + "qkv_proj.weight"].T).split([kd, kd, c], -1)
    gk = local @ sd[p + "gk_proj.0.weight"].T @ sd[p + "gk_proj.1.weight"].T + sd[p + "gk_proj.1.bias"]
    gk = F.logsigmoid(gk) / 16
    dk, dv = kd // heads, c // heads
    q, k, gk_f, gk_b = (t.reshape(b, n, heads, dk) for t in (q * dk ** -0.5, k, *gk.split(kd, -1)))
    v = v.reshape(b, n, heads, dv)
    o = torch.zeros(b, n, heads, dv, dtype=x.dtype)
    for gates, order in ((gk_f, range(n)), (gk_b, range(n - 1, -1, -1))):
        state = torch.zeros(b, heads, dk, dv, dtype=x.dtype)
        for i in order:
            state = state * gates[:, i].exp()[..., None] + k[:, i, :, :, None] * v[:, i, :, None, :]
            o[:, i] += torch.einsum("bhd,bhde->bhe", q[:, i], state)
    o = o / 2  # the kernel's mean of the two directions
    o = o / 2 if halve_again else o  # ViG's evaluation branch halves it again
    g = torch.sigmoid(local @ sd[p + "g_proj.weight"].T + sd[p + "g_proj.bias"]).reshape(b, n, heads, dv)
    o = _rms(o, sd[p + "g_norm.weight"]) * g + _rms(local.reshape(b, n, heads, dv), sd[p + "l_norm.weight"]) * (1 - g)
    o = o.reshape(b, n, c)
    return (F.silu(o) if out_act else o) @ sd[p + "o_proj.weight"].T


def _authors_network(sd, x, heads, depth, local_act, out_act):
    """ViG's forward in evaluation: the v2 stem, the 14 x 14 position embedding resized (float32 bicubic, as the
    authors') to the grid, pre-norm blocks (RMSNorm, the mixer, RMSNorm, SwiGLU), RMSNorm, mean, head."""
    t = F.conv2d(x, sd["patch_embed.proj.0.weight"], sd["patch_embed.proj.0.bias"], stride=8, padding=1)
    t = F.layer_norm(t.permute(0, 2, 3, 1), t.shape[1:2], sd["patch_embed.proj.1.weight"],
                     sd["patch_embed.proj.1.bias"], eps=1e-5).permute(0, 3, 1, 2)
    t = F.conv2d(F.silu(t), sd["patch_embed.proj.3.weight"], sd["patch_embed.proj.3.bias"], stride=2, padding=1)
    t = F.layer_norm(t.permute(0, 2, 3, 1), t.shape[1:2], sd["patch_embed.proj.4.weight"],
                     sd["patch_embed.proj.4.bias"], eps=1e-5)
    b, h, w, c = t.shape
    pos = sd["pos_embed"]
    if (h, w) != (14, 14):
        pos = pos.reshape(1, 14, 14, c).permute(0, 3, 1, 2)
        pos = F.interpolate(pos.float(), size=(h, w), mode="bicubic", align_corners=False).to(x.dtype)
        pos = pos.flatten(2).transpose(1, 2)
    t = t.reshape(b, h * w, c) + pos
    for i in range(depth):
        p = f"blocks.{i}."
        t = t + _authors_mixer(sd, p + "attn.", _rms(t, sd[p + "attn_norm.weight"]), (h, w), heads, local_act,
                               out_act)
        gate, val = (_rms(t, sd[p + "mlp_norm.weight"]) @ sd[p + "mlp.gate_proj.weight"].T).chunk(2, -1)
        t = t + (F.silu(gate) * val) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(t, sd["norm.weight"]).mean(1) @ sd["head.weight"].T + sd["head.bias"]


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.3 if p.dim() == 1 else p[0].numel() ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale + (1 if "norm" in name else 0))


_TO_AUTHORS = {"local.weight": "in_proj.0.weight", "qkv.weight": "qkv_proj.weight",
               "forget_gate.0.weight": "gk_proj.0.weight", "forget_gate.1.weight": "gk_proj.1.weight",
               "forget_gate.1.bias": "gk_proj.1.bias", "mix_gate.weight": "g_proj.weight",
               "mix_gate.bias": "g_proj.bias", "norm_global.weight": "g_norm.weight",
               "norm_local.weight": "l_norm.weight", "proj.weight": "o_proj.weight"}


@pytest.mark.parametrize("hw, chunk_size, act", [((3, 5), None, True), ((5, 7), 4, False), ((7, 2), 3, True)])
def test_vig_mixer_equals_the_authors_formulas(hw, chunk_size, act):
    """vig_gla (chunked scans, the backward one on the reversed tokens) against the authors' per-token recurrence:
    direction-wise gates (the forward and backward scans read different gates), both scans including the token
    itself, the locality injection and ViG-T's activations (``act``) or S/B's none, at odd grids and chunk sizes
    that split them unevenly."""
    torch.manual_seed(0)
    mixer = VigGatedAttention(24, 3, local_act=act, out_act=act, chunk_size=chunk_size).double().eval()
    _randomise(mixer, 1)
    sd = {_TO_AUTHORS[k]: v for k, v in mixer.state_dict().items()}
    x = torch.randn(2, hw[0] * hw[1], 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = mixer(x, hw)
    expected = _authors_mixer(sd, "", x, hw, 3, act, act)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    # the two directions' gates are not interchangeable: swapping them changes the result
    kd = mixer.key_dim
    swapped = dict(sd, **{"gk_proj.1.weight": sd["gk_proj.1.weight"].roll(kd, 0),
                          "gk_proj.1.bias": sd["gk_proj.1.bias"].roll(kd, 0)})
    assert (_authors_mixer(swapped, "", x, hw, 3, act, act) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("size, act", [((48, 80), True), ((100, 60), False)])
def test_vig_network_equals_the_authors_formulas(size, act, tmp_path):
    """A two-block ViG loaded from a file in the authors' layout (their names, their position-embedding grid)
    gives the transcription's logits in float64 at inputs of other sizes than 224 (grids 3 x 5 and 6 x 4: the
    stem's floor and the resampled position embedding)."""
    heads, dim, depth = 3, 48, 2
    sd = {}
    g = torch.Generator().manual_seed(3)
    shapes = {"pos_embed": (1, 196, dim), "patch_embed.proj.0.weight": (dim // 2, 3, 9, 9),
              "patch_embed.proj.0.bias": (dim // 2,), "patch_embed.proj.1.weight": (dim // 2,),
              "patch_embed.proj.1.bias": (dim // 2,), "patch_embed.proj.3.weight": (dim, dim // 2, 3, 3),
              "patch_embed.proj.3.bias": (dim,), "patch_embed.proj.4.weight": (dim,), "patch_embed.proj.4.bias": (dim,),
              "head.weight": (10, dim), "head.bias": (10,), "norm.weight": (dim,)}
    hidden = int(dim * 8 / 3)
    for i in range(depth):
        p = f"blocks.{i}."
        shapes.update({p + "attn_norm.weight": (dim,), p + "attn.in_proj.0.weight": (dim, 1, 3, 3),
                       p + "attn.qkv_proj.weight": (2 * dim, dim), p + "attn.gk_proj.0.weight": (16, dim),
                       p + "attn.gk_proj.1.weight": (dim, 16), p + "attn.gk_proj.1.bias": (dim,),
                       p + "attn.o_proj.weight": (dim, dim), p + "attn.g_norm.weight": (dim // heads,),
                       p + "attn.l_norm.weight": (dim // heads,), p + "attn.g_proj.weight": (dim, dim),
                       p + "attn.g_proj.bias": (dim,), p + "mlp_norm.weight": (dim,),
                       p + "mlp.gate_proj.weight": (2 * hidden, dim), p + "mlp.down_proj.weight": (dim, hidden)})
    for key, shape in shapes.items():
        scale = 0.3 if len(shape) == 1 else (shape[1] * (shape[2] * shape[3] if len(shape) == 4 else 1)) ** -0.5
        value = torch.randn(shape, generator=g, dtype=torch.float64) * scale
        value = value + 1 if re.search(VIG_ONES, key) else value
        sd[key] = value.float().double()  # values the float32 model holds exactly
    path = tmp_path / "vig_small_layout.pth"
    torch.save({"model": sd}, path)
    model = timm.create_model("vig_tiny", embed_dim=dim, num_heads=heads, depth=depth, num_classes=10,
                              mixer_kwargs=dict(local_act=act, out_act=act), pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path))).double().eval()
    x = torch.randn(2, 3, *size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(x)
    expected = _authors_network(sd, x, heads, depth, act, act)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", SIZES)
def test_vig_layout_loads_every_tensor(name, tmp_path):
    """Every tensor of the file lands in the model (a bijection: the sorted values are equal, so nothing is missing,
    duplicated or changed), from the raw weights under 'model'."""
    state = authors_layout(name, ones=VIG_ONES)
    path = tmp_path / f"{name}.pth"
    torch.save({"model": state}, path)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert_same_values(model.state_dict(), state)
    torch.testing.assert_close(model.blocks[3].mixer.forget_gate[1].bias, state["blocks.3.attn.gk_proj.1.bias"],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.blocks[3].mlp.fc1.weight, state["blocks.3.mlp.gate_proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("name", SIZES)
def test_vig_sizes_match_the_readme(name):
    with torch.device("meta"):  # shapes only: a CPU build's count (tests/test_docs.py), without weights
        model = timm.create_model(name)
    assert abs(count_params(model) / 1e6 - README_PARAMS[name]) <= 1.0


def test_vig_file_at_another_size_and_another_models_file(tmp_path):
    """A model built for 288 px takes the 224 px file with the position embedding resampled as the authors resample
    it at run time (so the logits at 288 are those of the 224 model run at 288); the state dict alone (as the hub
    files may hold it) loads too; a file of another size fails in one line naming the file."""
    state = authors_layout("vig_tiny", blocks=1, ones=VIG_ONES)
    path = tmp_path / "vig_t.pth"
    torch.save(state, path)
    args = dict(depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    at_224 = timm.create_model("vig_tiny", **args).eval()
    at_288 = timm.create_model("vig_tiny", img_size=288, **args).eval()
    assert at_288.pos_embed.shape == (1, 18 * 18, 192)
    x = torch.randn(1, 3, 288, 288, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(at_288(x), at_224(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"vig_t\.pth"):
        timm.create_model("vig_small", **args)


def test_vig_pretrained_true_reads_the_hub_file_and_runs_no_code(tmp_path, monkeypatch):
    """pretrained=True takes ViG's file from the authors' Hugging Face hub repository (only the transfer is
    replaced by a local file here), reads the raw weights and runs no code from the pickle."""
    marker = tmp_path / "marker"
    state = authors_layout("vig_tiny", blocks=1, ones=VIG_ONES)
    path = tmp_path / "vig_t_77p2acc.pth"
    torch.save({"model": state, "payload": Crafted(str(marker))}, path)
    asked = serve_hub_downloads_from(monkeypatch, path)
    model = timm.create_model("vig_tiny", depth=1, pretrained=True)
    assert asked == [("hustvl/ViG", "vig_t_77p2acc.pth")] and not marker.exists()
    torch.testing.assert_close(model.blocks[0].mixer.qkv.weight, state["blocks.0.attn.qkv_proj.weight"],
                               rtol=0, atol=0)
    for name, file, top1 in (("vig_small", "vig_s_81p7acc.pth", "81.7"), ("vig_base", "vig_b_82p6acc.pth", "82.6")):
        cfg = timm.models.get_pretrained_cfg(f"{name}.in1k")
        assert cfg.hf_hub_filename == file and top1 in cfg.description
        assert (cfg.crop_pct, cfg.interpolation, cfg.license) == (0.875, "bicubic", "mit")


def test_vig_refuses_naflex_batches_in_one_line():
    """timm's NaFlex batches (patches, not images) cannot go through ViG's conv stem: a ValueError saying so."""
    model = timm.create_model("vig_tiny", depth=1).eval()
    batch = dict(patches=torch.randn(1, 4, 16 * 16 * 3), patch_coord=torch.tensor([[[0, 0], [0, 1], [1, 0], [1, 1]]]),
                 patch_valid=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaFlex"):
        model(batch)


# ---- ViG-H: the authors' HierViG (configs/vig-h/vig-h-{t,s,b}.yaml) on LinHier ----

H_README_PARAMS = {"vig_h_tiny": 29, "vig_h_small": 50, "vig_h_base": 89}  # M, the authors' README
H_SIZES = [pytest.param(n, id=n, marks=[] if n == "vig_h_tiny" else [pytest.mark.slow]) for n in H_README_PARAMS]


def _ln(t, sd, key):
    return F.layer_norm(t, t.shape[-1:], sd[key + ".weight"], sd[key + ".bias"], eps=1e-5)


def _authors_hier_network(sd, x, heads):
    """HierViG's forward in evaluation (channels-first in their code, written here channels-last): the v2 stem
    (3x3 / 2 conv, LayerNorm, GELU, 3x3 / 2 conv, LayerNorm); per stage pre-norm blocks (LayerNorm, the mixer
    without ViG-T's activations and without the second halving, LayerNorm, gMlp: fc1 to twice the width,
    SiLU(first half) * second half, fc2), then the v3 downsampling (3x3 / 2 conv, LayerNorm); the classifier's
    LayerNorm, the mean, the head. LayerNorm eps 1e-5 everywhere."""
    t = F.conv2d(x, sd["patch_embed.0.weight"], sd["patch_embed.0.bias"], stride=2, padding=1)
    t = F.gelu(_ln(t.permute(0, 2, 3, 1), sd, "patch_embed.2")).permute(0, 3, 1, 2)
    t = F.conv2d(t, sd["patch_embed.5.weight"], sd["patch_embed.5.bias"], stride=2, padding=1)
    t = _ln(t.permute(0, 2, 3, 1), sd, "patch_embed.7")
    for i, nh in enumerate(heads):
        b, h, w, c = t.shape
        tokens = t.reshape(b, h * w, c)
        j = 0
        while f"layers.{i}.blocks.{j}.norm.weight" in sd:
            p = f"layers.{i}.blocks.{j}."
            tokens = tokens + _authors_mixer(sd, p + "op.", _ln(tokens, sd, p + "norm"), (h, w), nh, False, False,
                                             halve_again=False)
            gate, val = (_ln(tokens, sd, p + "norm2") @ sd[p + "mlp.fc1.weight"].T).chunk(2, -1)
            tokens = tokens + (F.silu(gate) * val) @ sd[p + "mlp.fc2.weight"].T
            j += 1
        t = tokens.reshape(b, h, w, c)
        if f"layers.{i}.downsample.1.weight" in sd:
            t = F.conv2d(t.permute(0, 3, 1, 2), sd[f"layers.{i}.downsample.1.weight"],
                         sd[f"layers.{i}.downsample.1.bias"], stride=2, padding=1)
            t = _ln(t.permute(0, 2, 3, 1), sd, f"layers.{i}.downsample.3")
    return _ln(t, sd, "classifier.norm").mean((1, 2)) @ sd["classifier.head.weight"].T + sd["classifier.head.bias"]


@pytest.mark.parametrize("size", [(64, 96), (72, 40)])
def test_vig_h_network_equals_the_authors_formulas(size, tmp_path):
    """ViG-H-T with one block per stage, loaded from a file in the authors' layout, gives the transcription's
    logits in float64 at two non-square inputs (the second not a multiple of 32: grids 18 x 10 to 3 x 2)."""
    state = {k: v.double() for k, v in authors_layout("vig_h_tiny", blocks=1, ones=H_ONES).items()}
    path = tmp_path / "vig_h_t.pth"
    torch.save({"model": state}, path)
    model = timm.create_model("vig_h_tiny", depths=(1, 1, 1, 1), pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path))).double().eval()
    x = torch.randn(2, 3, *size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(x)
    torch.testing.assert_close(ours, _authors_hier_network(state, x, (3, 6, 12, 24)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", H_SIZES)
def test_vig_h_layout_loads_every_tensor_and_matches_the_readme(name, tmp_path):
    """Every tensor of the file lands in the model unchanged; the parameter count is the README's (within 1 M)."""
    state = authors_layout(name, ones=H_ONES)
    path = tmp_path / f"{name}.pth"
    torch.save({"model": state}, path)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert_same_values(model.state_dict(), state)
    torch.testing.assert_close(model.stages[2].downsample.conv.weight, state["layers.1.downsample.1.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.stages[1].blocks[1].mixer.norm_global.weight,
                               state["layers.1.blocks.1.op.g_norm.weight"], rtol=0, atol=0)
    assert abs(count_params(model) / 1e6 - H_README_PARAMS[name]) <= 1.0


def test_vig_h_older_names_and_conv_shaped_projections_load(tmp_path):
    """The names the authors' own loader renames (``ln_1``, ``self_attention``, a bare ``norm`` / ``head``) and
    their channels-first projections stored as (out, in, 1, 1) load as the current layout does."""
    state = authors_layout("vig_h_tiny", blocks=1, ones=H_ONES)
    old = {}
    for key, value in state.items():
        key = key.replace(".blocks.0.norm.", ".blocks.0.ln_1.").replace(".op.", ".self_attention.")
        key = key.replace("classifier.", "")
        if key.endswith(("qkv_proj.weight", "g_proj.weight", "mlp.fc1.weight")):
            value = value[:, :, None, None]
        old[key] = value
    for file, content in (("new.pth", state), ("old.pth", old)):
        torch.save({"model": content}, tmp_path / file)
    new_model, old_model = (timm.create_model("vig_h_tiny", depths=(1, 1, 1, 1), pretrained=True,
                                              pretrained_cfg_overlay=dict(file=str(tmp_path / f))).eval()
                            for f in ("new.pth", "old.pth"))
    for (name, a), (_, b) in zip(new_model.state_dict().items(), old_model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_vig_h_pretrained_true_reads_the_hub_file(tmp_path, monkeypatch):
    """pretrained=True takes ViG-H's file from the authors' hub repository (the transfer replaced by a local
    file), runs no code from the pickle, and the model runs at a non-square size."""
    marker = tmp_path / "marker"
    state = authors_layout("vig_h_tiny", blocks=1, ones=H_ONES)
    path = tmp_path / "vig_h_t_82p8acc.pth"
    torch.save({"model": state, "payload": Crafted(str(marker))}, path)
    asked = serve_hub_downloads_from(monkeypatch, path)
    model = timm.create_model("vig_h_tiny", depths=(1, 1, 1, 1), pretrained=True).eval()
    assert asked == [("hustvl/ViG", "vig_h_t_82p8acc.pth")] and not marker.exists()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 160, 224)).shape == (1, 1000)
    for name, file, top1 in (("vig_h_small", "vig_h_s_83p8acc.pth", "83.8"),
                             ("vig_h_base", "vig_h_b_84p2acc.pth", "84.2")):
        cfg = timm.models.get_pretrained_cfg(f"{name}.in1k")
        assert cfg.hf_hub_filename == file and top1 in cfg.description
        assert (cfg.crop_pct, cfg.interpolation, cfg.license) == (0.875, "bicubic", "mit")
