"""The transforms of training and validation come from timm's data config: the model's pretrained cfg
(interpolation, crop_pct, crop_mode, mean, std), with the user's flags winning, resolved by one function
(linvision.data.datasets.resolve_data_config) that linvision-train and linvision-validate both call, and recorded in
a run's model.json so that validating the run's checkpoint transforms images the same way."""
import argparse
import json
import math
import os
import shutil

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from timm.data import create_transform
from timm.data import resolve_data_config as timm_resolve_data_config
from torchvision import transforms as T

import linvision.training.train as train_module
import linvision.training.validate as validate_module
import linvision.models  # noqa: F401  (registers linvision's models)
from linvision.utils.checkpoint import recorded_data_config
from linvision.utils.config import parse_args
from linvision.data.datasets import DigitsDataset, build_transform, resolve_data_config
from linvision.utils.factory import create_model, models_with_weights
from linvision.training.train import add_train_args, train, train_data_config
from linvision.training.train_config import TrainConfig
from linvision.training.validate import add_validate_args, validate_checkpoint
from support import TINY_VIT, run_tool, step_losses, tiny_train_flags, write_image_folder

LINVISION_MODULES = ["mlla", "ravlt", "mavit", "polaformer", "inline", "vig", "linhier", "linvit"]


def _weighted_models():
    """linvision's registered models that have trained weights, as timm lists them (name.tag)."""
    own = set(timm.list_models(module=LINVISION_MODULES))
    return sorted(n for n in timm.list_models(pretrained=True) if n.split(".")[0] in own)


WEIGHTED = _weighted_models()


def _images():
    """Two real images of other sizes than the models': a digit of scikit-learn's set upscaled to 100 px, and a
    non-square colour gradient with some texture."""
    digit = DigitsDataset("val", size=100).images[3]
    y, x = np.mgrid[0:180, 0:260]
    rgb = np.stack([x * 255 / 259, y * 255 / 179, 127 + 120 * np.sin(x / 7.0) * np.cos(y / 5.0)], -1)
    return [digit, Image.fromarray(rgb.round().clip(0, 255).astype(np.uint8), "RGB")]


def _parts(transform):
    """The Resize, CenterCrop and Normalize of an eval transform."""
    steps = transform.transforms
    return (next(t for t in steps if isinstance(t, T.Resize)), next(t for t in steps if isinstance(t, T.CenterCrop)),
            next(t for t in steps if isinstance(t, T.Normalize)))


class _Captured:
    """Stands in for validate's model factory, dataset and evaluation: builds the model without weights, keeps the
    transform validation builds, and scores nothing."""

    def __init__(self, monkeypatch):
        self.models, self.transforms = [], []

        def fake_create_model(name, pretrained=False, **kwargs):
            model = create_model(name, pretrained=False, **kwargs)
            self.models.append(model)
            return model

        def fake_create_dataset(dataset, data_dir, split, transform=None, digits_size=32):
            self.transforms.append(transform)
            return DigitsDataset("val", size=digits_size, transform=transform)

        monkeypatch.setattr(validate_module, "create_model", fake_create_model)
        monkeypatch.setattr(validate_module, "create_dataset", fake_create_dataset)
        monkeypatch.setattr(validate_module, "evaluate", lambda *a, **k: {"top1": 0.0})


def test_the_weighted_models_are_found():
    assert WEIGHTED == sorted(models_with_weights())
    for name in ("mlla_tiny.in1k", "mlla_small.in1k", "mlla_base.in1k", "ravlt_tiny.in1k", "ravlt_small.in1k",
                 "ravlt_base.in1k", "ravlt_large.in1k", "mavit_tiny.in1k", "mavit_small.in1k", "mavit_base.in1k",
                 "mavit_large.in1k", "vig_tiny.in1k", "vig_small.in1k", "vig_base.in1k",
                 "inline_deit_tiny.in1k", "inline_deit_small.in1k", "inline_deit_base.in1k",
                 "inline_swin_tiny.in1k", "inline_swin_small.in1k", "inline_swin_base.in1k"):
        assert name in WEIGHTED
    assert not any(n.startswith("pola_swin") for n in WEIGHTED)  # a local copy only: nothing to download


# one model of each family and cfg by default (the others differ only in size); all of them with --runslow
_DEFAULT_WEIGHTED = ("linvit_tiny_patch16_rope_224.deit_fb_in1k", "mlla_tiny.in1k", "ravlt_tiny.in1k",
                     "mavit_tiny.in1k", "vig_tiny.in1k", "inline_deit_small.in1k", "inline_swin_tiny.in1k")


