"""linvision-bench-naflex (linvision/tools/bench_naflex.py): its mixed-aspect workload makes valid NaFlex batches within the
budget, a tiny sweep writes the rows it should with finite figures, its guards (memory limit, slow factor) skip
what they should, and bad input is one line with exit status 2."""
import csv
import math
import os
import sys

import pytest
import torch
from support import ROOT, run_subprocess

from linvision.benchmark import naflex as bench
from linvision.tools import bench_naflex as tool

TOOL = os.path.join(ROOT, "linvision", "tools", "bench_naflex.py")
TINY = ["--model-kwargs", "embed_dim=32", "depth=1", "num_heads=1"]
SOFTMAX = bench.SOFTMAX_TINY


def _grid(batch, i):
    """(rows, cols) of image i of a NaFlex batch, from the coordinates of its valid patches."""
    coord = batch["patch_coord"][i][batch["patch_valid"][i]]
    return int(coord[:, 0].max()) + 1, int(coord[:, 1].max()) + 1


def test_image_sizes_keep_the_aspect_and_side_ranges():
    sizes = bench.image_sizes(400, seed=3)
    assert sizes == bench.image_sizes(400, seed=3) and sizes != bench.image_sizes(400, seed=4)
    ratios = [w / h for h, w in sizes]
    assert all(1 / 3 <= r <= 3 for r in ratios)
    assert all(128 <= min(h, w) and max(h, w) <= 1536 for h, w in sizes)
    # the whole range is drawn: tall and wide images near 1:3 and 3:1, small and large ones
    assert min(ratios) < 0.4 and max(ratios) > 2.5 and sum(r < 1 for r in ratios) > 100
    assert min(max(s) for s in sizes) < 500 and max(max(s) for s in sizes) > 1400


@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
def test_workload_batches_are_naflex_batches_within_the_budget(budget):
    """Each image's patches form its own full grid (raster order, coordinates (y, x)), as many as fit the
    budget (timm's resize fills it: at least half), with the source image's aspect ratio kept within 1:3..3:1;
    the padding after them is zero, and the patches are the resized image's own."""
    from timm.data.naflex_transforms import ResizeToSequence

    images = bench.workload(batch=3, batches=2, seed=0)
    assert [len(b) for b in images] == [3, 3]
    for sources in images:
        batch = bench.naflex_batch(sources, (16, 16), budget)
        assert batch["patches"].shape == (3, budget, 16 * 16 * 3)
        assert batch["patch_coord"].shape == (3, budget, 2) and batch["patch_coord"].dtype == torch.int64
        assert batch["patch_valid"].shape == (3, budget) and batch["patch_valid"].dtype == torch.bool
        for i, image in enumerate(sources):
            n = int(batch["patch_valid"][i].sum())
            assert budget / 2 <= n <= budget
            assert batch["patch_valid"][i, :n].all() and not batch["patch_valid"][i, n:].any()
            rows, cols = _grid(batch, i)
            assert rows * cols == n
            ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
            assert torch.equal(batch["patch_coord"][i, :n], torch.stack([ys.flatten(), xs.flatten()], -1))
            assert 1 / 3 <= cols / rows <= 3
            source = image.shape[2] / image.shape[1]
            if budget >= 256:  # the grid's aspect is the image's, up to a patch of rounding
                assert (cols - 1) / (rows + 1) <= source <= (cols + 1) / max(rows - 1, 1)
            assert not batch["patches"][i, n:].any()
            resized = ResizeToSequence(16, budget)(image)
            assert resized.shape[1:] == (rows * 16, cols * 16)
            first = resized[:, :16, :16].permute(1, 2, 0).reshape(-1)  # patch (0, 0), flattened row, col, channel
            torch.testing.assert_close(batch["patches"][i, 0], first)


def test_square_baseline_has_the_budget_s_token_count():
    assert [bench.square_side(b) for b in (16, 64, 256, 1024, 4096, 16384, 100, 1000)] == [4, 8, 16, 32, 64, 128,
                                                                                          10, 31]


def test_budget_list_parsing():
    assert bench.parse_budgets(["1024", "256,16384", "4096", "256"]) == [256, 1024, 4096, 16384]
    for bad in (["0"], ["12x"], ["-4"], ["256,"], ["1.5"]):
        with pytest.raises(ValueError, match="budgets: .* is not a positive whole number"):
            bench.parse_budgets(bad)


