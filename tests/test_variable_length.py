"""Batches of images of different sizes: token masks (valid=) and RoPE at per-sample positions give every sample
what it gets alone, at its own size."""
import os

import pytest
import torch

from linvision.ops import linear_attention, softmax_attention
from linvision.ops.rope import apply_rope, axial_rope, axial_rope_freqs, rope_at

from support import explicit_linear_attention

SIZES = [(3, 5), (4, 2), (1, 1)]  # each sample's grid (H, W); padded to N tokens


def padded_batch(sizes, n, heads=2, d=8, dv=6, prefix=0, dtype=torch.float64, pad_value=0.0, seed=0):
    """q, k, v (B, heads, prefix + n, .), the valid mask and each sample's (row, col) in raster order."""
    g = torch.Generator().manual_seed(seed)
    b = len(sizes)
    q, k, v = (torch.randn(b, heads, prefix + n, dim, generator=g, dtype=dtype) for dim in (d, d, dv))
    valid = torch.zeros(b, prefix + n, dtype=torch.bool)
    positions = torch.zeros(b, n, 2)
    for i, (h, w) in enumerate(sizes):
        valid[i, :prefix + h * w] = True
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, :h * w] = torch.stack([rows.flatten(), cols.flatten()], -1).float()
        for t in (q, k, v):
            t[i, :, prefix + h * w:] = pad_value
    return q, k, v, valid, positions


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("use_rope", [False, True])
def test_each_sample_gets_what_it_gets_alone(feature_map, use_rope):
    """Against the explicit N x N formula in float64 of each sample alone at its own grid; the padded positions
    output zero."""
    q, k, v, valid, positions = padded_batch(SIZES, 16)
    fx, fy = axial_rope_freqs(8)
    rope = rope_at(fx, fy, positions) if use_rope else None
    out = linear_attention(q, k, v, feature_map, rope=rope, valid=valid, backend="torch")
    for i, (h, w) in enumerate(SIZES):
        n = h * w
        alone = explicit_linear_attention(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], feature_map,
                                          rope=axial_rope(8, (h, w)) if use_rope else None)
        torch.testing.assert_close(out[i:i + 1, :, :n], alone, rtol=1e-12, atol=1e-12)
        assert torch.equal(out[i, :, n:], torch.zeros_like(out[i, :, n:]))


@pytest.mark.parametrize("use_rope", [False, True])
def test_gradients_of_a_padded_batch_are_those_of_each_sample_alone(use_rope):
    q, k, v, valid, positions = padded_batch(SIZES, 16, prefix=1)
    fx, fy = axial_rope_freqs(8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rope = rope_at(fx, fy, positions, num_prefix_tokens=1) if use_rope else None
    out = linear_attention(*leaves, "elu", rope=rope, valid=valid, backend="torch")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    for i, (h, w) in enumerate(SIZES):
        n = 1 + h * w
        alone = [t[i:i + 1, :, :n].detach().clone().requires_grad_() for t in (q, k, v)]
        rope1 = axial_rope(8, (h, w), num_prefix_tokens=1) if use_rope else None
        out1 = linear_attention(*alone, "elu", rope=rope1, backend="torch")
        (out1 * weights[i:i + 1, :, :n]).sum().backward()
        for batched, single in zip(leaves, alone):
            torch.testing.assert_close(batched.grad[i:i + 1, :, :n], single.grad, rtol=1e-10, atol=1e-12)
            assert not batched.grad[i, :, n:].any()


@pytest.mark.parametrize("pad_value", [float("inf"), float("nan")])
def test_padding_holding_anything_changes_nothing(pad_value):
    """Padded tokens may hold inf or NaN (uninitialised buffers): outputs and gradients stay those of zero
    padding (zero at the padding)."""
    clean = padded_batch(SIZES, 16)
    dirty = padded_batch(SIZES, 16, pad_value=pad_value)
    rope = rope_at(*axial_rope_freqs(8), clean[4])
    results = []
    for q, k, v, valid, _ in (clean, dirty):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = linear_attention(*leaves, "elu", rope=rope, valid=valid, backend="torch")
        out.sum().backward()
        results.append((out, *(t.grad for t in leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_softmax_twin_takes_the_same_mask():
    q, k, v, valid, positions = padded_batch(SIZES, 16)
    rope = rope_at(*axial_rope_freqs(8), positions)
    out = softmax_attention(q, k, v, rope=rope, valid=valid)
    for i, (h, w) in enumerate(SIZES):
        n = h * w
        alone = softmax_attention(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], rope=axial_rope(8, (h, w)))
        torch.testing.assert_close(out[i:i + 1, :, :n], alone, rtol=1e-12, atol=1e-12)
        assert not out[i, :, n:].any()


def test_positions_of_a_whole_grid_are_the_grid_s_rotation():
    h, w = 3, 4
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], -1).float()[None].expand(2, -1, -1)
    x = torch.randn(2, 2, 1 + h * w, 8, dtype=torch.float64)
    fx, fy = axial_rope_freqs(8, row_first=True)
    torch.testing.assert_close(apply_rope(x, rope_at(fx, fy, positions, num_prefix_tokens=1)),
                               apply_rope(x, axial_rope(8, (h, w), num_prefix_tokens=1, row_first=True)),
                               rtol=0, atol=1e-6)  # fp32 tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_under_autocast_at_100k_tokens(dtype):
    """fp32 inputs under autocast: the state still accumulates in fp32 over the valid tokens only."""
    n, keep = 131_072, 100_000
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) * 3 for _ in range(3))
    valid = torch.zeros(1, n, dtype=torch.bool)
    valid[0, :keep] = True
    with torch.autocast("cpu", dtype=dtype):
        out = linear_attention(q, k, v, "elu", valid=valid, backend="torch")
    assert out.dtype == dtype
    ref = linear_attention(*(t[:, :, :keep].double() for t in (q, k, v)), "elu", backend="torch")
    err = (out[:, :, :keep].double() - ref).abs().max() / ref.abs().max()
    assert err < (2e-2 if dtype == torch.bfloat16 else 2e-3), err.item()
    assert not out[:, :, keep:].any()


