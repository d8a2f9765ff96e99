"""Linearization: softmax ViT weights mapped onto linvit, attention transfer, local weight files."""
import json

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import linvision  # noqa: F401  (registers the models)
from linvision.data.datasets import build_transform, create_dataset
from linvision.experiments.linearize import attention_errors, attention_transfer, build_student, transfer_parameters
from linvision.models.vit_weights import checkpoint_filter_fn

SHAPE = dict(embed_dim=64, depth=3, num_heads=2)


def _vit(seed=0, **kwargs):
    """A timm softmax ViT with random (not initial) weights, so every mapped tensor matters."""
    torch.manual_seed(seed)
    model = timm.create_model("vit_small_patch16_224", num_classes=10, **SHAPE, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


# timm ViT heads and linvit's options of the same name: no class token with the mean of the normalised tokens
# (linvit's head for the mixers that cannot take a class token), the class token (the default of both), the mean
# then fc_norm (timm's "avg" default), register tokens without position rows for the prefix tokens (DeiT-III /
# reg4 models).
HEADS = {
    "mean-pool": dict(class_token=False, global_pool="avg", fc_norm=False),
    "class-token": dict(class_token=True, global_pool="token"),
    "mean-fc-norm": dict(class_token=True, global_pool="avg", fc_norm=True),
    "registers-no-embed-class": dict(class_token=True, reg_tokens=2, no_embed_class=True, global_pool="token"),
}


@pytest.mark.parametrize("vit_kwargs, head", [({}, "mean-pool"), (dict(init_values=0.5), "mean-pool"),
                                              ({}, "class-token"), ({}, "mean-fc-norm"),
                                              ({}, "registers-no-embed-class")],
                         ids=["plain", "layer-scale", "class-token", "mean-fc-norm", "registers"])
def test_converted_softmax_model_reproduces_timm_vit(tmp_path, vit_kwargs, head):
    """A timm ViT loaded from a local file into linvit with the softmax mixer and the same head options gives
    timm's logits, features and intermediates (prefix tokens included), in float64 (layer scale folded into the
    projections)."""
    vit = _vit(**HEADS[head], **vit_kwargs).double()
    path = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(path))
    lin = timm.create_model("linvit_small_patch16_224", pretrained=True, token_mixer="softmax", num_classes=10,
                            pretrained_cfg_overlay=dict(file=str(path), num_classes=10), **SHAPE,
                            **HEADS[head]).eval().double()
    x = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    # layer scale is folded into the fp32 file's projections, in fp32; otherwise only float64 rounding differs
    tol = dict(rtol=1e-6, atol=1e-8) if vit_kwargs else dict(rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), vit(x), **tol)
        torch.testing.assert_close(lin.forward_features(x), vit.forward_features(x), **tol)
        for ours, theirs in zip(lin.forward_intermediates(x, indices=2, return_prefix_tokens=True)[1],
                                vit.forward_intermediates(x, indices=2, return_prefix_tokens=True)[1]):
            if isinstance(theirs, tuple):  # (patch tokens as a map, prefix tokens)
                torch.testing.assert_close(ours[1], theirs[1], **tol)
                ours, theirs = ours[0], theirs[0]
            torch.testing.assert_close(ours, theirs, **tol)


def test_student_with_a_class_token_keeps_the_teachers_and_its_attention():
    """Linearization into a linvit with class_token=True keeps DeiT's class token and its position row, and the
    layer losses feed the student's mixers the prefix token too: the softmax twin then reproduces every layer
    of the teacher exactly, and a linear student has a finite error to learn."""
    vit = _vit()
    sd = vit.state_dict()
    twin = build_student("linvit_small_patch16_224", vit, 224, token_mixer="softmax", class_token=True,
                         global_pool="token", **SHAPE).eval()
    torch.testing.assert_close(twin.cls_token, sd["cls_token"], rtol=0, atol=0)
    torch.testing.assert_close(twin.pos_embed, sd["pos_embed"], rtol=0, atol=0)
    images = torch.randn(2, 3, 224, 224)
    errors = attention_errors(twin, vit, [images])
    assert len(errors) == SHAPE["depth"] and max(errors) < 1e-10
    with torch.no_grad():
        torch.testing.assert_close(twin(images), vit(images), rtol=1e-5, atol=1e-5)
    linear = build_student("linvit_small_patch16_rope_224", vit, 224, class_token=True, global_pool="token", **SHAPE)
    torch.testing.assert_close(linear.cls_token, sd["cls_token"], rtol=0, atol=0)
    errors = attention_errors(linear, vit, [images])
    assert all(0 < e < 10 for e in errors)
    with pytest.raises(ValueError, match="cls_token"):
        build_student("linvit_small_patch16_224", _vit(class_token=False, global_pool="avg"), 224,
                      class_token=True, global_pool="token", **SHAPE)
    with pytest.raises(ValueError, match="'bidir_delta' cannot take prefix tokens"):
        build_student("linvit_small_patch16_224", vit, 224, token_mixer="bidir_delta", class_token=True,
                      global_pool="token", **SHAPE)


