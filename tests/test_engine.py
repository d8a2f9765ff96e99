"""Library code behind the tools: configuration, data, checkpoints, evaluation, training resume, benchmark."""
import argparse
import math
import os

import numpy as np
import pytest
import timm
import torch
from torch import nn

from linvision.benchmark.plots import plot_results
from linvision.benchmark.throughput import benchmark_point, run_sweep
from linvision.utils.measure import MemoryMeter
from linvision.utils.checkpoint import load_model, load_pretrained, save_checkpoint
from linvision.utils.factory import create_model
from linvision.utils.files import atomic_write
from linvision.utils.config import ConfigError, parse_args, parse_kwargs
from linvision.data.datasets import BadImageError, ShardedSampler, create_dataset
from linvision.training.evaluate import evaluate
from linvision.training.train import add_train_args, train
from support import TINY_VIT, step_losses, write_image_folder



def train_args(data_dir, out_dir, *extra):
    parser = add_train_args(argparse.ArgumentParser())
    return parse_args(parser, ["--dataset", "folder", "--data-dir", data_dir, "--img-size", "16",
                               "--model", "test_vit", "--model-kwargs", *TINY_VIT, "--batch-size", "4",
                               "--output", out_dir, "--no-progress", "--log-interval", "1", "--device", "cpu",
                               *extra])


# --- configuration

