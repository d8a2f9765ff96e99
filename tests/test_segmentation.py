"""Segmentation: linvision's backbones as encoders of segmentation_models_pytorch (smp) through its timm
("tu-") encoders, and the offline mosaic set (linvision.data.mosaic).

The encoders are checked against the backbone itself: smp's feature maps equal the stage (or block) outputs of
the same network run as timm's classifier with the encoder's weights, bit for bit, at a non-square size that is
not the training size; the segmenters keep the input's size, answer to a change of the input where it changed,
and treat each image of a batch alone. The published MLLA weights reach an encoder through timm's cache (only
the network transfer replaced by a file copy). The mosaics are checked pixel by pixel against the photographs
they were cut from."""
import json
import random

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F

import linvision  # noqa: F401  (registers the models with timm)
from linvision.data import mosaic as mosaic_data
from linvision.data.mosaic import (CLASSES, IGNORE_INDEX, MEAN, STD, WINDOW, MosaicSegmentation,
                                          SegmentationFolder, make_mosaic, render_window, write_mosaic_folders)
from linvision.data.texture import photo_parts, photograph
from support import serve_downloads_from

smp = pytest.importorskip("segmentation_models_pytorch")

SIZE = (96, 160)  # non-square, a multiple of 32, not the 224 the models are named for
ONE_BLOCK = dict(depths=(1, 1, 1, 1))
DECODERS = {  # small decoders: the encoder is what is checked
    "Unet": dict(decoder_channels=(32, 16, 16, 8, 8)),
    "Segformer": dict(decoder_segmentation_channels=16),
    "UPerNet": dict(decoder_channels=16),
}
HIERARCHICAL = {"linhier_delta_femto_224": (48, 96, 192, 288), "mlla_tiny": (64, 128, 256, 512),
                "ravlt_tiny": (64, 128, 256, 512), "mavit_tiny": (64, 128, 256, 512),
                "pola_swin_tiny": (96, 192, 384, 768), "inline_swin_tiny": (96, 192, 384, 768),
                "inline_pvt_tiny": (64, 128, 320, 512), "pola_pvt_tiny": (64, 128, 320, 512),
                "inline_cswin_tiny": (64, 128, 256, 512), "vig_h_tiny": (96, 192, 384, 768)}
# smp builds each encoder's full-size model once more to read its strides (linhier does not build on the meta
# device): 0.1-0.2 s for mlla_tiny, ravlt_tiny, mavit_tiny and pola_swin_tiny on idle cores, seconds on busy ones, so
# each of them runs in one decoder unless --runslow (the encoder is the same in every decoder)
FAST = {("mlla_tiny", "UPerNet"), ("ravlt_tiny", "Segformer"), ("mavit_tiny", "Unet"), ("pola_swin_tiny", "UPerNet"),
        ("inline_pvt_tiny", "Segformer")}
CASES = [pytest.param(name, decoder, id=f"{name}-{decoder}",
                      marks=[] if name.startswith("linhier") or (name, decoder) in FAST else [pytest.mark.slow])
         for name in HIERARCHICAL for decoder in DECODERS]


def _outputs_of(modules, model, x):
    """Run ``model(x)`` (its classifier forward) and return what each of ``modules`` output on the way."""
    seen = []
    handles = [m.register_forward_hook(lambda _m, _i, out: seen.append(out)) for m in modules]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _copy_into(model, state, prefix):
    """Load the encoder's ``state`` (names under ``prefix``) into ``model``; returns the keys the model kept of
    its own (those the encoder dropped)."""
    missing, unexpected = model.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()}, strict=False)
    assert not unexpected, unexpected
    return missing