def test_bad_masks_are_one_line():
    q, k, v, valid, positions = padded_batch(SIZES, 16)
    with pytest.raises(TypeError, match="valid: expected a bool tensor"):
        linear_attention(q, k, v, valid=valid.float())
    with pytest.raises(ValueError, match=r"valid: expected shape \(B, Nk\)"):
        linear_attention(q, k, v, valid=valid[:, :8])
    with pytest.raises(ValueError, match="valid: the causal form takes no token mask"):
        linear_attention(q, k, v, causal=True, valid=valid)
    with pytest.raises(ValueError, match="rope: positions for 3 samples, the input has 2"):
        linear_attention(q[:2], k[:2], v[:2], rope=rope_at(*axial_rope_freqs(8), positions))
    with pytest.raises(ValueError, match="positions: expected a"):
        rope_at(*axial_rope_freqs(8), positions[0])


@pytest.mark.parametrize("form", ["gated", "gated_per_channel", "delta"])
def test_bidirectional_scans_with_lengths_equal_each_sample_alone(form):
    """Each sample's first lengths[b] tokens, padding after them (holding anything): its outputs and gradients
    are those of the sample alone (bitwise: the backward scan reverses the real tokens only), zeros at padding."""
    from linvision.ops import bidirectional_delta_rule_attention, bidirectional_gated_linear_attention

    g = torch.Generator().manual_seed(0)
    b, h, n, d = 3, 2, 21, 8
    lengths = torch.tensor([21, 13, 5])
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    gate = (torch.rand(b, h, n, d if form == "gated_per_channel" else 1, generator=g, dtype=torch.float64)
            .clamp(0.05).log() / 4)
    beta = torch.rand(b, h, n, generator=g, dtype=torch.float64)
    for t in (q, k, v, gate, beta):  # padding that holds inf changes nothing
        for i, length in enumerate(lengths.tolist()):
            t[i, :, length:] = float("inf")

    def run(q, k, v, extra, lengths=None):
        if form == "delta":
            return bidirectional_delta_rule_attention(q, k, v, extra, chunk_size=4, backend="torch", lengths=lengths)
        return bidirectional_gated_linear_attention(q, k, v, extra, chunk_size=4, backend="torch", lengths=lengths)

    extra = beta if form == "delta" else gate
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves, extra, lengths)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    (out * weights).sum().backward()
    for i, length in enumerate(lengths.tolist()):
        alone = [t[i:i + 1, :, :length].detach().clone().requires_grad_() for t in (q, k, v)]
        out1 = run(*alone, extra[i:i + 1, :, :length])
        (out1 * weights[i:i + 1, :, :length]).sum().backward()
        assert torch.equal(out[i:i + 1, :, :length], out1)
        assert not out[i, :, length:].any()
        for batched, single in zip(leaves, alone):
            torch.testing.assert_close(batched.grad[i:i + 1, :, :length], single.grad, rtol=1e-12, atol=1e-14)
            assert not batched.grad[i, :, length:].any()


