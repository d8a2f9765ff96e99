"""timm interface contracts of the linvit and linhier families."""
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import create_feature_extractor, get_graph_node_names, resample_abs_pos_embed
from timm.models import get_model_input_config
from timm.optim import param_groups_layer_decay

import linvision
from linvision.benchmark.flops import count_gflops, count_params
from support import ALL_NAMES, FAMILY_NAMES, SMALL_HIER, SMALL_VIT, is_isotropic, reduced_kwargs


# Reduced configurations (same code paths, CPU-sized) for the checks that need backward or many passes.
VIT_ABS = ("linvit_small_patch16_224", dict(SMALL_VIT, img_size=64))
VIT_ROPE = ("linvit_small_patch16_rope_224", SMALL_VIT)
VIT_MIXED = ("linvit_small_patch16_rope_mixed_224", SMALL_VIT)
HIER = ("linhier_tiny_224", SMALL_HIER)
MEAN_POOL = dict(class_token=False, global_pool="avg")  # the linvit head of the mixers that cannot take a class token
HIER_MIXERS = ("linhier_tiny_224", dict(SMALL_HIER, token_mixers="none,none,linear,softmax"))


def _fixed_size(name, kwargs):
    """The models whose patch embedding checks the size: an absolute position embedding (linvit's plain variants;
    InLine-DeiT built with dynamic_img_size=False, its default being True) without dynamic_img_size; ViG
    resamples its embedding to every input."""
    if name.startswith("inline_deit"):
        return kwargs.get("dynamic_img_size", True) is False
    return name.startswith("linvit") and "rope" not in name and not kwargs.get("dynamic_img_size", False)


# Every registered model reduced (its family's code paths at CPU size), and at full size with --runslow. Every
# full-size model is built and run at 224 px and at two other sizes (shapes, on the meta device) by the model
# table's fresh count (tests/test_docs.py), and one of each family for real at other sizes there.
REGISTERED = [pytest.param(n, reduced_kwargs(n), id=n) for n in ALL_NAMES] + [
    pytest.param(n, {}, id=f"{n}-full", marks=pytest.mark.slow) for n in ALL_NAMES]
# timm's model contract holds for every registered model and for the other mixers and size options of each family.
CONTRACT = REGISTERED + [
    pytest.param(*VIT_ABS, id="linvit-abs-img64"),
    pytest.param("linvit_small_patch16_224", dict(SMALL_VIT, dynamic_img_size=True), id="linvit-abs-dynamic"),
    pytest.param("linvit_small_patch16_rope_224", dict(SMALL_VIT, token_mixer="hybrid", mixer_kwargs=dict(window=2),
                                                       **MEAN_POOL), id="linvit-hybrid"),
    pytest.param("linvit_small_patch16_rope_224", dict(SMALL_VIT, token_mixer="causal", **MEAN_POOL),
                 id="linvit-causal"),
    pytest.param("linvit_small_patch16_rope_224", dict(SMALL_VIT, token_mixer="softmax"), id="linvit-softmax"),
    pytest.param("linvit_small_patch16_224", dict(SMALL_VIT, img_size=64, **MEAN_POOL), id="linvit-abs-mean-pool"),
    pytest.param("linvit_small_patch16_224", dict(SMALL_VIT, class_token=True, reg_tokens=2, global_pool="token",
                                                  dynamic_img_size=True), id="linvit-abs-dynamic-class-registers"),
    pytest.param("linvit_small_patch16_rope_224", dict(SMALL_VIT, class_token=True, reg_tokens=1, fc_norm=True),
                 id="linvit-rope-class-register-fc-norm"),
    pytest.param(*HIER_MIXERS, id="linhier-none-linear-softmax"),
    pytest.param("linhier_tiny_224", dict(SMALL_HIER, token_mixers="hybrid,causal,linear_rope,linear"),
                 id="linhier-hybrid-causal"),
    pytest.param("linhier_tiny_224", dict(SMALL_HIER, token_mixers="bidir_decay,bidir_gated,bidir_delta,linear"),
                 id="linhier-recurrent"),
]

# Flexible-size models are checked at (about) this size, a multiple of their largest stride; fixed-size models at
# the size they were built for, as timm's own tests do.
FLEXIBLE_TEST_SIZE = 96


def _create(name, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, **kwargs)


