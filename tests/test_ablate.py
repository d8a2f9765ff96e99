"""The ablation over seeds (mean and spread of top-1 from the runs' own summaries) and the offline photo-crops set."""
import argparse
import json

import numpy as np
import pytest

from linvision.experiments.ablate import add_ablate_args, markdown_table, run_ablation
from linvision.utils.config import parse_args
from support import tiny_ablate_flags


def _args(data, tmp_path, *extra):
    return parse_args(add_ablate_args(argparse.ArgumentParser()), tiny_ablate_flags(data, tmp_path, *extra))


def test_seeds_give_mean_and_sample_std_of_the_runs(data, tmp_path):
    said = []
    result = run_ablation(_args(data, tmp_path, "--mixers", "mala", "--seeds", "3", "5"), log=said.append)
    (row,) = result["rows"]
    tops = []
    for seed in (3, 5):
        with open(tmp_path / "ab" / "runs" / f"mala-s{seed}" / "summary.json") as f:
            summary = json.load(f)
        tops.append(summary["best_top1"])  # evaluated at the training size: the run's own validation
        with open(tmp_path / "ab" / "runs" / f"mala-s{seed}" / "config.yaml") as f:
            assert f"seed: {seed}" in f.read()
    assert row["accuracy_seeds"]["32"] == pytest.approx(tops)
    assert row["accuracy"]["32"] == pytest.approx(np.mean(tops))
    assert row["accuracy_std"]["32"] == pytest.approx(np.std(tops, ddof=1))
    assert result["seeds"] == [3, 5]
    table = (tmp_path / "ab" / "ablation.md").read_text()
    assert f"| mala | {row['params_m']:.3f} |" in table
    assert f"{np.mean(tops):.2f} ± {np.std(tops, ddof=1):.2f}" in table
    assert "mean ± sample standard deviation over seeds 3, 5" in table
    # the console's line of the mixer gives the same mean and spread
    (line,) = [m for m in said if m.startswith("   top-1 ")]
    assert line.startswith(f"   top-1 32 px {np.mean(tops):.2f} +- {np.std(tops, ddof=1):.2f}; ")


def test_duplicate_seeds_are_refused(data, tmp_path):
    with pytest.raises(ValueError, match="seeds: give distinct seeds"):
        run_ablation(_args(data, tmp_path, "--mixers", "none", "--seeds", "1", "1"), log=lambda m: None)


def test_table_of_a_single_seed_has_no_spread():
    result = {"eval_sizes": [32], "bench_sizes": [32], "img_size": 32, "seeds": [0], "bench_batch_size": 1,
              "device": "cpu", "rows": [{"mixer": "linear", "params_m": 1.0, "gflops": 0.5,
                                         "accuracy": {"32": 90.0}, "accuracy_std": {"32": 0.0},
                                         "bench": {"32": {"status": "ok", "error": "", "iters": 1,
                                                          "infer_img_s": 10.0, "infer_spread_pct": 0.0,
                                                          "infer_mem_mb": 1.0, "train_img_s": 5.0,
                                                          "train_spread_pct": 0.0, "train_mem_mb": 2.0}}}]}
    table = markdown_table(result)
    assert "| linear | 1.000 | 0.5000 | 90.00 | 10.0 | 5.0 | 1.0 | 2.0 |" in table
    assert "±" not in table
    # one timed run: no spread of the runs either
    assert ("Throughput: 1 timed run of batch 1 after one warm-up run, the mixers of each size timed interleaved, "
            "on cpu. Memory") in table
    assert "spread" not in table
    five = {**result["rows"][0]["bench"]["32"], "iters": 5, "infer_spread_pct": 12.0, "train_spread_pct": 30.0}
    table = markdown_table({**result, "rows": [{**result["rows"][0], "bench": {"32": five}}]})
    assert ("Throughput: median of 5 timed runs of batch 1 after one warm-up run, the mixers of each size timed "
            "interleaved, on cpu; spread of the runs ((slowest - fastest) / median) median 30%, largest 30%.") in table
    assert "Cost at" not in table and "†" not in table  # no softmax row to compare with; every timing stands