@pytest.mark.parametrize("head", ["class-token", "mean-pool"])
def test_softmax_twin_of_a_layer_scale_vit_has_no_attention_error(head):
    """The softmax twin of a ViT with layer scale (init_values=0.5; random weights, so every gamma differs) has
    its layer scale folded into the projection; the stage-1 target is the teacher's branch after its layer scale,
    so the twin's error is zero in every layer (comparing with the teacher's attention before its layer scale,
    each layer's error would be the mean of (gamma - 1)^2 weighted by the output: about 0.25 at gamma = 0.5)."""
    vit = _vit(init_values=0.5, **HEADS[head]).double()
    with torch.no_grad():  # the layer scale as initialised (0.5), not the random values of _vit
        for block in vit.blocks:
            block.ls1.gamma.fill_(0.5)
    twin = build_student("linvit_small_patch16_224", vit, 224, token_mixer="softmax", **SHAPE, **HEADS[head]).double()
    images = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    errors = attention_errors(twin, vit, [images])
    assert len(errors) == SHAPE["depth"] and max(errors) <= 1e-6, errors
    with torch.no_grad():
        torch.testing.assert_close(twin(images), vit(images), rtol=1e-6, atol=1e-8)
    # with random per-channel gammas as well
    random_gammas = _vit(seed=1, init_values=0.5, **HEADS[head]).double()
    twin = build_student("linvit_small_patch16_224", random_gammas, 224, token_mixer="softmax", **SHAPE,
                         **HEADS[head]).double()
    assert max(attention_errors(twin, random_gammas, [images])) <= 1e-6


