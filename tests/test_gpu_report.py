"""linvision-gpu-report: its dry run writes the whole report on a CPU (every part, each with figures, each said to
be no speed figure), the budget is shared out as the parts start, a part's rows reach report.md while it runs, a
part past its deadline is stopped and reported, and every test skipped for lack of CUDA carries the cuda marker
(the report's test subset is ``pytest -m cuda``)."""
import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from linvision.benchmark import gpu_parts, gpu_report
from linvision.tools import gpu_report as tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWIN = "linvit_small_patch16_rope_224:token_mixer=softmax"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(900)
def test_dry_run_writes_the_report_of_every_part(tmp_path, capsys):
    """The five parts in the order of their value, each with figures; few models keep the CPU's parts short."""
    cuda = torch.cuda.is_available()
    out = tmp_path / "report"
    status = tool.main((["--dry-run"] if cuda else []) + [
        "--output", str(out), "--models", "vit_small_patch16_224", TWIN, "--first-models", "vig_tiny",
        "--profile-models", "vit_small_patch16_224"])
    printed = capsys.readouterr().out
    assert status == 0, printed[-3000:]
    for line in ("[1/5] models:", "[2/5] kernels:", "[3/5] profile:", "[4/5] recurrences:", "[5/5] tests:",
                 "5 of 5 parts ok"):
        assert line in printed
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    assert report["dry_run"] is True and report["budget_s"] == 540 and list(report["parts"]) == list(gpu_report.PARTS)
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"), part.get("log_tail"))
        assert _number(part["seconds"]) and 0 < part["seconds"] <= part["deadline_s"]
        assert (out / part["log"]).is_file()
    # the budget is shared as the parts start: the first part gets its share of all of it
    assert report["parts"]["models"]["deadline_s"] == pytest.approx(540 * 5 / 11)

    kernels = report["parts"]["kernels"]
    assert [(r["n"], r["pass"]) for r in kernels["rows"]] == [(256, "fwd"), (256, "bwd"), (256, "fwd+bwd")]
    for row in kernels["rows"]:
        assert all(_number(row[k]) and row[k] > 0 for k in ("triton_ms", "torch_ref_ms", "sdpa_ms")), row
        assert math.isclose(row["sdpa_over_triton"], row["sdpa_ms"] / row["triton_ms"])

    profile = report["parts"]["profile"]
    assert [r["what"] for r in profile["rows"]] == [
        "fused forward, N=256", "fused forward+backward, N=256", "SDPA forward+backward, N=256",
        "vit_small_patch16_224 forward, batch 1, 32 px"]
    for r in profile["rows"]:  # on the CPU nothing is launched and the host's time is the call's
        assert r["wall_ms"] >= r["host_ms"] > 0 and r["launches"] == 0 and r["device_ms"] == 0, r
        assert r["aten_ops"] >= 1 and r["top"] and all(t["calls"] > 0 for t in r["top"]), r
    assert "linvision::linear_attention_bwd" in [t["op"] for t in profile["rows"][1]["top"]]
    # the grid sweep: each kind of kernel at every programs-per-SM setting, its default marked once
    assert [r["kernels"] for r in profile["grid"]] == [
        kind for kind in ("state, query", "output, key") for _ in gpu_parts.GRID_SWEEP] + [
        f"query at most {cap} registers" for cap in gpu_parts.REGISTER_SWEEP]
    assert [r["per_sm"] for r in profile["grid"][:2 * len(gpu_parts.GRID_SWEEP)]] == 2 * list(gpu_parts.GRID_SWEEP)
    from linvision.kernels import la_launch

    assert [r["per_sm"] for r in profile["grid"] if r["default"]] == [la_launch._SPLITS_PER_SM, la_launch._SPANS_PER_SM]
    assert all(_number(r[f"{p}_ms"]) and r[f"{p}_ms"] > 0 for r in profile["grid"] for p in gpu_parts.PASSES)
    assert "Grid sweep at N=256" in markdown
    # the autotuner's choices (one configuration in the interpreter) for each of the four kernels
    assert sorted({c["kernel"] for c in kernels["chosen"]}) == [
        "_key_bwd_kernel", "_output_fwd_kernel", "_query_bwd_kernel", "_state_fwd_kernel"]
    assert "The configurations the autotuner chose" in markdown

    points = report["parts"]["models"]["points"]
    assert [(p["batch_size"], p["model"], p["img_size"]) for p in points] == [  # the twin first at each size
        (2, TWIN, 32), (2, "vit_small_patch16_224", 32)]
    for p in points:
        assert p["status"] == "ok" and all(_number(p[k]) and p[k] > 0 for k in ("infer_img_s", "train_img_s")), p
    assert points[0]["train_ms_vs_twin"] == 1.0
    assert all(_number(points[1][f"{k}_ms_vs_twin"]) and points[1][f"{k}_ms_vs_twin"] > 0 for k in ("infer", "train"))
    assert report["parts"]["models"]["planned"] == 2

    rec = report["parts"]["recurrences"]
    assert [c["what"] for c in rec["first_calls"]] == [
        "linear_rope at N=256", "bidir_delta at N=256", "bidir_gated at N=256", "bidir_gated_ch at N=256",
        "vig_tiny at 32 px, batch 1"]
    assert all(_number(c["seconds"]) and c["seconds"] > 0 and c["status"] == "ok" for c in rec["first_calls"])
    assert all(r["status"] == "ok" for r in rec["rows"] + kernels["rows"])
    assert "warmups" not in rec and "warmups" not in kernels  # no GPU warm-up off CUDA
    assert rec["backend"] == "torch" and [r["pass"] for r in rec["rows"]] == ["fwd", "bwd", "fwd+bwd"]
    for row in rec["rows"]:
        assert math.isclose(row["bidir_delta_over_linear_rope"], row["bidir_delta_ms"] / row["linear_rope_ms"])

    tests = report["parts"]["tests"]
    c = tests["counts"]
    assert tests["command"].startswith("LINVISION_KERNEL_AUTOTUNE=0 pytest -v -m cuda ")
    assert "-k autocast" in tests["command"]
    assert c["passed"] >= 1 and c["failed"] == c["error"] == 0 and c["run"] == c["passed"] + c["skipped"]
    assert c["deselected"] == c["collected"] - c["run"]

    for heading in ("# GPU report", "## 1. Kernels against SDPA", "## 2. Where a small call's time goes",
                    "## 3. Models against timm's", "## 4. Recurrences on fla-core's kernels", "## 5. CUDA tests"):
        assert f"\n{heading}\n" in f"\n{markdown}"
    # every section with figures says first, in bold, that the dry run's figures are not speed figures
    assert markdown.count(f"**{gpu_report.DRY_NOTE}**") == 4 and "they are not speed figures" in gpu_report.DRY_NOTE
    row = kernels["rows"][0]
    assert f"| 256 | fwd | {row['triton_ms']:.3f} | {row['torch_ref_ms']:.3f} | {row['sdpa_ms']:.3f} |" in markdown
    assert f"| 2 | vit_small_patch16_224 | 32 | ok | {points[1]['infer_img_s']:.2f} |" in markdown
    # the time / twin columns of the model that is not the twin hold its ratios
    p = points[1]
    assert re.search(rf"\| 2 \| vit_small_patch16_224 \| 32 \| ok \|.* \| {p['infer_ms_vs_twin']:.2f} \| "
                     rf"{p['train_ms_vs_twin']:.2f} \|\n", markdown)
    assert "| models | ok |" in markdown and "| 2 of 2 points measured |" in markdown
    # the models' figure, one per batch, beside the report and shown in it
    assert report["parts"]["models"]["figures"] == {"2": "models_b2.png"} and (out / "models_b2.png").is_file()
    assert "(models_b2.png)" in markdown