def test_table_states_the_cost_of_softmax_and_marks_timings_of_a_busy_machine():
    """With a softmax row the table says what it costs against the linear mixers at the largest size; figures
    timed on a busy machine carry a dagger and the note why, the memory (not a timing) none."""
    def row(mixer, infer, train, unreliable=""):
        bench = {"status": "ok", "error": "", "iters": 3, "infer_img_s": infer, "infer_spread_pct": 10.0,
                 "infer_mem_mb": 1.0, "train_img_s": train, "train_spread_pct": 10.0, "train_mem_mb": 2.0,
                 "load": 4.5, "cores": 2, "unreliable": unreliable}
        return {"mixer": mixer, "params_m": 1.0, "gflops": 0.5, "accuracy": {"32": 90.0}, "bench": {"32": bench}}

    result = {"eval_sizes": [32], "bench_sizes": [32], "img_size": 32, "seeds": [0], "bench_batch_size": 1,
              "device": "cpu", "rows": [row("linear_rope", 40.0, 12.0), row("softmax", 10.0, 3.0)]}
    table = markdown_table(result)
    assert ("Cost at 32 px: softmax attention takes 4.0x the inference time of `linear_rope` and 4.0x its "
            "training step.") in table
    busy = "machine busy: load average 4.5 on 2 cores"
    result["rows"] = [row("linear_rope", 40.0, 12.0, busy), row("softmax", 10.0, 3.0, busy)]
    table = markdown_table(result)
    assert "| linear_rope | 1.000 | 0.5000 | 90.00 | 40.0† | 12.0† | 1.0 | 2.0 |" in table
    assert "training step† (UNRELIABLE" in table
    assert "† UNRELIABLE timings at 2 of 2 points (machine busy at 2: load average 4.5 on 2 cores)" in table


def test_one_seed_prints_no_spread(data, tmp_path):
    """One seed: the console's line of each mixer and the table show the score alone, no spread."""
    said = []
    result = run_ablation(_args(data, tmp_path, "--mixers", "none"), log=said.append)
    (row,) = result["rows"]
    (line,) = [m for m in said if m.startswith("   top-1 ")]
    assert line.startswith(f"   top-1 32 px {row['accuracy']['32']:.2f}; ")
    assert "+-" not in "".join(said) and "±" not in result["table"]


def test_photos_set_is_offline_disjoint_and_balanced():
    from linvision.data.datasets import create_dataset
    from linvision.data.texture import CLASSES, CROP, photo_parts

    pytest.importorskip("skimage")
    train = create_dataset("photos", None, "train", digits_size=48)
    val = create_dataset("photos", None, "val", digits_size=48)
    assert len(train) == 1200 and len(val) == 360 and train.classes == list(CLASSES) and len(CLASSES) == 10
    assert np.bincount(val.targets).tolist() == [36] * 10
    assert train.images[0].size == (48, 48)
    # every training crop lies left of the cut and every validation crop right of it: no shared pixel
    for (name, tpart), (_, vpart) in zip(photo_parts("train"), photo_parts("val")):
        assert tpart[2] == vpart[0]
    for ds, parts in ((train, photo_parts("train")), (val, photo_parts("val"))):
        for (left, top, right, bottom), label in zip(ds.boxes, ds.targets):
            pl, pt, pr, pb = parts[label][1]
            assert pl <= left and right <= pr and pt <= top and bottom <= pb and right - left == CROP
    # the same crops at any rendering size (evaluation at 1.5x, 2x sees the same content)
    assert create_dataset("photos", None, "val", digits_size=96).boxes == val.boxes
    with pytest.raises(ValueError, match="split: expected"):
        create_dataset("photos", None, "test")


