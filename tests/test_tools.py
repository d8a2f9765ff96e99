"""The command-line tools end to end on tiny data, and their answers to bad input."""
import argparse
import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess

import pytest

from linvision.utils.config import parse_args
from linvision.training.train import add_train_args
from support import (PY, ROOT, SCRIPTS, command_parser, logs, run_subprocess, run_tool, spawn, step_losses,
                     tiny_train_flags, wait_until, write_image_folder)

@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out"))
    cfg = os.path.join(out, "run.yaml")
    with open(cfg, "w") as f:
        f.write("epochs: 5\nlr: 0.001\nexperiment: from_config\nlog_interval: 1\n")
    proc = run_tool("train.py", "--config", cfg, *tiny_train_flags(data, out, "--lr", "0.003"))
    return os.path.join(out, "from_config"), proc


def test_train_writes_checkpoints_metrics_and_summary(trained):
    run_dir, proc = trained
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert f"best top-1 {summary['best_top1']:.2f}" in proc.stdout
    with open(os.path.join(run_dir, "config.yaml")) as f:
        text = f.read()
    assert "lr: 0.003" in text and "epochs: 5" in text  # the command line beat the config file
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(5))
    assert summary["best_top1"] == max(r["val_top1"] for r in epochs)
    assert len(step_losses(run_dir)) == 5 * 3  # 12 images, batch 4
    for name in ("best/model.safetensors", "best/model.json", "last/train_state.pt"):
        assert os.path.isfile(os.path.join(run_dir, name))


def test_validate_reproduces_the_best_score_and_runs_other_sizes(trained, data):
    run_dir, _ = trained
    proc = run_tool("validate.py", "--checkpoint", run_dir, "--data-dir", data, "--img-size", "16", "24")
    out = json.loads(proc.stdout)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    at16, at24 = out["results"]
    assert at16["img_size"] == 16 and at16["count"] == 6
    assert at16["top1"] == pytest.approx(summary["best_top1"])
    assert at16["loss"] == pytest.approx(summary["best"]["loss"], rel=1e-5)
    assert at24["img_size"] == 24 and "top1" in at24  # dynamic_img_size lets the ViT run at another size


def test_validate_in_16_bit_weights_and_compiled(trained, data, monkeypatch):
    """--weights bf16: the run's weights in bf16 (no autocast) score the validation set within bf16 rounding of
    fp32 (the same count, the loss to 5%); --compile inductor runs the model under torch.compile (here its
    aot_eager backend: Inductor's code generation takes minutes on a CPU) with fp32's figures; 16-bit weights
    under --amp are refused in one line."""
    import torch

    from linvision.training.validate import validate_checkpoint

    run_dir, _ = trained
    fp32 = validate_checkpoint(run_dir, data_dir=data, img_sizes=[16])["results"][0]
    bf16 = validate_checkpoint(run_dir, data_dir=data, img_sizes=[16], weights="bf16")["results"][0]
    assert bf16["count"] == fp32["count"] == 6
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=5e-2)
    real, modes = torch.compile, []

    def compile_for_test(model, mode=None, **kwargs):
        modes.append(mode)
        return real(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_for_test)
    torch._dynamo.reset()
    got = validate_checkpoint(run_dir, data_dir=data, img_sizes=[16], compile="inductor")["results"][0]
    assert modes == [None]
    assert got["top1"] == fp32["top1"] and got["loss"] == pytest.approx(fp32["loss"], rel=1e-5)
    proc = run_tool("validate.py", "--checkpoint", run_dir, "--data-dir", data, "--weights", "fp16", "--amp",
                    "bf16", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: weights: fp16 weights run without autocast (the model is in that dtype); got amp 'bf16': pass "
        "--amp none"]