def _input_size(model):
    """(C, H, W) the model's timm input config implies: its fixed size, or a small square multiple of its stride."""
    cfg = get_model_input_config(model)
    if cfg["fixed_input_size"]:
        return tuple(cfg["input_size"])
    stride = max(info["reduction"] for info in model.feature_info)
    side = max(stride, min(cfg["input_size"][1], FLEXIBLE_TEST_SIZE) // stride * stride)
    return (cfg["input_size"][0], side, side)


def _assert_gradients_reach(model, named_parameters):
    """Every parameter has a finite gradient, non-zero unless it cannot reach the logits: with the class token
    pooled, the last block's LePE and InLine-DeiT's local residual (they add to the patch tokens only), whose
    gradients are exactly zero."""
    unreached = ()
    if getattr(model, "global_pool", None) == "token":
        last = f"blocks.{len(model.blocks) - 1}.mixer."
        unreached = (last + "lepe.", last + "local.")
    for pname, p in named_parameters:
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert (p.grad.abs().sum() == 0) if pname.startswith(unreached) else (p.grad.abs().sum() > 0), pname


def _fx_model(model):
    """Symbolic trace with timm's leaf modules and functions, returning the model's output node (train or eval
    graph, following the model's mode)."""
    train_nodes, eval_nodes = get_graph_node_names(model)
    last = train_nodes[-1] if model.training else eval_nodes[-1]
    return create_feature_extractor(model, [last]), last


def test_import_registers_every_model():
    assert sorted(timm.list_models([f"{family}*" for family in ("lin", "mlla", "ravlt", "mavit", "vig", "inline",
                                                                  "pola")])) == sorted(ALL_NAMES)
    for family, names in FAMILY_NAMES.items():
        assert sorted(timm.list_models(module=family)) == sorted(names)


@pytest.mark.parametrize("name, kwargs", REGISTERED)
def test_registered_model_forward(name, kwargs):
    """Eval, at a small resolution: the images of a batch are independent (an image gives the same logits alone
    as beside another: no mixer, norm or reshape mixes the batch), forward is forward_head(forward_features), and
    different images give different logits (the input reaches the head)."""
    model = _create(name, num_classes=7, **(dict(kwargs, img_size=64) if is_isotropic(name) else kwargs)).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = model.forward_head(model.forward_features(x))
        alone = model(x[1:])
    assert y.shape == (2, 7)
    torch.testing.assert_close(alone, y[1:], rtol=1e-4, atol=1e-5)
    # relative to the logits' scale: a reduced MLLA's random start separates two images by 5e-5 in logits of 0.3;
    # a head the input does not reach gives two equal rows
    assert (y[0] - y[1]).abs().max() > 1e-4 * y.abs().max()


@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_default_cfg(name, kwargs):
    """The pretrained_cfg names real parameters, states the input constraints the model has, and agrees with the
    shapes forward_features and the pooled / unpooled heads give (timm's default-cfg contract)."""
    model = _create(name, **kwargs).eval()
    cfg = model.pretrained_cfg
    for key in ("url", "input_size", "test_input_size", "pool_size", "crop_pct", "mean", "std", "interpolation",
                "fixed_input_size", "first_conv", "classifier", "license", "num_classes"):
        assert key in cfg, key
    state = model.state_dict()
    assert cfg["first_conv"] + ".weight" in state
    assert cfg["classifier"] + ".weight" in state
    assert model.get_classifier() is model.get_submodule(cfg["classifier"])
    assert model.num_classes == cfg["num_classes"]
    # fixed exactly when the patch embedding checks the size: the absolute-position linvit without dynamic_img_size
    fixed = _fixed_size(name, kwargs)
    assert cfg["fixed_input_size"] is fixed and get_model_input_config(model)["fixed_input_size"] is fixed
    stride = model.feature_info[-1]["reduction"]
    if cfg["pool_size"] is not None:
        assert tuple(cfg["pool_size"]) == tuple(s // stride for s in cfg["input_size"][1:])

    c, h, w = _input_size(model)
    x = torch.randn(2, c, h, w)
    with torch.no_grad():
        feats = model.forward_features(x)
        grid = (h // stride, w // stride)
        if is_isotropic(name):  # tokens (B, prefix + N, C), like timm's ViTs
            assert feats.shape == (2, model.num_prefix_tokens + grid[0] * grid[1], model.num_features)
        else:  # channels-last map, as output_fmt says
            assert model.output_fmt == "NHWC" and feats.shape == (2, *grid, model.num_features)
        logits = model(x)
        assert logits.shape == (2, cfg["num_classes"])
        model.reset_classifier(0)
        assert model.num_classes == 0
        pooled = model(x)
        assert pooled.shape == (2, model.num_features)
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), pooled)
        model.reset_classifier(0, "")
        unpooled = model(x)
        if is_isotropic(name):  # the tokens, through the norm after pooling where fc_norm put it (as timm)
            torch.testing.assert_close(unpooled, model.fc_norm(feats), rtol=0, atol=0)
        else:
            assert unpooled.shape == feats.shape


@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_forward_backward_all_parameters_get_gradients(name, kwargs):
    model = _create(name, num_classes=5, **kwargs)
    model.train()
    x = torch.randn(2, *_input_size(model))
    y = model(x)
    assert y.shape == (2, 5) and torch.isfinite(y).all()
    y.logsumexp(-1).mean().backward()
    _assert_gradients_reach(model, model.named_parameters())


@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_fx_trace_forward(name, kwargs):
    """timm's FX feature extraction traces the model: the graph computes the model's output exactly, exposes the
    layers inside the blocks, and calls each token mixer as one leaf module."""
    model = _create(name, num_classes=5, **kwargs).eval()
    x = torch.randn(2, *_input_size(model))
    graph_model, last = _fx_model(model)
    with torch.no_grad():
        torch.testing.assert_close(graph_model(x)[last], model(x), rtol=0, atol=0)
    _, nodes = get_graph_node_names(model)
    block = "blocks.0" if is_isotropic(name) else "stages.0.blocks.0"
    assert f"{block}.mlp.fc1" in nodes and f"{block}.mixer" in nodes
    assert not any(n.startswith(f"{block}.mixer.") for n in nodes)
    if _fixed_size(name, kwargs):
        with pytest.raises(AssertionError):  # the size check stays in the traced graph
            graph_model(torch.randn(1, 3, x.shape[2] + 16, x.shape[3]))


@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_fx_trace_backward(name, kwargs):
    """The train-mode graph keeps every parameter, gives the model's output and a finite gradient to each."""
    model = _create(name, num_classes=5, **kwargs).train()
    x = torch.randn(2, *_input_size(model))
    graph_model, last = _fx_model(model)
    assert sum(p.numel() for p in graph_model.parameters()) == sum(p.numel() for p in model.parameters())
    y = graph_model(x)[last]
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    y.logsumexp(-1).mean().backward()
    _assert_gradients_reach(model, graph_model.named_parameters())


@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_forward_intermediates_match_forward_features(name, kwargs):
    model = _create(name, **kwargs).eval()
    x = torch.randn(2, *_input_size(model))
    fmt = getattr(model, "output_fmt", "NCHW")
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, output_fmt=fmt)
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
    assert len(inter) == len(model.feature_info) >= 3
    for f, info in zip(inter, model.feature_info):
        grid = (x.shape[2] // info["reduction"], x.shape[3] // info["reduction"])
        expected = (2, *grid, info["num_chs"]) if fmt == "NHWC" else (2, info["num_chs"], *grid)
        assert f.shape == expected and torch.isfinite(f).all()


@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_features_only(name, kwargs):
    """features_only gives at least three levels (timm's default out_indices) equal to forward_intermediates; the FX
    feature extractor (feature_cls="fx") returns the same maps in the blocks' layout: a channels-last grid, or
    (linvit, as timm's ViT) tokens with the prefix tokens first."""
    full = _create(name, **kwargs).eval()
    x = torch.randn(1, *_input_size(full))
    model = _create(name, features_only=True, **kwargs).eval()
    fx_model = _create(name, features_only=True, feature_cls="fx", **kwargs).eval()
    with torch.no_grad():
        outs, fx_outs = model(x), fx_model(x)
        ref = full.forward_intermediates(x, indices=model.feature_info.out_indices, intermediates_only=True)
    assert len(outs) == len(fx_outs) == len(ref) >= 3
    for out, fx_out, r, ch, red in zip(outs, fx_outs, ref, model.feature_info.channels(),
                                       model.feature_info.reduction()):
        assert out.shape == (1, ch, x.shape[2] // red, x.shape[3] // red)
        torch.testing.assert_close(out, r, rtol=0, atol=0)
        if fx_out.dim() == 3:
            grid = fx_out[:, getattr(full, "num_prefix_tokens", 0):].unflatten(1, r.shape[2:])
        else:
            grid = fx_out
        torch.testing.assert_close(grid.permute(0, 3, 1, 2), r, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", CONTRACT)
def test_torch_compile_matches_eager(name, kwargs):
    """In float64, so that a difference is the compiled graph's and not float32 rounding: with batch 2 and a few
    channels, train-mode BatchNorm is ill-conditioned enough that fp32 eager and fp32 compiled (another variance
    formula) differ by percents in the stem's gradients, while both agree with float64 to 1e-14."""
    model = _create(name, num_classes=5, **kwargs).train().double()
    x = torch.randn(2, *_input_size(model), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = model(x)
    ref.logsumexp(-1).mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    y = torch.compile(model)(x)
    # RoPE tables are fp32 by design (the kernels' angles); the compiled graph computes them itself, its angle
    # rounding (a fused multiply-add) differs from eager's by an fp32 ulp, which float64 outputs then show: as an
    # error relative to each tensor's scale as well as each element's (a class token's gradient reaches ~30 at
    # init while some of its elements are near 0)
    # ViG's position embedding is resampled in fp32 without antialiasing (the authors' way): inductor decomposes that
    # bicubic interpolation and rounds it otherwise than eager's kernel (3e-6 on values of 3), so it takes the same
    # tolerance as the fp32 RoPE tables; so do PVT's stage embeddings and PolaFormer's key encodings, which timm's
    # resample_abs_pos_embed interpolates in fp32 to an input grid that is not their own
    rope = any(getattr(m, "rope_type", None) for m in model.modules()) or not getattr(model, "pos_embed_antialias",
                                                                                       True)
    rope = rope or any(getattr(m, "pos_grid", None) or getattr(m, "key_pos_grid", None) for m in model.modules())

    def tol(t, rtol, atol):
        return dict(rtol=rtol, atol=max(atol, rtol * t.abs().max().item()) if rope else atol)

    fwd, grad = ((1e-7, 1e-9), (1e-6, 1e-8)) if rope else ((1e-9, 1e-10), (1e-8, 1e-10))
    torch.testing.assert_close(y, ref, **tol(ref, *fwd))
    y.logsumexp(-1).mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], **tol(ref_grads[n], *grad), msg=n)


@pytest.mark.parametrize("name, kwargs", [VIT_ROPE, HIER_MIXERS], ids=["linvit", "linhier"])
def test_intermediates_checkpointing_and_head(name, kwargs):
    model = _create(name, num_classes=5, **kwargs).eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        feats = model.forward_features(x)
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats, rtol=0, atol=0)
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


def test_forward_intermediates_norm_applies_the_final_norm():
    """norm=True passes the last stage's map through the final norm (the other stages untouched): the head's norm
    in linhier (which the classifier applies after the pooling), MLLA's final LayerNorm (so the last intermediate
    is forward_features); RAVLT, whose final layer is a conv head, and a head pruned of its norm refuse it."""
    x = torch.randn(2, 3, 64, 64)
    hier = _create(HIER[0], **HIER[1]).eval()
    mlla = _create("mlla_tiny", depths=(1, 1, 1, 1)).eval()
    with torch.no_grad():
        for model, norm in ((hier, hier.head.norm), (mlla, mlla.final)):
            plain = model.forward_intermediates(x, output_fmt="NHWC", intermediates_only=True)
            final, normed = model.forward_intermediates(x, norm=True, output_fmt="NHWC")
            assert len(plain) == len(normed) == 4
            for a, b in zip(plain[:-1], normed[:-1]):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
            torch.testing.assert_close(normed[-1], norm(plain[-1]), rtol=0, atol=0)
            assert not torch.allclose(normed[-1], plain[-1], atol=1e-3)
            torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
            nchw = model.forward_intermediates(x, indices=[1, 3], norm=True, intermediates_only=True)
            torch.testing.assert_close(nchw[1], normed[-1].permute(0, 3, 1, 2), rtol=0, atol=0)
            torch.testing.assert_close(nchw[0], plain[1].permute(0, 3, 1, 2), rtol=0, atol=0)
        torch.testing.assert_close(mlla.forward_intermediates(x, norm=True, output_fmt="NHWC")[1][-1],
                                   mlla.forward_features(x), rtol=0, atol=0)
    ravlt = _create("ravlt_tiny", depths=(1, 1, 1, 1)).eval()
    with pytest.raises(ValueError, match=r"^norm: the final layer of Ravlt is a conv head"):
        ravlt.forward_intermediates(x, norm=True)
    hier.prune_intermediate_layers(indices=[1])
    with pytest.raises(ValueError, match=r"^norm: LinHier has no final norm"):
        hier.forward_intermediates(x, norm=True)


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
    x = torch.randn(1, 3, 64, 32)
    torch.testing.assert_close(vit.forward_head(vit.forward_features(x), pre_logits=True),
                               vit.forward_features(x)[:, 0], rtol=0, atol=0)  # the class token, by default
    vit.reset_classifier(0, global_pool="")
    assert vit(x).shape == (1, 1 + 8, SMALL_VIT["embed_dim"])
    assert vit.prune_intermediate_layers(indices=1) == [2] and len(vit.blocks) == 3
    with pytest.raises(ValueError, match="global_pool"):
        vit.reset_classifier(0, global_pool="mean")
    no_class = _create("linvit_small_patch16_rope_224", num_classes=5, **SMALL_VIT, **MEAN_POOL).eval()
    with torch.no_grad():  # timm's default for "avg": the mean of the tokens, then the norm (fc_norm)
        torch.testing.assert_close(no_class.forward_head(no_class.forward_features(x), pre_logits=True),
                                   no_class.fc_norm(no_class.forward_features(x).mean(1)), rtol=0, atol=0)
        before = _create("linvit_small_patch16_rope_224", num_classes=5, **SMALL_VIT, **MEAN_POOL, fc_norm=False)
        before.eval().load_state_dict({k.replace("fc_norm.", "norm."): v for k, v in no_class.state_dict().items()})
        tokens = before.forward_features(x)  # through the final norm: the mean of the normalised tokens
        torch.testing.assert_close(tokens, before.norm(no_class.forward_features(x)), rtol=0, atol=0)
        torch.testing.assert_close(before.forward_head(tokens, pre_logits=True), tokens.mean(1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="global_pool: 'token' pools the class token"):
        no_class.reset_classifier(0, global_pool="token")
    with pytest.raises(ValueError, match="token mixer 'hybrid' cannot take prefix tokens"):
        _create("linvit_small_patch16_rope_224", token_mixer="hybrid", **SMALL_VIT)


_DEFAULT = object()


@pytest.mark.parametrize("fc_norm", [_DEFAULT, None, True, False], ids=["unset", "None", "True", "False"])
@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_final_norm_placement_follows_timm_vit(global_pool, fc_norm):
    """norm (before the pooling) and fc_norm (after it): linvit has the same one as an Identity as timm's
    VisionTransformer given the same arguments, its default (fc_norm unset) included."""
    from torch import nn

    args = dict(img_size=32, embed_dim=32, depth=1, num_heads=2, num_classes=3, global_pool=global_pool)
    if fc_norm is not _DEFAULT:
        args["fc_norm"] = fc_norm
    ours = timm.create_model("linvit_small_patch16_224", **args)
    theirs = timm.create_model("vit_small_patch16_224", **args)
    placement = [(isinstance(m.norm, nn.Identity), isinstance(m.fc_norm, nn.Identity)) for m in (ours, theirs)]
    assert placement[0] == placement[1] and sum(placement[0]) == 1, placement


def test_registered_linvit_models_keep_the_norm_before_the_class_token_pooling():
    """Every registered linvit pools the class token with the final norm before it, as DeiT (whose weights the
    .deit_fb_in1k tags convert) has it."""
    from torch import nn

    for name in FAMILY_NAMES["linvit"]:
        model = timm.create_model(name, depth=1)
        assert model.global_pool == "token" and isinstance(model.fc_norm, nn.Identity), name
        assert not isinstance(model.norm, nn.Identity), name


@pytest.mark.parametrize("name, kwargs", [VIT_ROPE, HIER], ids=["linvit", "linhier"])
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
    assert "cls_token" in nwd and all("rope_freqs" in n for n in nwd - {"cls_token"})
    assert {"pos_embed", "cls_token"} <= _create("linvit_small_patch16_224", **SMALL_VIT).no_weight_decay()
    # the models collect what each mixer excludes: every hybrid gate logit, and nothing else of a hybrid linhier
    hybrid = _create(HIER[0], **{**HIER[1], "token_mixers": "hybrid"})
    logits = {n for n, _ in hybrid.named_parameters() if n.endswith("mixer.mix_logit")}
    assert logits and hybrid.no_weight_decay() == logits


@pytest.mark.parametrize("name, kwargs", [VIT_ROPE, VIT_MIXED, HIER], ids=["axial", "mixed", "linhier"])
def test_rope_models_any_resolution_and_aspect(name, kwargs):
    """At every size and aspect ratio each mixer is given the input's grid, (rows, columns) at its stride, and
    the tokens of that grid (so RoPE rotates by the true row and column of every token), and the logits are
    those of a float64 run of the same weights: the fp32 rotation tables and the rest of the fp32 arithmetic
    stay accurate on grids other than the 224 px default."""
    import copy

    model = _create(name, num_classes=4, **kwargs).eval()
    reference = copy.deepcopy(model).double()
    mixers = [m for n, m in model.named_modules() if n.endswith(".mixer")]
    calls = []
    for mixer in mixers:
        mixer.register_forward_pre_hook(lambda module, args: calls.append((tuple(args[1].hw), args[0].shape[1])))
    prefix = getattr(model, "num_prefix_tokens", 0)
    if name.startswith("linvit"):
        strides = [16] * len(mixers)
    else:
        strides = [4 * 2 ** i for i, stage in enumerate(model.stages) for _ in stage.blocks]
    generator = torch.Generator().manual_seed(0)
    for size in [(64, 64), (128, 128), (64, 160), (96, 32)]:
        x = torch.randn(2, 3, *size, generator=generator)
        calls.clear()
        with torch.no_grad():
            y = model(x)
            expected = reference(x.double())
        grids = [(size[0] // s, size[1] // s) for s in strides]
        assert calls == [(g, prefix + g[0] * g[1]) for g in grids], size
        assert y.shape == (2, 4)
        torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-5)


def test_abs_pos_model_dynamic_img_size():
    fixed = _create("linvit_small_patch16_224", img_size=64, **SMALL_VIT).eval()
    dynamic = _create("linvit_small_patch16_224", img_size=64, dynamic_img_size=True, **SMALL_VIT).eval()
    dynamic.load_state_dict(fixed.state_dict())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(dynamic(x), fixed(x), rtol=0, atol=0)
        assert dynamic(torch.randn(1, 3, 96, 128)).shape == (1, 1000)
        with pytest.raises(ValueError, match=r"^x: this model takes 64x64 images"):
            fixed(torch.randn(1, 3, 96, 128))


def test_linear_and_softmax_twins_differ_only_in_the_mixer():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 96)
    for name, kwargs in [VIT_ABS, VIT_ROPE, HIER]:
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
    for name, kwargs in [VIT_ABS, VIT_MIXED, HIER_MIXERS]:
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
            if key == "pos_embed":  # the class token's row kept, the grid's resampled
                value = resample_abs_pos_embed(value, new_size=(6, 6), num_prefix_tokens=src.num_prefix_tokens)
            torch.testing.assert_close(dst_sd[key], value, msg=key)
        assert dst(torch.randn(1, 1, 96, 96)).shape == (1, 3)


def test_checkpoint_filter_unwraps_and_resamples_patch_kernel():
    from linvision.models.vit_weights import checkpoint_filter_fn

    for head, prefix in ((MEAN_POOL, 0), ({}, 1)):  # without and with the class token (its row is kept)
        model = _create("linvit_small_patch16_224", img_size=64, **SMALL_VIT, **head)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        sd["patch_embed.proj.weight"] = torch.randn(SMALL_VIT["embed_dim"], 3, 8, 8)
        sd["pos_embed"] = torch.randn(1, prefix + 64, SMALL_VIT["embed_dim"])
        out = checkpoint_filter_fn({"model": sd}, model)
        assert out["patch_embed.proj.weight"].shape == model.patch_embed.proj.weight.shape
        assert out["pos_embed"].shape == model.pos_embed.shape == (1, prefix + 16, SMALL_VIT["embed_dim"])
        torch.testing.assert_close(out["pos_embed"][:, :prefix], sd["pos_embed"][:, :prefix], rtol=0, atol=0)
        model.load_state_dict(out)


def test_channels_last_and_drop_args():
    x = torch.randn(2, 3, 64, 64)
    for name, kwargs in [VIT_ROPE, HIER]:
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


@pytest.mark.parametrize("name, kwargs, arg", [(*VIT_ROPE, "token_mixer"), (*HIER, "token_mixers")],
                         ids=["linvit", "linhier"])
def test_token_mixer_takes_a_class_as_well_as_a_name(name, kwargs, arg):
    """As timm's layer arguments do: a mixer class builds the same model as its registered name."""
    from linvision.layers import LinearRopeAttention, get_mixer_class

    assert get_mixer_class("linear_rope") is LinearRopeAttention
    by_name = _create(name, **{**kwargs, arg: "linear_rope"}).eval()
    by_class = _create(name, **{**kwargs, arg: LinearRopeAttention}).eval()
    assert by_name.state_dict().keys() == by_class.state_dict().keys()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(by_class(x), by_name(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown.*'linear_ropee'"):
        _create(name, **{**kwargs, arg: "linear_ropee"})


def test_entry_point_defaults_give_way_and_options_never_vanish():
    """Any entry-point default can be overridden through timm.create_model (token_mixers, sizes); a caller's mixer
    option reaches every stage whose mixer takes it, merged with the family's defaults (RAVLT keeps its RoPE and
    LePE with a new feature map); an option no stage's mixer takes fails in one line naming it and the mixer."""
    from linvision.layers import LinearRopeAttention

    model = timm.create_model("linhier_delta_femto_224", token_mixers="linear_rope", depths=(1, 1, 1, 1))
    assert model.token_mixers == ("linear_rope",) * 4 and [len(s.blocks) for s in model.stages] == [1, 1, 1, 1]
    assert isinstance(model.stages[0].blocks[0].mixer, LinearRopeAttention)
    vit = timm.create_model("linvit_small_patch16_rope_mixed_224", rope="axial", depth=2, embed_dim=64, num_heads=2)
    assert vit.blocks[0].mixer.rope_type == "axial" and len(vit.blocks) == 2

    ravlt = timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1), mixer_kwargs=dict(feature_map="relu"))
    rala = ravlt.stages[0].blocks[0].mixer
    assert rala.feature_map == "relu" and rala.rope_type == "axial" and rala.lepe is not None
    default = timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1)).stages[0].blocks[0].mixer
    assert default.feature_map != "relu" and default.rope_type == "axial"
    # the blocks' options are named arguments like any other (RAVLT's CPE before the mixer only, its MLP with a
    # depthwise conv), overridable the same way; the family's mixer defaults are its layout's, written in the spec
    from linvision.layers import DwConvMlp

    block = ravlt.stages[0].blocks[0]
    assert block.cpe == "first" and isinstance(block.mlp, DwConvMlp) and ravlt.spec[0].blocks[0].options["lepe"] is True
    assert timm.create_model("ravlt_tiny", depths=(1, 1, 1, 1), cpe=False).stages[0].blocks[0].cpe is False
    for name in ("ravlt_tiny", "mavit_tiny"):  # the conv head's width, a default like any other
        model = timm.create_model(name, depths=(1, 1, 1, 1), head_chs=96)
        assert model.num_features == 96 and model.final.conv.out_channels == 96
        with pytest.raises(ValueError, match="norm: the final layer of .* is a conv head"):
            model.forward_intermediates(torch.randn(1, 3, 64, 64), norm=True)
    with pytest.raises(ValueError, match="head_chs: the channels of a final conv head need final_layer"):
        timm.create_model("linhier_tiny_224", depths=(1, 1, 1, 1), head_chs=96)
    for old in ("block_kwargs", "mixer_defaults"):
        with pytest.raises(TypeError, match=old):
            timm.create_model("linhier_gcnn_femto_224", **{old: {}})

    with pytest.raises(ValueError, match=r"^mixer_kwargs: 'feture_map' is not an option of the bidir_delta mixer"):
        timm.create_model("linhier_delta_femto_224", mixer_kwargs=dict(feture_map="relu"))
    with pytest.raises(ValueError, match=r"'lepee' is not an option of the linear_rope mixer"):
        timm.create_model("linvit_tiny_patch16_rope_224", mixer_kwargs=dict(lepee=True))
    # an option of one stage's mixer is accepted and reaches that stage only (the Gated CNN has no feature map)
    mixed = timm.create_model("linhier_tiny_224", token_mixers="none,none,linear,linear", depths=(1, 1, 1, 1),
                              mixer_kwargs=dict(feature_map="relu"))
    assert mixed.stages[2].blocks[0].mixer.feature_map == "relu"