def test_photos_aspect_set_keeps_mixed_aspects_of_disjoint_parts():
    """photos_aspect: crops of 1:3 to 3:1 (not all square) of about 64 x 64 source pixels, at their own aspect,
    from the same disjoint parts as the square set's, the same at every construction and rendering size."""
    from linvision.data.datasets import create_dataset
    from linvision.data.texture import ASPECT_RANGE, CLASSES, CROP, photo_parts

    pytest.importorskip("skimage")
    train = create_dataset("photos_aspect", None, "train", digits_size=64)
    val = create_dataset("photos_aspect", None, "val", digits_size=64)
    assert len(train) == 1200 and len(val) == 360 and train.classes == val.classes == list(CLASSES)
    assert train.num_classes == 10 and np.bincount(train.targets).tolist() == [120] * 10
    for ds, parts in ((train, photo_parts("train")), (val, photo_parts("val"))):
        shapes = np.array([(r - l, b - t) for l, t, r, b in ds.boxes])
        aspects = shapes[:, 0] / shapes[:, 1]
        assert ASPECT_RANGE == (1 / 3, 3.0)
        assert aspects.min() >= 1 / 3 - 1e-9 and aspects.max() <= 3 + 1e-9
        assert aspects.min() < 0.5 and aspects.max() > 2 and (aspects < 1).mean() > 0.3 < (aspects > 1).mean()
        assert np.all(np.abs(shapes.prod(1) / CROP ** 2 - 1) <= 0.02)  # about 64 x 64 source pixels
        # at the default size each image is its crop as cut: own aspect, PIL images of different sizes
        assert [im.size for im in ds.images] == [tuple(s) for s in shapes.tolist()]
        for (left, top, right, bottom), label in zip(ds.boxes, ds.targets):
            pl, pt, pr, pb = parts[label][1]
            assert pl <= left and right <= pr and pt <= top and bottom <= pb
    # training crops left of each photograph's cut, validation crops right of it: no shared pixel
    for label, ((_, tpart), (_, vpart)) in enumerate(zip(photo_parts("train"), photo_parts("val"))):
        assert max(r for (_, _, r, _), t in zip(train.boxes, train.targets) if t == label) <= tpart[2] == vpart[0]
        assert min(l for (l, _, _, _), t in zip(val.boxes, val.targets) if t == label) >= vpart[0]
    # deterministic: the same crops at every construction; another size renders the same crops, scaled
    again = create_dataset("photos_aspect", None, "val", digits_size=64)
    assert again.boxes == val.boxes and again.targets == val.targets
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(again.images, val.images))
    half = create_dataset("photos_aspect", None, "val", digits_size=32)
    assert half.boxes == val.boxes
    assert all(abs(im.size[0] - w / 2) <= 0.5 and abs(im.size[1] - h / 2) <= 0.5
               for im, (w, h) in zip(half.images, (im.size for im in val.images)))
    # the shared code leaves the square set's crops where they were (its published figures used these)
    square = create_dataset("photos", None, "val", digits_size=64)
    assert {(r - l, b - t) for l, t, r, b in square.boxes} == {(CROP, CROP)} and square.boxes != val.boxes
    assert square.boxes[:2] == [(378, 7, 442, 71), (448, 319, 512, 383)] and square.boxes[-1] == (466, 196, 530, 260)
    assert create_dataset("photos", None, "train").boxes[:2] == [(172, 363, 236, 427), (47, 269, 111, 333)]


def test_train_on_photos_aspect_with_the_naflex_loader(tmp_path):
    """linvision-train --dataset photos_aspect --naflex-loader: one tiny epoch on the photographs at their own
    aspect; linvision-validate --naflex-loader scores its checkpoint on the 360 validation crops."""
    from support import run_tool

    pytest.importorskip("skimage")
    run_tool("train.py", "--dataset", "photos_aspect", "--img-size", "32", "--model", "linvit_tiny_patch16_rope_224",
             "--model-kwargs", "depth=1", "patch_size=8", "embed_dim=32", "num_heads=2", "--batch-size", "64",
             "--epochs", "1", "--naflex-loader", "--naflex-train-seq-lens", "8", "16", "--naflex-max-seq-len", "16",
             "--interpolation", "bilinear", "--no-progress", "--device", "cpu", "--output", str(tmp_path),
             "--experiment", "r")
    records = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    (record,) = [r for r in records if r["kind"] == "epoch"]
    assert np.isfinite(record["train_loss"]) and 0 <= record["val_top1"] <= 100
    proc = run_tool("validate.py", "--checkpoint", str(tmp_path / "r" / "last"), "--naflex-loader",
                    "--naflex-max-seq-len", "16", "--device", "cpu")
    out = json.loads(proc.stdout)
    assert out["train_naflex_seq_lens"] == [8, 16] and "train_img_size" not in out  # not the unused --img-size
    result = out["results"][0]
    assert result["count"] == 360 and result["naflex_max_seq_len"] == 16
    assert result["loss"] == pytest.approx(record["val_loss"], rel=1e-5)


