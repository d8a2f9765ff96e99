"""Nothing lost, nothing run from a file: run folders, checkpoints, signals, and inputs checked where they enter."""
import json
import os
import re
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

from linvision.utils.files import recover_checkpoint_folder, write_checkpoint_folder
from linvision.utils.run_folder import claim_run_folder
from support import (PY, ROOT, SUBPROCESS_TIMEOUT, TINY_VIT, command_argv, logs, run_tool, spawn, step_losses,
                     tiny_train_flags, wait_until, write_image_folder)


def _summary(run):
    with open(os.path.join(run, "summary.json")) as f:
        return json.load(f)


def _lrs(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r["lr"] for r in map(json.loads, f) if r["kind"] == "step"}


# --- run folders

def test_a_finished_run_is_never_overwritten(data, tmp_path):
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "r")
    run_tool("train.py", *flags)
    first = (tmp_path / "r" / "metrics.jsonl").read_text()
    proc = run_tool("train.py", *flags, "--lr", "0.01")
    assert f"writes to {tmp_path / 'r-1'}" in proc.stdout
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == first  # untouched
    assert _summary(tmp_path / "r-1")["run_dir"] == str(tmp_path / "r-1")
    proc = run_tool("train.py", *flags, "--overwrite", "--epochs", "2")
    assert "--overwrite: deleted the earlier run" in proc.stdout
    assert _summary(tmp_path / "r")["epochs"] == 2 and not (tmp_path / "r-2").exists()


def test_a_folder_in_use_is_refused(data, tmp_path):
    held = claim_run_folder(str(tmp_path / "busy"))  # another run, alive
    try:
        (tmp_path / "busy" / "config.yaml").write_text("epochs: 1\n")
        for extra in (["--resume", str(tmp_path / "busy")], ["--experiment", "busy", "--overwrite"]):
            proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1"), *extra, check=False)
            assert proc.returncode == 2 and f"in use by another run (process {os.getpid()})" in proc.stderr
        # a new run of that name goes beside it
        run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "busy"))
        assert (tmp_path / "busy-1" / "summary.json").exists()
    finally:
        held.release()
    claim_run_folder(str(tmp_path / "busy"), resume=True).release()  # free once its owner has gone


@pytest.mark.parametrize("where", ["file", "read_only"])
def test_an_output_that_cannot_be_written_is_one_line(data, tmp_path, where):
    if where == "file":
        (tmp_path / "out").write_text("a file where the output folder should be")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        (tmp_path / "out").mkdir(mode=0o500)
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path / "out"), "--epochs", "1"), check=False)
    assert proc.returncode == 2 and "cannot create or write the run folder" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_debris_in_the_output(data, tmp_path):
    """A new run that fails before its first checkpoint leaves no folder (the next run takes its name, not
    <name>-1); a finished run leaves no .lock; an empty folder the claim made is gone with the lock."""
    out = tmp_path / "out"
    proc = run_tool("train.py", *tiny_train_flags(data, str(out), "--epochs", "1", "--experiment", "r",
                                                  "--model", "no_such_model"), check=False)
    assert proc.returncode == 2 and not (out / "r").exists()
    run_tool("train.py", *tiny_train_flags(data, str(out), "--epochs", "1", "--experiment", "r"))
    assert sorted(os.listdir(out)) == ["r"]
    assert sorted(os.listdir(out / "r")) == ["best", "config.yaml", "last", "metrics.jsonl", "summary.json"]
    claim_run_folder(str(tmp_path / "empty")).release()
    assert not (tmp_path / "empty").exists()
    (tmp_path / "mine").mkdir()
    claim_run_folder(str(tmp_path / "mine")).discard()  # a folder the user made stays
    assert (tmp_path / "mine").is_dir() and not os.listdir(tmp_path / "mine")


def test_the_resume_line_says_what_it_resumes(data, tmp_path):
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "2", "--experiment", "r")
    run_tool("train.py", *flags, "--stop-after-steps", "1")
    proc = run_tool("train.py", *flags, "--resume", str(tmp_path / "r"), "--stop-after-steps", "4")
    assert "step 1 of 3 (update 1), no epoch evaluated yet" in proc.stdout and "-1.00" not in proc.stdout
    top1 = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")][-1]["val_top1"]
    proc = run_tool("train.py", *flags, "--resume", str(tmp_path / "r"))
    assert f"best top-1 so far {top1:.2f} (epoch 0)" in proc.stdout