def test_softmax_heads_and_the_projected_attention_matrix():
    import timm

    name, kwargs = bench.resolve_spec(SOFTMAX)
    assert name == "naflexvit_base_patch16_gap" and (kwargs["embed_dim"], kwargs["depth"], kwargs["num_heads"]) == (
        192, 12, 3)
    name, kwargs = bench.resolve_spec(f"{SOFTMAX}:depth=2", {"embed_dim": 32, "num_heads": 2, "depth": 1})
    softmax = timm.create_model(name, **kwargs)
    assert (softmax.embed_dim, len(softmax.blocks), bench.softmax_heads(softmax)) == (32, 2, 2)
    assert bench.patch_size_of(softmax) == (16, 16)
    assert bench.softmax_heads(timm.create_model("linvit_tiny_patch16_224", depth=1)) is None
    assert bench.softmax_heads(timm.create_model("linvit_tiny_patch16_224", depth=1, token_mixer="softmax")) == 3
    # ViT-Ti at 16384 patches, 4 images, fp32: 4 x 3 x 16385^2 x 4 bytes
    assert bench.attention_matrix_bytes(4, 3, 16385, 4) / 2**30 == pytest.approx(12.0, rel=1e-3)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_tiny_sweep_writes_every_row_with_figures(tmp_path, capsys):
    """Three models on NaFlex batches and the square baseline, two budgets, both modes: one row each, in
    order, with finite positive figures, the reference's time ratio 1, and the tokens per image as built;
    --from-csv prints the same table from the CSV and draws the plot again."""
    out, png = tmp_path / "r.csv", tmp_path / "r.png"
    code = tool.main(["--models", "linvit_tiny_patch16_224", "linvit_tiny_patch16_rope_224", SOFTMAX,
                      "--square", "linvit_tiny_patch16_224", *TINY, "--budgets", "16,64", "--batch", "2",
                      "--batches", "2", "--iters", "2", "--warmup", "0", "--modes", "infer", "train",
                      "--device", "cpu", "--slow-factor", "1e6", "--output", str(out), "--plot", str(png)])
    assert code == 0
    rows = _rows(out)
    series = [("linvit_tiny_patch16_224", "naflex"), ("linvit_tiny_patch16_rope_224", "naflex"), (SOFTMAX, "naflex"),
              ("linvit_tiny_patch16_224", "square")]
    assert [(r["mode"], int(r["budget"]), r["model"], r["input"]) for r in rows] == [
        (mode, budget, model, kind) for mode in ("infer", "train") for budget in (16, 64) for model, kind in series]
    batches = [bench.naflex_batch(b, (16, 16), 64) for b in bench.workload(2, 2, seed=0)]
    tokens64 = torch.stack([b["patch_valid"] for b in batches]).sum(-1).float().mean().item()
    for r in rows:
        assert r["status"] == "ok" and r["reason"] == "", r
        assert int(r["iters"]) == 2 and int(r["batch"]) == 2 and r["device"] == "cpu" and r["dtype"] == "float32"
        figures = {k: float(r[k]) for k in ("images_per_s", "images_per_s_min", "images_per_s_max", "ms", "ms_min",
                                            "ms_max", "time_vs_ref", "params_m", "tokens_per_image")}
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), r
        assert math.isfinite(float(r["peak_mib"])) and float(r["peak_mib"]) >= 0
        assert figures["ms_min"] <= figures["ms"] <= figures["ms_max"]
        assert figures["images_per_s"] == pytest.approx(2000 / figures["ms"], rel=1e-4)
        assert int(r["seq_len"]) == int(r["budget"])  # 16 and 64 are squares: the baseline's grid is the budget
        if r["input"] == "square":
            assert figures["tokens_per_image"] == int(r["budget"])
        elif r["budget"] == "64":
            assert figures["tokens_per_image"] == pytest.approx(tokens64, rel=1e-4)
        if r["model"] == "linvit_tiny_patch16_224" and r["input"] == "naflex":
            assert figures["time_vs_ref"] == 1.0
        # softmax rows carry the projected matrix: batch x heads x (budget + class token)^2 x 4 bytes
        expected = 2 * 1 * (int(r["budget"]) + 1) ** 2 * 4 / 2**20 if r["model"] == SOFTMAX else None
        assert (float(r["attn_matrix_mib"]) == pytest.approx(expected, rel=1e-4)) if expected else not r[
            "attn_matrix_mib"]
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    table = printed[printed.index("| mode |"):printed.index("plot in")]
    assert table.count("\n| infer | ") == 8 and table.count("\n| train | ") == 8
    again = tmp_path / "again.png"
    assert tool.main(["--from-csv", str(out), "--slow-factor", "1e6", "--plot", str(again)]) == 0
    assert capsys.readouterr().out == table + f"plot in {again}\n"
    assert again.stat().st_size > 10_000 and out.read_text().count("\n") == 17  # the CSV as it was