def test_isotropic_family_takes_one_mixer_for_every_block(data, tmp_path):
    args = _args(data, tmp_path, "--mixers", "inline", "--model", "linvit_tiny_patch16_224", "--model-kwargs",
                 '{"patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2, "dynamic_img_size": true, '
                 '"class_token": false, "global_pool": "avg"}',
                 "--eval-sizes", "32", "48")
    (row,) = run_ablation(args, log=lambda m: None)["rows"]
    saved = (tmp_path / "ab" / "runs" / "inline" / "config.yaml").read_text()
    assert "token_mixer: inline" in saved and "token_mixers" not in saved
    assert set(row["accuracy"]) == {"32", "48"} and all(isinstance(v, float) for v in row["accuracy"].values())


def test_a_stopped_ablation_goes_on_with_resume_as_if_never_stopped(data, tmp_path):
    """--stop-after-steps stops the ablation inside its first run; --resume continues that run from its last/ and
    trains the next mixer: the same rows and loss records as an ablation never stopped. Resumed once more, both
    finished runs are scored as they are, not trained again."""
    flags = ("--mixers", "none", "linear", "--epochs", "2", "--log-interval", "1")
    folder = tmp_path / "a" / "ab"
    said = []
    stopped = run_ablation(_args(data, tmp_path / "a", *flags, "--stop-after-steps", "4"), log=said.append)
    assert stopped["stopped"] == str(folder / "runs" / "none") and stopped["table"] is None
    assert said[-1].endswith(f"continue with: the same linvision-ablate command with --resume {folder}")
    assert not (folder / "runs" / "linear").exists()
    said.clear()
    resumed = run_ablation(_args(data, tmp_path / "a", *flags, "--resume", str(folder)), log=said.append)
    assert f"   continuing {folder / 'runs' / 'none'} from its last/ checkpoint" in said
    whole = run_ablation(_args(data, tmp_path / "b", *flags), log=lambda m: None)
    for got, want in zip(resumed["rows"], whole["rows"], strict=True):
        assert got["mixer"] == want["mixer"] and got["accuracy"] == want["accuracy"]
    for mixer in ("none", "linear"):
        records = [(tmp_path / f / "ab" / "runs" / mixer / "metrics.jsonl").read_text().splitlines()
                   for f in ("a", "b")]
        losses = [[(r["kind"], r["epoch"], r.get("step"), r.get("loss", r.get("train_loss")))
                   for r in map(json.loads, lines)] for lines in records]
        assert losses[0] == losses[1] and len(losses[0]) == 8  # 3 steps and 1 epoch record per epoch
    written = {m: (folder / "runs" / m / "summary.json").stat().st_mtime_ns for m in ("none", "linear")}
    said.clear()
    again = run_ablation(_args(data, tmp_path / "a", *flags, "--resume", str(folder)), log=said.append)
    assert sum(m.endswith("finished earlier: scored as it is, not trained again") for m in said) == 2
    assert {m: (folder / "runs" / m / "summary.json").stat().st_mtime_ns for m in written} == written
    assert [r["accuracy"] for r in again["rows"]] == [r["accuracy"] for r in resumed["rows"]]


def test_resume_refuses_a_folder_without_an_ablation_or_of_another_model(data, tmp_path):
    with pytest.raises(ValueError, match="holds no ablation"):
        run_ablation(_args(data, tmp_path, "--mixers", "none", "--resume", str(tmp_path)), log=lambda m: None)
    run_ablation(_args(data, tmp_path, "--mixers", "none"), log=lambda m: None)
    with pytest.raises(ValueError, match=r"is an ablation with img_size=32; this command gives img_size=48"):
        run_ablation(_args(data, tmp_path, "--mixers", "none", "--img-size", "48", "--resume",
                           str(tmp_path / "ab")), log=lambda m: None)


def test_a_signal_in_a_run_says_how_the_ablation_goes_on(data, tmp_path, monkeypatch):
    """A run stopped by SIGTERM (after saving) stops the ablation with the command that continues it, not the
    command of that one run."""
    import signal

    import linvision.experiments.ablate as ablate
    from linvision.utils.interrupt import TrainInterrupted

    def stopped_run(cfg):
        raise TrainInterrupted(signal.SIGTERM, cfg.output, f"linvision-train --resume {cfg.output}")

    monkeypatch.setattr(ablate, "train", stopped_run)
    with pytest.raises(TrainInterrupted) as stop:
        run_ablation(_args(data, tmp_path, "--mixers", "none"), log=lambda m: None)
    assert stop.value.signum == signal.SIGTERM
    assert str(stop.value).endswith(f"continue with: the same linvision-ablate command with --resume "
                                    f"{tmp_path / 'ab'}")