def test_class_token_vit_mapping_and_rope_student():
    """A class-token ViT into a linvit without one: cls_token dropped, its position row stripped; qkv/proj/MLP/
    norm/head copied; the RoPE student drops the position embedding and starts LePE at zero and the gate at
    identity."""
    vit = _vit()
    sd = vit.state_dict()
    lin = timm.create_model("linvit_small_patch16_224", num_classes=10, class_token=False, global_pool="avg", **SHAPE)
    out = checkpoint_filter_fn(sd, lin)
    assert "cls_token" not in out
    torch.testing.assert_close(out["pos_embed"], sd["pos_embed"][:, 1:], rtol=0, atol=0)
    # mean pooling puts the final norm after the pooling (timm's default): the teacher's norm goes there
    assert "norm.weight" not in out
    torch.testing.assert_close(out["fc_norm.weight"], sd["norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(out["fc_norm.bias"], sd["norm.bias"], rtol=0, atol=0)
    before = timm.create_model("linvit_small_patch16_224", num_classes=10, class_token=False, global_pool="avg",
                               fc_norm=False, **SHAPE)
    kept = checkpoint_filter_fn(sd, before)
    assert "fc_norm.weight" not in kept
    torch.testing.assert_close(kept["norm.weight"], sd["norm.weight"], rtol=0, atol=0)
    before.load_state_dict(kept)
    # and back: an fc_norm ViT (mean-pooled) into a class-token student, whose norm is before the pooling
    mean_vit = _vit(**HEADS["mean-fc-norm"]).state_dict()
    token = timm.create_model("linvit_small_patch16_224", num_classes=10, **SHAPE)
    moved = checkpoint_filter_fn(mean_vit, token)
    torch.testing.assert_close(moved["norm.weight"], mean_vit["fc_norm.weight"], rtol=0, atol=0)
    token.load_state_dict(moved)
    for i in range(SHAPE["depth"]):
        for part in ("qkv", "proj"):
            torch.testing.assert_close(out[f"blocks.{i}.mixer.{part}.weight"], sd[f"blocks.{i}.attn.{part}.weight"])
        torch.testing.assert_close(out[f"blocks.{i}.mlp.fc2.bias"], sd[f"blocks.{i}.mlp.fc2.bias"])
    torch.testing.assert_close(out["head.weight"], sd["head.weight"])
    lin.load_state_dict(out)

    rope = timm.create_model("linvit_small_patch16_rope_224", num_classes=10, mixer_kwargs=dict(gate=True), **SHAPE)
    out = checkpoint_filter_fn(sd, rope)
    rope.load_state_dict(out)
    assert "pos_embed" not in out
    mixer = rope.blocks[0].mixer
    assert mixer.lepe.weight.abs().sum() == 0 and mixer.lepe.bias.abs().sum() == 0
    tokens = torch.randn(2, 16, SHAPE["embed_dim"])
    torch.testing.assert_close(F.silu(mixer.gate(tokens)), torch.ones_like(tokens), rtol=0, atol=1e-6)


def test_pola_entry_point_takes_deit_shaped_weights_and_keeps_its_own_feature_map():
    """linvit_*_patch16_pola_224 (the plain model with PolaFormer's mixer) loads a class-token softmax ViT: its
    absolute embedding, class token, qkv and projection are the teacher's, LePE starts at zero and the feature
    map's parameters (power, scale) at the model's own initialisation; its logits differ from the teacher's."""
    vit = _vit()
    sd = vit.state_dict()
    pola = timm.create_model("linvit_small_patch16_pola_224", num_classes=10, **SHAPE).eval()
    fresh = {k: v.clone() for k, v in pola.state_dict().items()}
    out = checkpoint_filter_fn(sd, pola)
    pola.load_state_dict(out)
    torch.testing.assert_close(pola.pos_embed, sd["pos_embed"], rtol=0, atol=0)
    torch.testing.assert_close(pola.cls_token, sd["cls_token"], rtol=0, atol=0)
    for i in range(SHAPE["depth"]):
        mixer = pola.blocks[i].mixer
        assert type(mixer).__name__ == "PolaAttention"
        torch.testing.assert_close(mixer.qkv.weight, sd[f"blocks.{i}.attn.qkv.weight"], rtol=0, atol=0)
        torch.testing.assert_close(mixer.proj.weight, sd[f"blocks.{i}.attn.proj.weight"], rtol=0, atol=0)
        assert mixer.lepe.weight.abs().sum() == 0 and mixer.lepe.bias.abs().sum() == 0
        for name in ("power_logit", "qk_scale"):
            key = f"blocks.{i}.mixer.{name}"
            assert key not in sd and torch.equal(pola.state_dict()[key], fresh[key]), key
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert not torch.allclose(pola(x), vit(x), atol=1e-3)


def test_wrong_and_truncated_files_give_clear_errors(tmp_path):
    other_width = timm.create_model("vit_small_patch16_224", embed_dim=32, depth=3, num_heads=2)
    wrong = tmp_path / "wrong.safetensors"
    save_file({k: v.contiguous() for k, v in other_width.state_dict().items()}, str(wrong))
    with pytest.raises(ValueError, match=r"wrong\.safetensors.*another width"):
        timm.create_model("linvit_small_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(wrong)),
                          **SHAPE)
    deeper = timm.create_model("vit_small_patch16_224", embed_dim=64, depth=4, num_heads=2)
    with pytest.raises(ValueError, match="blocks.3"):
        checkpoint_filter_fn(deeper.state_dict(), timm.create_model("linvit_small_patch16_224", **SHAPE))
    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in _vit().state_dict().items()}, str(good))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated\.safetensors.*truncated"):
        timm.create_model("linvit_small_patch16_224", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(truncated)), **SHAPE)


def test_pretrained_tags_point_at_timm_softmax_weights():
    """The DeiT conversion is an explicit tag; no model's default names weights, and pretrained=True without a
    tag fails in one line naming the tag that does (no download is attempted)."""
    for name in timm.list_models("linvit*"):
        size = name.split("_")[1]
        cfg = timm.create_model(f"{name}.deit_fb_in1k", pretrained=False, depth=1).pretrained_cfg
        assert cfg["hf_hub_id"] == f"timm/deit_{size}_patch16_224.fb_in1k" and cfg["tag"] == "deit_fb_in1k"
        default = timm.create_model(name, pretrained=False, depth=1).pretrained_cfg
        assert not any(default.get(k) for k in ("url", "hf_hub_id", "file")), name
        with pytest.raises(ValueError, match=rf"{name} has no trained weights; '{name}\.deit_fb_in1k'"):
            timm.create_model(name, pretrained=True, depth=1)
        teacher_cfg = timm.models.get_pretrained_cfg(f"deit_{size}_patch16_224.fb_in1k")
        assert tuple(cfg["mean"]) == tuple(teacher_cfg.mean) and tuple(cfg["std"]) == tuple(teacher_cfg.std)


