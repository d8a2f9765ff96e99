"""timm interface contracts of the linvit and linhier families."""
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed
from timm.optim import param_groups_layer_decay

import linvision
from linvision.engine.flops import count_gflops, count_params

FAMILY_NAMES = {
    "linvit": [
        "linvit_tiny_patch16_224", "linvit_small_patch16_224", "linvit_base_patch16_224",
        "linvit_tiny_patch16_rope_224", "linvit_small_patch16_rope_224", "linvit_base_patch16_rope_224",
        "linvit_small_patch16_rope_mixed_224",
    ],
    "linhier": [
        "linhier_tiny_224", "linhier_small_224", "linhier_base_224", "linhier_gcnn_femto_224", "linhier_gcnn_tiny_224",
    ],
}
ALL_NAMES = [n for names in FAMILY_NAMES.values() for n in names]

# Reduced configurations (same code paths, CPU-sized) for the checks that need backward or many passes.
SMALL_VIT = dict(embed_dim=32, depth=3, num_heads=2)
SMALL_HIER = dict(depths=(1, 1, 2, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))
REDUCED = [
    ("linvit_small_patch16_224", dict(SMALL_VIT, img_size=64)),
    ("linvit_small_patch16_rope_224", SMALL_VIT),
    ("linvit_small_patch16_rope_mixed_224", SMALL_VIT),
    ("linvit_small_patch16_rope_224", dict(SMALL_VIT, token_mixer="hybrid", mixer_kwargs=dict(window=2))),
    ("linvit_small_patch16_rope_224", dict(SMALL_VIT, token_mixer="causal")),
    ("linhier_tiny_224", SMALL_HIER),
    ("linhier_tiny_224", dict(SMALL_HIER, token_mixers="none,none,linear,softmax")),
    ("linhier_tiny_224", dict(SMALL_HIER, token_mixers="hybrid,causal,linear_rope,linear")),
    ("linhier_gcnn_femto_224", SMALL_HIER),
]
REDUCED_IDS = [f"{n}-{i}" for i, (n, _) in enumerate(REDUCED)]


def _create(name, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, **kwargs)


def test_import_registers_every_model():
    assert sorted(timm.list_models("lin*")) == sorted(ALL_NAMES)
    assert all(name in timm.list_models(module="linvit") + timm.list_models(module="linhier") for name in ALL_NAMES)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_registered_model_forward_and_cfg(name):
    """Full-size model: eval forward at a small resolution, and a pretrained_cfg that names real parameters."""
    model = _create(name, num_classes=7, img_size=64) if name.startswith("linvit") else _create(name, num_classes=7)
    model.eval()
    with torch.no_grad():
        y = model(torch.randn(1, 3, 64, 64))
    assert y.shape == (1, 7) and torch.isfinite(y).all()
    cfg = model.pretrained_cfg
    for key in ("input_size", "test_input_size", "crop_pct", "mean", "std", "interpolation", "first_conv",
                "classifier", "license", "num_classes"):
        assert key in cfg, key
    params = dict(model.named_parameters())
    assert cfg["first_conv"] + ".weight" in params
    assert cfg["classifier"] + ".weight" in params
    assert model.get_classifier() is model.get_submodule(cfg["classifier"])
    if name.startswith("linhier"):
        assert cfg["pool_size"] == (7, 7)


@pytest.mark.parametrize("name, kwargs", REDUCED, ids=REDUCED_IDS)
def test_forward_backward_all_parameters_get_gradients(name, kwargs):
    model = _create(name, num_classes=5, **kwargs)
    model.train()
    x = torch.randn(2, 3, 64, 64)
    y = model(x)
    assert y.shape == (2, 5)
    y.logsumexp(-1).mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name, kwargs", REDUCED, ids=REDUCED_IDS)