def test_rope_entry_points_fall_back_to_an_absolute_embedding_for_a_mixer_without_rope():
    """A *_rope_* entry point's RoPE is a default: with a mixer that has no rope option it builds the plain
    variant's learned absolute embedding instead (the same weights and logits), resampled to every input's grid
    as the RoPE variants take any grid; the embedding reaches the output. A rope the caller gives must fit."""
    from linvision.models.linvit import LinViT

    kwargs = dict(SMALL_VIT, token_mixer="bidir_delta", **MEAN_POOL, num_classes=3)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"^linvit_tiny_patch16_rope_224: the bidir_delta mixer takes no RoPE, so "
                                         r"the model has a learned absolute position embedding instead") as record:
        rope = timm.create_model("linvit_tiny_patch16_rope_224", **kwargs).eval()
    assert len(record) == 1 and "\n" not in str(record[0].message)
    plain = timm.create_model("linvit_tiny_patch16_224", **kwargs, dynamic_img_size=True).eval()
    assert rope.rope is None and rope.dynamic_img_size and rope.pos_embed is not None
    assert not any(getattr(m, "rope_type", None) for m in rope.modules())
    assert rope.pretrained_cfg["fixed_input_size"] is False
    plain.load_state_dict(rope.state_dict())  # strict: the same parameters as the plain variant
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(rope(x), plain(x), rtol=0, atol=0)
        other = rope(torch.randn(1, 3, 96, 160))  # another grid: the embedding is resampled to it
        assert other.shape == (1, 3)
        shifted = rope.pos_embed.detach().clone()
        rope.pos_embed.add_(torch.randn_like(rope.pos_embed))
        assert not torch.allclose(rope(x), plain(x))  # the position embedding reaches the logits
        rope.pos_embed.copy_(shifted)
    with pytest.warns(UserWarning, match="takes no RoPE"):
        fixed = timm.create_model("linvit_tiny_patch16_rope_224", **kwargs, dynamic_img_size=False)
    assert fixed.pos_embed is not None and not fixed.dynamic_img_size
    assert fixed.pretrained_cfg["fixed_input_size"] is True
    # a mixer with a rope option keeps the entry point's RoPE and has no absolute embedding
    linear = timm.create_model("linvit_tiny_patch16_rope_224", **dict(kwargs, token_mixer="linear"))
    assert linear.pos_embed is None and linear.blocks[0].mixer.rope_type == "axial"
    # the caller's rope must fit the mixer: one line naming the option and the mixer
    for make in (lambda: timm.create_model("linvit_tiny_patch16_rope_224", **kwargs, rope="axial"),
                 lambda: timm.create_model("linvit_tiny_patch16_224", **kwargs, rope="mixed"),
                 lambda: LinViT(rope="axial", **kwargs)):
        with pytest.raises(ValueError, match=r"^rope: '(axial|mixed)' is not an option of the bidir_delta mixer") as e:
            make()
        assert "\n" not in str(e.value)