def test_guards_skip_over_the_memory_limit_and_after_a_slow_point(tmp_path, capsys):
    """A softmax model over --memory-limit-gib is skipped with the projection in its reason; a model slower than
    --slow-factor x the reference is timed once (status slow) and not run at the larger budgets."""
    out = tmp_path / "g.csv"
    # at budget 64: 1 image x 1 head x 65^2 x 4 bytes = 16.5 KiB > 1e-5 GiB (10.5 KiB); at 16, 1.1 KiB fits
    code = tool.main(["--models", "linvit_tiny_patch16_224", SOFTMAX, "--square", *TINY, "--budgets", "16", "64",
                      "--batch", "1", "--batches", "1", "--iters", "1", "--warmup", "0", "--device", "cpu",
                      "--memory-limit-gib", "1e-5", "--output", str(out)])
    assert code == 0
    rows = {(r["model"], int(r["budget"])): r for r in _rows(out)}
    assert len(rows) == 4 and rows[(SOFTMAX, 16)]["status"] == "ok"
    skipped = rows[(SOFTMAX, 64)]
    assert skipped["status"] == "skipped" and skipped["images_per_s"] == "" and skipped["peak_mib"] == ""
    assert "projected attention matrix 1.57e-05 GiB (1 x 1 heads x 65^2 x 4 B) > --memory-limit-gib 1e-05" in \
        skipped["reason"]
    text = capsys.readouterr().out
    assert f"infer: {SOFTMAX} [naflex]: does not fit from budget 64 (skipped: projected" in text

    code = tool.main(["--models", "linvit_tiny_patch16_224", "linvit_tiny_patch16_rope_224", "--square", *TINY,
                      "--budgets", "16", "64", "256", "--batch", "1", "--batches", "1", "--iters", "3",
                      "--device", "cpu", "--slow-factor", "1e-6", "--output", str(out)])
    assert code == 0
    rows = [r for r in _rows(out) if r["model"] == "linvit_tiny_patch16_rope_224"]
    assert [r["status"] for r in rows] == ["slow", "skipped", "skipped"]
    assert int(rows[0]["iters"]) == 1 and float(rows[0]["time_vs_ref"]) > 1e-6
    assert rows[0]["reason"].startswith("second run ") and "> --slow-factor 1e-06); timed once" in rows[0]["reason"]
    assert rows[1]["reason"].endswith("x the reference's time at budget 16: larger budgets not run")
    assert all(int(r["iters"]) == 3 for r in _rows(out) if r["model"] == "linvit_tiny_patch16_224")
    assert "more than 1e-06x the reference's time from budget 16" in capsys.readouterr().out

    # --max-run-s: a point whose first run takes longer is recorded from that run alone
    code = tool.main(["--models", "linvit_tiny_patch16_224", "--square", *TINY, "--budgets", "16", "--batch", "1",
                      "--batches", "1", "--iters", "3", "--device", "cpu", "--max-run-s", "1e-9",
                      "--output", str(out)])
    (row,) = _rows(out)
    assert code == 0 and row["status"] == "ok" and int(row["iters"]) == 1
    assert row["reason"].startswith("one run: it took ") and row["reason"].endswith(" s > --max-run-s 1e-09")
    assert float(row["ms"]) == float(row["ms_min"]) == float(row["ms_max"]) > 0


BAD_INPUT = [
    (["--budgets", "256", "lots"], "error: budgets: 'lots' is not a positive whole number of patches per image"),
    (["--budgets", "0"], "error: budgets: '0' is not a positive whole number"),
    (["--models", "linvit_tiny_patch16_224", "vit_no_such_model"], "error: model: unknown 'vit_no_such_model'"),
    (["--square", "linvit_no_such"], "error: model: unknown 'linvit_no_such'"),
    (["--reference", "vit_tiny_patch16_224"], "error: reference: 'vit_tiny_patch16_224' is not one of --models"),
    (["--iters", "0"], "error: iters: at least 1, got 0"),
    (["--modes", "fly"], "error: argument --modes: invalid choice: 'fly'"),
    (["--batch", "two"], "error: argument --batch: invalid int value: 'two'"),
    (["--model-kwargs", "depth"], "error: model_kwargs: expected key=value"),
    (["--from-csv", "no_such.csv"], "error: [Errno 2] No such file or directory: 'no_such.csv'"),
    (["--max-aspect", "20"], "error: min_side/max_side/max_aspect: need 1 <= min side and min side x max aspect"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, flags, message):
    """As the command runs it (run_cli around main), in this process."""
    monkeypatch.setattr(sys, "argv", ["linvision-bench-naflex", *flags, "--output", str(tmp_path / "x.csv")])
    with pytest.raises(SystemExit) as e:
        tool.cli()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), err
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("case", [0, 2, 6])
def test_bad_input_of_the_command_line(tmp_path, case):
    """The same from the command line: a bad budget, an unknown model, a bad flag value."""
    flags, message = BAD_INPUT[case]
    proc = run_subprocess([sys.executable, TOOL, *flags, "--output", str(tmp_path / "x.csv")], timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.csv").exists()


def test_help_describes_the_tool():
    proc = run_subprocess([sys.executable, TOOL, "--help"], timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: linvision-bench-naflex ")
    text = " ".join(proc.stdout.split())
    for flag in ("--budgets", "--models", "--square", "--memory-limit-gib", "--slow-factor", "--plot", "--dtype",
                 "--device", "--iters", "--warmup", "--batch", "--output", "--model-kwargs"):
        assert flag in text
    assert "(default: 256 1024 4096 16384)" in text and "(default: 16.0)" in text
    assert f"(default: linvit_tiny_patch16_224 linvit_tiny_patch16_rope_224 {SOFTMAX})" in text