def test_config_file_sets_defaults_and_command_line_wins(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("img-size: 48\nlr: 0.5\nmodel_kwargs: {depth: 2}\n")
    parser = add_train_args(argparse.ArgumentParser())
    args = parse_args(parser, ["--config", str(cfg), "--lr", "0.25"])
    assert args.img_size == 48 and args.lr == 0.25 and args.model_kwargs == {"depth": 2}


def test_config_unknown_key_is_named(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("img_size: 48\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        parse_args(add_train_args(argparse.ArgumentParser()), ["--config", str(cfg)])


def test_parse_kwargs_forms():
    assert parse_kwargs(["token_mixers=none,linear", "drop_path_rate=0.1", "flag=true"]) == {
        "token_mixers": "none,linear", "drop_path_rate": 0.1, "flag": True}
    assert parse_kwargs(['{"depths": [1, 2]}']) == {"depths": [1, 2]}
    with pytest.raises(ConfigError, match="model_kwargs"):
        parse_kwargs(["depth"])


# --- data

def test_sharded_sampler_covers_the_epoch_and_resumes_mid_epoch():
    full = [list(ShardedSampler(10, r, 3, shuffle=True, seed=5)) for r in range(3)]
    assert all(len(s) == 4 for s in full)  # padded to 12 = 3 ranks x 4
    assert sorted(set(sum(full, []))) == list(range(10))
    s = ShardedSampler(10, 1, 3, shuffle=True, seed=5)
    s.set_epoch(0, start=2)
    assert list(s) == full[1][2:]
    s.set_epoch(1)
    assert list(s) != full[1]  # another epoch, another order
    evals = [list(ShardedSampler(10, r, 3, shuffle=False)) for r in range(3)]
    assert sorted(sum(evals, [])) == list(range(10))  # evaluation repeats no sample


def test_bad_image_names_the_file(tmp_path):
    root = write_image_folder(tmp_path / "data")
    bad = os.path.join(root, "train", "class1", "broken.png")
    with open(bad, "wb") as f:
        f.write(b"not an image at all")
    dataset = create_dataset("folder", root, "train")
    index = [p for p, _ in dataset.samples].index(bad)
    with pytest.raises(BadImageError, match="broken.png"):
        dataset[index]


def test_missing_data_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_dir"):
        create_dataset("folder", str(tmp_path / "nowhere"), "train")


def test_digits_split_is_fixed_and_disjoint():
    train_set, val_set = create_dataset("digits", None, "train", digits_size=8), create_dataset("digits", None, "val",
                                                                                                digits_size=8)
    assert len(train_set) + len(val_set) == 1797 and len(train_set.classes) == 10
    img, target = val_set[0]
    assert img.size == (8, 8) and 0 <= target < 10


def _write_idx(path, array, magic):
    """An IDX file as MNIST ships it: big-endian magic, dimensions, then uint8 data."""
    import struct

    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape))
        f.write(array.astype(np.uint8).tobytes())


def test_torchvision_datasets_in_timm_spelling(tmp_path):
    """``torch/mnist`` (timm's spelling) finds torchvision's MNIST on disk; nothing is downloaded."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.RandomState(0)
    for prefix, n in (("train", 6), ("t10k", 4)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.randint(0, 256, (n, 28, 28)), 2051)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10, 2049)
    for name in ("torch/mnist", "torchvision/MNIST"):
        train, val = create_dataset(name, str(tmp_path), "train"), create_dataset(name, str(tmp_path), "val")
        assert (len(train), len(val), len(train.classes)) == (6, 4, 10)
        assert [int(val[i][1]) for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="CIFAR10 not found under"):
        create_dataset("torch/cifar10", str(tmp_path), "train")
    with pytest.raises(ValueError, match="torchvision has no dataset 'nosuchset'"):
        create_dataset("torch/nosuchset", str(tmp_path), "train")


# --- evaluation

def test_evaluate_matches_explicit_counts():
    torch.manual_seed(0)
    x, y = torch.randn(23, 6), torch.randint(0, 7, (23,))
    model = nn.Linear(6, 7)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    res = evaluate(model, loader)
    with torch.no_grad():
        logits = model(x).double()
    ranks = (logits > logits.gather(1, y[:, None])).sum(1)  # how many classes score above the true one
    assert res["count"] == 23
    assert res["top1"] == pytest.approx(100 * (ranks == 0).double().mean().item())
    assert res["top5"] == pytest.approx(100 * (ranks < 5).double().mean().item())
    assert res["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-6)


# --- checkpoints

def test_checkpoint_round_trip_and_head_reset(tmp_path):
    torch.manual_seed(0)
    model = create_model("test_vit", num_classes=3, model_kwargs=parse_kwargs(TINY_VIT)).eval()
    meta = {"model": "test_vit", "num_classes": 3, "in_chans": 3, "model_kwargs": parse_kwargs(TINY_VIT),
            "img_size": 16, "mean": [0.5] * 3, "std": [0.5] * 3}
    save_checkpoint(str(tmp_path / "ckpt"), model, meta)
    loaded, loaded_meta = load_model(str(tmp_path / "ckpt"))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded_meta["num_classes"] == 3

    new = create_model("test_vit", num_classes=5, model_kwargs=parse_kwargs(TINY_VIT))
    report = load_pretrained(new, str(tmp_path / "ckpt"))
    assert sorted(report["skipped"]) == ["head.bias", "head.weight"] and not report["missing"], report
    assert torch.equal(new.patch_embed.proj.weight, model.patch_embed.proj.weight)
    assert new.head.weight.shape == (5, model.head.weight.shape[1])


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "model.safetensors"

    def fail(path):
        with open(path, "w") as f:
            f.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(str(target), fail)
    assert os.listdir(tmp_path) == []


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown 'vit_nonexistent_model'"):
        create_model("vit_nonexistent_model")


# --- training

def test_resume_equals_uninterrupted_training(tmp_path, capsys):
    """2 epochs of 3 steps; the interrupted run stops mid-epoch 1 (step 4), says so, and is resumed."""
    data = write_image_folder(tmp_path / "data")
    common = ["--epochs", "2", "--model-ema", "--model-ema-decay", "0.9", "--warmup-epochs", "1",
              "--drop-path", "0.1"]
    ref = train(train_args(data, str(tmp_path / "out"), "--experiment", "ref", *common))
    part = train(train_args(data, str(tmp_path / "out"), "--experiment", "cut", "--stop-after-steps", "4", *common))
    assert part["stopped_at_step"] == 4
    assert (f"stopped after step 4 (--stop-after-steps 4); checkpoint saved in {part['run_dir']}/last; continue "
            f"with: linvision-train --resume {part['run_dir']}") in capsys.readouterr().out
    resumed = train(train_args(data, str(tmp_path / "out"), "--resume", part["run_dir"], *common))

    ref_losses, cut_losses = step_losses(ref["run_dir"]), step_losses(resumed["run_dir"])
    assert [s for s, _ in ref_losses] == list(range(1, 7))
    assert cut_losses == ref_losses  # bitwise: same data order, RNG, optimizer and schedule state
    assert resumed["best_top1"] == ref["best_top1"]
    a, _ = load_model(os.path.join(ref["run_dir"], "last"))
    b, _ = load_model(os.path.join(resumed["run_dir"], "last"))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_train_config_makes_the_flags_and_runs_as_a_dataclass(tmp_path):
    """TrainConfig's fields are exactly the training flags (a YAML key per field); a config built in code and
    changed with replace trains as the command line does: the same losses as the parsed flags, and config.yaml
    holds its recipe."""
    import dataclasses

    import yaml

    from linvision.training.train_config import RUN_ONLY_KEYS, TrainConfig

    parser = add_train_args(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}
    assert vars(parser.parse_args([])) == TrainConfig().to_dict()

    data = write_image_folder(tmp_path / "data")
    parsed = train(train_args(data, str(tmp_path / "out"), "--experiment", "flags", "--epochs", "1"))
    base = TrainConfig.from_namespace(train_args(data, str(tmp_path / "out"), "--epochs", "1"))
    built = train(base.replace(experiment="built"))
    assert step_losses(built["run_dir"]) == step_losses(parsed["run_dir"])
    with open(os.path.join(built["run_dir"], "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved == {k: v for k, v in base.replace(experiment="built").to_dict().items() if k not in RUN_ONLY_KEYS}
    other = train(base.replace(experiment="seed1", seed=1))
    assert step_losses(other["run_dir"]) != step_losses(parsed["run_dir"])


# --- benchmark

def test_memory_meter_sees_a_known_allocation():
    with MemoryMeter(torch.device("cpu")) as mem:
        x = torch.ones(25_000_000)  # 95.4 MiB, touched by the fill
        del x
    assert mem.peak_mb == pytest.approx(25e6 * 4 / 2**20, rel=0.1)


def test_sweep_records_failures_and_goes_on(tmp_path):
    def build(name, img_size, kwargs):
        if name == "broken":
            raise RuntimeError("injected failure")
        if name == "oom" and img_size > 16:
            raise torch.OutOfMemoryError("injected out of memory")
        return create_model("test_vit", model_kwargs=parse_kwargs(TINY_VIT))

    points = run_sweep(["broken", "oom", "ok"], [16, 32], str(tmp_path), log=lambda s: None, batch_size=2,
                       iters=1, warmup=0, build_fn=build)
    status = [(p["model"], p["img_size"], p["status"]) for p in points]
    assert status == [("broken", 16, "error"), ("broken", 32, "error"), ("oom", 16, "ok"), ("oom", 32, "oom"),
                      ("ok", 16, "ok"), ("ok", 32, "ok")]
    assert "injected failure" in points[0]["error"]
    ok = points[-1]
    assert ok["infer_img_s"] > 0 and ok["train_img_s"] > 0 and ok["gflops"] > 0
    assert ok["params_m"] == pytest.approx(sum(p.numel() for p in build("ok", 32, {}).parameters()) / 1e6)
    with open(tmp_path / "results.jsonl") as f:
        assert len(f.readlines()) == 6
    plot_results(points, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
    # inference only (training figures NaN, as with --no-train): the plot leaves those panels out
    infer_only = [{**p, "train_img_s": math.nan, "train_mem_mb": math.nan} for p in points]
    plot_results(infer_only, str(tmp_path / "infer_only.png"))
    assert (tmp_path / "infer_only.png").stat().st_size > 0


def test_model_specs_twin_ratios_and_gemm_fraction(tmp_path):
    """A model spec carries its own options (over the common ones); --twin ratios are each point's figures over
    the twin's at the same size (1 for the twin); the GEMM fraction is 2 x GFLOPs x batch / forward time / rate."""
    from linvision.benchmark.throughput import add_comparisons, comparison_table, parse_model_spec

    assert parse_model_spec("test_vit") == ("test_vit", {})
    assert parse_model_spec("m:token_mixer=softmax,depth=2,rope=null") == (
        "m", {"token_mixer": "softmax", "depth": 2, "rope": None})
    with pytest.raises(ValueError, match="'depth' is not key=value"):
        parse_model_spec("m:token_mixer=softmax,depth")
    seen = []

    def build(name, img_size, kwargs):
        seen.append(dict(kwargs))
        return create_model(name, model_kwargs=kwargs)

    common = parse_kwargs(TINY_VIT)
    specs = ["test_vit", "test_vit:depth=2"]
    points = run_sweep(specs, [16, 32], None, log=lambda s: None, batch_size=2, iters=1, warmup=0, build_fn=build,
                       model_kwargs=common)
    assert [p["model"] for p in points] == [specs[0]] * 2 + [specs[1]] * 2
    assert seen[0] == common and seen[1] == {**common, "depth": 2}  # the models of one size are built together
    add_comparisons(points, twin=specs[0], gemm=100.0)
    for p in points:
        t = next(q for q in points if q["model"] == specs[0] and q["img_size"] == p["img_size"])
        assert p["train_ms_vs_twin"] == pytest.approx(p["train_ms"] / t["train_ms"])
        assert p["infer_mem_mb_vs_twin"] == pytest.approx(p["infer_mem_mb"] / t["infer_mem_mb"], nan_ok=True)
        assert p["gemm_fraction"] == pytest.approx(2 * p["gflops"] * 2 / (p["infer_ms"] / 1e3) / 100.0)
    assert points[0]["train_ms_vs_twin"] == 1.0
    assert "| test_vit:depth=2 | 32 |" in comparison_table(points)
    with pytest.raises(ValueError, match="twin"):
        add_comparisons(points, twin="other")


def test_models_of_one_size_are_timed_interleaved_and_marked_on_a_busy_machine(monkeypatch):
    """The timed runs go round the models (A, B, B, A, ...) after each model's untimed first pass; a point timed on
    a machine whose load average is above its cores, or with runs spread above the limit, is marked unreliable:
    the table daggers its times and says why below, the training columns are left out when none was measured."""
    from linvision.benchmark import throughput
    from linvision.benchmark.throughput import benchmark_interleaved, comparison_table

    calls = []

    class Tagged(nn.Module):
        def __init__(self, tag):
            super().__init__()
            self.tag, self.fc = tag, nn.Linear(3 * 8 * 8, 2)

        def forward(self, x):
            calls.append(self.tag)
            return self.fc(x.flatten(1))

    monkeypatch.setattr(throughput, "machine_load", lambda: {"load": 4.5, "cores": 2, "threads": 2})
    points = benchmark_interleaved([("a", {}), ("b", {})], 8, batch_size=2, warmup=1, iters=3, train=False,
                                   flops=False, build_fn=lambda name, size, kw: Tagged(name))
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]  # first passes, then three rounds
    assert [p["model"] for p in points] == ["a", "b"] and all(p["status"] == "ok" for p in points)
    assert points[0]["unreliable"].startswith("machine busy: load average 4.5 on 2 cores")
    table = comparison_table(points)
    assert "train ms" not in table and "nan" not in table
    assert f"| a | 8 | {points[0]['infer_ms']:.0f}† |" in table
    assert "† UNRELIABLE timings at 2 of 2 points (machine busy at 2: load average 4.5 on 2 cores" in table
    throughput.mark_reliability(points, {"load": 1.0, "cores": 2, "threads": 2}, spread_limit=1e9)
    assert points[0]["unreliable"] == "" and "†" not in comparison_table(points)
    points[1]["infer_spread_pct"] = 80.0
    throughput.mark_reliability(points, {"load": 1.0, "cores": 2, "threads": 2})
    assert points[1]["unreliable"] == "infer spread 80% above 50%"