@pytest.mark.parametrize("name", [n if n in _DEFAULT_WEIGHTED else pytest.param(n, marks=pytest.mark.slow)
                                  for n in WEIGHTED])
def test_pretrained_evaluation_uses_timms_transform(name, monkeypatch):
    """linvision-validate --model NAME --pretrained transforms images as timm's
    create_transform(**resolve_data_config({}, model=model)) does: the same steps and the same tensors."""
    captured = _Captured(monkeypatch)
    out = validate_checkpoint(None, pretrained=name, device="cpu")
    (model,), (ours,) = captured.models, captured.transforms
    cfg = timm.models.get_pretrained_cfg(name)
    assert model.pretrained_cfg["interpolation"] == cfg.interpolation
    assert model.pretrained_cfg["crop_pct"] == cfg.crop_pct

    theirs = create_transform(**timm_resolve_data_config({}, model=model))
    assert repr(ours) == repr(theirs)
    resize, crop, normalize = _parts(ours)
    size = cfg.input_size[-1]
    scale = math.floor(size / cfg.crop_pct)
    if cfg.crop_mode == "squash":  # a square resize, the aspect ratio not kept (InLine-DeiT's evaluation)
        assert resize.size in ((scale, scale), [scale, scale])
    else:
        assert resize.size in (scale, [scale])
    assert resize.interpolation == T.InterpolationMode(cfg.interpolation)
    assert tuple(crop.size) == (size, size)
    assert normalize.mean.tolist() == pytest.approx(list(cfg.mean))
    assert normalize.std.tolist() == pytest.approx(list(cfg.std))
    for image in _images():
        a, b = ours(image), theirs(image)
        assert a.shape == (3, size, size) and torch.equal(a, b)
    (result,) = out["results"]
    assert result["img_size"] == size
    assert result["interpolation"] == cfg.interpolation and result["crop_pct"] == cfg.crop_pct
    if name.startswith(("mlla", "ravlt", "mavit", "vig", "inline_swin")):  # the published evaluation transform
        assert resize.interpolation == T.InterpolationMode.BICUBIC and cfg.crop_pct == 0.875
        assert resize.size in (256, [256])
    if name.startswith("inline_deit"):  # the authors' square resize to 256/224 of the crop, bicubic
        assert resize.interpolation == T.InterpolationMode.BICUBIC and cfg.crop_pct == 0.875
        assert resize.size in ((scale, scale), [scale, scale]) and cfg.crop_mode == "squash"


def test_flags_override_the_pretrained_cfg(monkeypatch):
    captured = _Captured(monkeypatch)
    out = validate_checkpoint(None, pretrained="mlla_tiny.in1k", device="cpu", interpolation="bilinear",
                              crop_pct=1.0)
    (ours,) = captured.transforms
    resize, crop, _ = _parts(ours)
    assert resize.interpolation == T.InterpolationMode.BILINEAR and resize.size in (224, [224])
    assert tuple(crop.size) == (224, 224)
    assert out["results"][0]["interpolation"] == "bilinear" and out["results"][0]["crop_pct"] == 1.0
    model = captured.models[0]
    theirs = create_transform(**timm_resolve_data_config({"interpolation": "bilinear", "crop_pct": 1.0},
                                                         model=model))
    cfg_transform = create_transform(**timm_resolve_data_config({}, model=model))
    for image in _images():
        assert torch.equal(ours(image), theirs(image))
        assert not torch.equal(ours(image), cfg_transform(image))

    # each value on its own; the others stay the cfg's
    resolved = resolve_data_config(model, img_size=96, mean=[0.5, 0.5, 0.5])
    assert resolved == {"img_size": 96, "interpolation": "bicubic", "crop_pct": 0.875, "crop_mode": "center",
                        "mean": [0.5, 0.5, 0.5], "std": pytest.approx([0.229, 0.224, 0.225])}
    resolved = resolve_data_config(model, crop_pct=0.9, interpolation="lanczos", std=[0.25])
    assert (resolved["img_size"], resolved["crop_pct"], resolved["interpolation"]) == (224, 0.9, "lanczos")
    assert resolved["std"] == [0.25] * 3 and resolved["mean"] == pytest.approx([0.485, 0.456, 0.406])