def test_rope_entry_points_rope_none():
    """rope="none" (or None when called directly: timm.create_model drops a None) to a *_rope_* entry point:
    with a mixer without RoPE it asks for the absolute embedding the entry
    point would fall back to (the same model, resampled to any grid, no warning); with a mixer that takes RoPE it
    contradicts the entry point and fails in one line naming the plain variant to use instead."""
    import warnings
    from linvision.models.linvit import linvit_tiny_patch16_rope_224

    kwargs = dict(SMALL_VIT, token_mixer="bidir_delta", **MEAN_POOL, num_classes=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(0)
        quiet = timm.create_model("linvit_tiny_patch16_rope_224", **kwargs, rope="none").eval()
        direct = linvit_tiny_patch16_rope_224(**kwargs, rope=None)
    assert direct.rope is None and direct.dynamic_img_size and direct.pos_embed is not None
    with pytest.warns(UserWarning, match="takes no RoPE"):
        torch.manual_seed(0)
        fallback = timm.create_model("linvit_tiny_patch16_rope_224", **kwargs).eval()
    assert quiet.rope is None and quiet.dynamic_img_size and quiet.pretrained_cfg["fixed_input_size"] is False
    x = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        torch.testing.assert_close(quiet(x), fallback(x), rtol=0, atol=0)
    # a mixer with a rope option given no RoPE: refused, in one line, whatever the entry point
    for variant, mixer, plain in (("linvit_tiny_patch16_rope_224", "linear_rope", "linvit_tiny_patch16_224"),
                                  ("linvit_small_patch16_rope_224", "softmax", "linvit_small_patch16_224"),
                                  ("linvit_small_patch16_rope_mixed_224", "linear", "linvit_small_patch16_224")):
        with pytest.raises(ValueError, match=rf"^rope: 'none' asks {variant} for no RoPE, but its {mixer} mixer "
                                             rf"takes RoPE; use {plain} for a learned absolute position "
                                             rf"embedding$") as e:
            timm.create_model(variant, **dict(SMALL_VIT, token_mixer=mixer), rope="none")
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^rope: None asks linvit_tiny_patch16_rope_224 for no RoPE"):
        linvit_tiny_patch16_rope_224(**SMALL_VIT, rope=None)
    # "none" is None for the plain variants too
    plain = timm.create_model("linvit_tiny_patch16_224", **SMALL_VIT, rope="none")
    assert plain.rope is None and plain.pos_embed is not None
    # the RoPE default with a mixer that takes it: no warning, RoPE in the mixer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = timm.create_model("linvit_tiny_patch16_rope_224", **dict(SMALL_VIT, token_mixer="softmax"))
    assert model.pos_embed is None and model.blocks[0].mixer.rope_type == "axial"


# Every family a mixer can be swapped into, tiny: one block per stage.
# even head counts: cswin_stripes splits its heads between its two directions
_ONE_BLOCK = dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 32), num_heads=(2, 2, 2, 2))
_INIT_FAMILIES = {
    "linhier": lambda mixer: timm.create_model("linhier_tiny_224", token_mixers=mixer, **_ONE_BLOCK),
    "linvit": lambda mixer: timm.create_model("linvit_tiny_patch16_224", token_mixer=mixer, img_size=32,
                                              embed_dim=32, depth=1, num_heads=2, **MEAN_POOL),
    "mlla": lambda mixer: timm.create_model("mlla_tiny", token_mixers=mixer, **_ONE_BLOCK),
    "ravlt": lambda mixer: timm.create_model("ravlt_tiny", token_mixers=mixer, **_ONE_BLOCK),
    "dit": lambda mixer: _dit(self_attn=mixer),
}