def test_threads_fit_the_cores_left_free():
    from linvision.benchmark.throughput import threads_for_load

    assert threads_for_load({"load": 0.3, "cores": 2, "threads": 2}) == 2
    assert threads_for_load({"load": 1.2, "cores": 2, "threads": 2}) == 1
    assert threads_for_load({"load": 6.0, "cores": 2, "threads": 2}) == 1
    assert threads_for_load({"load": 1.0, "cores": 8, "threads": 4}) == 4


def test_busy_cores_between_two_readings_of_proc_stat(tmp_path):
    """The busy share of the machine's time (user, nice, system, irq, softirq, steal: not idle, not I/O wait)
    times its cores; an unreadable file gives NaN, and machine_load falls back to the load average then."""
    from linvision.benchmark.throughput import busy_cores, cores_busy_between

    def reading(user, nice, system, idle, iowait, steal):
        per_core = " 0 0 0 0 0 0 0 0 0 0"
        return (f"cpu  {user} {nice} {system} {idle} {iowait} 0 0 {steal} 0 0\n"
                f"cpu0{per_core}\ncpu1{per_core}\nintr 1 2 3\nctxt 4\n")

    before = reading(100, 50, 50, 700, 100, 0)
    # 400 ticks of two cores: 150 user, 50 nice (a niced job counts), 0 system, 150 idle, 30 I/O wait, 20 stolen
    after = reading(250, 100, 50, 850, 130, 20)
    assert cores_busy_between(before, after) == pytest.approx(2 * (150 + 50 + 20) / 400)
    assert cores_busy_between(before, reading(100, 50, 50, 1100, 100, 0)) == 0.0
    with pytest.raises(ValueError, match="no time passed"):
        cores_busy_between(before, before)
    assert np.isnan(busy_cores(0.0, str(tmp_path / "missing")))