def test_the_budget_is_shared_out_as_the_parts_start():
    assert sum(gpu_report.part_deadline(p, gpu_report.PARTS, 540) for p in gpu_report.PARTS) == pytest.approx(540)
    assert gpu_report.PARTS[0] == "models"  # the headline first
    assert gpu_report.part_deadline("models", gpu_report.PARTS, 540) == pytest.approx(540 * 5 / 11)
    # what the models left (400 of 540 s) goes to the parts after it, by their shares 2:1:1:2
    assert gpu_report.part_deadline("kernels", ("kernels", "profile", "recurrences", "tests"), 400) == \
        pytest.approx(400 * 2 / 6)
    assert gpu_report.part_deadline("tests", ("tests",), 37) == pytest.approx(37)
    assert gpu_report.part_deadline("tests", ("tests",), -3) == 0


def test_the_comparison_is_measured_batch_by_batch_and_size_by_size():
    order = gpu_parts.comparison_order(["a", "b"], [512, 1024], [8, 1])
    assert order == [(8, 512, "a"), (8, 512, "b"), (8, 1024, "a"), (8, 1024, "b"),
                     (1, 512, "a"), (1, 512, "b"), (1, 1024, "a"), (1, 1024, "b")]
    assert gpu_parts.comparison_order(["a", "b", "t"], [512, 1024], [8], twin="t") == [
        (8, 512, "t"), (8, 512, "a"), (8, 512, "b"), (8, 1024, "t"), (8, 1024, "a"), (8, 1024, "b")]
    # the deciding models first, at the first batch and size, each point once; a deciding name not among the
    # models is not measured
    order = gpu_parts.comparison_order(["a", "b", "c", "t"], [1024, 512], [8, 1], twin="t", deciding=["c", "a", "x"])
    assert order == [
        (8, 1024, "c"), (8, 1024, "a"), (8, 1024, "t"), (8, 1024, "b"),
        (8, 512, "t"), (8, 512, "a"), (8, 512, "b"), (8, 512, "c"),
        (1, 1024, "t"), (1, 1024, "a"), (1, 1024, "b"), (1, 1024, "c"),
        (1, 512, "t"), (1, 512, "a"), (1, 512, "b"), (1, 512, "c")]
    points = [{"model": "a", "batch_size": 8, "img_size": 512, "status": "ok"},
              {"model": "a", "batch_size": 8, "img_size": 1024, "status": "oom"},
              {"model": "a", "batch_size": 8, "img_size": 2048, "status": "oom"},
              {"model": "b", "batch_size": 1, "img_size": 2048, "status": "oom"}]
    assert gpu_parts._oom_at(points) == {"a @ batch 8": 1024, "b @ batch 1": 2048}