def _corrupt(data):
    bad = [os.path.join(data, "train", "class0", "broken.png"), os.path.join(data, "val", "class1", "cut.png")]
    with open(bad[0], "w") as f:
        f.write("not an image")
    png = open(os.path.join(data, "val", "class1", "0.png"), "rb").read()
    with open(bad[1], "wb") as f:
        f.write(png[: len(png) // 2])
    return bad


def test_unreadable_images_are_found_before_the_first_step(tmp_path):
    data = write_image_folder(tmp_path / "data")
    bad = _corrupt(data)
    out = tmp_path / "out"
    proc = run_tool("train.py", *tiny_train_flags(data, str(out), "--epochs", "1", "--experiment", "r"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "--skip-bad-images" in line
    assert "1 of the 13 training files, 1 of the 7 validation files cannot be read" in line
    assert bad[0] in line and "UnidentifiedImageError" in line and bad[1] in line and "truncated" in line
    assert not (out / "r").exists()  # nothing was started
    proc = run_tool("train.py", *tiny_train_flags(data, str(out), "--epochs", "1", "--experiment", "r",
                                                  "--skip-bad-images"))
    assert "left out 1 of the 13 training samples" in proc.stdout and bad[0] in proc.stdout
    assert "left out 1 of the 7 validation samples" in proc.stdout and bad[1] in proc.stdout
    assert _summary(out / "r")["run_dir"] == str(out / "r")  # the name was free


def test_unreadable_segmentation_files_are_found_before_the_first_step(tmp_path):
    """An image and a mask that cannot be read: one line naming both; --skip-bad-images leaves their samples out."""
    from linvision.data.mosaic import write_mosaic_folders

    root = write_mosaic_folders(str(tmp_path / "data"), size=128, train=5, val=2, seed=0)
    bad = [os.path.join(root, "train", "images", "00001.png"), os.path.join(root, "val", "masks", "00000.png")]
    for path in bad:
        with open(path, "wb") as f:
            f.write(b"\x89PNG broken")
    flags = ["--dataset", "folder", "--data-dir", root, "--img-size", "32", "--encoder", "linhier_delta_femto_224",
             "--model-kwargs", "depths=[1,1,1,1]", "--decoder-kwargs", "decoder_channels=[16,8,8,8,8]", "-b", "2",
             "--epochs", "1", "--output", str(tmp_path / "out"), "--experiment", "s", "--no-progress",
             "--device", "cpu"]
    proc = run_tool("train_seg.py", *flags, check=False)
    assert proc.returncode == 2 and all(path in proc.stderr for path in bad), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "s").exists()
    proc = run_tool("train_seg.py", *flags, "--skip-bad-images")
    assert "left out 1 of the 5 training samples" in proc.stdout
    assert "left out 1 of the 2 validation samples" in proc.stdout


def test_an_error_after_the_first_step_saves_a_checkpoint_to_resume(tmp_path, monkeypatch):
    """With --no-check-images a bad file is found when a batch draws it: last/ is saved at the step before, the
    message says how to continue, and the run continues from there once the file is fixed."""
    import linvision.data.datasets as data_module

    data = write_image_folder(tmp_path / "data")
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "2", "--experiment", "r", "--no-check-images",
                             "--log-interval", "1")
    real, calls = data_module._load_rgb, []

    def load(path):  # the sixth image read during training (in the second batch) is a broken file
        calls.append(path)
        return real(str(broken) if len(calls) == 6 else path)

    monkeypatch.setattr(data_module, "_load_rgb", load)
    proc = run_tool("train.py", *flags, check=False)
    monkeypatch.undo()
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert str(broken) in line and f"continue with: linvision-train --resume {tmp_path / 'r'}" in line
    state = torch.load(tmp_path / "r" / "last" / "train_state.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (0, 1, 1)
    run_tool("train.py", *flags[:flags.index("--epochs")], "--resume", str(tmp_path / "r"))
    assert [s for s, _ in step_losses(str(tmp_path / "r"))] == list(range(1, 7))
    assert _summary(tmp_path / "r")["epochs"] == 2


def test_learning_rate_shown_is_the_schedule_s_with_layer_decay(data, tmp_path):
    """The records (and the progress bar) give the base learning rate; the layer-decayed range is logged once."""
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "2", "--log-interval", "1", "--lr", "1e-3",
                             "--min-lr", "1e-5")
    run_tool("train.py", *flags, "--experiment", "plain")
    proc = run_tool("train.py", *flags, "--experiment", "decayed", "--layer-decay", "0.5")
    assert _lrs(tmp_path / "decayed") == _lrs(tmp_path / "plain")
    assert min(_lrs(tmp_path / "decayed").values()) >= 1e-5
    assert "layer decay 0.5:" in proc.stdout and "x the learning rate" in proc.stdout


def test_a_new_head_is_reported_once(data, tmp_path):
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "src"))
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "ft",
                                                  "--num-classes", "5", "--initial-checkpoint",
                                                  str(tmp_path / "src")))
    line = next(l for l in proc.stdout.splitlines() if l.startswith("pretrained: loaded"))
    total = len(torch.load(tmp_path / "ft" / "last" / "train_state.pt", weights_only=True)["model"])
    assert f"loaded {total - 2} of {total} tensors" in line, line
    assert "new (shape changed): head.bias, head.weight" in line and "missing" not in line, line