def test_validate_gives_the_known_answer_of_a_constant_classifier(trained, data, tmp_path):
    """A head with zero weights and bias b predicts argmax(b) for every image: top-1 is that class's share of
    the validation set and the loss is mean_c (logsumexp(b) - b_c) over the (balanced) classes."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    run_dir, _ = trained
    const = tmp_path / "const"
    shutil.copytree(run_dir, const)
    weights = const / "best" / "model.safetensors"
    state = load_file(weights)
    bias = [0.0, 3.0, 1.0]
    state["head.weight"] = torch.zeros_like(state["head.weight"])
    state["head.bias"] = torch.tensor(bias)
    save_file(state, weights)
    out = json.loads(run_tool("validate.py", "--checkpoint", str(const / "best"), "--data-dir", data).stdout)
    (res,) = out["results"]
    lse = math.log(sum(math.exp(b) for b in bias))
    assert res["count"] == 6 and res["top1"] == pytest.approx(100 / 3) and res["top5"] == 100.0
    assert res["loss"] == pytest.approx(sum(lse - b for b in bias) / 3, rel=1e-6)


def test_fine_tune_from_pretrained_path_with_new_head(trained, tmp_path):
    """The backbone starts from the source weights (a learning rate of 1e-12 keeps them), the head is new."""
    from safetensors.torch import load_file

    run_dir, _ = trained
    data4 = write_image_folder(tmp_path / "data4", classes=4, seed=1)
    run_tool("train.py", *tiny_train_flags(data4, str(tmp_path), "--epochs", "1", "--experiment", "ft",
                                           "--lr", "1e-12", "--warmup-lr", "1e-12", "--min-lr", "1e-12",
                                           "--pretrained-path", os.path.join(run_dir, "best")))
    with open(tmp_path / "ft" / "best" / "model.json") as f:
        assert json.load(f)["num_classes"] == 4
    source = load_file(os.path.join(run_dir, "best", "model.safetensors"))
    tuned = load_file(str(tmp_path / "ft" / "best" / "model.safetensors"))
    assert set(source) == set(tuned)
    assert tuned["head.weight"].shape[0] == 4 and source["head.weight"].shape[0] == 3
    backbone = [k for k in source if not k.startswith("head.")]
    assert len(backbone) > 10
    for key in backbone:
        assert (tuned[key] - source[key]).abs().max() < 1e-6, key


def test_sigterm_saves_a_checkpoint_that_resumes(data, tmp_path):
    args = tiny_train_flags(data, str(tmp_path), "--epochs", "200", "--experiment", "sig", "--log-interval", "1")
    proc = spawn([PY, os.path.join(ROOT, "linvision", "tools", "train.py"), *args], tmp_path, "sig-log", cwd=ROOT)
    metrics = tmp_path / "sig" / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, proc, what="2 metric records")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    _, err = logs(tmp_path, "sig-log")
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint saved" in err
    import torch

    state = torch.load(tmp_path / "sig" / "last" / "train_state.pt", weights_only=False)
    assert state["global_step"] == step_losses(str(tmp_path / "sig"))[-1][0]
    # the run folder and the new length are enough: the rest comes from the run's config.yaml
    run_tool("train.py", "--resume", str(tmp_path / "sig"), "--epochs", str(state["epoch"] + 1))
    steps = [s for s, _ in step_losses(str(tmp_path / "sig"))]
    assert steps == list(range(1, 3 * (state["epoch"] + 1) + 1))  # no step lost or repeated


def test_ctrl_c_under_a_pipe_whose_reader_is_gone_saves_and_says_so(data, tmp_path):
    """``linvision-train ... | tee`` stopped by Ctrl-C: tee dies with it, so the run's standard output has no
    reader any more (here from the start: every epoch line finds the pipe broken). The run goes on to its next
    step, saves, prints the message on stderr (a pipe, read after the exit: it was flushed) and exits 130."""
    import subprocess

    args = tiny_train_flags(data, str(tmp_path), "--epochs", "200", "--experiment", "int", "--log-interval", "1")
    read, write = os.pipe()
    os.close(read)  # the reader of its standard output is gone
    proc = subprocess.Popen([PY, os.path.join(ROOT, "linvision", "tools", "train.py"), *args], stdout=write,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    os.close(write)
    metrics = tmp_path / "int" / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count('"epoch"') >= 2, proc,
               what="2 epochs, each ending with a line to the broken pipe")
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    assert f"interrupted by SIGINT; checkpoint saved in {tmp_path / 'int'}; continue with:" in err
    assert "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.parametrize("flags, expected", [
    (["--epoch", "3"], "error: unrecognized arguments: --epoch 3 (did you mean --epochs?)"),
    (["--amp", "bf61"], "error: argument --amp: invalid choice: 'bf61' (choose from 'none', 'bf16', 'fp16') "
                        "(did you mean bf16?)"),
])
def test_unknown_flags_and_values_name_the_nearest_in_two_lines(flags, expected):
    proc = run_tool("train.py", *flags, check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"linvision-train: {expected}", "linvision-train --help lists every flag"]


def test_an_unknown_dataset_names_the_nearest(data, tmp_path):
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--dataset", "photos_aspekt"), check=False)
    assert proc.returncode == 2
    assert "error: dataset: unknown 'photos_aspekt' (did you mean 'photos_aspect'?); allowed:" in proc.stderr


@pytest.mark.parametrize("case", ["missing_data", "unknown_model", "unknown_key", "corrupt_image",
                                  "corrupt_image_unchecked"])
def test_bad_input_gives_a_clear_error(case, data, tmp_path):
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "1")
    if case == "missing_data":
        flags += ["--data-dir", str(tmp_path / "nowhere")]
        expected = "folder not found"
    elif case == "unknown_model":
        flags += ["--model", "vit_no_such_model"]
        expected = "unknown 'vit_no_such_model'"
    elif case == "unknown_key":
        cfg = tmp_path / "bad.yaml"
        cfg.write_text("epochs: 1\nlearnin_rate: 0.1\n")
        flags += ["--config", str(cfg)]
        expected = "unknown key 'learnin_rate'"
    else:
        bad = write_image_folder(tmp_path / "bad")
        broken = os.path.join(bad, "train", "class0", "0.png")
        with open(broken, "wb") as f:
            f.write(b"\x89PNG truncated")
        flags += ["--data-dir", bad, "--workers", "1"]
        # read before the first step; unchecked, when a loader worker draws it
        expected = f"1 of the 12 training files cannot be read: {broken}"
        if case == "corrupt_image_unchecked":
            flags.append("--no-check-images")
            expected = f"cannot read image file {broken}"
    proc = run_tool("train.py", *flags, check=False)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def _bench(tmp_path, experiment, *flags):
    return run_tool("benchmark.py", *flags, "-b", "2", "--iters", "2", "--warmup", "0", "--device", "cpu",
                    "--output", str(tmp_path), "--experiment", experiment, check=False)


def test_benchmark_cli_records_a_failure_and_plots(tmp_path):
    """A point that fails is recorded, the sweep goes on, the plot shows the rest, and the exit status says so."""
    proc = _bench(tmp_path, "b", "--model", "test_vit", "--img-size", "16", "20", "32")  # 20: not a multiple of 16
    assert proc.returncode == 1, proc.stderr
    with open(tmp_path / "b" / "results.json") as f:
        points = json.load(f)
    assert [(p["img_size"], p["status"]) for p in points] == [(16, "ok"), (20, "error"), (32, "ok")]
    assert "divisible by patch size" in points[1]["error"]
    assert points[2]["gflops"] > points[0]["gflops"] > 0 and points[0]["iters"] == 2
    for p in (points[0], points[2]):  # the median of the 2 runs (their mean), between the fastest and the slowest
        for kind in ("infer", "train"):
            assert p[f"{kind}_ms_min"] <= p[f"{kind}_ms"] <= p[f"{kind}_ms_max"]
            assert p[f"{kind}_ms"] == pytest.approx((p[f"{kind}_ms_min"] + p[f"{kind}_ms_max"]) / 2)
            assert p[f"{kind}_img_s_min"] == pytest.approx(2000 / p[f"{kind}_ms_max"])
            assert p[f"{kind}_spread_pct"] == pytest.approx(
                100 * (p[f"{kind}_ms_max"] - p[f"{kind}_ms_min"]) / p[f"{kind}_ms"])
    assert "warm-up + 2 timed runs per figure (their median)" in proc.stdout
    assert "median of 2 timed runs" in proc.stdout  # each point's line
    assert "2 of 3 points measured, 0 out of memory, 1 failed" in proc.stdout
    assert "with throughput_memory.png" in proc.stdout
    for name in ("results.csv", "results.jsonl", "throughput_memory.png"):
        assert (tmp_path / "b" / name).stat().st_size > 0


def test_benchmark_cli_says_when_there_is_no_plot(tmp_path):
    proc = _bench(tmp_path, "none", "--models", "linvit_tiny_patch16_rope_224", "--img-size", "20")
    assert proc.returncode == 1
    assert "0 of 1 points measured" in proc.stdout and "no plot" in proc.stdout
    assert not (tmp_path / "none" / "throughput_memory.png").exists()


def test_benchmark_cli_refuses_an_unknown_model_before_measuring(tmp_path):
    proc = _bench(tmp_path, "typo", "--models", "test_vit", "vit_no_such_model", "--img-size", "16")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: model: unknown 'vit_no_such_model'") and "Traceback" not in proc.stderr
    assert not (tmp_path / "typo").exists()


def test_ablate_cli_tables_each_mixer(data, tmp_path):
    args = ["--dataset", "folder", "--data-dir", data, "--img-size", "32", "--model", "linhier_tiny_224",
            "--model-kwargs", '{"depths": [1, 1, 1, 1], "dims": [8, 16, 16, 16], "num_heads": [1, 1, 1, 1]}',
            "--mixers", "none", "linear_rope", "--epochs", "1", "--batch-size", "4", "--eval-sizes", "32", "48",
            "--bench-sizes", "32", "--bench-batch-size", "2", "--bench-iters", "1", "--device", "cpu",
            "--output", str(tmp_path), "--experiment", "ab", "--no-progress"]
    proc = run_tool("ablate.py", *args)
    with open(tmp_path / "ab" / "ablation.json") as f:
        result = json.load(f)
    assert [r["mixer"] for r in result["rows"]] == ["none", "linear_rope"]
    for row in result["rows"]:
        run = tmp_path / "ab" / "runs" / row["mixer"]
        with open(run / "summary.json") as f:
            assert row["accuracy"]["32"] == pytest.approx(json.load(f)["best_top1"])
        saved = parse_args(add_train_args(argparse.ArgumentParser()), [], base_config=str(run / "config.yaml"))
        assert saved.model_kwargs["token_mixers"] == row["mixer"]  # each run folder is a plain training run
    table = (tmp_path / "ab" / "ablation.md").read_text()
    assert sum(line.startswith("| ") for line in table.splitlines()) == 3  # header and 2 rows
    assert "| linear_rope | " in table
    assert ("Throughput: 1 timed run of batch 2 after one warm-up run, the mixers of each size timed interleaved, "
            "on cpu. Memory") in table  # what a figure is
    assert "±" not in table and "+-" not in proc.stdout  # one seed: no spread printed
    assert "   top-1 32 px " in proc.stdout
    assert "== token mixer none (1 of 2" in proc.stdout and "== token mixer linear_rope (2 of 2" in proc.stdout
    # the same command again leaves this ablation as it is and writes beside it
    again = run_tool("ablate.py", *args)
    assert f"writes to {tmp_path / 'ab-1'}" in again.stdout and (tmp_path / "ab-1" / "ablation.md").exists()
    assert (tmp_path / "ab" / "ablation.md").read_text() == table
    for name in ("accuracy.png", "throughput_memory.png"):
        assert (tmp_path / "ab" / name).stat().st_size > 0


def test_torchrun_two_processes_match_one_process(tmp_path):
    """DDP on gloo: 2 ranks x batch 4 take the same steps as 1 process x batch 8 (no BN, no augmentation)."""
    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=8, val_per_class=3)
    flags = ["--epochs", "2", "--no-aug", "--log-interval", "1", "--lr", "0.003", "--seed", "3"]
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--experiment", "one", *flags, "--batch-size", "8"))
    proc = run_subprocess(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(ROOT, "linvision", "tools", "train.py"),
         *tiny_train_flags(data, str(tmp_path), "--experiment", "two", *flags, "--batch-size", "4")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = step_losses(str(tmp_path / "one")), step_losses(str(tmp_path / "two"))
    assert [s for s, _ in two] == [1, 2, 3, 4]
    assert [l for _, l in two] == pytest.approx([l for _, l in one], rel=1e-4)
    with open(tmp_path / "one" / "summary.json") as f, open(tmp_path / "two" / "summary.json") as g:
        s1, s2 = json.load(f), json.load(g)
    assert s2["best"]["top1"] == s1["best"]["top1"] and s2["best"]["loss"] == pytest.approx(s1["best"]["loss"],
                                                                                               rel=1e-4)
    assert proc.stdout.count("best top-1") == 1  # only rank 0 reports


# --- a newcomer's command lines: the size asked for, timm's spellings, installed tools

def _tiny_linvit_flags(data, out, model, size, *extra):
    return ["--dataset", "folder", "--data-dir", data, "--img-size", str(size), "--model", model,
            "--model-kwargs", "embed_dim=16", "depth=1", "num_heads=1", "-b", "4", "--output", out,
            "--no-progress", "--device", "cpu", *extra]


def test_img_size_reaches_a_model_with_a_fixed_grid(data, tmp_path):
    """A learned position embedding is built for the size asked for, and validation at another size rebuilds
    the model with the embedding resampled, instead of an AssertionError about 224."""
    from safetensors.torch import load_file

    run_tool("train.py", *_tiny_linvit_flags(data, str(tmp_path), "linvit_tiny_patch16_224", 32, "--epochs", "1",
                                             "--experiment", "fixed"))
    state = load_file(str(tmp_path / "fixed" / "best" / "model.safetensors"))
    # a 2 x 2 grid of 16 channels at 32 px, not 14 x 14, and the class token's row (timm's layout)
    assert tuple(state["pos_embed"].shape) == (1, 1 + 2 * 2, 16)
    proc = run_tool("validate.py", "--checkpoint", str(tmp_path / "fixed"), "--data-dir", data,
                    "--img-size", "48", "32")  # the training size after another: the model is rebuilt for each
    at48, at32 = json.loads(proc.stdout)["results"]
    with open(tmp_path / "fixed" / "summary.json") as f:
        assert at32["top1"] == pytest.approx(json.load(f)["best_top1"])
    assert "error" not in at48 and at48["count"] == 6


@pytest.mark.parametrize("model", ["linvit_tiny_patch16_rope_224", "linvit_tiny_patch16_224",
                                   "linvit_tiny_patch16_pola_224"])
@pytest.mark.parametrize("size, line", [
    (40, "got 40x40 (the patch grid would leave out 8 rows and 8 columns of pixels); use 32x32 or 48x48"),
    (100, "got 100x100 (the patch grid would leave out 4 rows and 4 columns of pixels); use 96x96 or 112x112"),
])
def test_img_size_a_model_cannot_run_at_is_one_line(data, tmp_path, model, size, line):
    """Every linvit variant refuses a size its patch grid cannot cover before any image is read, the variants
    with a learned position embedding too (they built a 6 x 6 grid for 100 px and trained on it)."""
    proc = run_tool("train.py", *_tiny_linvit_flags(data, str(tmp_path), model, size, "--epochs", "1"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1:] == [
        f"error: img_size: {model}: height and width must be multiples of the patch size 16x16, {line}"]
    assert not list(tmp_path.iterdir()) and "Traceback" not in proc.stderr  # no run folder


def test_timm_spellings_of_the_training_flags(tmp_path):
    parser = add_train_args(argparse.ArgumentParser())
    args = parse_args(parser, ["-b", "32", "-j", "4", "--amp", "--initial-checkpoint", "w.pth",
                               "--dataset", "torch/cifar10"])
    assert (args.batch_size, args.workers, args.amp, args.pretrained_path) == (32, 4, "bf16", "w.pth")
    assert parse_args(parser, ["--amp", "float16"]).amp == "fp16"
    assert parse_args(parser, ["--amp", "bfloat16"]).amp == "bf16"
    assert parse_args(parser, []).amp == "none"
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(parser, ["--amp", "fp8"])


def test_resume_from_a_timm_checkpoint_file(data, tmp_path):
    """A timm train.py checkpoint (epoch, state_dict, optimizer, version 2) continues at the next epoch: the
    losses of that epoch equal an uninterrupted run's (no augmentation, so no random state is involved)."""
    import torch

    flags = ["--epochs", "2", "--no-aug", "--log-interval", "1", "--lr", "0.003"]
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--experiment", "whole", *flags))
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--experiment", "half", *flags,
                                           "--stop-after-steps", "3"))
    ours = torch.load(tmp_path / "half" / "last" / "train_state.pt", weights_only=False)
    assert ours["epoch"] == 1 and ours["step_in_epoch"] == 0
    timm_file = tmp_path / "checkpoint-0.pth.tar"
    torch.save({"epoch": 0, "arch": "test_vit", "state_dict": {f"module.{k}": v for k, v in ours["model"].items()},
                "optimizer": ours["optimizer"], "version": 2, "args": argparse.Namespace(model="test_vit"),
                "metric": 50.0}, timm_file)
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--experiment", "from_timm", *flags,
                                                  "--resume", str(timm_file)))
    assert f"starting at epoch 1 from {timm_file}" in proc.stdout
    whole, resumed = step_losses(str(tmp_path / "whole")), step_losses(str(tmp_path / "from_timm"))
    assert [s for s, _ in resumed] == [4, 5, 6]
    assert [l for _, l in resumed] == pytest.approx([l for s, l in whole if s > 3], rel=1e-5)

    # the same timm file as --initial-checkpoint: its weights (under "state_dict", with timm's arguments
    # pickled beside them as an argparse.Namespace) start a fresh schedule
    for name, source in (("init_timm", timm_file), ("init_ours", tmp_path / "half" / "last")):
        run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--experiment", name, "--epochs", "1",
                                               "--no-aug", "--log-interval", "1", "--initial-checkpoint", str(source)))
    assert step_losses(str(tmp_path / "init_timm")) == step_losses(str(tmp_path / "init_ours"))  # same weights
    assert step_losses(str(tmp_path / "init_timm"))[0] != step_losses(str(tmp_path / "whole"))[0]  # not fresh ones
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a torch file")
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--initial-checkpoint", str(garbage)),
                    check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: pretrained_path: cannot read {garbage}")

    torch.save(ours["model"], tmp_path / "weights.pth")  # weights alone: not a training checkpoint
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--resume", str(tmp_path / "weights.pth")),
                    check=False)
    assert proc.returncode == 2 and "holds no 'state_dict'" in proc.stderr and "--initial-checkpoint" in proc.stderr