def _dit(**kwargs):
    from linvision.diffusion import create_dit

    return create_dit("digits", **kwargs)


NO_ROPE = {"agent": r"^rope: agent attention takes no RoPE", "swin_window": r"^rope: swin_window places tokens by",
           "cswin_stripes": r"^rope: cswin_stripes places tokens by"}


def test_every_mixer_keeps_its_own_start_inside_every_family(monkeypatch):
    """Each registered mixer, built inside every family it can run in, keeps every parameter its own init fixes
    (the same under any seed: the gated forget gate at RetNet's decays, hybrid's mixing logits, PolaFormer's
    power and scale, ...) exactly as the mixer alone has it after its ``init_weights()``: no generic rule of a
    model, which runs first, overwrites a mixer's start. The pairs that cannot be built are named: RAVLT's
    family default is RoPE, which agent attention and Swin's and CSWin's window attentions refuse."""
    import linvision.diffusion.block as dit_block
    import linvision.layers.block as layers_block
    from linvision.layers import create_mixer, list_mixers

    built = []

    def recording(mixer, dim, num_heads, **kwargs):
        module = create_mixer(mixer, dim, num_heads, **kwargs)
        built.append((mixer, dim, num_heads, kwargs, module))
        return module

    monkeypatch.setattr(layers_block, "create_mixer", recording)
    monkeypatch.setattr(dit_block, "create_mixer", recording)

    def alone(mixer, dim, num_heads, kwargs, seed):
        torch.manual_seed(seed)
        module = create_mixer(mixer, dim, num_heads, **kwargs)
        module.init_weights()
        return dict(module.named_parameters())

    fixed = {}  # (family, mixer) -> the names of the parameters the mixer's own init fixes
    for family, make in _INIT_FAMILIES.items():
        for name in list_mixers():
            built.clear()
            if family == "ravlt" and name in NO_ROPE:
                with pytest.raises(ValueError, match=NO_ROPE[name]):
                    make(name)
                continue
            make(name)
            assert len(built) == (1 if family == "linvit" else 4), (family, name)
            for mixer, dim, num_heads, kwargs, module in built:
                first, second = (alone(mixer, dim, num_heads, kwargs, seed) for seed in (0, 1))
                for pname, value in module.named_parameters():
                    if torch.equal(first[pname], second[pname]):
                        fixed.setdefault((family, name), set()).add(pname)
                        assert torch.equal(value, first[pname]), f"{family} / {name}: {pname} lost its start"
    # the check reaches every family's own-init parameters (it would pass vacuously otherwise)
    for family in _INIT_FAMILIES:
        assert fixed[(family, "bidir_gated")] == {"forget_gate.weight", "forget_gate.bias"}
        assert fixed[(family, "hybrid")] == {"mix_logit"} and fixed[(family, "pola")] == {"power_logit", "qk_scale"}