# --- checkpoints are one unit

def _files(text):
    return {name: (lambda p, t=text: open(p, "w").write(t)) for name in ("a.json", "b.json")}


def _content(folder):
    return {n: open(os.path.join(folder, n)).read() for n in sorted(os.listdir(folder))}


def test_checkpoint_folder_survives_a_crash_at_every_step(tmp_path, monkeypatch):
    """A crash while writing, between the two renames, or before the old copy is removed leaves the old or the
    new checkpoint whole once recovered (what a resumed run does first), never files of both."""
    import linvision.utils.files as ck

    folder = str(tmp_path / "last")
    write_checkpoint_folder(folder, _files("old"))
    assert _content(folder) == {"a.json": "old", "b.json": "old"}

    def crash_in_write(p):
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint_folder(folder, {"a.json": _files("new")["a.json"], "b.json": crash_in_write})
    recover_checkpoint_folder(folder)
    assert _content(folder) == {"a.json": "old", "b.json": "old"}

    real_replace = os.replace
    for crash_at in (1, 2):  # after moving the old folder aside / after moving the new one in
        calls = []

        def replace(src, dst):
            calls.append(src)
            real_replace(src, dst)
            if len(calls) == crash_at:
                raise KeyboardInterrupt("killed")

        monkeypatch.setattr(ck.os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            write_checkpoint_folder(folder, _files(f"new{crash_at}"))
        monkeypatch.setattr(ck.os, "replace", real_replace)
        recover_checkpoint_folder(folder)
        assert _content(folder) == {"a.json": f"new{crash_at}", "b.json": f"new{crash_at}"}
        assert sorted(os.listdir(tmp_path)) == ["last"]  # no .last.new / .last.old left


def test_train_state_loads_without_pickle_and_a_crafted_one_does_not_run(data, tmp_path):
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "2", "--experiment", "s",
                                           "--stop-after-steps", "2"))
    state_path = tmp_path / "s" / "last" / "train_state.pt"
    state = torch.load(state_path, weights_only=True)  # tensors, numbers and containers only
    assert state["global_step"] == 2 and state["batch_size"] == 4
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model": Payload()}, state_path)
    proc = run_tool("train.py", "--resume", str(tmp_path / "s"), check=False)
    assert proc.returncode == 2 and "resume: cannot read" in proc.stderr
    assert not marker.exists()


# --- resume

def test_resume_extends_the_schedule_and_refuses_a_new_batch_size(data, tmp_path):
    flags = ["--no-aug", "--log-interval", "1", "--lr", "0.003", "--min-lr", "0.0001"]
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "4", "--experiment", "long", *flags))
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "2", "--experiment", "short", *flags))
    proc = run_tool("train.py", "--resume", str(tmp_path / "short"), "--epochs", "4")
    assert "schedule extended from 2 to 4 epochs" in proc.stdout
    long, short = _lrs(tmp_path / "long"), _lrs(tmp_path / "short")
    assert sorted(short) == list(range(1, 13))
    # the added epochs follow the 4-epoch cosine, not the old schedule's minimum
    assert [short[s] for s in range(7, 13)] == pytest.approx([long[s] for s in range(7, 13)], rel=1e-6)
    assert short[7] > 10 * 0.0001
    proc = run_tool("train.py", "--resume", str(tmp_path / "short"), "--epochs", "5", "-b", "2", check=False)
    assert proc.returncode == 2 and "batch_size: the run trained with 4" in proc.stderr