def test_benchmark_point_gflops_of_a_linear_model():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * 8 * 8, 10)

        def forward(self, x):
            return self.fc(x.flatten(1))

    p = benchmark_point("flat", 8, batch_size=2, iters=1, warmup=0, build_fn=lambda *a: Flat())
    assert p["status"] == "ok"
    assert p["gflops"] == pytest.approx(3 * 8 * 8 * 10 / 1e9)  # one multiply-accumulate per weight


_TINY_ROPE = dict(embed_dim=32, depth=1, num_heads=2)


def test_benchmark_point_with_16_bit_weights():
    """weights="bf16": the model and input in bf16 (no autocast), inference timed, no training step (its figures
    NaN), the mode recorded; under autocast the point is refused in one line."""
    built = []

    def build(name, size, kwargs):
        built.append(timm.create_model(name, **kwargs))
        return built[-1]

    p = benchmark_point("linvit_tiny_patch16_rope_224", 32, batch_size=1, iters=1, warmup=0, flops=False,
                        model_kwargs=_TINY_ROPE, build_fn=build, weights="bf16")
    assert p["status"] == "ok", p["error"]
    assert p["weights"] == "bf16" and p["compile"] == "none" and p["infer_img_s"] > 0
    assert math.isnan(p["train_img_s"]) and math.isnan(p["infer_compile_s"])
    assert {q.dtype for q in built[0].parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"^weights: bf16 weights run without autocast .*pass --amp none$"):
        benchmark_point("linvit_tiny_patch16_rope_224", 32, weights="bf16", amp="bf16")
    with pytest.raises(ValueError, match=r"^compile: unknown 'max'; allowed: none, inductor, reduce-overhead$"):
        benchmark_point("linvit_tiny_patch16_rope_224", 32, compile="max")