def test_resume_accepts_a_file_of_the_run(trained, tmp_path):
    """--resume RUN/last/train_state.pt means the run, as --resume RUN does (here: nothing left to train)."""
    run_dir, _ = trained
    before = step_losses(run_dir)
    run_tool("train.py", "--resume", os.path.join(run_dir, "last", "train_state.pt"))
    assert step_losses(run_dir) == before


def test_a_shipped_config_is_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here: the installed copy is used
    args = parse_args(add_train_args(argparse.ArgumentParser()), ["--config", "digits_demo", "--epochs", "1"])
    assert (args.model, args.dataset, args.epochs) == ("resnet10t", "digits", 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [1, 2\n")
    proc = run_tool("train.py", "--config", str(bad), check=False)
    assert proc.returncode == 2 and "is not valid YAML at line" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_tool("train.py", "--config", "no_such_config", check=False)
    assert proc.returncode == 2 and "digits_demo" in proc.stderr  # the message lists the shipped configs


def test_installed_console_scripts():
    from importlib.metadata import entry_points

    scripts = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name.startswith("linvision-")}
    assert {"linvision-train", "linvision-validate", "linvision-benchmark", "linvision-ablate"} <= set(scripts)
    for ep in scripts.values():
        assert callable(ep.load()), ep.name
    script = os.path.join(os.path.dirname(PY), "linvision-benchmark")
    proc = run_subprocess([script, "--help"], cwd="/", timeout=120)
    assert proc.returncode == 0 and "usage: linvision-benchmark" in proc.stdout


def test_every_command_has_a_parser_with_help_for_each_flag():
    """Each console script of pyproject.toml runs a function of linvision.tools.<module>, whose module has the
    parser the command runs (build_parser(), or PARSERS[command] in a module of several commands): named as the
    command is typed, and with a help line for every flag."""
    import importlib

    assert {"linvision-train", "linvision-validate", "linvision-benchmark", "linvision-export"} <= set(SCRIPTS)
    for name, entry in SCRIPTS.items():
        module, function = entry.split(":")
        assert module.startswith("linvision.tools.") and callable(getattr(importlib.import_module(module), function))
        parser = command_parser(name)
        assert isinstance(parser, argparse.ArgumentParser), name
        assert parser.prog == name
        assert parser.format_help().startswith(f"usage: {name} ")
        bare = [a.option_strings for a in parser._actions
                if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
        assert not bare, f"{name}: flags without a help string: {bare}"


def test_distilling_a_teacher_into_its_own_copy_starts_at_zero_loss(trained, data, tmp_path):
    """The student starts from the teacher's weights and is trained on the distillation term alone: its first
    loss is the KL divergence of two equal distributions, 0; a teacher with another head is refused."""
    run_dir, _ = trained
    flags = tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--no-aug", "--log-interval", "1",
                             "--initial-checkpoint", run_dir, "--distill-teacher", run_dir, "--distill-weight", "1",
                             "--distill-temperature", "2")
    run_tool("train.py", *flags, "--experiment", "kd")
    losses = [loss for _, loss in step_losses(str(tmp_path / "kd"))]
    assert losses[0] == pytest.approx(0.0, abs=1e-6) and losses[1] > 0
    four = write_image_folder(tmp_path / "four", classes=4)
    proc = run_tool("train.py", *tiny_train_flags(four, str(tmp_path), "--epochs", "1", "--distill-teacher", run_dir),
                    check=False)
    assert proc.returncode == 2 and "predicts 3 classes, the model being trained 4" in proc.stderr


def test_the_no_weights_error_lists_every_family_with_weights():
    """timm.create_model(<a model without weights>, pretrained=True) names the families with trained weights as
    the registry has them: those of the model table's rows with weights (docs/models.json, README's table)."""
    import timm

    import linvision  # noqa: F401
    from linvision.benchmark.model_table import _has_weights, read_rows

    rows = read_rows(os.path.join(ROOT, "docs", "models.json"))
    expected = sorted({r["model"].rsplit("_", 1)[0] + "_*" for r in rows if _has_weights(r["model"])})
    assert len(expected) >= 10 and "pola_swin_*" in expected  # loaded from a local copy: weights all the same
    with pytest.raises(ValueError) as error:
        timm.create_model("linhier_tiny_224", pretrained=True)
    assert f"the families with trained weights: {', '.join(expected)} (or" in str(error.value)


def test_amp_on_vig_says_nothing_about_dtypes():
    """--amp on ViG (RMS norms with fp32 weights on bf16 activations): no torch dtype warning to break into the
    progress bar (torch warns once per process: each case in a process of its own), and the forward and backward
    still run; plain torch.autocast does warn."""
    import subprocess
    import sys

    code = ("import timm, torch, linvision\n"
            "from linvision.utils.amp import autocast\n"
            "model = timm.create_model('vig_tiny', depth=1, num_classes=3)\n"
            "with {context}:\n"
            "    out = model(torch.randn(2, 3, 32, 32))\n"
            "out.float().mean().backward()\n"
            "print(out.dtype, model.head.weight.grad is not None)\n")
    ours = subprocess.run([sys.executable, "-W", "always", "-c",
                           code.format(context="autocast(torch.device('cpu'), 'bf16')")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert ours.returncode == 0 and ours.stdout.split() == ["torch.bfloat16", "True"], ours.stderr
    assert "dtype" not in ours.stderr, ours.stderr
    plain = subprocess.run([sys.executable, "-W", "always", "-c",
                            code.format(context="torch.autocast('cpu', dtype=torch.bfloat16)")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "Mismatch dtype between input and weight" in plain.stderr  # what the context keeps out


def test_export_checks_and_times_hxw_sizes_as_the_benchmark_takes_them(tmp_path):
    """--check-sizes and --bench-sizes take a side or HxW (linvision-benchmark's --img-size form), not sides only."""
    bench = tmp_path / "bench.json"
    proc = run_tool("export.py", "--model", "linvit_small_patch16_rope_224", "--model-kwargs", "depth=1",
                    "embed_dim=32", "num_heads=2", "--img-size", "64", "--output", str(tmp_path / "vit.pt2"),
                    "--check-sizes", "64x96", "48", "--bench-sizes", "32x48", "--bench-iters", "1",
                    "--bench-out", str(bench))
    lines = proc.stdout.splitlines()
    assert lines[1].startswith(f"check {tmp_path / 'vit.pt2'} against eager at 64x96, 48x48: ") and \
        lines[1].endswith(": ok")
    assert lines[2].startswith("torch threads: ") and lines[3].startswith("bench 32x48: eager ")
    assert json.loads(bench.read_text())["rows"][0]["size"] == "32x48"
    proc = run_tool("export.py", "--model", "mlla_tiny", "--output", "x.pt2", "--check-sizes", "320by512",
                    check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == (
        "linvision-export: error: argument --check-sizes: img_size: '320by512' is neither a side nor HxW (e.g. 512 "
        "or 2048x1024)")


@pytest.mark.parametrize("flags, expected", [
    (["--learning-rate", "0.1"], "--learning-rate 0.1 (did you mean --lr?)"),
    (["--learning_rate", "0.1"], "--learning_rate 0.1 (did you mean --lr?)"),
    (["--batch_size", "4"], "--batch_size 4 (did you mean --batch-size?)"),
    (["--num-epochs", "3"], "--num-epochs 3 (did you mean --epochs?)"),
])
def test_other_tools_spellings_of_a_flag_name_the_tools_own(flags, expected):
    proc = run_tool("train.py", *flags, check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"linvision-train: error: unrecognized arguments: {expected}",
                                        "linvision-train --help lists every flag"]


@pytest.mark.parametrize("name, nearest", [("mla_tiny", "mlla_tiny"), ("mla_tiny.in1k", "mlla_tiny.in1k"),
                                           ("linvit_tiny_patch16", "linvit_tiny_patch16_224")])
def test_a_misspelt_model_names_the_nearest_registered_one(data, tmp_path, name, nearest):
    """Before any image is read (no image-check bar) and in one line."""
    proc = run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--model", name, "--progress"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: model: unknown {name!r} (did you mean {nearest!r}?); similar: "
        + proc.stderr.strip().split("; similar: ", 1)[-1]]
    assert "reading the" not in proc.stderr


def test_resume_with_a_stop_the_run_has_passed_is_refused_in_one_line(data, tmp_path):
    """--stop-after-steps counts the run's steps from its start: resumed at step 6, 4 is behind it (it took a step
    and said "stopped after step 7"); 8 stops at 8."""
    flags = ["--epochs", "4", "--log-interval", "1"]
    run_tool("train.py", *tiny_train_flags(data, str(tmp_path), "--experiment", "cut", *flags,
                                           "--stop-after-steps", "6"))
    run_dir = str(tmp_path / "cut")
    proc = run_tool("train.py", "--resume", run_dir, "--stop-after-steps", "4", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: stop_after_steps: the run resumes at step 6 and --stop-after-steps counts the run's steps from its "
        "start, so 4 is behind it; give more than 6 (e.g. --stop-after-steps 10 for 4 more)"]
    assert [s for s, _ in step_losses(run_dir)] == list(range(1, 7))  # nothing trained, nothing cut
    proc = run_tool("train.py", "--resume", run_dir, "--stop-after-steps", "8")
    assert "stopped after step 8 (--stop-after-steps 8)" in proc.stdout
    assert [s for s, _ in step_losses(run_dir)] == list(range(1, 9))


# --- torch's CPU threads: one rule, one flag, the choice printed

CPU_TOOLS = ["linvision-train", "linvision-train-seg", "linvision-validate", "linvision-benchmark", "linvision-ablate",
             "linvision-export", "linvision-linearize", "linvision-bench-naflex", "linvision-train-diffusion",
             "linvision-sample-diffusion", "linvision-eval-diffusion-samples", "linvision-bench-diffusion-block"]


@pytest.mark.parametrize("command", CPU_TOOLS)
def test_every_tool_that_runs_torch_on_the_cpu_takes_its_threads_the_same_way(command):
    from linvision.utils.cli import THREADS_HELP

    parser = command_parser(command)
    (action,) = [a for a in parser._actions if "--threads" in a.option_strings]
    assert (action.default, action.type, action.help) == (None, int, THREADS_HELP)


def test_the_threads_rule_flag_then_omp_num_threads_then_the_free_cores(monkeypatch):
    import torch

    from linvision.benchmark import throughput
    from linvision.utils import threads

    assert throughput.threads_for_load is threads.threads_for_load  # one implementation, re-exported
    assert throughput.machine_load is threads.machine_load
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for load, chosen in ((1.3, "1 of 2 (1.3 of 2 cores busy"), (0.2, "2 of 2 (0.2 of 2 cores busy")):
            torch.set_num_threads(2)
            monkeypatch.setattr(threads, "machine_load",
                                lambda sample_s=None, load=load: {"load": load, "cores": 2, "threads": 2})
            said = threads.set_threads()
            assert said == f"torch threads: {chosen}; --threads to choose)"
            assert torch.get_num_threads() == int(chosen[0]) and threads.threads_note() == said
        assert threads.set_threads(1) == "torch threads: 1 (--threads)" and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert threads.set_threads() == "torch threads: 1 (OMP_NUM_THREADS=1)"
        with pytest.raises(ValueError, match=r"^threads: at least 1, got 0$"):
            threads.set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_train_says_what_it_runs_in_one_line_before_reading_an_image(data, tmp_path):
    """The opening line: model, parameters, size, data folder, classes, training / validation images, device,
    precision and threads, before the image-check bar (stderr merged into stdout, in the order written). With no
    OMP_NUM_THREADS and no --threads the threads are the free cores' (the rule's line); --threads 1 says so."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    flags = [PY, "-m", "linvision.tools.train", *tiny_train_flags(data, str(tmp_path), "--epochs", "1", "--progress")]
    proc = run_subprocess(flags, env=env)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    head = (f"training test_vit (0.25M parameters) at 16 px on folder {data}: 3 classes, 12 training / 6 validation "
            f"images; cpu, fp32 (no AMP), torch threads: ")
    assert first.startswith(head)
    assert re.fullmatch(r"\d+ of \d+ \([\d.]+ of \d+ cores busy; --threads to choose\)|1 \(torch's default here; "
                        r"--threads to choose\)", first[len(head):]), first
    merged = subprocess.run([*flags, "--threads", "1", "--experiment", "one"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=600)
    assert merged.returncode == 0, merged.stdout
    assert merged.stdout.index(head + "1 (--threads)") < merged.stdout.index("reading the training images")
    validated = run_tool("validate.py", "--checkpoint", str(tmp_path / "one"), "--threads", "1")
    assert json.loads(validated.stdout)["threads"] == "torch threads: 1 (--threads)"  # stdout holds the JSON