def test_a_running_part_writes_its_rows_into_the_report(tmp_path, monkeypatch):
    """While a part runs, each change of its saved figures rewrites report.md and report.json (status
    "running"), so a run cut there keeps them."""
    seen = {}

    def fake_child_part(part, settings, out_dir, deadline, dry, update):
        update({"rows": [{"n": 4096, "pass": "fwd", "triton_ms": 0.25, "torch_ref_ms": 1.0, "sdpa_ms": 0.5,
                          "sdpa_over_triton": 2.0}],
                "device": "cuda", "batch": 1, "heads": 16, "dim": 64, "dtype": "bfloat16", "feature_map": "elu"})
        seen["md"] = (tmp_path / "report.md").read_text()
        seen["json"] = json.loads((tmp_path / "report.json").read_text())
        return {"status": "ok", "error": "", "seconds": 1.0, "deadline_s": deadline, "log": "kernels.log",
                "log_tail": []}

    monkeypatch.setattr(gpu_report, "run_child_part", fake_child_part)
    report = {"command": "linvision-gpu-report", "budget_s": 540, "environment": gpu_report.environment(False),
              "parts": {}}
    result = gpu_report._run_part("kernels", {"kernels": {}}, {}, str(tmp_path), 108.0, False, report)
    assert result["status"] == "ok"
    assert seen["json"]["parts"]["kernels"]["status"] == "running"
    assert "| kernels | running |" in seen["md"] and "| 4096 | fwd | 0.250 | 1.000 | 0.500 | 2.00 |" in seen["md"]
    assert gpu_report.DRY_NOTE not in seen["md"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # written through renamed temporaries


def test_a_part_past_its_deadline_is_stopped_and_keeps_what_it_saved(tmp_path, capsys):
    result = tmp_path / "part.json"
    script = (f"import json, time; json.dump({{'rows': [1, 2]}}, open({str(result)!r}, 'w')); print('saved', "
              "flush=True); time.sleep(60)")
    ticks = []
    start = time.monotonic()
    run = gpu_report.run_process([sys.executable, "-c", script], 5.0, str(tmp_path / "part.log"),
                                 tick=lambda: ticks.append(result.exists()))
    assert run["timed_out"] and run["returncode"] != 0 and time.monotonic() - start < 60
    assert run["tail"] == ["saved"] and "    saved" in capsys.readouterr().out and True in ticks
    assert json.loads(result.read_text()) == {"rows": [1, 2]}
    run = gpu_report.run_process([sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], 30,
                                 str(tmp_path / "x.log"))
    assert not run["timed_out"] and run["returncode"] == 3 and run["tail"] == ["x"]

    part = gpu_report.run_child_part("kernels", {"device": "cpu"}, str(tmp_path), 0.2, True)
    assert part["status"] == "timeout" and "deadline of 0 s" in part["error"] and part["seconds"] < 30
    failed = {"status": "error", "error": "RuntimeError: boom", "seconds": 3.0, "deadline_s": 60, "log": "models.log",
              "log_tail": ["Traceback (most recent call last):", "RuntimeError: boom"]}
    report = {"command": "linvision-gpu-report", "budget_s": 60, "environment": gpu_report.environment(True),
              "parts": {"kernels": part, "models": failed}}
    gpu_report.write_report(report, str(tmp_path))
    markdown = (tmp_path / "report.md").read_text()
    assert "| kernels | timeout |" in markdown and "| models | error | 3 | 60 | RuntimeError: boom |" in markdown
    assert "Status: **error**: RuntimeError: boom" in markdown and "```\nTraceback" in markdown


def test_test_outcomes_are_read_from_junit_or_from_the_printed_lines(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_kernels" name="test_a[2]"/>'
                   '<testcase classname="tests.test_kernels" name="test_b"><failure message="assert 1 == 2">'
                   'tb</failure></testcase><testcase classname="tests.test_x" name="test_c"><skipped message="'
                   'needs a GPU"/></testcase></testsuite></testsuites>')
    results = gpu_report.junit_results(str(xml))
    assert results == [
        {"test": "tests/test_kernels.py::test_a[2]", "outcome": "passed", "message": ""},
        {"test": "tests/test_kernels.py::test_b", "outcome": "failed", "message": "assert 1 == 2"},
        {"test": "tests/test_x.py::test_c", "outcome": "skipped", "message": "needs a GPU"}]
    assert gpu_report.junit_results(str(tmp_path / "missing.xml")) is None
    lines = ["collected 9 items / 6 deselected", "tests/test_kernels.py::test_a[2] PASSED   [ 50%]", "noise",
             "tests/test_kernels.py::test_b FAILED"]
    figures = gpu_report.tests_figures(lines, gpu_report.line_results(lines))
    assert figures["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0, "collected": 9,
                                 "deselected": 6, "run": 2}
    assert figures["failures"] == [{"test": "tests/test_kernels.py::test_b", "message": ""}]


def test_bad_arguments_stop_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--parts", "nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="twin: 'resnet18' is not one of --models"):
        tool.main(["--twin", "resnet18", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="budget: seconds > 0"):
        tool.main(["--budget", "0", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="model: unknown 'linhier_nope'"):
        tool.main(["--models", "linhier_nope", "--twin", "none", "--output", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


# --- the measuring parts, run in this process on the CPU with their timings stubbed or failing


def _saver(snapshots):
    """A part's ``save``: the figures so far, a deep copy of each state kept in ``snapshots``."""
    state = {}

    def save(**figures):
        state.update(figures)
        snapshots.append(json.loads(json.dumps(gpu_parts.plain(state))))

    return save


def _fake_point(name, size, batch_size, device, model_kwargs, **_):
    """A measured point: inference 10 ms, training 30 ms, 100 / 300 MiB; the softmax twin twice as long, and out
    of memory at 64 px with batch 2."""
    twin = model_kwargs.get("token_mixer") == "softmax"
    slow, oom = (2.0 if twin else 1.0), twin and size == 64 and batch_size == 2
    nan = float("nan")
    return {"model": name, "img_size": size, "batch_size": batch_size, "device": device,
            "status": "oom" if oom else "ok", "error": "CUDA out of memory" if oom else "",
            "infer_ms": nan if oom else 10.0 * slow, "train_ms": nan if oom else 30.0 * slow,
            "infer_mem_mb": nan if oom else 100.0, "train_mem_mb": nan if oom else 300.0,
            "infer_img_s": nan if oom else 100.0 / slow, "train_img_s": nan if oom else 33.0 / slow}


def test_a_cut_models_part_keeps_the_ratios_to_the_twin_and_counts_every_planned_point(monkeypatch):
    """The twin is measured first at each size and batch, and each point is saved with its time / twin ratios (not
    only when the part ends: a part stopped at its deadline has them; "-" where the twin has no figures); the
    summary counts the points planned (models x sizes x batches), not those reached."""
    from linvision.benchmark import gpu_render, throughput

    monkeypatch.setattr(throughput, "benchmark_point", _fake_point)
    snapshots = []
    settings = {"models": ["vit_small_patch16_224", TWIN], "twin": TWIN, "device": "cpu", "img_size": [32, 64],
                "batches": [2, 1], "amp": "none", "warmup": 0, "iters": 1, "model_kwargs": {}}
    gpu_parts.models_part(settings, _saver(snapshots))
    assert snapshots[0]["planned"] == 8 and snapshots[0]["points"] == []
    measured = [snap for snap in snapshots if snap["points"]]
    assert [len(snap["points"]) for snap in measured] == list(range(1, 9))
    ratios = []
    for snap in measured:  # each point's ratios as it is saved
        last = snap["points"][-1]
        ratios.append((last["model"], last["batch_size"], last["img_size"], last.get("infer_ms_vs_twin"),
                       last.get("train_ms_vs_twin")))
    vit = "vit_small_patch16_224"
    assert ratios == [(TWIN, 2, 32, 1.0, 1.0), (vit, 2, 32, 0.5, 0.5), (TWIN, 2, 64, None, None),
                      (vit, 2, 64, None, None), (TWIN, 1, 32, 1.0, 1.0), (vit, 1, 32, 0.5, 0.5),
                      (TWIN, 1, 64, 1.0, 1.0), (vit, 1, 64, 0.5, 0.5)]  # None: NaN (the twin out of memory)
    cut = {"status": "timeout", "points": measured[5]["points"], "planned": 8}  # stopped after 6 of 8 points
    assert gpu_render.summary("models", cut) == "5 of 8 points measured"  # the twin's 64 px point: out of memory
    rows = gpu_render._models({**measured[5], "batches": [2, 1], "amp": "none", "device": "cpu", "iters": 1,
                               "warmup": 0, "twin": TWIN})
    assert f"| 1 | {vit} | 32 | ok | 100.00 | 100 | 33.00 | 300 | 0.50 | 0.50 |" in rows
    assert f"| 2 | {vit} | 64 | ok | 100.00 | 100 | 33.00 | 300 | - | - |" in rows


def test_models_part_runs_each_model_in_each_mode(monkeypatch):
    """--model-modes: every model at every size in each mode, labelled with its mode ("name [mode]" unless eager),
    benchmarked with that mode's compile and weights (16-bit weights without autocast), the twin's ratios taken
    within the mode."""
    from linvision.benchmark import throughput

    calls = []

    def fake(name, size, batch_size, device, model_kwargs, compile="none", weights="fp32", amp="none", **_):
        calls.append((compile, weights, amp))
        point = _fake_point(name, size, batch_size, device, model_kwargs)
        if weights != "fp32":  # 16-bit weights: twice as fast in inference, every model; no training step
            point.update(infer_ms=point["infer_ms"] / 2, infer_img_s=point["infer_img_s"] * 2,
                         train_ms=float("nan"), train_img_s=float("nan"))
        if compile != "none":  # compiled: training 1.5x as fast, its first calls timed apart
            point.update(train_ms=point["train_ms"] / 1.5, train_img_s=point["train_img_s"] * 1.5,
                         infer_compile_s=12.5, train_compile_s=40.0)
        return point

    monkeypatch.setattr(throughput, "benchmark_point", fake)
    snapshots = []
    settings = {"models": ["vit_small_patch16_224", TWIN], "twin": TWIN, "device": "cpu", "img_size": [32],
                "batches": [1], "amp": "bf16", "warmup": 0, "iters": 1, "model_kwargs": {},
                "modes": ["eager", "reduce-overhead", "bf16-weights"], "deciding": ["vit_small_patch16_224"]}
    gpu_parts.models_part(settings, _saver(snapshots))
    points = snapshots[-1]["points"]
    assert snapshots[0]["planned"] == 6 and len(points) == 6
    # the deciding model first, in every mode, then the twin
    assert [p["model"] for p in points[:4]] == ["vit_small_patch16_224", "vit_small_patch16_224 [reduce-overhead]",
                                                "vit_small_patch16_224 [bf16-weights]", TWIN]
    assert sorted(set(calls)) == [("none", "bf16", "none"), ("none", "fp32", "bf16"), ("reduce-overhead", "fp32", "bf16")]
    vit = "vit_small_patch16_224"
    by_label = {p["model"]: p for p in points}
    assert set(by_label) == {TWIN, vit, f"{TWIN} [reduce-overhead]", f"{vit} [reduce-overhead]",
                             f"{TWIN} [bf16-weights]", f"{vit} [bf16-weights]"}
    assert {p["mode"] for p in points} == {"eager", "reduce-overhead", "bf16-weights"}
    for mode in ("", " [reduce-overhead]", " [bf16-weights]"):  # within each mode: vit half the twin's time
        assert by_label[vit + mode]["infer_ms_vs_twin"] == 0.5
    # the report: each model in its fastest mode, inference and training apart, and the compilations' seconds
    from linvision.benchmark import gpu_render

    markdown = "\n".join(gpu_render._models(snapshots[-1]))
    assert f"| 1 | 32 | {vit} | 200.00 | bf16-weights | 49.50 | reduce-overhead |" in markdown
    assert f"| 1 | 32 | {TWIN} | 100.00 | bf16-weights | 24.75 | reduce-overhead |" in markdown
    assert f"{vit} [reduce-overhead] @ 1 x 32 px: infer 12.5 s, train 40.0 s" in markdown


class _FailingBackward(torch.autograd.Function):
    """The identity forward; its backward raises as fla-core's gated backward did on Hopper with Triton 3.6."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results (see #640).\n"
                           "second line")


def test_a_failing_row_of_the_recurrences_is_its_status_and_the_part_goes_on(monkeypatch, tmp_path):
    """bidir_gated's backward failing (in its first call and in each timing) and a first model failing to build:
    each is that row's status (the exception's type and first line), every other row is measured (the first
    calls after them, the timings at each N), and the part ends "failed" naming the rows."""
    real_paths = gpu_parts.recurrence_paths

    def paths(n, d, device, backend):
        found = real_paths(n, d, device, backend)
        gated = found["bidir_gated"]
        found["bidir_gated"] = lambda q, k, v: _FailingBackward.apply(gated(q, k, v))
        return found

    def model_step(name, img_size, device, amp):
        if name == "broken":
            raise ValueError("model: unknown 'broken'")
        return lambda: torch.ones(8, 8) @ torch.ones(8, 8)

    monkeypatch.setattr(gpu_parts, "recurrence_paths", paths)
    monkeypatch.setattr(gpu_parts, "_model_step", model_step)
    snapshots = []
    settings = {"device": "cpu", "heads": 1, "dim": 16, "dtype": "float32", "batch": 1, "n": [64, 128],
                "backend": "torch", "first_models": ["broken", "tiny"], "amp": "none", "model_img_size": 32}
    gpu_parts.recurrences_part(settings, _saver(snapshots))
    rec = snapshots[-1]
    error = "RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results (see #640)."
    assert [(c["what"], c["status"]) for c in rec["first_calls"]] == [
        ("linear_rope at N=64", "ok"), ("bidir_delta at N=64", "ok"), ("bidir_gated at N=64", error),
        ("bidir_gated_ch at N=64", "ok"), ("broken at 32 px, batch 1", "ValueError: model: unknown 'broken'"),
        ("tiny at 32 px, batch 1", "ok")]
    assert [_number(c["seconds"]) for c in rec["first_calls"]] == [True, True, False, True, False, True]
    assert [(r["n"], r["pass"]) for r in rec["rows"]] == [(n, p) for n in (64, 128) for p in gpu_parts.PASSES]
    for r in rec["rows"]:
        assert _number(r["linear_rope_ms"]) and _number(r["bidir_delta_ms"]) and _number(r["bidir_gated_ch_ms"]), r
        assert _number(r["bidir_gated_ms"]) == (r["pass"] == "fwd"), r  # its forward is timed, not its backward
        assert r["status"] == ("ok" if r["pass"] == "fwd" else f"bidir_gated: {error}"), r
    assert rec["status"] == "failed" and rec["error"].startswith(
        "6 rows failed: bidir_gated at N=64, broken at 32 px, batch 1, N=64 bwd, N=64 fwd+bwd, N=128 bwd")
    from linvision.benchmark import gpu_render

    markdown = "\n".join(gpu_render._recurrences({**rec, "pinned": True}))
    assert f"| bidir_gated at N=64 | - | {error} |" in markdown
    # linear_rope, bidir_delta, bidir_gated, bidir_gated_ch, then the three ratios, then the status
    assert re.search(rf"\| 128 \| bwd \| [0-9.]+ \| [0-9.]+ \| - \| [0-9.]+ \| [0-9.]+ \| - \| [0-9.]+ \| "
                     rf"bidir_gated: {re.escape(error)} \|", markdown)


def test_a_failing_kernel_path_is_its_rows_status(monkeypatch):
    """The fused kernels raising at every call: each row's status says so, the reference and SDPA are still timed
    at each N, and the kernels part ends "failed"."""
    import linvision.kernels

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setattr(linvision.kernels, "linear_attention_triton", broken)
    snapshots = []
    settings = {"device": "cpu", "heads": 1, "dim": 16, "dtype": "float32", "batch": 1, "n": [32, 64],
                "feature_map": "elu", "sdpa_max_n": 64}
    gpu_parts.kernels_part(settings, _saver(snapshots))
    rows = snapshots[-1]["rows"]
    assert [(r["n"], r["pass"]) for r in rows] == [(n, p) for n in (32, 64) for p in gpu_parts.PASSES]
    for r in rows:
        assert r["triton_ms"] is None and _number(r["torch_ref_ms"]) and _number(r["sdpa_ms"]), r
        assert r["status"] == "triton: RuntimeError: PassManager::run failed", r
    assert snapshots[-1]["status"] == "failed" and snapshots[-1]["error"].startswith("6 rows failed: N=32 fwd, ")


def test_the_timing_parts_warm_the_gpu_up_first(monkeypatch, capsys):
    """Each timing part runs the GPU warm-up before its first timing, prints and saves it; off CUDA the warm-up
    runs nothing; the load itself is synchronised matmuls, bounded in count and in time."""
    from linvision.benchmark import throughput

    events = []
    record = {"matmuls": 4200, "seconds": 1.0, "size": 4096}
    monkeypatch.setattr(gpu_parts, "warm_up", lambda device: events.append(f"warm-up {device}") or dict(record))
    monkeypatch.setattr(gpu_parts, "time_paths", lambda paths, *a: events.append("timed") or {
        label: {p: 1.0 for p in gpu_parts.PASSES} for label in paths})
    monkeypatch.setattr(gpu_parts, "_first_calls", lambda *a: events.append("first calls"))
    monkeypatch.setattr(throughput, "benchmark_point", lambda *a, **kw: events.append("timed") or _fake_point(
        "vit_small_patch16_224", 32, 2, "cpu", {}))
    base = {"device": "cpu", "heads": 1, "dim": 16, "dtype": "float32", "batch": 1, "n": [64]}
    runs = {"kernels": {**base, "feature_map": "elu", "sdpa_max_n": 64},
            "models": {"models": ["vit_small_patch16_224"], "twin": None, "device": "cpu", "img_size": [32],
                       "batches": [2], "amp": "none", "warmup": 0, "iters": 1, "model_kwargs": {}},
            "recurrences": {**base, "backend": "torch", "first_models": [], "amp": "none", "model_img_size": 32}}
    expected = {"kernels": ["warm-up cpu", "timed"], "models": ["warm-up cpu", "timed"],
                "recurrences": ["warm-up cpu", "first calls", "warm-up cpu", "timed"]}
    for part, settings in runs.items():
        events.clear()
        snapshots = []
        gpu_parts.PART_FUNCTIONS[part](settings, _saver(snapshots))
        assert events == expected[part], part
        assert snapshots[-1]["warmups"][0] == {"before": snapshots[-1]["warmups"][0]["before"], **record}, part
    printed = capsys.readouterr().out
    assert "GPU warm-up before the first timing: 4200 bf16 matmuls of 4096^2 in 1.00 s" in printed
    monkeypatch.undo()
    monkeypatch.setattr(gpu_parts, "matmul_load", lambda *a: pytest.fail("a load off CUDA"))
    assert gpu_parts.warm_up("cpu") is None
    monkeypatch.undo()
    assert gpu_parts.matmul_load("cpu", torch.float32, 60.0, 25, 16)["matmuls"] == 25  # bounded in count
    load = gpu_parts.matmul_load("cpu", torch.float32, 0.2, 10 ** 9, 16)  # and in time
    assert 0.2 <= load["seconds"] < 30 and 0 < load["matmuls"] < 10 ** 9


def test_the_kernel_test_files_run_first_without_autotuning(tmp_path):
    """The tests part names every test file, the kernels' first (pytest keeps the order of the files named on its
    command line, not of a folder named after them), and runs pytest with LINVISION_KERNEL_AUTOTUNE=0."""
    paths = gpu_report.ordered_test_paths(ROOT)
    files = sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    assert paths[:2] == ["tests/test_kernels.py", "tests/test_recurrent_kernels.py"]
    assert sorted(paths) == files and paths[2:] == [f for f in files if f not in paths[:2]]
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_z.py"):
        (tmp_path / "tests" / name).write_text(
            "import os, pytest\n@pytest.mark.cuda\ndef test_env():\n"
            "    assert os.environ['LINVISION_KERNEL_AUTOTUNE'] == '0'\n")
    order = gpu_report.ordered_test_paths(str(tmp_path), first=["tests/test_z.py"])
    assert order == ["tests/test_z.py", "tests/test_a.py"]
    part = gpu_report.tests_part(str(tmp_path), str(tmp_path), 300, None, True, paths=order)
    assert part["status"] == "ok", part
    ran = [line.split("::")[0] for line in (tmp_path / "tests.log").read_text().splitlines() if "::test_env" in line]
    assert ran == ["tests/test_z.py", "tests/test_a.py"] and part["counts"]["passed"] == 2


# What the lent GPU machine's Python holds of linvision's and its examples' requirements (docs/kernels.md, "On a
# lent GPU"): the rest comes in the wheels of `make gpu-wheels`.
GPU_MACHINE_PACKAGES = {"torch", "torchvision", "triton", "numpy", "pillow", "safetensors", "huggingface-hub", "tqdm",
                        "pyyaml", "einops", "matplotlib", "scikit-learn", "scikit-image"}


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str):
    """The distributions ``dist`` requires (its extras' left out), as installed here."""
    import importlib.metadata

    reqs = importlib.metadata.distribution(dist).requires or []
    return {_dist(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs if "extra ==" not in r}


def test_the_gpu_wheels_carry_what_the_examples_and_the_wheels_need():
    """`make gpu-wheels` downloads pinned wheels (constraints.txt) that, with the GPU machine's own packages, hold
    every requirement of linvision and of those wheels, and every package the manual's examples import (the CUDA
    tests run them: segmentation-models-pytorch for docs/segmentation.md)."""
    import importlib.metadata

    from support import python_examples

    makefile = open(os.path.join(ROOT, "Makefile")).read().replace("\\\n", " ")  # continued lines joined
    carried = {_dist(n) for n in re.search(r"pip download .* -d \.whl (.+)", makefile).group(1).split()}
    pins = {_dist(line.split("==")[0]) for line in open(os.path.join(ROOT, "constraints.txt")) if "==" in line}
    assert carried <= pins and "segmentation-models-pytorch" in carried
    there = carried | GPU_MACHINE_PACKAGES | {"linvision"}
    for dist in carried | {"linvision"}:
        assert _requirements(dist) <= there, (dist, _requirements(dist) - there)
    modules = importlib.metadata.packages_distributions()
    imported = set()
    for page, line, code in python_examples():
        for node in ast.walk(ast.parse(code)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in (n.split(".")[0] for n in names):
                if top not in sys.stdlib_module_names:
                    imported |= {_dist(d) for d in modules.get(top, [top])}
    assert "segmentation-models-pytorch" in imported and imported <= there, imported - there


# --- the cuda marker ---

_GPU_WORDS = re.compile(r"\b(GPU|CUDA)\b|cuda\.is_available|\bDEVICE\b")


def _marks_cuda(nodes) -> bool:
    return any("mark.cuda" in ast.unparse(n) for n in nodes)


def _needs_cuda(nodes) -> bool:
    """A skipif/skip mark among ``nodes`` (decorators or pytestmark values) whose condition or reason is about CUDA."""
    calls = [c for n in nodes for c in ast.walk(n) if isinstance(c, ast.Call)
             and getattr(c.func, "attr", "") in ("skipif", "skip")]
    return any(_GPU_WORDS.search(ast.unparse(c)) for c in calls)


def unmarked_cuda_tests(path: str):
    """The tests of a test file that skip for lack of CUDA (a skipif/skip mark of theirs or of the module naming
    CUDA or a GPU, or a pytest.skip in their body with such a reason) and carry no cuda marker."""
    with open(path) as f:
        tree = ast.parse(f.read())
    module_marks = [n.value for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)]
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
        if _marks_cuda(module_marks + fn.decorator_list):
            continue
        body_skips = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == "pytest.skip"]
        called = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        texts = [ast.unparse(c) for c in body_skips] + [ast.unparse(helpers[c]) for c in called & set(helpers)
                                                         if body_skips]
        if _needs_cuda(module_marks + fn.decorator_list) or any(re.search(r"\b(GPU|CUDA)\b", t) for t in texts):
            missing.append(fn.name)
    return missing


def test_every_test_skipped_without_cuda_carries_the_cuda_marker():
    """Read from the test files: no test that skips for lack of CUDA (however its skip is written) lacks
    @pytest.mark.cuda, so `pytest -m cuda` is the whole CUDA subset; the reading catches each way of skipping."""
    files = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py"))
    missing = {f: m for f in files if (m := unmarked_cuda_tests(os.path.join(ROOT, "tests", f)))}
    assert missing == {}


def test_the_reading_finds_each_way_of_skipping_for_lack_of_cuda(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import pytest, torch\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_a(): pass\n"
        "@pytest.mark.cuda\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_b(): pass\n"
        "def why(): return 'need a GPU'\n"
        "def test_c():\n    pytest.skip(why())\n"
        "def test_d():\n    pytest.skip('no onnxruntime')\n"
        "@pytest.mark.skipif(True, reason='the fused kernels need a GPU or TRITON_INTERPRET=1')\ndef test_e(): pass\n")
    assert unmarked_cuda_tests(str(sample)) == ["test_a", "test_c", "test_e"]
    assert "test_a_naflex_batch_on_the_fused_kernels" not in unmarked_cuda_tests(
        os.path.join(ROOT, "tests", "test_variable_length.py"))


def test_an_unmarked_test_skipped_for_lack_of_cuda_fails_the_run(tmp_path):
    """tests/conftest.py turns a skip for lack of CUDA without the marker into a failure that says what to add
    (on a machine without CUDA, where such a skip happens)."""
    if torch.cuda.is_available():
        pytest.skip("nothing is skipped for want of an accelerator on this machine")
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "def test_unmarked():\n    pytest.skip('needs a GPU')\n"
        "@pytest.mark.cuda\ndef test_marked():\n    pytest.skip('needs a GPU')\n"
        "def test_other():\n    pytest.skip('no onnxruntime')\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                             "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "1 failed, 2 skipped" in result.stdout
    assert "test_unmarked is skipped for lack of CUDA (Skipped: needs a GPU) but has no @pytest.mark.cuda" in \
        result.stdout


def test_the_profile_section_lists_each_calls_operators_and_kernels():
    """A row as a GPU gives it (kernels with device time): the clocks' table, then per call its busiest
    operators and its kernels."""
    from linvision.benchmark import gpu_render

    row = {"what": "fused forward, N=4096", "wall_ms": 0.2, "host_ms": 0.19, "device_ms": 0.012, "launches": 2,
           "aten_ops": 11, "top": [{"op": "linvision::linear_attention_fwd", "calls": 1, "self_host_us": 95.5}],
           "kernels": [{"kernel": "_output_fwd_kernel", "calls": 1, "device_us": 7.5}]}
    markdown = "\n".join(gpu_render._profile({"rows": [row], "device": "cuda", "steps": 5}))
    assert "| fused forward, N=4096 | 0.200 | 0.190 | 0.012 | 2 | 11 |" in markdown
    assert "| `linvision::linear_attention_fwd` | 1 | 95.5 |" in markdown
    assert "| `_output_fwd_kernel` | 1 | 7.5 |" in markdown