# --- linvit on timm's NaFlex batches

IMAGE_SIZES = [(48, 80), (64, 32), (16, 16)]  # (H, W) in pixels: 3x5, 4x2 and 1x1 patches of 16


def naflex_batch(images, patch=16, max_seq_len=24):
    """timm's own NaFlex batch of ``images`` ((C, H, W) tensors): its Patchify transform and its collator."""
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import Patchify

    patchify = Patchify(patch)
    batch, _ = NaFlexCollator(max_seq_len)([(patchify(img), 0) for img in images])
    # the collator holds patches in float32: in the images' dtype, the comparisons below are exact to rounding
    return {k: v.to(images[0].dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def tiny_linvit(name, **kwargs):
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, depth=2, img_size=64, num_classes=5, **kwargs).double().eval()


def _images(seed=0):
    g = torch.Generator().manual_seed(seed)
    # float32 values (what timm's collator holds) as float64 images
    return [torch.rand(3, h, w, generator=g).double() for h, w in IMAGE_SIZES]


MODELS = {  # name, options: every mixer of the isotropic family that takes a NaFlex batch
    "linear_rope": ("linvit_tiny_patch16_rope_224", {}),  # 2D RoPE on the numerator and LePE
    "softmax_twin": ("linvit_tiny_patch16_rope_224", {"token_mixer": "softmax"}),
    "mixed_rope": ("linvit_small_patch16_rope_mixed_224", {}),
    "rope_origin_centre": ("linvit_tiny_patch16_rope_224", {"mixer_kwargs": {"rope_origin": "centre"}}),
    # positions interpolated to the 4 x 4 grid: each image of the batch scaled by its own grid, as alone
    "rope_ref_grid": ("linvit_tiny_patch16_rope_224", {"mixer_kwargs": {"rope_ref_grid": 4, "rope_origin": "centre"}}),
    "linear_abs_pos_avg": ("linvit_tiny_patch16_224", {"dynamic_img_size": True, "global_pool": "avg"}),
    "registers_no_embed_class": ("linvit_tiny_patch16_224", {"dynamic_img_size": True, "reg_tokens": 2,
                                                             "no_embed_class": True}),
    # the scans: no prefix tokens, mean pooling, the absolute embedding asked for (rope="none")
    "bidir_delta": ("linvit_tiny_patch16_rope_224", {"token_mixer": "bidir_delta", "rope": "none", "class_token": False,
                                                     "global_pool": "avg", "mixer_kwargs": {"chunk_size": 4}}),
    "bidir_gated_both_orders_lepe": ("linvit_tiny_patch16_rope_224", {
        "token_mixer": "bidir_gated", "rope": "none", "class_token": False, "global_pool": "avg",
        "mixer_kwargs": {"column_major": True, "lepe": True, "chunk_size": 4}}),
}
# An image alone has its grid's frequencies scaled, one in a batch its positions: the same angles, rounded apart in
# fp32 (RoPE's angles are fp32 whatever the input dtype), about 1e-7 of an angle.
FP32_ANGLES = {"rope_ref_grid"}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_a_naflex_batch_gives_each_image_its_own_logits_and_intermediates(case):
    """The property NaFlex needs: each image of a batch of different sizes and aspect ratios gets the logits and
    block outputs the model gives it alone at its own size (float64, so equal to rounding)."""
    name, options = MODELS[case]
    tol = dict(rtol=1e-6, atol=1e-8) if case in FP32_ANGLES else dict(rtol=1e-10, atol=1e-10)
    model = tiny_linvit(name, **options)
    images = _images()
    batch = naflex_batch(images)
    with torch.no_grad():
        logits = model(batch)
        final, inter = model.forward_intermediates(batch, output_fmt="NLC")
        for i, img in enumerate(images):
            alone = model(img[None])
            torch.testing.assert_close(logits[i:i + 1], alone, **tol)
            n = img.shape[1] // 16 * (img.shape[2] // 16)
            _, inter1 = model.forward_intermediates(img[None], output_fmt="NLC")
            for a, b in zip(inter, inter1):
                torch.testing.assert_close(a[i:i + 1, :n], b, **tol)
    assert model.get_patch_size() == (16, 16)


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the fused kernels need a GPU or TRITON_INTERPRET=1")
def test_a_naflex_batch_on_the_fused_kernels(monkeypatch):
    """linvit with 2D RoPE on a NaFlex batch with its attention on the fused kernels (the token mask read in the
    kernels, RoPE at each image's positions): logits equal each image alone on the PyTorch path, and so does
    the gradient of every parameter (fp32)."""
    pytest.importorskip("triton")
    from linvision.ops import record_backends
    from linvision.ops.attention import dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the kernels in the interpreter
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 convolutions on both paths
    model = tiny_linvit("linvit_tiny_patch16_rope_224").float().to(device)
    images = [img.float() for img in _images()]
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in naflex_batch(images).items()}
    images = [img.to(device) for img in images]
    monkeypatch.setattr(dispatch, "_AUTO_DEVICES", ("cuda", "cpu"))  # the interpreted kernels serve CPU tensors
    with record_backends() as used:
        logits = model(batch)
    assert ("linear_attention", "triton") in used and ("linear_attention", "torch") not in used
    logits.sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    monkeypatch.setattr(dispatch, "_AUTO_DEVICES", ())
    model.zero_grad()
    for i, img in enumerate(images):
        alone = model(img[None])
        torch.testing.assert_close(logits[i:i + 1], alone, rtol=1e-4, atol=1e-5)
        alone.sum().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(fused_grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_a_naflex_batch_of_one_odd_image():
    """Batch 1, an odd non-square grid (3 x 7 patches) padded to 24 tokens: the logits of the image alone."""
    model = tiny_linvit("linvit_tiny_patch16_rope_224")
    img = torch.rand(3, 48, 112, generator=torch.Generator().manual_seed(2)).double()
    batch = naflex_batch([img])
    assert batch["patch_valid"].shape == (1, 24) and int(batch["patch_valid"].sum()) == 21
    with torch.no_grad():
        torch.testing.assert_close(model(batch), model(img[None]), rtol=1e-10, atol=1e-10)


def test_naflex_gradients_are_the_sum_of_each_image_s():
    """Training on a NaFlex batch: the gradient of the summed loss is the sum of each image's gradient alone."""
    model = tiny_linvit("linvit_tiny_patch16_rope_224").train()
    images, targets = _images(1), torch.tensor([0, 3, 1])
    batch = naflex_batch(images)
    torch.nn.functional.cross_entropy(model(batch), targets, reduction="sum").backward()
    batched = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for img, target in zip(images, targets):
        torch.nn.functional.cross_entropy(model(img[None]), target[None], reduction="sum").backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(batched[n], p.grad, rtol=1e-9, atol=1e-11, msg=n)


def test_naflex_inference_mode_then_training():
    model = tiny_linvit("linvit_tiny_patch16_rope_224")
    batch = naflex_batch(_images())
    with torch.inference_mode():
        expected = model(batch)
    model.train()
    out = model(batch)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected)