def test_transfer_parameters_selection():
    plain = timm.create_model("linvit_small_patch16_224", **SHAPE)
    with pytest.raises(ValueError, match="selects no parameter"):
        transfer_parameters(plain, "new")
    assert all(".mixer." in n for n in transfer_parameters(plain, "mixer"))
    rope = timm.create_model("linvit_small_patch16_rope_224", mixer_kwargs=dict(feature_map="focused"), **SHAPE)
    new = transfer_parameters(rope, "new")
    assert new and all(".lepe." in n or "focus_scale" in n for n in new)


def test_attention_transfer_lowers_layer_errors_on_real_images():
    """Stage 1 on scikit-learn's digits: every layer's attention-output error of the student falls, and only the
    selected parameters move."""
    size = 32
    transform = build_transform(size, False, (0.5,) * 3, (0.5,) * 3, crop_pct=1.0)
    data = create_dataset("digits", None, "train", transform=transform, digits_size=size)
    images = torch.stack([data[i][0] for i in range(96)])
    batches, held_out = list(images[:64].split(16)), [images[64:]]
    torch.manual_seed(0)
    teacher = timm.create_model("vit_small_patch16_224", img_size=size, patch_size=4, num_classes=10, **SHAPE).eval()
    student = build_student("linvit_small_patch16_rope_224", teacher, size, patch_size=4,
                            mixer_kwargs=dict(feature_map="focused"), **SHAPE)
    before_state = {k: v.clone() for k, v in student.state_dict().items()}
    before = attention_errors(student, teacher, held_out)
    losses = attention_transfer(student, teacher, batches, steps=12, lr=1e-2, which="new")
    after = attention_errors(student, teacher, held_out)
    assert len(losses) == 12 and len(before) == len(after) == SHAPE["depth"]
    assert all(a < b for a, b in zip(after, before)), (before, after)
    trained = transfer_parameters(student, "new")
    for name, value in student.state_dict().items():
        if name not in trained:
            torch.testing.assert_close(value, before_state[name], rtol=0, atol=0, msg=name)


def test_linearize_tool_end_to_end(tmp_path):
    """linvision/tools/train.py trains a small softmax ViT on digits; linvision/tools/linearize.py converts it and runs stage 1: the
    written weights load into the student, carry the teacher's qkv unchanged and a trained LePE."""
    from safetensors.torch import load_file
    from support import run_tool

    from linvision.utils.checkpoint import load_model

    shape = ["patch_size=4", "embed_dim=32", "depth=2", "num_heads=2"]
    run_tool("train.py", "--dataset", "digits", "--img-size", "16", "--model", "vit_tiny_patch16_224",
             "--model-kwargs", *shape, "--epochs", "1", "--batch-size", "64", "--output", str(tmp_path),
             "--experiment", "teacher", "--no-progress")
    out = tmp_path / "student.safetensors"
    proc = run_tool("linearize.py", "--teacher", str(tmp_path / "teacher"), "--model", "linvit_tiny_patch16_rope_224",
                    "--model-kwargs", *shape, "--steps", "3", "--batch-size", "16", "--eval-batches", "1",
                    "--output", str(out))
    report = json.loads(proc.stdout)
    assert report["img_size"] == 16 and len(report["layer_error_before"]) == len(report["layer_error_after"]) == 2
    state = load_file(str(out))
    student = timm.create_model("linvit_tiny_patch16_rope_224", num_classes=10, img_size=16, patch_size=4,
                                embed_dim=32, depth=2, num_heads=2)
    student.load_state_dict(state)
    teacher, _ = load_model(str(tmp_path / "teacher"))
    torch.testing.assert_close(state["blocks.1.mixer.qkv.weight"], teacher.state_dict()["blocks.1.attn.qkv.weight"])
    assert state["blocks.1.mixer.lepe.weight"].abs().sum() > 0  # started at zero, moved by stage 1
