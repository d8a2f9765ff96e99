"""A classification run's checkpoint folders are also in timm's hub layout: config.json as timm's save_config_for_hf
writes it beside model.safetensors, so that ``timm.create_model("local-dir:RUN/best", pretrained=True)`` in a plain
process (after ``import linvision``) is the trained model with the run's transform, and what push_to_hf_hub writes
from it loads the same; linvision keeps reading model.json, so folders without config.json still load."""
import json
import os
import shutil

import pytest
import torch
from support import PY, run_subprocess, run_tool, write_image_folder
from timm.models._hub import load_model_config_from_path

from linvision.utils import load_model, save_checkpoint
from linvision.utils.checkpoint import recorded_data_config
from linvision.utils.factory import create_model
from linvision.training.resume import is_external_checkpoint

MODEL = "linvit_tiny_patch16_rope_224"
KWARGS = {"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 4}
# a transform unlike the model's default cfg (bicubic 0.9, ImageNet mean and std), so that reading it back shows
# where it came from
TRANSFORM = {"interpolation": "bilinear", "crop_pct": 0.8, "mean": [0.4, 0.5, 0.6], "std": [0.2, 0.3, 0.25]}

# What a user of timm alone runs: build the run's model from its folder, its logits on seeded images, its
# pretrained cfg and the data config timm resolves from it; then save_for_hf (what push_to_hf_hub uploads) into
# another folder and load that back the same way.
TIMM_USER = """
import json, sys
import torch
import linvision, timm
from timm.models import save_for_hf

folder, hub, out = sys.argv[1:]
model = timm.create_model("local-dir:" + folder, pretrained=True).eval()
images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
save_for_hf(model, hub, safe_serialization=True)
again = timm.create_model("local-dir:" + hub, pretrained=True).eval()
with torch.no_grad():
    torch.save({"logits": model(images), "again": again(images)}, out + ".pt")
with open(out + ".json", "w") as f:
    json.dump({"cfg": model.pretrained_cfg, "again_cfg": again.pretrained_cfg, "name": type(model).__name__,
               "data": timm.data.resolve_data_config({}, model=model)}, f)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-epoch run of a tiny linvit (a linvision model: timm knows it only after ``import linvision``) on a tiny
    image folder, with the transform of TRANSFORM: (run folder, data folder)."""
    root = tmp_path_factory.mktemp("timm_run")
    data = write_image_folder(root / "data")
    run_tool("train.py", "--dataset", "folder", "--data-dir", data, "--img-size", "16", "--model", MODEL,
             "--model-kwargs", *[f"{k}={v}" for k, v in KWARGS.items()], "--drop-path", "0.1",
             "--interpolation", TRANSFORM["interpolation"], "--crop-pct", str(TRANSFORM["crop_pct"]),
             "--mean", *map(str, TRANSFORM["mean"]), "--std", *map(str, TRANSFORM["std"]),
             "--batch-size", "4", "--epochs", "1", "--output", str(root / "out"), "--experiment", "run",
             "--no-progress", "--device", "cpu")
    return str(root / "out" / "run"), data


def _images():
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def test_config_json_is_timm_s_hub_config_of_the_run(run):
    """config.json holds what timm's hub layout has, with the run's model arguments (no drop rate), transform and
    classes; timm's own reader takes it, and nothing of linvision's folder is gone."""
    folder = os.path.join(run[0], "best")
    assert sorted(os.listdir(folder)) == ["config.json", "model.json", "model.safetensors"]
    assert sorted(os.listdir(os.path.join(run[0], "last"))) == [
        "config.json", "model.json", "model.safetensors", "train_state.pt"]
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "model.json")) as f:
        meta = json.load(f)
    assert {"architecture", "num_classes", "num_features", "label_names", "model_args",
            "pretrained_cfg"} <= set(config)
    assert (config["architecture"], config["num_classes"], config["num_features"]) == (MODEL, 3, 32)
    assert config["label_names"] == meta["classes"] == ["class0", "class1", "class2"]
    assert config["model_args"] == {**KWARGS, "in_chans": 3, "num_classes": 3, "img_size": [16, 16],
                                    "global_pool": "token"}
    cfg = config["pretrained_cfg"]
    assert {k: cfg[k] for k in TRANSFORM} == TRANSFORM
    assert (cfg["input_size"], cfg["crop_mode"], cfg["num_classes"], cfg["custom_load"]) == ([3, 16, 16], "center",
                                                                                            3, False)
    assert "trained with linvision" in cfg["description"] and not cfg["tag"] and not cfg["notes"]
    assert meta["model_kwargs"]["drop_path_rate"] == 0.1  # model.json keeps the run's; timm leaves drop rates out

    pretrained_cfg, name, model_args = load_model_config_from_path(folder)
    assert (name, model_args) == (MODEL, config["model_args"])
    assert (pretrained_cfg["source"], pretrained_cfg["file"]) == ("local-dir", folder)
    assert pretrained_cfg["label_names"] == meta["classes"] and tuple(pretrained_cfg["input_size"]) == (3, 16, 16)
    # a file of the folder, as --resume takes it: not a checkpoint of timm's train.py
    assert not is_external_checkpoint(os.path.join(run[0], "last", "config.json"))


