"""The ViT-Tiny ablation on photos_fine: its two configs load and build every model at its real size (no training),
and linvit takes one mixer per block (the hybrid with softmax in the last quarter of the blocks)."""
import argparse
import os

import pytest
import torch
from torch import nn

from linvision.experiments.ablate import _mixer_label, add_ablate_args
from linvision.utils.config import parse_args
from linvision.utils.factory import create_model

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
HYBRID = ",".join(["linear"] * 9 + ["softmax"] * 3)


def _load(name):
    return parse_args(add_ablate_args(argparse.ArgumentParser()), ["--config", os.path.join(CONFIGS, name)])


@pytest.mark.parametrize("name, mixers, class_token", [
    ("ablate_vit_tiny_photos_fine.yaml", ["softmax", "linear", "linear_rope", "pola", HYBRID], True),
    ("ablate_vit_tiny_photos_fine_avg.yaml", ["softmax", "linear", "agent", "inline", "bidir_delta"], False),
])
def test_config_builds_every_mixer_at_vit_tiny_size(name, mixers, class_token):
    args = _load(name)
    assert (args.model, args.dataset, args.img_size, args.epochs, args.warmup_epochs, args.batch_size) == (
        "linvit_tiny_patch16_224", "photos_fine", 96, 20, 2, 64)
    assert (args.opt, args.lr, args.weight_decay, args.sched, args.seeds) == ("adamw", 1e-3, 0.05, "cosine", [0, 1])
    assert args.mixers == mixers and args.eval_sizes == [96, 144, 192]
    kwargs = dict(args.model_kwargs)
    assert kwargs.pop("patch_size") == 8 and kwargs.pop("dynamic_img_size") is True
    assert kwargs == ({} if class_token else dict(class_token=False, global_pool="avg", fc_norm=False))
    torch.manual_seed(0)
    x = torch.randn(1, 3, 96, 96)
    for mixer in mixers:
        model = create_model(args.model, num_classes=12, model_kwargs={**args.model_kwargs, "token_mixer": mixer},
                             img_size=args.img_size).eval()
        blocks = list(model.blocks)
        assert len(blocks) == 12 and model.embed_dim == 192 and model.patch_embed.num_patches == 144
        assert {b.mixer.num_heads for b in blocks} == {3}
        assert (model.cls_token is not None) == class_token and model.global_pool == ("token" if class_token
                                                                                       else "avg")
        assert model.pos_embed.shape == (1, 144 + class_token, 192)  # learned absolute embedding
        # the size of ViT-Tiny (timm's vit_tiny_patch16_224 at patch 8, 12 classes: 5.41 M parameters)
        assert 5.3e6 < sum(p.numel() for p in model.parameters()) < 5.8e6
        with torch.no_grad():
            assert model(x).shape == (1, 12)


def test_linvit_takes_one_mixer_per_block():
    """The hybrid is linear attention in blocks 0-8 and softmax in 9-11: the same function as a linear model whose
    last three blocks are those of a softmax model with the same weights."""
    from linvision.layers.mixers import LinearAttention, SoftmaxAttention

    kwargs = dict(patch_size=8, embed_dim=24, depth=4, num_heads=2)
    torch.manual_seed(0)
    hybrid = create_model("linvit_tiny_patch16_224", num_classes=5, img_size=32,
                          model_kwargs=dict(kwargs, token_mixer=["linear", "linear", "linear", "softmax"])).eval()
    assert [type(b.mixer) for b in hybrid.blocks] == [LinearAttention] * 3 + [SoftmaxAttention]
    same = create_model("linvit_tiny_patch16_224", num_classes=5, img_size=32,
                        model_kwargs=dict(kwargs, token_mixer="linear,linear,linear,softmax")).eval()
    assert [type(b.mixer) for b in same.blocks] == [type(b.mixer) for b in hybrid.blocks]
    parts = {m: create_model("linvit_tiny_patch16_224", num_classes=5, img_size=32,
                             model_kwargs=dict(kwargs, token_mixer=m)).eval() for m in ("linear", "softmax")}
    for part in parts.values():
        part.load_state_dict(hybrid.state_dict())
    reference = parts["linear"]
    reference.blocks = nn.Sequential(*list(reference.blocks)[:3], parts["softmax"].blocks[3])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = hybrid(x)
        assert torch.equal(out, reference(x)) and not torch.allclose(out, parts["softmax"](x))
    with pytest.raises(ValueError, match=r"^token_mixer: 2 names \['linear', 'softmax'\] for 4 blocks; give 1 or 4$"):
        create_model("linvit_tiny_patch16_224", model_kwargs=dict(kwargs, token_mixer="linear,softmax"))
    with pytest.raises(ValueError, match="token mixer 'inline' cannot take prefix tokens"):
        create_model("linvit_tiny_patch16_224", model_kwargs=dict(kwargs, token_mixer="linear,linear,linear,inline"))


def test_mixer_labels_name_runs_of_blocks():
    assert _mixer_label(HYBRID) == "9xlinear+3xsoftmax"
    assert _mixer_label("none,none,linear,softmax") == "2xnone+linear+softmax"
    assert _mixer_label("linear") == "linear"


@pytest.mark.parametrize("name, fine, mixers", [
    ("ablate_vit_tiny_photos_scale.yaml", "ablate_vit_tiny_photos_fine.yaml",
     ["softmax", "linear", "linear_rope", "pola", HYBRID]),
    ("ablate_vit_tiny_photos_scale_avg.yaml", "ablate_vit_tiny_photos_fine_avg.yaml", ["softmax", "linear"]),
])
def test_photos_scale_configs_are_photos_fines_on_the_other_set_with_three_seeds(name, fine, mixers):
    """The ablation on photos_scale changes the data set, the seeds and the mixers, nothing of the recipe."""
    args, reference = vars(_load(name)), vars(_load(fine))
    assert (args.pop("dataset"), reference.pop("dataset")) == ("photos_scale", "photos_fine")
    assert args.pop("seeds") == [0, 1, 2] and args.pop("mixers") == mixers
    assert args.pop("experiment") == name[:-len(".yaml")]
    for key in ("seeds", "mixers", "experiment", "config"):
        reference.pop(key)
    args.pop("config")
    assert args == reference


@pytest.mark.parametrize("mixer, options", [("linear_rope", {"rope_ref_grid": 12}),
                                             ("linear", {"feature_map": "focused"})])
def test_the_designs_with_options_of_the_photos_scale_ablation_build_and_run_at_every_size(mixer, options):
    """linear_rope with its positions interpolated to the training grid and linear with the focused map, as the
    config's header passes them (--model-kwargs), build at ViT-Tiny size and take the evaluation sizes."""
    args = _load("ablate_vit_tiny_photos_scale.yaml")
    kwargs = {**args.model_kwargs, "mixer_kwargs": options, "token_mixer": mixer}
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=12, model_kwargs=kwargs, img_size=args.img_size).eval()
    assert all(getattr(b.mixer, "rope_ref_grid", None) is not None for b in model.blocks) == ("rope_ref_grid"
                                                                                              in options)
    with torch.no_grad():
        for size in args.eval_sizes:
            assert model(torch.randn(1, 3, size, size)).shape == (1, 12)
