"""linvision-validate given a checkpoint alone evaluates it on the data its run recorded (the run folder's
config.yaml, else the checkpoint's model.json), the flags given winning, and says on one line which data it used."""
import json
import os

import pytest
import yaml
from support import run_tool, tiny_train_flags, write_image_folder

from linvision.data.run_data import run_data


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """A 2-epoch run of the tiny ViT on a tiny image folder: (run folder, data folder, its epoch records)."""
    root = tmp_path_factory.mktemp("recorded")
    data = write_image_folder(root / "data")
    run_tool("train.py", *tiny_train_flags(data, str(root / "out"), "--epochs", "2", "--experiment", "run"))
    run = str(root / "out" / "run")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        epochs = [r for r in map(json.loads, f) if r["kind"] == "epoch"]
    return run, data, epochs


def test_a_checkpoint_alone_is_validated_on_its_run_s_folder(folder_run):
    """Without --dataset/--data-dir, last/ scores what the run's final validation scored (same images, same
    transform), the run folder what best/ scored; the note names the folder and the record it came from."""
    run, data, epochs = folder_run
    assert [r["epoch"] for r in epochs] == [0, 1]
    last = run_tool("validate.py", "--checkpoint", os.path.join(run, "last"))
    (result,) = json.loads(last.stdout)["results"]
    assert result["count"] == 6 and result["img_size"] == 16
    assert result["top1"] == pytest.approx(epochs[-1]["val_top1"])
    assert result["loss"] == pytest.approx(epochs[-1]["val_loss"], rel=1e-5)
    config = os.path.join(run, "config.yaml")
    assert last.stderr == f"data: folder at {data}, its validation split (as {config} records)\n"
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    best = json.loads(run_tool("validate.py", "--checkpoint", run).stdout)["results"][0]
    assert best["top1"] == pytest.approx(summary["best_top1"])


def test_flags_given_win_over_the_run_s_record(folder_run, tmp_path):
    run, data, _ = folder_run
    other = write_image_folder(tmp_path / "other", val_per_class=3, seed=1)
    proc = run_tool("validate.py", "--checkpoint", run, "--data-dir", other)
    assert json.loads(proc.stdout)["results"][0]["count"] == 9
    config = os.path.join(run, "config.yaml")
    assert proc.stderr == f"data: folder (as {config} records) at {other} (as given), its validation split\n"
    # another dataset does not take the run's folder: digits' classes are not the run's
    proc = run_tool("validate.py", "--checkpoint", run, "--dataset", "digits", check=False)
    assert proc.returncode == 2 and "its classes differ" in proc.stderr and data not in proc.stderr


def _checkpoint(folder, meta):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump(meta, f)
    return str(folder)


def test_run_data_reads_the_run_s_config_then_the_checkpoint_s_meta(tmp_path):
    """The record behind both validators: a run folder's config.yaml for its best/ or last/ (a segmenter's
    model.json of an older run names no data_dir), model.json for a checkpoint outside a run, nothing recorded
    for a checkpoint that records nothing."""
    meta = {"model": "m", "num_classes": 2, "dataset": "folder"}
    run = tmp_path / "run"
    best = _checkpoint(run / "best", meta)
    with open(run / "config.yaml", "w") as f:
        yaml.safe_dump({"dataset": "folder", "data_dir": "/data/pets", "epochs": 3}, f)
    config = str(run / "config.yaml")
    for checkpoint in (str(run), best):
        assert run_data(checkpoint, meta) == (
            "folder", "/data/pets", f"data: folder at /data/pets, its validation split (as {config} records)")
    assert run_data(best, meta, dataset="digits") == (
        "digits", None, "data: digits, its validation split (as given)")
    assert run_data(best, meta, data_dir="/x")[:2] == ("folder", "/x")

    mosaic = {**meta, "dataset": "mosaic", "data_dir": None}
    alone = _checkpoint(tmp_path / "alone", mosaic)
    json_path = os.path.join(alone, "model.json")
    assert run_data(alone, mosaic) == (
        "mosaic", None, f"data: mosaic, its validation split (as {json_path} records)")
    seg = _checkpoint(tmp_path / "seg" / "best", {**meta, "data_dir": "/data/scenes"})
    assert run_data(seg, {**meta, "data_dir": "/data/scenes"})[:2] == ("folder", "/data/scenes")
    bare = _checkpoint(tmp_path / "bare", {"model": "m", "num_classes": 2})
    assert run_data(bare, {"model": "m", "num_classes": 2}) == (
        "folder", None, "data: folder, its validation split (the default)")


def test_model_kwargs_rebuild_the_same_weights_with_rope_positions_interpolated(tmp_path):
    """--model-kwargs merges over the options the checkpoint records, a dict option key by key (the recorded
    rope_theta stays beside rope_ref_grid): on the training grid the scores are those without it, bit for bit;
    at twice the size the interpolated positions give another loss. The tool prints what the function returns;
    an option that changes the weights' shapes fails in one line."""
    from support import write_rope_checkpoint

    from linvision.training.validate import validate_checkpoint
    from linvision.utils.checkpoint import load_model

    folder = write_rope_checkpoint(tmp_path / "rope")
    given = {"mixer_kwargs": {"rope_ref_grid": 12}}
    model, _ = load_model(folder, **given)
    mixer = model.blocks[0].mixer
    assert mixer.rope_ref_grid == (12, 12) and mixer.rope_axial["theta"] == 10.0
    plain = validate_checkpoint(folder, img_sizes=[96, 192], device="cpu")["results"]
    interp = validate_checkpoint(folder, img_sizes=[96, 192], device="cpu", model_kwargs=given)["results"]
    assert interp[0] == plain[0] and interp[0]["count"] == 360
    assert interp[1]["loss"] != plain[1]["loss"]
    proc = run_tool("validate.py", "--checkpoint", folder, "--img-size", "192", "--model-kwargs", json.dumps(given))
    (printed,) = json.loads(proc.stdout)["results"]
    assert printed["loss"] == pytest.approx(interp[1]["loss"], rel=1e-6)
    proc = run_tool("validate.py", "--checkpoint", folder, "--model-kwargs", "embed_dim=64", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "(size mismatch for cls_token: copying a param with shape torch.Size([1, 1, 32])" in proc.stderr