@pytest.mark.parametrize("interleave", [False, True])
def test_benchmark_point_compiled(monkeypatch, interleave):
    """compile="inductor": the model timed under torch.compile (here its aot_eager backend, Inductor's code
    generation being minutes on a CPU), inference and a training step, each first call's seconds recorded as
    the compilation; the timed figures come after it."""
    real = torch.compile
    modes = []

    def compile_for_test(model, mode=None, **kwargs):
        modes.append(mode)
        return real(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_for_test)
    torch._dynamo.reset()
    (p,) = run_sweep(["linvit_tiny_patch16_rope_224"], [32], batch_size=1, iters=1, warmup=0, flops=False,
                     model_kwargs=_TINY_ROPE, compile="inductor", interleave=interleave, log=lambda m: None)
    assert p["status"] == "ok", p["error"]
    assert modes == [None] and p["compile"] == "inductor"
    assert p["infer_compile_s"] > 0 and p["train_compile_s"] > 0
    assert p["infer_img_s"] > 0 and p["train_img_s"] > 0


def test_benchmark_point_records_which_path_each_op_took():
    """The point names the path of every op that dispatches between kernels and PyTorch, in inference and in the
    training step: on CPU tensors the PyTorch one; nothing for a model without such ops. Recording ends with the
    block: a call after it is not recorded."""
    from linvision.ops import linear_attention, record_backends

    kwargs = dict(batch_size=1, iters=1, warmup=0, flops=False)
    delta = benchmark_point("linhier_delta_femto_224", 64, model_kwargs={"depths": [1, 1, 1, 1]}, **kwargs)
    assert delta["status"] == "ok" and delta["backends"] == "bidirectional_delta_rule_attention: torch"
    rope = benchmark_point("linhier_tiny_224", 64, model_kwargs={"depths": [1, 1, 1, 1]}, **kwargs)
    assert rope["backends"] == "linear_attention: torch"
    flat = benchmark_point("flat", 8, build_fn=lambda *a: nn.Linear(8, 2), **kwargs)
    assert flat["status"] == "ok" and flat["backends"] == ""
    q = torch.rand(1, 1, 4, 8)
    with record_backends() as outer:
        with record_backends() as inner:
            linear_attention(q, q, q, backend="torch")
    linear_attention(q, q, q, backend="torch")
    assert outer == inner == {("linear_attention", "torch")}