def test_resume_drops_records_written_after_the_checkpoint(data, tmp_path):
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "2", "--experiment", "m", "--log-interval", "1")
    run_tool("train.py", *flags, "--stop-after-steps", "4")
    metrics = tmp_path / "m" / "metrics.jsonl"
    with open(metrics, "a") as f:  # what a run killed after step 5 (checkpoint at 4) would have left
        f.write(json.dumps({"kind": "step", "epoch": 1, "step": 5, "loss": 9.0, "lr": 0.1}) + "\n")
        f.write('{"kind": "step", "ep')
    proc = run_tool("train.py", "--resume", str(tmp_path / "m"))
    assert "dropped 2 metric records" in proc.stdout and "at epoch 1, step 1 of 3" in proc.stdout
    steps = [s for s, _ in step_losses(str(tmp_path / "m"))]
    assert steps == list(range(1, 7))
    assert [r["epoch"] for r in map(json.loads, open(metrics)) if r["kind"] == "epoch"] == [0, 1]


# --- inputs checked where they enter

def test_class_lists_are_checked(tmp_path):
    root = write_image_folder(tmp_path / "d", classes=3)
    os.rename(os.path.join(root, "val", "class1"), os.path.join(root, "val_class1_aside"))
    proc = run_tool("train.py", *tiny_train_flags(root, str(tmp_path), "--epochs", "1"), check=False)
    assert proc.returncode == 2 and "missing in validation: ['class1']" in proc.stderr
    one = write_image_folder(tmp_path / "one", classes=1)
    proc = run_tool("train.py", *tiny_train_flags(one, str(tmp_path), "--epochs", "1"), check=False)
    assert proc.returncode == 2 and "one class" in proc.stderr
    # a checkpoint validated on data with other classes
    good = write_image_folder(tmp_path / "good", classes=2)
    run_tool("train.py", *tiny_train_flags(good, str(tmp_path), "--epochs", "1", "--experiment", "c2"))
    other = write_image_folder(tmp_path / "other", classes=3)
    proc = run_tool("validate.py", "--checkpoint", str(tmp_path / "c2"), "--data-dir", other, check=False)
    assert proc.returncode == 2 and "not trained on: ['class2']" in proc.stderr


def test_weight_loads_are_reported_and_incompatible_ones_refused(data, tmp_path):
    from safetensors.torch import save_file

    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "src"))
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "ft",
                                                  "--initial-checkpoint", str(tmp_path / "src")))
    assert "pretrained: loaded " in proc.stdout
    save_file({"fc.weight": torch.zeros(3, 3)}, str(tmp_path / "other.safetensors"))
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--initial-checkpoint",
                                                  str(tmp_path / "other.safetensors")), check=False)
    assert proc.returncode == 2 and "fits 0 of the model's" in proc.stderr
    from safetensors.torch import load_file

    # weights of a wider model: the error names the tensors of another shape with both shapes
    src = load_file(str(tmp_path / "src" / "best" / "model.safetensors"))
    wide = {k: torch.zeros(2 * v.shape[0], *v.shape[1:]) if v.ndim else v for k, v in src.items()}
    save_file(wide, str(tmp_path / "wide.safetensors"))
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--initial-checkpoint",
                                                  str(tmp_path / "wide.safetensors")), check=False)
    found = re.search(r"(\d+) of another shape, e.g. ([\w.]+): ([\dx]+) in the file, ([\dx]+) in the model",
                      proc.stderr)
    assert proc.returncode == 2 and found, proc.stderr
    shape = tuple(src[found.group(2)].shape)
    assert found.group(3) == "x".join(map(str, (2 * shape[0], *shape[1:])))
    assert found.group(4) == "x".join(map(str, shape))
    assert int(found.group(1)) == sum(v.ndim > 0 for v in src.values()) and "missing" not in proc.stderr

    ints = {k: v.to(torch.int32) for k, v in load_file(str(tmp_path / "src" / "best" / "model.safetensors")).items()}
    save_file(ints, str(tmp_path / "ints.safetensors"))
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--initial-checkpoint",
                                                  str(tmp_path / "ints.safetensors")), check=False)
    assert proc.returncode == 2 and "torch.int32" in proc.stderr


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    from linvision.data.datasets import _load_rgb

    grey = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    Image.fromarray(grey).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    out = np.asarray(_load_rgb(str(tmp_path / "g16.png")))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    np.testing.assert_allclose(out[..., 0], grey / 65535 * 255, atol=0.51)