def _check_segmenter(seg, x, classes):
    """The output has the input's size, changes where the input changed (and the image of a batch left alone does
    not), and a batch is each of its images alone."""
    other = x.clone()
    other[..., : x.shape[-2] // 2, :] = torch.randn_like(other[..., : x.shape[-2] // 2, :])
    with torch.no_grad():
        y, y_other, both = seg(x), seg(other), seg(torch.cat([x, other]))
    assert y.shape == (1, classes, *x.shape[-2:]) and torch.isfinite(y).all()
    assert (y - y_other).abs().amax() > 1e-3
    scale = float(y.abs().amax())  # fp32 products summed in another order for a batch of 2
    torch.testing.assert_close(both, torch.cat([y, y_other]), rtol=0, atol=2e-5 * max(scale, 1.0))


@pytest.mark.parametrize("name, decoder", CASES)
def test_hierarchical_encoder_features_are_the_backbones_stage_outputs(name, decoder):
    """smp passes extra keyword arguments (here depths) to timm.create_model; its encoder's four feature maps (after
    smp's input and empty stride-2 entries) are exactly the backbone's stage outputs, NCHW, at strides 4-32."""
    torch.manual_seed(0)
    seg = getattr(smp, decoder)(f"tu-{name}", encoder_weights=None, classes=5, **ONE_BLOCK, **DECODERS[decoder])
    seg.eval()
    dims = HIERARCHICAL[name]
    assert seg.encoder.out_channels == [3, 0, *dims]
    reference = timm.create_model(name, **ONE_BLOCK).eval()
    dropped = _copy_into(reference, seg.encoder.state_dict(), "model.model.")
    assert dropped and all(k.startswith(("head.", "final.")) for k in dropped), dropped  # only the classifier's end

    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        features = seg.encoder(x)
    stages = _outputs_of(reference.stages, reference, x)
    assert len(features) == 6 and features[0] is x and features[1].shape == (1, 0, SIZE[0] // 2, SIZE[1] // 2)
    for i, (got, stage) in enumerate(zip(features[2:], stages)):
        assert got.shape == (1, dims[i], SIZE[0] // 2 ** (i + 2), SIZE[1] // 2 ** (i + 2))
        torch.testing.assert_close(got, stage.permute(0, 3, 1, 2), rtol=0, atol=0)  # the stages are channels-last
    with torch.no_grad():
        own = reference.forward_intermediates(x, intermediates_only=True)
    for got, expected in zip(features[2:], own):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _check_segmenter(seg, x, 5)


def test_other_smp_heads_build_on_a_linvision_encoder_and_dilated_ones_say_why_not():
    """The heads of the manual's list run at a non-square size; DeepLabV3(+) and PAN ask timm for a dilated
    encoder (output_stride 8 or 16), which linvision's models refuse by name."""
    x = torch.randn(1, 3, *SIZE)
    for head in ("FPN", "Linknet", "MAnet", "PSPNet", "UnetPlusPlus"):
        torch.manual_seed(0)
        model = getattr(smp, head)("tu-linhier_delta_femto_224", encoder_weights=None, classes=3, **ONE_BLOCK)
        with torch.no_grad():
            y = model.eval()(x)
        assert y.shape == (1, 3, *SIZE) and torch.isfinite(y).all() and y.std() > 0, head
    for head in ("DeepLabV3", "DeepLabV3Plus", "PAN"):
        with pytest.raises(TypeError, match="output_stride"):
            getattr(smp, head)("tu-linhier_delta_femto_224", encoder_weights=None, classes=3, **ONE_BLOCK)


@pytest.mark.parametrize("name", ["linvit_tiny_patch16_rope_224", "linvit_tiny_patch16_224", "inline_deit_tiny"])
def test_linvit_in_dpt_at_another_size(name):
    """DPT on linvit and on InLine-DeiT, a linvit with its own mixer (dynamic_img_size=True; the absolute-embedding
    models need it, InLine-DeiT has it by default, the RoPE one runs at any size without it): the encoder's four maps are the outputs of blocks 2,
    5, 8 and 11 (patch tokens on the 6 x 10 grid) and its prefix tokens the class token after those blocks."""
    torch.manual_seed(0)
    seg = smp.DPT(f"tu-{name}", encoder_weights=None, classes=4, dynamic_img_size=True,
                  decoder_intermediate_channels=(16, 32, 32, 32), decoder_fusion_channels=16).eval()
    assert seg.encoder._output_indices == [2, 5, 8, 11] and seg.encoder.has_prefix_tokens
    reference = timm.create_model(name, dynamic_img_size=True).eval()
    assert not _copy_into(reference, seg.encoder.state_dict(), "model.")
    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        features, prefix = seg.encoder(x)
    blocks = _outputs_of(reference.blocks, reference, x)
    grid = (SIZE[0] // 16, SIZE[1] // 16)
    for got, tokens, index in zip(features, prefix, [2, 5, 8, 11]):
        out = blocks[index]
        expected = out[:, 1:].reshape(1, *grid, 192).permute(0, 3, 1, 2)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(tokens, out[:, :1], rtol=0, atol=0)
    _check_segmenter(seg, x, 4)
    if "rope" not in name:  # without dynamic_img_size the absolute embedding fixes the size (InLine-DeiT's is on
        # by default)
        with pytest.raises(ValueError, match=r"^x: this model takes 224x224 images"):
            timm.create_model(name, depth=1, dynamic_img_size=False)(x)


def test_vig_in_dpt_at_another_size():
    """DPT on the published ViG (no class token; its conv stem and resampled position embedding take any size): the
    encoder's four maps are the outputs of blocks 2, 5, 8 and 11 (tokens on the 6 x 10 grid), with no prefix
    tokens."""
    torch.manual_seed(0)
    seg = smp.DPT("tu-vig_tiny", encoder_weights=None, classes=4, decoder_intermediate_channels=(16, 32, 32, 32),
                  decoder_fusion_channels=16).eval()
    assert seg.encoder._output_indices == [2, 5, 8, 11] and not seg.encoder.has_prefix_tokens
    reference = timm.create_model("vig_tiny").eval()
    assert not _copy_into(reference, seg.encoder.state_dict(), "model.")
    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        features, prefix = seg.encoder(x)
    blocks = _outputs_of(reference.blocks, reference, x)
    grid = (SIZE[0] // 16, SIZE[1] // 16)
    assert all(p is None for p in prefix)
    for got, index in zip(features, [2, 5, 8, 11]):
        torch.testing.assert_close(got, blocks[index].reshape(1, *grid, 192).permute(0, 3, 1, 2), rtol=0, atol=0)
    _check_segmenter(seg, x, 4)


def test_published_mlla_weights_reach_the_encoder_through_timms_cache(tmp_path, monkeypatch):
    """smp.Unet("tu-mlla_tiny.in1k", encoder_weights=True) has timm download the authors' file once into its cache
    (a classifier of the same tag reads the cache; a local copy loads through pretrained_cfg_overlay), and the
    encoder holds the file's raw weights (not its EMA copy): named
    tensors compared with the file, the q/k rows in linvision's order, every tensor equal to timm's classifier
    built from the same file."""
    from support import authors_layout
    from support import save_published

    state = authors_layout("mlla_tiny", blocks=1)
    path = tmp_path / "mlla_t.pth"
    save_published(path, state)
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    seg = smp.Unet("tu-mlla_tiny.in1k", encoder_weights=True, classes=3, **ONE_BLOCK, **DECODERS["Unet"])
    assert asked == ["https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1"]
    assert (tmp_path / "torch_home" / "hub" / "checkpoints" / "mlla_tiny_in1k.pth").is_file()
    backbone = seg.encoder.model.model
    named = {"stem.conv1.conv.weight": "patch_embed.conv1.conv.weight",
             "stem.conv1.bn.running_var": "patch_embed.conv1.norm.running_var",
             "stages.0.blocks.0.mlp.fc1.weight": "layers.0.blocks.0.mlp.fc1.weight",
             "stages.1.downsample.project.bn.bias": "layers.0.downsample.conv.2.norm.bias",
             "stages.3.blocks.0.mixer.out_proj.weight": "layers.3.blocks.0.out_proj.weight"}
    own = backbone.state_dict()
    for mine, theirs in named.items():
        torch.testing.assert_close(own[mine], state[theirs], rtol=0, atol=0, msg=mine)
    attn = backbone.stages[0].blocks[0].mixer.attn
    d, source = attn.head_dim, state["layers.0.blocks.0.attn.qk.weight"]
    for t in range(d // 2):  # interleaved RoPE pairs (2t, 2t+1) of the file become halves (t, t + d/2)
        torch.testing.assert_close(attn.qkv.weight[t], source[2 * t], rtol=0, atol=0)
        torch.testing.assert_close(attn.qkv.weight[t + d // 2], source[2 * t + 1], rtol=0, atol=0)

    classifier = timm.create_model("mlla_tiny", **ONE_BLOCK, pretrained=True,
                                   pretrained_cfg_overlay=dict(file=str(path))).state_dict()
    assert len(own) > 100
    for key, value in own.items():
        torch.testing.assert_close(value, classifier[key], rtol=0, atol=0, msg=key)
    cached = timm.create_model("mlla_tiny.in1k", pretrained=True, **ONE_BLOCK)
    assert len(asked) == 1  # the classifier of the same tag reads the cached file
    torch.testing.assert_close(cached.stem.conv1.conv.weight, state["patch_embed.conv1.conv.weight"], rtol=0, atol=0)
    local = smp.Segformer("tu-mlla_tiny", encoder_weights=True, classes=3, **ONE_BLOCK, **DECODERS["Segformer"],
                          pretrained_cfg_overlay=dict(file=str(path)))  # a local copy, no download
    assert len(asked) == 1
    for key, value in local.encoder.model.model.state_dict().items():
        torch.testing.assert_close(value, own[key], rtol=0, atol=0, msg=key)


# --- the mosaic set ---

def _photo_array(c):
    return np.asarray(photograph(CLASSES[c]))


def test_mosaic_pixels_are_their_labelled_photographs_pixels():
    """At 128 px a region shows its window unscaled: every pixel equals the photograph of its label at the window's
    offset, exactly; the label is what decides it (the same rebuild with the labels of another region fails at
    almost every pixel)."""
    for split in ("train", "val"):
        for index in range(4):
            m = make_mosaic(split, index, 128, seed=3)
            image = np.asarray(m.image)
            rebuilt = np.zeros_like(image)
            window = dict(m.sources)
            assert len(window) == len(m.sources)  # the classes of an image are distinct
            rows, cols = np.mgrid[0:128, 0:128]
            for c, (x0, y0, x1, y1) in window.items():
                inside = m.mask == c
                rebuilt[inside] = _photo_array(c)[y0 + rows[inside], x0 + cols[inside]]
            np.testing.assert_array_equal(image, rebuilt)
            present = sorted(set(np.unique(m.mask).tolist()))
            assert len(present) >= 2 and set(present) <= set(window)
            wrong = np.zeros_like(image)
            for i, c in enumerate(present):  # each region rebuilt from the photograph and window of another
                other = present[(i + 1) % len(present)]
                x0, y0 = window[other][:2]
                inside = m.mask == c
                wrong[inside] = _photo_array(other)[y0 + rows[inside], x0 + cols[inside]]
            assert (wrong == image).all(-1).mean() < 0.05


def test_mosaic_at_512_is_the_bilinear_rendering_of_the_windows():
    """Above 128 px each pixel is its window resized bilinearly: equal to the window's PIL rendering, and within
    the 8-bit rounding of torch's float64 bilinear interpolation of the photograph's pixels."""
    m = make_mosaic("val", 5, 512, seed=0)
    image = np.asarray(m.image).astype(np.float64)
    for c, window in m.sources:
        inside = m.mask == c
        if not inside.any():
            continue
        np.testing.assert_array_equal(image[inside], np.asarray(render_window(c, window, 512))[inside])
        x0, y0, x1, y1 = window
        src = torch.from_numpy(_photo_array(c)[y0:y1, x0:x1].astype(np.float64)).permute(2, 0, 1)[None]
        exact = F.interpolate(src, size=(512, 512), mode="bilinear", align_corners=False)[0].permute(1, 2, 0).numpy()
        diff = np.abs(image[inside] - exact[inside])
        assert diff.max() < 1.5 and diff.mean() < 0.5


def test_train_and_val_windows_lie_in_disjoint_parts_of_each_photograph():
    parts = {split: dict(enumerate(box for _, box in photo_parts(split))) for split in ("train", "val")}
    seen = {"train": set(), "val": set()}
    for split in ("train", "val"):
        for index in range(60):
            for c, (x0, y0, x1, y1) in make_mosaic(split, index, 128, seed=1).sources:
                left, top, right, bottom = parts[split][c]
                assert left <= x0 and x1 <= right and top <= y0 and y1 <= bottom and x1 - x0 == WINDOW == y1 - y0
                seen[split].add(c)
    for c in range(len(CLASSES)):  # the train part ends where the val part starts: no source column in both
        assert parts["train"][c][2] == parts["val"][c][0]
    assert seen["train"] == seen["val"] == set(range(len(CLASSES)))


def test_mosaics_are_drawn_from_split_index_and_seed_alone():
    first = make_mosaic("train", 7, 128, seed=2)
    np.random.seed(123)
    torch.manual_seed(123)
    random.seed(123)
    make_mosaic("train", 3, 128, seed=2)
    again = make_mosaic("train", 7, 128, seed=2)
    np.testing.assert_array_equal(np.asarray(first.image), np.asarray(again.image))
    np.testing.assert_array_equal(first.mask, again.mask)
    assert first.sources == again.sources
    for other in (make_mosaic("train", 7, 128, seed=3), make_mosaic("val", 7, 128, seed=2),
                  make_mosaic("train", 8, 128, seed=2)):
        assert other.sources != first.sources


def test_every_class_appears_and_sizes_render_one_layout():
    """The first samples of each split show every class; 128 and 512 px render the same layout (area fractions
    within 1%, and the 512 px mask at the 128 px pixel centres equal at >= 97% of them); other sizes are refused."""
    for split in ("train", "val"):
        shown = set()
        for index in range(8):
            shown |= set(np.unique(make_mosaic(split, index, 128).mask).tolist())
        assert shown == set(range(len(CLASSES))), (split, shown)
    small, large = make_mosaic("train", 11, 128), make_mosaic("train", 11, 512)
    assert small.sources == large.sources and large.image.size == (512, 512) and large.mask.shape == (512, 512)
    assert large.mask.dtype == np.uint8
    fractions = [np.bincount(m.mask.ravel(), minlength=10) / m.mask.size for m in (small, large)]
    np.testing.assert_allclose(fractions[0], fractions[1], atol=0.01)
    assert (large.mask[1::4, 1::4] == small.mask).mean() >= 0.97
    for size in (127, 1025):
        with pytest.raises(ValueError, match="size"):
            make_mosaic("train", 0, size)
    with pytest.raises(ValueError, match="split"):
        make_mosaic("test", 0, 128)


def test_dataset_returns_normalised_images_and_class_masks():
    data = MosaicSegmentation("val", size=128, length=3, seed=4)
    assert len(data) == 3 and data.num_classes == 10 and data.ignore_index == IGNORE_INDEX == 255
    assert len(MosaicSegmentation("train")) == 1000 and len(MosaicSegmentation("val")) == 200
    x, y = data[2]
    m = make_mosaic("val", 2, 128, seed=4)
    assert x.dtype == torch.float32 and x.shape == (3, 128, 128) and y.dtype == torch.int64 and y.shape == (128, 128)
    pixels = (x * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)) * 255
    torch.testing.assert_close(pixels, torch.from_numpy(np.array(m.image)).permute(2, 0, 1).float(), rtol=0,
                               atol=1e-3)
    torch.testing.assert_close(y, torch.from_numpy(m.mask).long(), rtol=0, atol=0)
    pair = MosaicSegmentation("val", size=128, length=3, seed=4, transform=lambda im, mk: (im, mk))[2]
    assert pair[0].mode == "RGB" and pair[1].mode == "L"
    np.testing.assert_array_equal(np.asarray(pair[1]), m.mask)
    with pytest.raises(IndexError):
        data[3]


def test_folders_written_and_read_back(tmp_path):
    root = write_mosaic_folders(str(tmp_path / "mosaics"), size=128, train=3, val=2, seed=5)
    meta = json.loads((tmp_path / "mosaics" / "dataset.json").read_text())
    assert meta["classes"] == list(CLASSES) and meta["ignore_index"] == 255
    assert meta["splits"] == {"train": 3, "val": 2} and meta["size"] == 128 and meta["seed"] == 5
    for split, count in (("train", 3), ("val", 2)):
        assert sorted(p.name for p in (tmp_path / "mosaics" / split / "masks").iterdir()) == \
            [f"{i:05d}.png" for i in range(count)]
        folder, memory = SegmentationFolder(root, split), MosaicSegmentation(split, 128, count, seed=5)
        assert len(folder) == count and folder.classes == list(CLASSES)
        for i in range(count):
            (a, ma), (b, mb) = folder[i], memory[i]
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(ma, mb, rtol=0, atol=0)
    with pytest.raises(FileExistsError):
        write_mosaic_folders(root, size=128, train=1, val=1)
    (tmp_path / "mosaics" / "val" / "masks" / "00001.png").unlink()
    with pytest.raises(FileNotFoundError, match="no mask"):
        SegmentationFolder(root, "val")
    assert mosaic_data.MIN_SIZE == 128 and mosaic_data.MAX_SIZE == 1024


def test_scores_are_all_in_percent_and_miou_is_the_mean_of_the_classes():
    """Per-class pixel counts of 4 classes (class 3 neither in the masks nor predicted): the IoU of each class is
    tp / (tp + fp + fn) in percent, None for class 3, mIoU their mean and pixel accuracy the share of labelled
    pixels predicted right, in percent too."""
    from linvision.training.seg_metrics import segmentation_scores

    tp = torch.tensor([30.0, 10.0, 0.0, 0.0])
    fp = torch.tensor([10.0, 0.0, 5.0, 0.0])
    fn = torch.tensor([0.0, 10.0, 5.0, 0.0])
    tn = 60.0 - tp - fp - fn  # unused by IoU and accuracy
    scores = segmentation_scores(tp, fp, fn, tn)
    assert scores["iou"] == [pytest.approx(75.0), pytest.approx(50.0), 0.0, None]
    assert scores["miou"] == pytest.approx(125.0 / 3)
    assert scores["miou"] == pytest.approx(np.mean([v for v in scores["iou"] if v is not None]), rel=1e-12)
    assert scores["pixel_acc"] == pytest.approx(100.0 * 40 / 55)