@pytest.mark.parametrize("mixer", ["linear", "rala"])
def test_converted_vit_output_gate_starts_as_a_pass_through(mixer):
    """convert_vit_state_dict starts an output gate at weight 0 and the bias its activation maps to 1 (SiLU for
    the linear mixers, none for RALA's output modulation), so the gated model computes what the ungated one
    does from the same softmax ViT (float64)."""
    from linvision.models.vit_weights import convert_vit_state_dict

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, embed_dim=32, num_heads=2, num_classes=3)
    args = dict(img_size=32, depth=1, embed_dim=32, num_heads=2, num_classes=3, token_mixer=mixer)
    gated, plain = (timm.create_model("linvit_tiny_patch16_224", **args, mixer_kwargs=dict(gate=g)).double().eval()
                    for g in (True, False))
    for model in (gated, plain):
        model.load_state_dict(convert_vit_state_dict(vit.double().state_dict(), model))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(gated(x), plain(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rope", ["axial", "mixed"])
def test_a_learned_absolute_embedding_beside_rope_is_added_at_every_grid(rope):
    """pos_embed='learn' on a RoPE model (EVA-02's pairing): the tokens are the RoPE model's plus timm's resampling
    of the embedding to the input's grid (class-token row included), at the training grid and at an odd
    non-square one; with the embedding zeroed the logits are the RoPE-only model's, in float64. pos_embed='none'
    removes the plain model's embedding; anything else fails in one line."""
    kwargs = dict(SMALL_VIT, patch_size=8, img_size=32, num_classes=5, token_mixer="softmax", rope=rope)
    torch.manual_seed(0)
    both = timm.create_model("linvit_tiny_patch16_rope_224", pos_embed="learn", **kwargs).double().eval()
    rope_only = timm.create_model("linvit_tiny_patch16_rope_224", **kwargs).double().eval()
    assert rope_only.pos_embed is None and both.pos_embed.shape == (1, 1 + 16, 32)
    missing, unexpected = rope_only.load_state_dict(both.state_dict(), strict=False)[:2]
    assert missing == [] and unexpected == ["pos_embed"]
    for h, w in ((32, 32), (40, 72)):
        x = torch.randn(2, 3, h, w, dtype=torch.float64)
        tokens, grid = both._embed(x)
        expected = resample_abs_pos_embed(both.pos_embed, new_size=grid, old_size=(4, 4), num_prefix_tokens=1)
        torch.testing.assert_close(tokens, rope_only._embed(x)[0] + expected, rtol=0, atol=1e-12)
        assert grid == (h // 8, w // 8)
    with torch.no_grad():
        both.pos_embed.zero_()
    x = torch.randn(1, 3, 40, 72, dtype=torch.float64)
    torch.testing.assert_close(both(x), rope_only(x), rtol=0, atol=1e-12)

    plain = timm.create_model("linvit_tiny_patch16_224", pos_embed="none", **dict(kwargs, rope="none"))
    assert plain.pos_embed is None and "pos_embed" not in plain.state_dict()
    with pytest.raises(ValueError, match=r"^pos_embed: unknown 'sincos'"):
        timm.create_model("linvit_tiny_patch16_224", pos_embed="sincos")


def test_hierarchical_convolutions_run_channels_last():
    """The blocks hold (B, H, W, C), so every convolution of linhier after the stem's first (which takes the image)
    reads and writes channels-last strides, the layout the GPU's convolutions run fastest, in eval and training."""
    torch.manual_seed(0)
    model = timm.create_model("linhier_tiny_224", num_classes=3)
    seen = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_hook(lambda m, i, o, name=name: seen.append(
                (name, i[0].stride(1) == 1 and o.is_contiguous(memory_format=torch.channels_last))))
    for train in (False, True):
        model.train(train)
        seen.clear()
        with torch.set_grad_enabled(train):
            model(torch.randn(1, 3, 96, 80))
        assert seen[0] == ("stem.conv1", False) and len(seen) > 20
        assert all(ok for _, ok in seen[1:]), [name for name, ok in seen[1:] if not ok]