class _Sdpa(nn.Module):
    """One softmax attention call on (B, H, N, D) = (1, 2, N, 8) tokens made from the image's pixels."""

    def forward(self, x):
        t = x.flatten(2).transpose(1, 2).reshape(1, -1, 2, 8).transpose(1, 2)  # 3 x 16 x 16 pixels -> N = 48
        return torch.nn.functional.scaled_dot_product_attention(t, t, t).sum()


def test_flop_counter_counts_sdpa_on_this_torch():
    """Softmax attention counts 2 * B * H * N^2 * D multiply-accumulates (QK^T and PV). torch's counter lost
    its CPU SDPA kernel in a release; linvision registers the formula for every SDPA kernel torch lacks. If
    this fails, torch dispatches SDPA to a kernel not listed in linvision.benchmark.flops.SDPA_OPS."""
    from torch.utils.flop_counter import FlopCounterMode

    from linvision.benchmark.flops import count_gflops

    b, h, n, d = 1, 2, 48, 8
    gflops = count_gflops(_Sdpa(), 16)
    assert gflops == pytest.approx(2 * b * h * n * n * d / 1e9), (
        f"torch {torch.__version__}: FlopCounterMode counted {gflops * 1e9:.0f} MACs for one SDPA call, "
        f"expected {2 * b * h * n * n * d}; add the aten op it now dispatches to to SDPA_OPS")
    q = torch.randn(b, h, n, d, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    # forward 2 products, backward 5, each 2 * B * H * N^2 * D FLOPs
    assert counter.get_total_flops() == 7 * 2 * b * h * n * n * d


def test_gflops_match_timm_published_vit_small():
    """timm lists vit_small_patch16_224 at 4.6 GMACs (4.25 of them outside attention)."""
    import timm

    from linvision.benchmark.flops import count_gflops

    assert count_gflops(timm.create_model("vit_small_patch16_224")) == pytest.approx(4.6, abs=0.01)


def test_ablate_digits_trains_with_more_than_one_token_in_the_last_stage():
    """The resolution column of linvision/configs/ablate_digits.yaml is only meaningful when the training size leaves the
    deepest stages a real grid: at 32 px the stride-32 model's last stage is one token (its conv taps off the
    centre never trained) and every mixer, plain convolutions included, fell to chance at 2x."""
    from linvision.utils.config import load_yaml

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    cfg = load_yaml(os.path.join(root, "ablate_digits.yaml"))
    size = cfg["img_size"]
    model = create_model(cfg["model"], num_classes=10, model_kwargs=dict(cfg["model_kwargs"], token_mixers="none"))
    with torch.no_grad():
        feats = model.forward_features(torch.zeros(1, 3, size, size))
    assert min(feats.shape[1:3]) >= 2, f"last stage grid {tuple(feats.shape[1:3])} at the {size} px training size"
    assert min(cfg["eval_sizes"]) == size and all(s >= size for s in cfg["eval_sizes"])


def test_distillation_loss_matches_its_formula():
    from linvision.training.distill import distillation_loss

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    task = torch.tensor(1.3, dtype=torch.float64)
    for w, temp in ((0.5, 1.0), (0.3, 4.0), (1.0, 2.0)):
        p_t = torch.softmax(t / temp, -1)
        kl = (p_t * (torch.log(p_t) - torch.log_softmax(s / temp, -1))).sum(-1).mean()
        expected = (1 - w) * task + w * temp ** 2 * kl
        got = distillation_loss(s.float(), t.float(), task.float(), w, temp)
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert distillation_loss(s, s, task, 1.0, 3.0).item() == pytest.approx(0.0, abs=1e-6)