@pytest.mark.parametrize("bad", ["epochs=0", "log_interval=0", "batch_size=-1", "smoothing=1.5"])
def test_config_values_are_checked_with_the_key_named(data, tmp_path, bad):
    key, value = bad.split("=")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"batch_size: 4\n{key}: {value}\n")  # the later key wins
    flags = ["--dataset", "folder", "--data-dir", data, "--img-size", "16", "--model", "test_vit", "--model-kwargs",
             *TINY_VIT, "--output", str(tmp_path), "--no-progress", "--device", "cpu"]
    proc = run_tool("train.py", "--config", str(cfg), *flags, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {key}: must be") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("damage", ["truncated_weights", "garbage_json", "json_without_keys", "other_model"])
def test_a_damaged_checkpoint_is_one_line(data, tmp_path, damage):
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--experiment", "v"))
    best = tmp_path / "v" / "best"
    if damage == "truncated_weights":
        blob = (best / "model.safetensors").read_bytes()
        (best / "model.safetensors").write_bytes(blob[: len(blob) // 2])
        expected = "cannot read"
    elif damage == "garbage_json":
        (best / "model.json").write_text("{not json")
        expected = "is not valid JSON"
    elif damage == "json_without_keys":
        (best / "model.json").write_text('{"img_size": 16}')
        expected = "lacks ['model', 'num_classes']"
    else:
        meta = json.loads((best / "model.json").read_text())
        (best / "model.json").write_text(json.dumps({**meta, "model": "resnet10t", "model_kwargs": {}}))
        expected = "does not hold the weights of the resnet10t"
    proc = run_tool("validate.py", "--checkpoint", str(tmp_path / "v"), "--data-dir", data, check=False)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr


def test_a_last_batch_of_one_trains_with_batchnorm(tmp_path):
    root = write_image_folder(tmp_path / "d", classes=3, train_per_class=3)  # 9 images, batch 4: 4 + 4 + 1
    run_tool("train.py", "--dataset", "folder", "--data-dir", root, "--img-size", "16", "--model", "resnet10t",
             "-b", "4", "--epochs", "1", "--output", str(tmp_path), "--no-progress", "--device", "cpu",
             "--experiment", "bn", "--log-interval", "1")
    assert len(step_losses(str(tmp_path / "bn"))) == 2  # the single image waits for the next epoch's order


# --- signals

def _wait_for_steps(proc, metrics, n):
    wait_until(lambda: metrics.exists() and metrics.read_text().count('"step"') >= n, proc,
               what=f"{n} step records in {metrics}")


def test_sigterm_to_the_process_group_with_workers_saves(data, tmp_path):
    """timeout, SLURM and shells signal the whole group: the loader workers must not die first."""
    args = tiny_train_flags(data, str(tmp_path), "--epochs", "200", "--experiment", "grp", "--log-interval", "1",
                            "-j", "2")
    proc = spawn([PY, os.path.join(ROOT, "linvision", "tools", "train.py"), *args], tmp_path, "grp", cwd=ROOT,
                 start_new_session=True)
    _wait_for_steps(proc, tmp_path / "grp" / "metrics.jsonl", 2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    _, err = logs(tmp_path, "grp")
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"continue with: linvision-train --resume {tmp_path / 'grp'}" in err
    state = torch.load(tmp_path / "grp" / "last" / "train_state.pt", weights_only=True)
    assert state["global_step"] == step_losses(str(tmp_path / "grp"))[-1][0]


def test_sigterm_saves_the_diffusion_trainer(tmp_path):
    cfg = tmp_path / "d.yaml"
    cfg.write_text("steps: 100000\nbatch_size: 8\nlog_every: 1\nsave_every: 0\nthreads: 1\n"
                   "model_kwargs: {dim: 32, depth: 1, num_heads: 2, head_dim: 16}\n")
    proc = spawn([*command_argv("linvision-train-diffusion"), "--config", str(cfg), "--output", str(tmp_path),
                  "--experiment", "dit"], tmp_path, "dit-log", cwd=ROOT, start_new_session=True)
    wait_until(lambda: logs(tmp_path, "dit-log")[0].count("step ") >= 3, proc, what="3 steps")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    _, err = logs(tmp_path, "dit-log")
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint saved" in err
    meta = json.loads((tmp_path / "dit" / "last" / "model.json").read_text())
    state = torch.load(tmp_path / "dit" / "last" / "train_state.pt", weights_only=True)
    assert meta["step"] == state["step"] >= 3


@pytest.mark.slow
@pytest.mark.parametrize("kills", [10])
def test_random_kills_lose_nothing(data, tmp_path, kills):
    """kill -9 at random moments (during start-up, steps, evaluation and checkpoint writes), then resume, until
    the run finishes: the final weights are bitwise those of an uninterrupted run, and every step is logged
    exactly once with the uninterrupted run's loss (augmentation on: its RNG state is part of the checkpoint)."""
    import random

    starts = iter(range(10_000))

    def start(*args):
        name = f"start{next(starts)}"
        proc = spawn([PY, os.path.join(ROOT, "linvision", "tools", "train.py"), *args], tmp_path, name, cwd=ROOT)
        proc.log_name = name
        return proc

    def finish(proc, timeout=SUBPROCESS_TIMEOUT):
        proc.wait(timeout=timeout)
        return logs(tmp_path, proc.log_name)[1]

    def records(run_dir):  # metrics lines written so far (a line cut by a kill counts)
        path = run_dir / "metrics.jsonl"
        return len(path.read_bytes().splitlines()) if path.exists() else 0

    rng = random.Random(0)
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "8", "--log-interval", "1")
    # the uninterrupted run, and its start-up time (until its first metrics line)
    t0, t_startup = time.monotonic(), None
    proc = start(*flags, "--experiment", "ref")
    while proc.poll() is None and time.monotonic() - t0 < SUBPROCESS_TIMEOUT:
        if t_startup is None and records(tmp_path / "ref"):
            t_startup = time.monotonic() - t0
        time.sleep(0.01)
    err = finish(proc, timeout=60)
    assert proc.returncode == 0 and t_startup is not None, err
    total = records(tmp_path / "ref")
    run = tmp_path / "k"
    killed = 0
    while True:
        if (run / "last" / "train_state.pt").exists():
            proc = start("--resume", str(run))
        else:
            proc = start(*flags, "--experiment", "k", "--overwrite")
        if killed < kills:
            before = records(run)
            if before >= total - 1 or rng.random() < 0.3:  # during start-up (imports, resume)
                time.sleep(rng.uniform(0.3, 0.9) * t_startup)
            else:  # a moment after a random one of the records still to come: in a step, evaluation or checkpoint
                # (a resume first drops records past its checkpoint); kills spread over the whole run
                target = rng.randint(before + 1, min(total - 1, before + max(2, total // kills)))
                wait_until(lambda: records(run) >= target, proc, what=f"record {target}", interval=0.005)
                time.sleep(rng.uniform(0.0, 0.03))
            if proc.poll() is None:
                proc.kill()
                killed += 1
        err = finish(proc, timeout=300)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err
    assert killed == kills
    assert (run / "last" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "last" /
                                                                 "model.safetensors").read_bytes()
    assert step_losses(str(run)) == step_losses(str(tmp_path / "ref"))
    assert not [n for n in os.listdir(run) if n.startswith(".") and n != ".lock"]


def test_loader_workers_leave_the_group_but_still_end_on_sigterm():
    """Workers sit outside the run's process group (a group signal reaches only the main process), and have
    SIGTERM's default action even when forked under the training loop's stop-flag handler: the DataLoader and
    multiprocessing's exit handler end stuck workers with it, so a worker that survived it would leave the
    process hanging at exit."""
    from linvision.data.datasets import ShardedSampler, create_loader

    from linvision.utils.interrupt import StopFlag

    loader = create_loader(list(range(8)), 2, ShardedSampler(8, shuffle=False), num_workers=1)
    with StopFlag():  # the workers are forked while the trainer's handler is installed, as in training
        it = iter(loader)
    assert next(it).tolist() == [0, 1]
    worker = it._workers[0]
    assert os.getpgid(worker.pid) == worker.pid != os.getpgid(0)
    os.kill(worker.pid, signal.SIGTERM)
    # a worker that ends on SIGTERM is reported by the DataLoader's SIGCHLD handler in this process
    with pytest.raises(RuntimeError, match="killed by signal: Terminated"):
        for _ in range(100):
            time.sleep(0.1)
    assert not worker.is_alive()
    del it
