"""linvision-gpu-report: its dry run writes the whole report on a CPU (every part, each with figures), a part past
its deadline is stopped and reported, and the CUDA test subset is found in the test files."""
import datetime
import json
import math
import os
import sys
import time

import pytest
import torch

from linvision.tools import gpu_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(300)
def test_dry_run_writes_the_report_of_every_part(tmp_path, capsys):
    """Without CUDA the plain command is the dry run (so it says); with CUDA --dry-run asks for it."""
    cuda = torch.cuda.is_available()
    out = tmp_path / "report"
    start = time.monotonic()
    status = gpu_report.main((["--dry-run"] if cuda else []) + ["--output", str(out)])
    seconds = time.monotonic() - start
    printed = capsys.readouterr().out
    assert status == 0, printed[-3000:]
    if not cuda:
        assert "no CUDA device: running the dry run" in printed
    for line in ("[1/3] tests:", "[2/3] kernels:", "[3/3] models:", "3 of 3 parts ok"):
        assert line in printed

    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    env = report["environment"]
    assert report["dry_run"] is True and env["torch"] == torch.__version__
    assert abs(datetime.datetime.fromisoformat(env["date"]).timestamp() - time.time()) < seconds + 60
    assert list(report["parts"]) == ["tests", "kernels", "models"]
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"), part.get("log_tail"))
        assert _number(part["seconds"]) and 0 < part["seconds"] <= seconds and _number(part["deadline_s"])
        assert (out / part["log"]).is_file()

    tests = report["parts"]["tests"]
    counts = tests["counts"]
    assert all(isinstance(v, int) for v in counts.values())
    # a case marked slow is skipped without --runslow; every other selected case runs and passes
    assert counts["collected"] >= 250 and counts["run"] == counts["passed"] + counts["skipped"]
    assert counts["passed"] >= 1
    assert counts["failed"] == counts["error"] == 0 and counts["deselected"] == counts["collected"] - counts["run"]
    assert "tests/test_kernels.py::test_autocast_runs_in_the_autocast_dtype" in tests["autocast"]["tests"]
    assert tests["autocast"]["passed"] >= 1 and tests["failures"] == []

    kernels = report["parts"]["kernels"]
    assert [(r["n"], r["pass"]) for r in kernels["rows"]] == [(512, "fwd"), (512, "bwd"), (512, "fwd+bwd")]
    for row in kernels["rows"]:
        for key in ("triton_ms", "torch_ref_ms", "sdpa_ms", "sdpa_over_triton"):
            assert _number(row[key]) and row[key] > 0, (key, row)
        assert math.isclose(row["sdpa_over_triton"], row["sdpa_ms"] / row["triton_ms"])

    models = report["parts"]["models"]
    points = models["points"]
    assert [p["model"] for p in points] == gpu_report.MODELS and {p["img_size"] for p in points} == {64}
    for p in points:
        assert p["status"] == "ok", p["error"]
        for key in ("infer_img_s", "infer_ms", "train_img_s", "train_ms", "params_m"):
            assert _number(p[key]) and p[key] > 0, (key, p)
        for key in ("infer_mem_mb", "train_mem_mb", "train_ms_vs_twin", "infer_ms_vs_twin"):
            assert _number(p[key]), (key, p)
        assert math.isclose(p["infer_img_s"] * p["infer_ms"], 1000.0, rel_tol=1e-6)
    assert points[-1]["model"] == models["twin"] and points[-1]["train_ms_vs_twin"] == 1.0
    assert (out / "models" / "results.json").is_file() and (out / "models" / "throughput_memory.png").is_file()

    headings = ("# GPU report", "## 1. CUDA tests", "## 2. Kernels against SDPA", "## 3. Models at high resolution")
    for heading in headings:
        assert f"\n{heading}\n" in f"\n{markdown}"
    assert f"torch {torch.__version__}" in markdown and env["date"] in markdown
    for part in ("tests", "kernels", "models"):
        assert f"| {part} | ok |" in markdown
    assert f"| {counts['collected']} | {counts['deselected']} | {counts['run']} | {counts['passed']} |" in markdown
    row = kernels["rows"][0]
    assert f"| 512 | fwd | {row['triton_ms']:.3f} | {row['torch_ref_ms']:.3f} | {row['sdpa_ms']:.3f} |" in markdown
    assert f"| linhier_delta_tiny_224 | 64 | ok | {points[1]['infer_img_s']:.2f} |" in markdown