def test_timm_create_model_from_the_folder_is_the_trained_model(run, tmp_path):
    """In a plain process, timm builds the run's model from best/ with its weights (the logits of load_model) and
    the transform the run validated with; save_for_hf of that model (what push_to_hf_hub uploads) loads the same."""
    folder = os.path.join(run[0], "best")
    out = str(tmp_path / "user")
    proc = run_subprocess([PY, "-c", TIMM_USER, folder, str(tmp_path / "hub"), out], timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out + ".pt")
    with open(out + ".json") as f:
        user = json.load(f)
    model, meta = load_model(run[0])
    with torch.no_grad():
        expected = model(_images())
    torch.testing.assert_close(got["logits"], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["again"], expected, rtol=1e-6, atol=1e-6)
    assert user["name"] == "LinViT"
    recorded = recorded_data_config(meta)
    assert user["data"] == {**TRANSFORM, "input_size": [3, 16, 16], "crop_mode": "center"}
    for cfg in (user["cfg"], user["again_cfg"]):
        assert (cfg["mean"], cfg["std"], tuple(cfg["input_size"])) == (
            list(recorded["mean"]), list(recorded["std"]), recorded["input_size"])
        assert cfg["label_names"] == meta["classes"]
    assert sorted(os.listdir(tmp_path / "hub")) == ["config.json", "model.safetensors"]


def test_a_folder_without_config_json_still_loads_and_validates(run, tmp_path):
    """A run folder written before config.json (removed here from a copy) loads with load_model and validates as
    the same run does: linvision reads model.json only."""
    old = str(tmp_path / "old_run")
    shutil.copytree(run[0], old)
    for folder in ("best", "last"):
        os.remove(os.path.join(old, folder, "config.json"))
    model, meta = load_model(old)
    reference, _ = load_model(run[0])
    with torch.no_grad():
        assert torch.equal(model(_images()), reference(_images()))
    assert meta["classes"] == ["class0", "class1", "class2"]
    results = [json.loads(run_tool("validate.py", "--checkpoint", path).stdout)["results"][0]
               for path in (old, run[0])]
    assert results[0]["count"] == 6 and results[0]["top1"] == results[1]["top1"]
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)


def test_config_json_only_when_asked_and_timm_can_write_it(tmp_path, monkeypatch):
    """save_checkpoint writes config.json only for a classifier (timm_config, as the classification task asks;
    segmentation and diffusion checkpoints have none), and not with a timm whose save_config_for_hf cannot record
    the run's transform (before 1.0.31)."""
    import timm.models._hub as hub

    model = create_model(MODEL, num_classes=2, model_kwargs=KWARGS, img_size=16)
    meta = {"model": MODEL, "num_classes": 2, "in_chans": 3, "model_kwargs": KWARGS, "img_size": 16,
            "classes": ["a", "b"], **TRANSFORM}
    save_checkpoint(str(tmp_path / "plain"), model, meta)
    assert sorted(os.listdir(tmp_path / "plain")) == ["model.json", "model.safetensors"]
    save_checkpoint(str(tmp_path / "timm"), model, meta, timm_config=True)
    assert sorted(os.listdir(tmp_path / "timm")) == ["config.json", "model.json", "model.safetensors"]

    def older_timm(model, config_path, model_config=None, model_args=None):
        raise AssertionError("not to be called")

    monkeypatch.setattr(hub, "save_config_for_hf", older_timm)
    save_checkpoint(str(tmp_path / "older"), model, meta, timm_config=True)
    assert sorted(os.listdir(tmp_path / "older")) == ["model.json", "model.safetensors"]