def test_intermediates_checkpointing_and_head(name, kwargs):
    model = _create(name, num_classes=5, **kwargs).eval()
    x = torch.randn(2, 3, 64, 96) if "img_size" not in kwargs else torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats, rtol=0, atol=0)
        assert len(inter) == len(model.feature_info)
        for f, info in zip(inter, model.feature_info):
            assert f.shape == (2, info["num_chs"], x.shape[2] // info["reduction"], x.shape[3] // info["reduction"])
        only = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True, stop_early=True)
        torch.testing.assert_close(only, inter[:2], rtol=0, atol=0)
        logits = model(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, model.head_hidden_size)
        torch.testing.assert_close(model.get_classifier()(pre), logits)
        model.set_grad_checkpointing(True)
        torch.testing.assert_close(model(x), logits, rtol=0, atol=0)
    model.train()
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()  # checkpointed backward works
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.parametrize("name, kwargs", [REDUCED[1], REDUCED[6]], ids=["linvit", "linhier"])
def test_features_only(name, kwargs):
    n_out = 3 if name.startswith("linvit") else 4
    model = _create(name, features_only=True, out_indices=tuple(range(n_out)), **kwargs).eval()
    x = torch.randn(1, 3, 64, 96)
    outs = model(x)
    assert len(outs) == n_out
    for out, ch, red in zip(outs, model.feature_info.channels(), model.feature_info.reduction()):
        assert out.shape == (1, ch, 64 // red, 96 // red)
    full = _create(name, **kwargs).eval()
    ref = full.forward_intermediates(x, indices=list(range(n_out)), intermediates_only=True)
    for out, r in zip(outs, ref):
        torch.testing.assert_close(out, r)


def test_reset_classifier_prune_and_global_pool():
    model = _create("linhier_tiny_224", num_classes=5, global_pool="max", **SMALL_HIER).eval()
    x = torch.randn(1, 3, 64, 64)
    feats = model.forward_features(x)
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), model.head.norm(feats.amax(dim=(1, 2))))
    model.reset_classifier(3)
    assert model(x).shape == (1, 3) and model.num_classes == 3
    model.reset_classifier(0)
    assert model(x).shape == (1, model.num_features)
    kept = model.prune_intermediate_layers(indices=[1])
    assert kept == [1] and len(model.stages) == 2 and model.num_features == SMALL_HIER["dims"][1]

    vit = _create("linvit_small_patch16_rope_224", num_classes=5, **SMALL_VIT).eval()
    vit.reset_classifier(0, global_pool="")
    assert vit(torch.randn(1, 3, 64, 32)).shape == (1, 8, SMALL_VIT["embed_dim"])
    assert vit.prune_intermediate_layers(indices=1) == [2] and len(vit.blocks) == 3
    with pytest.raises(ValueError, match="global_pool"):
        vit.reset_classifier(0, global_pool="token")


@pytest.mark.parametrize("name, kwargs", [REDUCED[1], REDUCED[5]], ids=["linvit", "linhier"])
def test_group_matcher_and_no_weight_decay_cover_real_parameters(name, kwargs):
    model = _create(name, **kwargs)
    groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.75)
    grouped = sum(len(g["params"]) for g in groups)
    assert grouped == len(list(model.parameters()))
    assert len({g["lr_scale"] for g in groups}) > 2  # several layer-decay levels
    names = dict(model.named_parameters())
    assert model.no_weight_decay() <= set(names)


def test_mixed_rope_frequencies_are_not_decayed():
    model = _create("linvit_small_patch16_rope_mixed_224", **SMALL_VIT)
    nwd = model.no_weight_decay()
    assert nwd and all("rope_freqs" in n for n in nwd)
    assert "pos_embed" in _create("linvit_small_patch16_224", **SMALL_VIT).no_weight_decay()


@pytest.mark.parametrize("name, kwargs", [REDUCED[1], REDUCED[2], REDUCED[5]], ids=["axial", "mixed", "linhier"])
def test_rope_models_any_resolution_and_aspect(name, kwargs):
    model = _create(name, num_classes=4, **kwargs).eval()
    with torch.no_grad():
        for size in [(64, 64), (128, 128), (64, 160), (96, 32)]:
            y = model(torch.randn(1, 3, *size))
            assert y.shape == (1, 4) and torch.isfinite(y).all()


def test_abs_pos_model_dynamic_img_size():
    fixed = _create("linvit_small_patch16_224", img_size=64, **SMALL_VIT).eval()
    dynamic = _create("linvit_small_patch16_224", img_size=64, dynamic_img_size=True, **SMALL_VIT).eval()
    dynamic.load_state_dict(fixed.state_dict())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(dynamic(x), fixed(x), rtol=0, atol=0)
        assert dynamic(torch.randn(1, 3, 96, 128)).shape == (1, 1000)
        with pytest.raises(AssertionError):
            fixed(torch.randn(1, 3, 96, 128))


