"""One reader of training-checkpoint layouts: every way a file reaches a linvit or linhier picks the same weights,
in the one documented order (linvision.models.published.DEFAULT_WEIGHT_KEYS, timm's)."""
import pytest
import timm
import torch

import linvision  # noqa: F401  (registers the models)
from linvision.utils.checkpoint import load_pretrained
from linvision.models import linhier, linvit
from linvision.models.published import DEFAULT_WEIGHT_KEYS, load_published, unwrap_state_dict
from linvision.safe_pickle import read_checkpoint

MODELS = {
    "linvit": ("linvit_small_patch16_224", dict(img_size=32, embed_dim=32, depth=1, num_heads=2, num_classes=3),
               linvit.checkpoint_filter_fn),
    "linhier": ("linhier_tiny_224", dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 32), num_heads=(1, 2, 2, 2),
                                         num_classes=3), linhier.checkpoint_filter_fn),
}


def _create(family, **kwargs):
    name, args, _ = MODELS[family]
    return timm.create_model(name, **args, **kwargs).eval()


def _weights(model, value):
    """The model's state dict with every float tensor set to ``value`` (integer buffers kept)."""
    return {k: torch.full_like(v, value) if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}


def _loaded_value(model):
    """The one value every float parameter of ``model`` holds."""
    values = {float(v.flatten()[0]) for v in model.state_dict().values() if v.is_floating_point()}
    assert len(values) == 1, values
    return values.pop()


def _every_entry_point(family, path):
    """The value of the weights ``path`` gives a fresh model through each reader: the family's
    checkpoint_filter_fn on the loaded file, unwrap_state_dict, load_published, linvision-train's
    --pretrained-path (engine.checkpoint.load_pretrained) and timm's pretrained_cfg_overlay=dict(file=...)."""
    _, _, filter_fn = MODELS[family]
    out = {}
    model = _create(family)
    model.load_state_dict(filter_fn(read_checkpoint(str(path), "test"), model))
    out["checkpoint_filter_fn"] = _loaded_value(model)
    model = _create(family)
    model.load_state_dict(unwrap_state_dict(read_checkpoint(str(path), "test")))
    out["unwrap_state_dict"] = _loaded_value(model)
    model = _create(family)
    load_published(model, str(path), filter_fn)
    out["load_published"] = _loaded_value(model)
    model = _create(family)
    result = load_pretrained(model, str(path))
    assert not result["missing"] and not result["unexpected"] and not result["skipped"], result
    out["load_pretrained"] = _loaded_value(model)
    overlay = dict(file=str(path), num_classes=3)
    out["timm file"] = _loaded_value(_create(family, pretrained=True, pretrained_cfg_overlay=overlay))
    return out


def test_the_documented_order_is_timms():
    assert DEFAULT_WEIGHT_KEYS == ("state_dict_ema", "model_ema", "state_dict", "model")


@pytest.mark.parametrize("family", sorted(MODELS))
def test_model_and_state_dict_in_one_file_load_the_same_weights_everywhere(family, tmp_path):
    """A file with different weights under 'model' and 'state_dict': every reader takes 'state_dict' (the
    earlier of the two in DEFAULT_WEIGHT_KEYS), with DistributedDataParallel's 'module.' prefixes removed."""
    model = _create(family)
    path = tmp_path / "two.pth"
    torch.save({"model": _weights(model, 1.0),
                "state_dict": {f"module.{k}": v for k, v in _weights(model, 2.0).items()},
                "epoch": 3}, path)
    assert _every_entry_point(family, path) == dict.fromkeys(
        ("checkpoint_filter_fn", "unwrap_state_dict", "load_published", "load_pretrained", "timm file"), 2.0)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_reader_follows_the_documented_order(family, tmp_path):
    """A file holding the keys DEFAULT_WEIGHT_KEYS[i:] (each with its own weights), for every i: every reader
    takes key i."""
    model = _create(family)
    for i, expected in enumerate(DEFAULT_WEIGHT_KEYS):
        path = tmp_path / f"from_{i}.pth"
        torch.save({key: _weights(model, float(j + 1)) for j, key in enumerate(DEFAULT_WEIGHT_KEYS) if j >= i}, path)
        values = _every_entry_point(family, path)
        assert set(values.values()) == {float(i + 1)}, (expected, values)


def test_a_file_without_weights_fails_in_one_line(tmp_path):
    path = tmp_path / "empty.pth"
    torch.save({"epoch": 3, "optimizer": {}}, path)
    with pytest.raises(ValueError, match=r"^checkpoint: no weights under \['state_dict_ema', 'model_ema'"):
        linvit.checkpoint_filter_fn(read_checkpoint(str(path), "test"), _create("linvit"))


def test_a_timm_training_checkpoint_gives_its_weights_and_ema_apart(tmp_path):
    """--resume from timm's train.py file (engine.resume.read_timm_checkpoint) reads 'state_dict' and
    'state_dict_ema' each as the state dict it is, through the same unwrap_state_dict, 'module.' prefixes removed."""
    from linvision.training.resume import read_timm_checkpoint

    model = _create("linhier")
    path = tmp_path / "checkpoint-0.pth.tar"
    torch.save({"epoch": 0, "version": 2, "optimizer": {"state": {}, "param_groups": []},
                "state_dict": {f"module.{k}": v for k, v in _weights(model, 2.0).items()},
                "state_dict_ema": _weights(model, 3.0)}, path)
    read = read_timm_checkpoint(str(path))
    assert read["start_epoch"] == 1
    for key, value in (("model", 2.0), ("ema", 3.0)):
        model.load_state_dict(read[key])
        assert _loaded_value(model) == value, key