def test_a_part_past_its_deadline_is_stopped_and_the_report_says_so(tmp_path, capsys):
    log = tmp_path / "sleep.log"
    start = time.monotonic()
    run = gpu_report.run_process([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                                 1.0, str(log))
    assert run["timed_out"] and run["returncode"] != 0 and time.monotonic() - start < 30
    assert run["tail"] == ["started"] and log.read_text() == "started\n" and "    started" in capsys.readouterr().out
    run = gpu_report.run_process([sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], 30, str(log))
    assert not run["timed_out"] and run["returncode"] == 3 and run["tail"] == ["x"]

    # a real part stopped before it measured anything (importing torch alone takes longer), then the report
    part = gpu_report._run_child_part("kernels", {"device": "cpu", "n": [512], "heads": 1, "dim": 16,
                                                  "dtype": "float32", "hbm_tbps": None}, str(tmp_path), 0.2, True)
    assert part["status"] == "timeout" and "deadline of 0.2 s" in part["error"] and part["seconds"] < 30
    failed = {"status": "error", "error": "RuntimeError: boom", "seconds": 3.0, "deadline_s": 60, "log": "models.log",
              "log_tail": ["Traceback (most recent call last):", "RuntimeError: boom"]}
    report = {"command": "linvision-gpu-report", "environment": gpu_report.environment(True),
              "parts": {"kernels": part, "models": failed}}
    gpu_report.write_report(report, str(tmp_path))
    markdown = (tmp_path / "report.md").read_text()
    assert "| kernels | timeout |" in markdown and "| models | error | 3 | 60 | RuntimeError: boom |" in markdown
    assert "## 2. Kernels against SDPA" in markdown and "## 3. Models at high resolution" in markdown
    assert "Status: **error**: RuntimeError: boom" in markdown and "```\nTraceback" in markdown
    assert json.loads((tmp_path / "report.json").read_text())["parts"]["kernels"]["status"] == "timeout"


def test_the_cuda_test_subset_is_found_in_the_test_files():
    subset = gpu_report.cuda_tests(ROOT)
    selection = subset["selection"]
    assert {"tests/test_kernels.py", "tests/test_recurrent_kernels.py",
            "tests/test_variants.py::test_fused_kernel_route_matches_formula",
            "tests/test_examples.py::test_example_runs"} <= set(selection)
    assert not any(s.startswith(("tests/test_engine.py", "tests/test_help.py", "tests/test_gpu_report.py"))
                   for s in selection)
    assert {"tests/test_kernels.py::test_autocast_runs_in_the_autocast_dtype",
            "tests/test_recurrent_kernels.py::test_fp32_inputs_run_with_fp16_operands"} <= set(subset["autocast"])


def test_test_outcomes_are_read_from_junit_or_from_the_printed_lines(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_kernels" name="test_a[2]"/>'
                   '<testcase classname="tests.test_kernels" name="test_b"><failure message="assert 1 == 2">'
                   'tb</failure></testcase><testcase classname="tests.test_x" name="test_c"><skipped message="'
                   'needs a GPU"/></testcase></testsuite></testsuites>')
    assert gpu_report._junit_results(str(xml)) == [
        {"test": "tests/test_kernels.py::test_a[2]", "outcome": "passed", "message": ""},
        {"test": "tests/test_kernels.py::test_b", "outcome": "failed", "message": "assert 1 == 2"},
        {"test": "tests/test_x.py::test_c", "outcome": "skipped", "message": "needs a GPU"}]
    assert gpu_report._junit_results(str(tmp_path / "missing.xml")) is None
    lines = ["tests/test_kernels.py::test_a[2] PASSED   [ 50%]", "noise", "tests/test_kernels.py::test_b FAILED"]
    assert [(r["test"], r["outcome"]) for r in gpu_report._line_results(lines)] == [
        ("tests/test_kernels.py::test_a[2]", "passed"), ("tests/test_kernels.py::test_b", "failed")]


def test_bad_arguments_stop_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_report.main(["--parts", "nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="twin: 'resnet18' is not one of --models"):
        gpu_report.main(["--twin", "resnet18", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="tests_timeout: seconds > 0"):
        gpu_report.main(["--tests-timeout", "0", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="model: unknown 'linhier_nope'"):
        gpu_report.main(["--models", "linhier_nope", "--twin", "none", "--output", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
