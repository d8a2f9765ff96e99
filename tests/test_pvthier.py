"""PVT's layout (linvision.models.pvthier), which Pola-PVT and InLine-PVT share: every stage's entry equals PVT's
patch embedding and position embedding written out (with the authors' bilinear resampling at another grid), the
authors' names map to linvision's, a file for 224 px loads into a model built for another size as the model
resamples at run time, and there is no final norm. The families' blocks are checked in test_published_pola.py and
test_published_inline.py."""
import pytest
import timm
import torch
import torch.nn.functional as F

import linvision  # noqa: F401  (registers the models)
from linvision.models.pvthier import pvt_published_name, stage_grids
from support import authors_layout, layer_norm, published_tensors

REDUCED = dict(depths=(1, 1, 1, 1), dims=(16, 24, 32, 40), num_heads=(2, 2, 4, 4))


def _authors_entry(embed, x, trained_grid):
    """PVT's stage entry written out: a conv of kernel = stride, LayerNorm eps 1e-5 over the channels, plus the
    position embedding; on another grid the embedding is resized by F.interpolate(mode="bilinear"), as the
    authors' ``_get_pos_embed`` does. x: NCHW; returns (B, H, W, C)."""
    y = F.conv2d(x, embed.proj.weight, embed.proj.bias, stride=embed.proj.stride).permute(0, 2, 3, 1)
    y = layer_norm(y, embed.norm.weight, embed.norm.bias, 1e-5)
    b, h, w, c = y.shape
    pos = embed.pos_embed.reshape(1, *trained_grid, c).permute(0, 3, 1, 2)
    if (h, w) != trained_grid:
        pos = F.interpolate(pos, size=(h, w), mode="bilinear")
    return y + pos.permute(0, 2, 3, 1)


@pytest.mark.parametrize("size", [(224, 224), (160, 288), (100, 132)])
def test_stage_entries_equal_pvt_written_out(size):
    """Stem (4x4, stride 4) and the entries of stages 2-4 (2x2, stride 2, channels-last input) of a model built for
    224 px, in float64, at its own size and at others (non-square, not a multiple of 32: the convs round down).
    timm's resampling, which the model calls, interpolates in float32: on another grid the embedding agrees to
    float32's precision of the interpolation weights."""
    model = timm.create_model("inline_pvt_tiny", **REDUCED).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    grids = stage_grids(224, 4)
    assert grids == ((56, 56), (28, 28), (14, 14), (7, 7))
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    tol = 1e-12 if size == (224, 224) else 2e-5
    with torch.no_grad():
        y = model.stem(x)
        torch.testing.assert_close(y, _authors_entry(model.stem, x, grids[0]), rtol=tol, atol=tol)
        for i in range(1, 4):
            embed = model.stages[i].downsample
            expected = _authors_entry(embed, y.permute(0, 3, 1, 2), grids[i])
            y = embed(y)
            torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    assert y.shape[1:3] == (size[0] // 32, size[1] // 32)


def test_authors_names_map_to_the_layout():
    names = {k: pvt_published_name(k) for k, _, _ in published_tensors("pola_pvt_tiny")}
    assert names["pos_embed1"] == "stem.pos_embed" and names["pos_embed3"] == "stages.2.downsample.pos_embed"
    assert names["patch_embed1.proj.weight"] == "stem.proj.weight"
    assert names["patch_embed4.norm.bias"] == "stages.3.downsample.norm.bias"
    assert names["block2.1.attn.kv.weight"] == "stages.1.blocks.1.mixer.kv.weight"
    assert names["block4.0.mlp.fc2.bias"] == "stages.3.blocks.0.mlp.fc2.bias"
    assert names["head.weight"] == "head.fc.weight"
    assert names["norm.weight"] is None  # built by the authors' Pola-PVT, never applied


def test_a_file_for_224_in_a_model_for_another_size(tmp_path):
    """An authors' 224 px file (Pola-PVT-T's layout, one block per stage) in a model built for 320 x 256: the
    position embeddings and the key encodings take the new grids at load, and the logits there equal the 224
    model's, which resamples at run time; the head takes the mean of the last map, with no final norm."""
    state = authors_layout("pola_pvt_tiny", blocks=1)
    path = tmp_path / "pola_pvt_t.pth"
    torch.save({"model": state, "epoch": 300}, path)
    args = dict(depths=(1, 1, 1, 1), pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    at_224 = timm.create_model("pola_pvt_tiny", **args).eval()
    other = timm.create_model("pola_pvt_tiny", img_size=(320, 256), **args).eval()
    assert other.stem.pos_embed.shape == (1, 80 * 64, 64) and other.stem.pos_grid == (80, 64)
    assert other.stages[1].blocks[0].mixer.key_pos.shape == (1, 40 * 32, 128)
    x = torch.randn(1, 3, 320, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(other(x), at_224(x), rtol=1e-5, atol=1e-5)
        feats = at_224.forward_intermediates(x, intermediates_only=True)
        pooled = at_224.forward_head(at_224.forward_features(x), pre_logits=True)
    assert [tuple(f.shape[-2:]) for f in feats] == [(80, 64), (40, 32), (20, 16), (10, 8)]
    torch.testing.assert_close(pooled, feats[-1].mean((2, 3)))
    with pytest.raises(ValueError, match=r"^norm: PolaPvt has no final norm"):
        at_224.forward_intermediates(x, norm=True)