def test_bad_values_fail_in_one_line(monkeypatch):
    model = create_model("test_vit")
    cases = [(dict(interpolation="cubic"), "interpolation: unknown 'cubic'; allowed: nearest, bilinear, bicubic"),
             (dict(crop_pct=0.0), r"crop_pct: must be within \(0, 1\], got 0.0"),
             (dict(crop_pct=1.5), r"crop_pct: must be within \(0, 1\], got 1.5"),
             (dict(crop_mode="middle"), "crop_mode: unknown 'middle'"),
             (dict(mean=[0.5, 0.5]), "mean: expected 3 numbers"),
             (dict(std=[0.5, 0.0, 0.5]), "std: expected 3 positive numbers")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            resolve_data_config(model, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="interpolation: unknown 'cubic'.*from the model's pretrained cfg"):
        resolve_data_config(pretrained_cfg={"interpolation": "cubic"})
    for changes, message in ((dict(interpolation="cubic"), "interpolation: must be one of nearest, bilinear"),
                             (dict(crop_pct=0.0), r"crop_pct: must be within \(0, 1\], got 0.0"),
                             (dict(mean=[0.5]), r"mean: must be 3 numbers"),
                             (dict(std=[0.5, -1.0, 0.5]), "std: must be > 0")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**changes).check()
    captured = _Captured(monkeypatch)
    with pytest.raises(ValueError, match="interpolation: unknown 'cubic'"):
        validate_checkpoint(None, pretrained="mlla_tiny.in1k", device="cpu", interpolation="cubic")
    assert captured.models == []  # refused before any model is built
    for add in (add_train_args, add_validate_args):
        with pytest.raises(SystemExit):
            add(argparse.ArgumentParser()).parse_args(["--interpolation", "cubic"])


def test_flags_default_to_the_models_cfg():
    """The options default to None (the model's pretrained cfg), so a flag given is told from one left out; both
    tools take timm's spellings."""
    cfg = TrainConfig()
    assert (cfg.interpolation, cfg.crop_pct, cfg.mean, cfg.std) == (None, None, None, None)
    args = add_train_args(argparse.ArgumentParser()).parse_args(["--interpolation", "bilinear", "--crop-pct", "1"])
    assert (args.interpolation, args.crop_pct) == ("bilinear", 1.0)
    args = add_validate_args(argparse.ArgumentParser()).parse_args(["--interpolation", "nearest", "--crop-pct",
                                                                    "0.9"])
    assert (args.interpolation, args.crop_pct) == ("nearest", 0.9)
    model = create_model("test_vit")
    resolved = train_data_config(TrainConfig(img_size=24), model)
    assert resolved == resolve_data_config(model, img_size=24)
    assert (resolved["interpolation"], resolved["crop_pct"], resolved["mean"]) == ("bicubic", 0.95, [0.5] * 3)


def _train_args(data, out, *extra):
    return parse_args(add_train_args(argparse.ArgumentParser()),
                      ["--dataset", "folder", "--data-dir", data, "--img-size", "16", "--model", "test_vit",
                       "--model-kwargs", *TINY_VIT, "--batch-size", "4", "--output", out, "--no-progress",
                       "--device", "cpu", "--epochs", "1", *extra])


def test_training_resolves_through_the_same_function_and_validation_reuses_it(tmp_path, monkeypatch):
    """linvision-train builds both transforms from resolve_data_config (the model's cfg, flags winning) and records
    the values in model.json; linvision-validate --checkpoint builds the same eval transform from them, and a
    model.json of an older run (no interpolation) is validated with bilinear, as such runs were."""
    data = write_image_folder(tmp_path / "data")
    calls, built = [], []
    real_resolve, real_build = train_module.resolve_data_config, train_module.build_transform

    def spy_resolve(*args, **kwargs):
        calls.append((args, kwargs))
        return real_resolve(*args, **kwargs)

    def spy_build(*args, **kwargs):
        transform = real_build(*args, **kwargs)
        built.append((kwargs, transform))
        return transform

    monkeypatch.setattr(train_module, "resolve_data_config", spy_resolve)
    monkeypatch.setattr(train_module, "build_transform", spy_build)
    cfg_run = train(_train_args(data, str(tmp_path / "out"), "--experiment", "cfg"))
    assert len(calls) == 1 and calls[0][1]["img_size"] == 16 and calls[0][1]["interpolation"] is None
    expected = {"img_size": 16, "interpolation": "bicubic", "crop_pct": 0.95, "crop_mode": "center",
                "mean": [0.5] * 3, "std": [0.5] * 3}  # test_vit's pretrained cfg
    assert [kw["is_training"] for kw, _ in built] == [True, False]
    for kwargs, _ in built:
        assert {k: kwargs[k] for k in expected} == expected
    (_, train_tf), (_, val_tf) = built
    assert train_tf.transforms[0].interpolation == T.InterpolationMode.BICUBIC
    assert _parts(val_tf)[0].size in (16, [16])  # floor(16 / 0.95)
    with open(os.path.join(cfg_run["run_dir"], "best", "model.json")) as f:
        meta = json.load(f)
    assert {k: meta[k] for k in expected} == expected

    calls.clear()
    built.clear()
    flag_run = train(_train_args(data, str(tmp_path / "out"), "--experiment", "flags", "--interpolation",
                                 "bilinear", "--crop-pct", "0.5", "--mean", "0.4", "0.4", "0.4"))
    assert calls[0][1]["interpolation"] == "bilinear" and calls[0][1]["crop_pct"] == 0.5
    (_, train_tf), (_, val_tf) = built
    assert train_tf.transforms[0].interpolation == T.InterpolationMode.BILINEAR
    resize, crop, normalize = _parts(val_tf)
    assert resize.size in (32, [32]) and resize.interpolation == T.InterpolationMode.BILINEAR
    assert normalize.mean.tolist() == pytest.approx([0.4] * 3) and normalize.std.tolist() == [0.5] * 3
    with open(os.path.join(flag_run["run_dir"], "best", "model.json")) as f:
        meta = json.load(f)
    assert (meta["interpolation"], meta["crop_pct"], meta["mean"]) == ("bilinear", 0.5, pytest.approx([0.4] * 3))

    # validation of the checkpoint: the transform the run recorded (the real data and evaluation)
    seen = []
    real_dataset = validate_module.create_dataset

    def capture(*args, **kwargs):
        seen.append(kwargs["transform"])
        return real_dataset(*args, **kwargs)

    monkeypatch.setattr(validate_module, "create_dataset", capture)
    out = validate_checkpoint(flag_run["run_dir"], data_dir=data, device="cpu")
    assert repr(seen[-1]) == repr(val_tf)
    assert out["results"][0]["top1"] == pytest.approx(flag_run["best_top1"])
    assert (out["results"][0]["interpolation"], out["results"][0]["crop_pct"]) == ("bilinear", 0.5)
    image = _images()[1]
    assert torch.equal(seen[-1](image), val_tf(image))
    out = validate_checkpoint(flag_run["run_dir"], data_dir=data, device="cpu", interpolation="bicubic",
                              crop_pct=1.0)  # flags win over the record
    resize, _, _ = _parts(seen[-1])
    assert resize.size in (16, [16]) and resize.interpolation == T.InterpolationMode.BICUBIC

    # an older run's model.json: no interpolation or crop mode recorded
    old = tmp_path / "old"
    shutil.copytree(os.path.join(cfg_run["run_dir"], "best"), old)
    meta_path = old / "model.json"
    meta = json.loads(meta_path.read_text())
    for key in ("interpolation", "crop_mode"):
        del meta[key]
    meta_path.write_text(json.dumps(meta))
    assert recorded_data_config(meta)["interpolation"] == "bilinear"
    validate_checkpoint(str(old), data_dir=data, device="cpu", img_sizes=[40])
    resize, crop, normalize = _parts(seen[-1])
    assert resize.interpolation == T.InterpolationMode.BILINEAR
    assert resize.size in (42, [42]) and tuple(crop.size) == (40, 40)  # its crop_pct 0.95 kept: floor(40 / 0.95)
    assert normalize.mean.tolist() == [0.5] * 3
    del meta["crop_pct"]
    meta_path.write_text(json.dumps(meta))
    validate_checkpoint(str(old), data_dir=data, device="cpu", img_sizes=[40])
    resize, crop, _ = _parts(seen[-1])
    assert resize.size in (40, [40]) and tuple(crop.size) == (40, 40)  # crop 1.0, as before it was recorded


def test_resuming_a_run_older_than_the_transform_options_keeps_its_transform(tmp_path, monkeypatch):
    """A run written before interpolation was configurable (config.yaml without `interpolation`, model.json
    without interpolation or crop mode) trained with bilinear and its crop_pct: resumed, it goes on with those,
    through linvision-train --resume (the saved config.yaml as defaults) and through train() with the recipe
    alone, not with the model's cfg (bicubic, crop 0.95); a run of this version goes on with what it recorded."""
    data = write_image_folder(tmp_path / "data")
    out = str(tmp_path / "out")
    run_tool("train.py", *tiny_train_flags(data, out, "--experiment", "old", "--epochs", "1", "--crop-pct", "0.8",
                                                    "--log-interval", "1"))
    run = os.path.join(out, "old")
    # make it a run of the earlier version: what its files held
    config_path = os.path.join(run, "config.yaml")
    config = yaml.safe_load(open(config_path))
    assert "interpolation" in config and config["crop_pct"] == 0.8
    del config["interpolation"]
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    for sub in ("last", "best"):
        meta_path = os.path.join(run, sub, "model.json")
        meta = json.load(open(meta_path))
        for key in ("interpolation", "crop_mode"):
            del meta[key]
        assert meta["crop_pct"] == 0.8
        with open(meta_path, "w") as f:
            json.dump(meta, f)

    built = []
    real_build = train_module.build_transform

    def spy_build(*args, **kwargs):
        transform = real_build(*args, **kwargs)
        built.append((kwargs, transform))
        return transform

    monkeypatch.setattr(train_module, "build_transform", spy_build)
    # what the earlier version built for this run: bilinear, crop 0.8, test_vit's mean and std
    old_val = build_transform(16, False, [0.5] * 3, [0.5] * 3, crop_pct=0.8, interpolation="bilinear")
    image = _images()[1]

    def check_bilinear(run_dir):
        (train_kw, train_tf), (val_kw, val_tf) = built[-2:]
        assert (train_kw["is_training"], val_kw["is_training"]) == (True, False)
        assert train_kw["interpolation"] == val_kw["interpolation"] == "bilinear"
        assert train_kw["crop_pct"] == val_kw["crop_pct"] == 0.8
        assert train_tf.transforms[0].interpolation == T.InterpolationMode.BILINEAR
        resize, crop, normalize = _parts(val_tf)
        assert resize.interpolation == T.InterpolationMode.BILINEAR
        assert resize.size in (20, [20]) and tuple(crop.size) == (16, 16)  # floor(16 / 0.8)
        assert normalize.mean.tolist() == [0.5] * 3
        assert repr(val_tf) == repr(old_val) and torch.equal(val_tf(image), old_val(image))
        meta = json.load(open(os.path.join(run_dir, "last", "model.json")))
        assert (meta["interpolation"], meta["crop_pct"], meta["crop_mode"]) == ("bilinear", 0.8, "center")

    # linvision-train --resume RUN: the saved config.yaml as defaults
    run_tool("train.py", "--resume", run, "--epochs", "2")
    check_bilinear(run)
    assert len(step_losses(run)) == 6  # 3 steps in each of the 2 epochs
    assert json.load(open(os.path.join(run, "summary.json")))["epochs"] == 2
    # resumed again: its config.yaml now has the key (null), its model.json the values: still bilinear
    assert yaml.safe_load(open(config_path))["interpolation"] is None
    run_tool("train.py", "--resume", run, "--epochs", "3")
    check_bilinear(run)

    # train() with a recipe that leaves crop_pct and interpolation unset takes the record of last/model.json,
    # an old one's too (bilinear; its crop_pct)
    meta_path = os.path.join(run, "last", "model.json")
    meta = json.load(open(meta_path))
    for key in ("interpolation", "crop_mode"):
        del meta[key]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    train(parse_args(add_train_args(argparse.ArgumentParser()),
                     tiny_train_flags(data, out, "--resume", run, "--epochs", "4")))
    check_bilinear(run)

    # a flag given when resuming wins over the record
    run_tool("train.py", "--resume", run, "--epochs", "5", "--interpolation", "bicubic")
    (train_kw, train_tf), (_, val_tf) = built[-2:]
    assert train_kw["interpolation"] == "bicubic" and train_kw["crop_pct"] == 0.8
    assert _parts(val_tf)[0].interpolation == T.InterpolationMode.BICUBIC

    # a run of this version with the model's cfg (nothing given) goes on with it when resumed
    run_tool("train.py", *tiny_train_flags(data, out, "--experiment", "new", "--epochs", "1"))
    run_tool("train.py", "--resume", os.path.join(out, "new"), "--epochs", "2")
    (train_kw, train_tf), (_, val_tf) = built[-2:]
    assert (train_kw["interpolation"], train_kw["crop_pct"]) == ("bicubic", 0.95)
    assert train_tf.transforms[0].interpolation == T.InterpolationMode.BICUBIC