def test_naflex_refusals_are_one_line():
    batch = naflex_batch(_images())
    model = tiny_linvit("linvit_tiny_patch16_rope_224")
    with pytest.raises(ValueError, match="output_fmt: 'NCHW' needs one grid"):
        model.forward_intermediates(batch)
    with pytest.raises(ValueError, match=r"patches: expected \(B, N, 16\*16\*3\)"):
        model({**batch, "patches": batch["patches"][..., :10]})
    with pytest.raises(ValueError, match="missing 'patch_coord'"):
        model({"patches": batch["patches"]})
    windows = tiny_linvit("linvit_tiny_patch16_rope_224", token_mixer="hybrid", class_token=False,
                          global_pool="avg")
    with pytest.raises(ValueError, match="'hybrid' cannot take a batch of images of different sizes"):
        windows(batch)
    scan = tiny_linvit("linvit_tiny_patch16_rope_224", token_mixer="bidir_delta", rope="none", class_token=False,
                       global_pool="avg")
    holes = {**batch, "patch_valid": batch["patch_valid"].roll(1, dims=1),
             "patch_coord": batch["patch_coord"].roll(1, dims=1)}
    with pytest.raises(ValueError, match="the scans need each image's patches first"):
        scan(holes)


def mixed_aspect_folder(root, train_per_class=2, val_per_class=3):
    """Two classes of images in five aspect ratios (grey levels apart, with noise)."""
    import os

    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    shapes = [(24, 40), (40, 24), (16, 48), (32, 32), (20, 36)]
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(2):
            os.makedirs(root / split / f"class{c}", exist_ok=True)
            for i in range(count):
                h, w = shapes[(i + c) % len(shapes)]
                pixels = np.clip(100 * c + 60 + rng.randn(h, w, 3) * 20, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.png")
    return str(root)


TINY_NAFLEX_RUN = ["--img-size", "32", "--model", "linvit_tiny_patch16_rope_224", "--model-kwargs", "depth=1",
                   "patch_size=8", "--batch-size", "2", "--no-progress", "--device", "cpu",
                   "--interpolation", "bilinear"]


def test_validate_with_the_naflex_loader_scores_each_image_at_its_own_aspect(tmp_path):
    """linvision-validate --naflex-loader on a folder of images of several aspect ratios: the top-1 and loss of
    each image alone, resized by timm's NaFlex transform (at most 16 patches of 8 px) and run as an image."""
    import json

    from PIL import Image
    from support import run_tool
    from timm.data import create_transform

    data = mixed_aspect_folder(tmp_path / "data")
    run_tool("train.py", "--dataset", "folder", "--data-dir", data, *TINY_NAFLEX_RUN, "--epochs", "1",
             "--output", str(tmp_path), "--experiment", "r")
    proc = run_tool("validate.py", "--checkpoint", str(tmp_path / "r"), "--naflex-loader", "--naflex-max-seq-len",
                    "16", "--batch-size", "4", "--device", "cpu")
    result = json.loads(proc.stdout)["results"][0]
    assert result["naflex_max_seq_len"] == 16 and result["count"] == 6

    from linvision.utils.checkpoint import load_model

    model, meta = load_model(str(tmp_path / "r"))
    resize = create_transform(is_training=False, interpolation="bilinear", mean=meta["mean"], std=meta["std"],
                              naflex=True, patch_size=(8, 8), max_seq_len=16, patchify=False, use_prefetcher=False)
    hits, losses, grids = [], [], set()
    with torch.no_grad():
        for c in range(2):
            for i in range(3):
                img = resize(Image.open(tmp_path / "data" / "val" / f"class{c}" / f"{i}.png").convert("RGB"))
                grids.add((img.shape[1] // 8, img.shape[2] // 8))
                logits = model(img[None])
                hits.append(float(logits.argmax(-1).item() == c))
                losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor([c])).item())
    assert len(grids) >= 3 and all(h * w <= 16 for h, w in grids), grids  # aspect ratios kept, within budget
    assert result["top1"] == pytest.approx(100 * sum(hits) / 6)
    assert result["loss"] == pytest.approx(sum(losses) / 6, rel=1e-5)


def test_train_on_naflex_batches_resumes_exactly_and_validates_as_validate_does(tmp_path):
    """linvision-train --naflex-loader: timm's NaFlex schedule (batches of 4, 8 and 16 patches per image), stopped
    mid-epoch and resumed gives the uninterrupted run's step losses; each epoch's validation loss is what
    linvision-validate --naflex-loader gives its checkpoint."""
    import json

    from support import run_tool, step_losses

    data = mixed_aspect_folder(tmp_path / "data", train_per_class=6)
    flags = ["--dataset", "folder", "--data-dir", data, *TINY_NAFLEX_RUN, "--epochs", "2", "--output",
             str(tmp_path), "--naflex-loader", "--naflex-train-seq-lens", "4", "8", "16", "--naflex-max-seq-len",
             "16", "--log-interval", "1"]
    run_tool("train.py", *flags, "--experiment", "whole")
    run_tool("train.py", *flags, "--experiment", "parts", "--stop-after-steps", "3")
    run_tool("train.py", "--resume", str(tmp_path / "parts"), "--no-progress")
    whole, parts = step_losses(str(tmp_path / "whole")), step_losses(str(tmp_path / "parts"))
    assert len(whole) == 8 and [s for s, _ in parts] == [s for s, _ in whole]
    torch.testing.assert_close([l for _, l in parts], [l for _, l in whole], rtol=1e-6, atol=1e-7)
    last = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")][-1]
    proc = run_tool("validate.py", "--checkpoint", str(tmp_path / "whole" / "last"), "--naflex-loader",
                    "--naflex-max-seq-len", "16", "--device", "cpu")
    result = json.loads(proc.stdout)["results"][0]
    assert result["count"] == 6 and result["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    with pytest.raises(AssertionError, match="Mixup, CutMix and distillation"):
        run_tool("train.py", *flags, "--experiment", "mix", "--mixup", "0.2")