def test_linear_and_softmax_twins_differ_only_in_the_mixer():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 96)
    for name, kwargs in [REDUCED[0], REDUCED[1], REDUCED[5]]:
        mixer_arg = "token_mixers" if name.startswith("linhier") else "token_mixer"
        linear = _create(name, **kwargs).eval()
        softmax = _create(name, **{**kwargs, mixer_arg: "softmax"}).eval()
        lin_sd, soft_sd = linear.state_dict(), softmax.state_dict()
        differing = set(lin_sd) ^ set(soft_sd)
        assert all(".mixer." in k for k in differing), differing
        shared = set(lin_sd) & set(soft_sd)
        assert all(lin_sd[k].shape == soft_sd[k].shape for k in shared)
        # The RoPE mixers ("linear_rope", the linhier default) own a LePE conv that softmax has not; nothing else
        # differs, and softmax gets the same RoPE.
        assert all(".mixer.lepe." in k for k in differing), differing
        assert count_params(linear) - count_params(softmax) == sum(lin_sd[k].numel() for k in differing)
        if name == "linvit_small_patch16_224":
            assert not differing
        if "rope" in name:
            assert softmax.blocks[0].mixer.rope_type == "axial"
        xi = x[..., :64] if "img_size" in kwargs else x
        with torch.no_grad():
            assert linear(xi).shape == softmax(xi).shape


def test_round_trip_safetensors_other_classes_and_one_channel(tmp_path):
    """Save a model's weights as safetensors; load them through pretrained_cfg_overlay into a model with another
    num_classes and in_chans=1 (timm sums the first conv over the input channels) and a larger img_size (the
    filter resamples the absolute position embedding)."""
    for name, kwargs in [REDUCED[0], REDUCED[2], REDUCED[6]]:
        src = _create(name, **kwargs)
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
        dst_kwargs = dict(kwargs, img_size=96) if "img_size" in kwargs else kwargs
        dst = timm.create_model(
            name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), num_classes=3, in_chans=1,
            **dst_kwargs,
        )
        src_sd, dst_sd = src.state_dict(), dst.state_dict()
        first_conv = src.pretrained_cfg["first_conv"] + ".weight"
        classifier = src.pretrained_cfg["classifier"]
        torch.testing.assert_close(dst_sd[first_conv], src_sd[first_conv].sum(dim=1, keepdim=True))
        assert dst_sd[classifier + ".weight"].shape[0] == 3
        for key, value in src_sd.items():
            if key == first_conv or key.startswith(classifier + "."):
                continue
            if key == "pos_embed":
                value = resample_abs_pos_embed(value, new_size=(6, 6), num_prefix_tokens=0)
            torch.testing.assert_close(dst_sd[key], value, msg=key)
        assert dst(torch.randn(1, 1, 96, 96)).shape == (1, 3)


def test_checkpoint_filter_unwraps_and_resamples_patch_kernel():
    from linvision.models.linvit import checkpoint_filter_fn

    model = _create("linvit_small_patch16_224", img_size=64, **SMALL_VIT)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["patch_embed.proj.weight"] = torch.randn(SMALL_VIT["embed_dim"], 3, 8, 8)
    sd["pos_embed"] = torch.randn(1, 64, SMALL_VIT["embed_dim"])
    out = checkpoint_filter_fn({"model": sd}, model)
    assert out["patch_embed.proj.weight"].shape == model.patch_embed.proj.weight.shape
    assert out["pos_embed"].shape == model.pos_embed.shape
    model.load_state_dict(out)


def test_channels_last_and_drop_args():
    x = torch.randn(2, 3, 64, 64)
    for name, kwargs in [REDUCED[1], REDUCED[5]]:
        model = _create(name, drop_rate=0.2, drop_path_rate=0.3, **kwargs).eval()
        with torch.no_grad():
            ref = model(x)
            model = model.to(memory_format=torch.channels_last)
            torch.testing.assert_close(model(x.to(memory_format=torch.channels_last)), ref, rtol=1e-5, atol=1e-5)
        model.train()
        torch.manual_seed(1)
        a = model(x)
        torch.manual_seed(2)
        assert not torch.allclose(a, model(x))  # stochastic depth / dropout are active in training


def test_flop_counts_follow_token_count():
    """Linear-attention models grow linearly in FLOPs with the token count, the softmax twin faster."""
    linear = _create("linvit_small_patch16_rope_224", **SMALL_VIT)
    softmax = _create("linvit_small_patch16_rope_224", token_mixer="softmax", **SMALL_VIT)
    ratio_linear = count_gflops(linear, 256) / count_gflops(linear, 128)
    ratio_softmax = count_gflops(softmax, 256) / count_gflops(softmax, 128)
    assert 3.9 < ratio_linear < 4.1
    assert ratio_softmax > 4.5
    with pytest.raises(ValueError, match="input_size"):
        count_gflops(linear, (1, 3, 64, 64))


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", [REDUCED[1], REDUCED[6]], ids=["linvit", "linhier"])
def test_torch_compile_matches_eager(name, kwargs):
    model = _create(name, **kwargs).eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        ref = model(x)
        compiled = torch.compile(model)
        torch.testing.assert_close(compiled(x), ref, rtol=1e-4, atol=1e-4)
