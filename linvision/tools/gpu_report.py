r"""Everything a GPU can tell about linvision, in one run and one report.

On a CUDA machine, three parts, one after the other, each in a process of its own stopped at its deadline:

  tests    the CUDA test subset: the kernel and fla-core tests against their references (tests/test_kernels.py,
           tests/test_recurrent_kernels.py, autocast cases included) and every other test skipped without a
           GPU, run by pytest; pass/fail counts and the failures
  kernels  the fused kernels, the PyTorch reference and softmax attention (SDPA) forward, backward and
           forward+backward at 4k-131k tokens in bf16 (linvision-bench-kernels' timing)
  models   throughput and peak memory of linhier_tiny_224, linhier_delta_tiny_224 and their softmax twin at
           512-2048 px, training and inference, bf16 autocast (linvision-benchmark's sweep)

A part that fails or runs past its deadline is recorded as such, and the next part still runs. Writes report.md
and report.json (the figures) into --output, with the GPU's name, the torch, triton and fla-core versions and
the date; each part's output goes to <part>.log beside them, the models' results and plot to models/.

Without CUDA, or with --dry-run, every part runs at tiny sizes on the CPU and writes the same report: the test
subset with -k autocast, the kernels at 512 tokens in the Triton interpreter, each model at 64 px in a
shallow, narrow build (one block per stage). The size flags are not used then.

    linvision-gpu-report                                      # on a GPU: output/gpu_report/report.md
    linvision-gpu-report --dry-run --output /tmp/gpu_report   # every part at tiny sizes, on the CPU
    linvision-gpu-report --parts kernels models --n 8192 65536 --img-size 1024 -b 4
    linvision-gpu-report --parts tests --tests-k "delta or gated" --tests-timeout 900

Exit status 0 when every part passed, 1 when one failed or ran out of time (the report is written either way),
2 for bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import collections
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any, Callable, Dict, List, Optional, Sequence

from linvision.utils.cli import AMP_HELP, amp_flag_options, run_cli, tool_parser

PARTS = ("tests", "kernels", "models")
TITLES = {"tests": "1. CUDA tests", "kernels": "2. Kernels against SDPA", "models": "3. Models at high resolution"}
SOFTMAX_TWIN = "linhier_tiny_224:token_mixers=softmax"
MODELS = ["linhier_tiny_224", "linhier_delta_tiny_224", SOFTMAX_TWIN]
# The test files that exercise the kernels and fla-core's path against the references, whole; other files add
# the tests (or the whole file) that a skip reason marks as needing a GPU.
KERNEL_TEST_FILES = ("tests/test_kernels.py", "tests/test_recurrent_kernels.py")
GPU_REASON = re.compile(r"needs (a |the )?(GPU|CUDA)", re.I)
# The dry run: every part at sizes a CPU runs in seconds.
DRY = {"tests_k": "autocast", "n": [512], "heads": 1, "dim": 16, "dtype": "float32", "img_size": [64],
       "batch_size": 1, "warmup": 0, "iters": 1, "amp": "none",
       "model_kwargs": {"depths": [1, 1, 1, 1], "dims": [16, 32, 64, 128]}}


def _img_size(value: str):
    from linvision.benchmark.throughput import parse_img_size

    try:
        return parse_img_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-gpu-report."""
    p = tool_parser("linvision-gpu-report", __doc__)
    p.add_argument("--output", default=os.path.join("output", "gpu_report"),
                   help="folder of report.md, report.json and the parts' logs")
    p.add_argument("--dry-run", action="store_true",
                   help="every part at tiny sizes on the CPU (what runs without CUDA anyway)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run, in this order")
    p.add_argument("--tests-k", default=None, metavar="EXPR",
                   help="pytest -k expression over the test subset (default: all of it; 'autocast' in the dry run)")
    p.add_argument("--tests-timeout", type=float, default=1800, help="seconds for the test subset")
    p.add_argument("--n", type=int, nargs="+", default=[1 << e for e in range(12, 18)],
                   help="token counts of the kernel timings")
    p.add_argument("--heads", type=int, default=16, help="attention heads of the kernel timings")
    p.add_argument("--dim", type=int, default=64, help="head dim D = Dv of the kernel timings")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the kernel timings' queries, keys and values")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth in TB/s, for the kernels' share of it (default: by the GPU's name)")
    p.add_argument("--kernels-timeout", type=float, default=1200, help="seconds for the kernel timings")
    p.add_argument("--models", nargs="+", default=MODELS,
                   help="models of the throughput part, each a timm name optionally with name:key=value options")
    p.add_argument("--twin", default=SOFTMAX_TWIN,
                   help="one of --models: the others' time and memory over its ('none': no comparison)")
    p.add_argument("--img-size", type=_img_size, nargs="+", default=[512, 1024, 2048],
                   help="input sizes of the throughput part: a side in pixels or HxW")
    p.add_argument("--batch-size", "-b", type=int, default=8, help="images per forward and per training step")
    p.add_argument("--amp", default="bf16", help=AMP_HELP, **amp_flag_options())
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before the timed ones")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per figure")
    p.add_argument("--point-timeout", type=float, default=None,
                   help="seconds: each model point in a process of its own, stopped at this budget")
    p.add_argument("--models-timeout", type=float, default=1800, help="seconds for the throughput part")
    return p


# ----------------------------------------------------------------------------------------------------------------
# Running a part: a process of its own, its output streamed and logged, stopped at the deadline


def run_process(cmd: Sequence[str], deadline: float, log_path: str, env: Optional[Dict[str, str]] = None,
                cwd: Optional[str] = None, tail: int = 30) -> Dict[str, Any]:
    """Run ``cmd`` in a session of its own, its output (stdout and stderr) printed as it comes and written to
    ``log_path``, and stop it and its children (SIGTERM, then SIGKILL) at ``deadline`` seconds. Returns
    timed_out, returncode, seconds and the last ``tail`` lines of output."""
    start = time.monotonic()
    lines: collections.deque = collections.deque(maxlen=tail)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, env=env, cwd=cwd, start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                lines.append(line.rstrip("\n"))
                print("    " + line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
        reader.join(timeout=10)
    return {"timed_out": timed_out, "returncode": proc.returncode, "seconds": time.monotonic() - start,
            "tail": list(lines)}


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _child_env(interpret: bool) -> Dict[str, str]:
    """The environment of a part's process: unbuffered output, and Triton's interpreter on (``interpret``) or off,
    whatever this process's own environment says."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _run_child_part(part: str, settings: Dict[str, Any], out_dir: str, deadline: float, dry: bool) -> Dict[str, Any]:
    """A kernels or models part in a Python process of its own (:func:`child`); the figures it saved as it went
    come back even when it failed or was stopped."""
    result_path = os.path.join(out_dir, f"{part}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    code = "from linvision.tools.gpu_report import child; child()"
    run = run_process([sys.executable, "-c", code, part, json.dumps(settings), result_path], deadline,
                      os.path.join(out_dir, f"{part}.log"), env=_child_env(interpret=dry))
    result: Dict[str, Any] = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    figures = {k: v for k, v in result.items() if k not in ("done", "error", "status")}
    if run["timed_out"]:
        status, error = "timeout", f"stopped at the deadline of {deadline:g} s"
    elif run["returncode"] == 0 and result.get("done"):
        status, error = result.get("status", "ok"), result.get("error", "")
    else:
        status = "error"
        error = result.get("error") or f"exit status {run['returncode']}: " + next(
            (line for line in reversed(run["tail"]) if line.strip()), "no output")
    return {"status": status, "error": error, "seconds": run["seconds"], "deadline_s": deadline,
            "log": f"{part}.log", "log_tail": run["tail"][-12:] if status != "ok" else [], **figures}


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_plain(data), f, indent=2, allow_nan=False)
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has neither) and tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def child() -> None:
    """The entry of a part's process: ``python -c ... PART SETTINGS_JSON RESULT_PATH``. The part saves its figures
    to RESULT_PATH as it goes; an exception is saved as the part's error (exit status 1)."""
    import traceback

    part, settings, result_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    state: Dict[str, Any] = {"done": False}

    def save(**figures):
        state.update(figures)
        _write_json(result_path, state)

    try:
        {"kernels": kernels_part, "models": models_part}[part](settings, save)
        save(done=True)
    except Exception as e:
        traceback.print_exc()
        message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        save(error=f"{type(e).__name__}: {message}" if message else type(e).__name__)
        sys.exit(1)


# ----------------------------------------------------------------------------------------------------------------
# Part 1: the CUDA test subset


def _strings(node: ast.AST) -> List[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def cuda_tests(repo: str) -> Dict[str, Any]:
    """The CUDA test subset of the checkout at ``repo``: ``selection``, the pytest arguments (the kernel test files
    whole; of the other test files, the whole file when its ``pytestmark`` names a GPU in a skip reason, else the
    tests whose decorators, or module functions they call, do) and ``autocast``, the names of the selected tests
    that run under torch.autocast."""
    selection, autocast = [], []
    tests_dir = os.path.join(repo, "tests")
    for name in sorted(os.listdir(tests_dir)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        rel = f"tests/{name}"
        with open(os.path.join(tests_dir, name)) as f:
            tree = ast.parse(f.read())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        tests = [n for n in functions.values() if n.name.startswith("test_")]
        marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and any(GPU_REASON.search(s) for s in _strings(n.value)) for n in tree.body)
        if rel in KERNEL_TEST_FILES or marked:
            chosen = tests
            selection.append(rel)
        else:
            chosen = []
            for fn in tests:
                called = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
                texts = [s for d in fn.decorator_list for s in _strings(d)]
                texts += [s for c in called if c in functions and c != fn.name for s in _strings(functions[c])]
                if any(GPU_REASON.search(s) for s in texts):
                    chosen.append(fn)
                    selection.append(f"{rel}::{fn.name}")
        autocast += [f"{rel}::{fn.name}" for fn in chosen if any(
            getattr(n, "attr", getattr(n, "id", None)) == "autocast" for n in ast.walk(fn))]
    return {"selection": selection, "autocast": autocast}


_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _junit_results(path: str) -> Optional[List[Dict[str, str]]]:
    """(test, outcome, message) of every test case of a JUnit XML file, None when there is none (a run stopped)."""
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    results = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name')}" if module else case.get("name", "")
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome = name
                message = (found.get("message") or found.text or "").strip()
                break
        results.append({"test": test, "outcome": outcome, "message": message})
    return results


def _line_results(lines: List[str]) -> List[Dict[str, str]]:
    words = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped",
             "XPASS": "passed"}
    return [{"test": m.group(1), "outcome": words[m.group(2)], "message": ""}
            for m in map(_OUTCOME.match, lines) if m]


def tests_part(args, dry: bool, out_dir: str, repo: str) -> Dict[str, Any]:
    """Part 1: pytest on the CUDA test subset (:func:`cuda_tests`) in a process stopped at the deadline."""
    import torch

    subset = cuda_tests(repo)
    keyword = args.tests_k if args.tests_k is not None else (DRY["tests_k"] if dry else None)
    xml = os.path.abspath(os.path.join(out_dir, "tests.xml"))
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *subset["selection"], *(["-k", keyword] if keyword else [])]
    log = os.path.join(out_dir, "tests.log")
    # on a GPU the tests run the compiled kernels; without one conftest.py runs them in the interpreter
    run = run_process(cmd, args.tests_timeout, log, env=_child_env(not torch.cuda.is_available()), cwd=repo)
    with open(log) as f:
        lines = f.read().splitlines()
    results = _junit_results(xml)
    if results is None:  # stopped before pytest wrote its report: the outcomes printed so far
        results = _line_results(lines)
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "error", "skipped")}
    collected = next((m for m in map(re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?").search, lines)
                      if m), None)
    counts["collected"] = int(collected.group(1)) if collected else len(results)
    counts["deselected"] = int(collected.group(2) or 0) if collected else 0
    counts["run"] = len(results)
    autocast = [r for r in results if r["test"].split("[")[0] in subset["autocast"]]
    rc = run["returncode"]
    if run["timed_out"]:
        status, error = "timeout", f"stopped at the deadline of {args.tests_timeout:g} s"
    elif rc == 0 and results:
        status, error = "ok", ""
    elif rc == 1 and counts["failed"] + counts["error"]:
        status, error = "failed", f"{counts['failed']} failed, {counts['error']} errors"
    else:  # pytest could not run the tests (a collection error, no test selected, no pytest)
        status = "error"
        error = f"pytest exit status {rc}: " + next((x for x in reversed(run["tail"]) if x.strip()), "no output")
    return {"status": status, "error": error, "seconds": run["seconds"], "deadline_s": args.tests_timeout,
            "log": "tests.log", "log_tail": run["tail"][-12:] if status not in ("ok", "failed") else [],
            "command": " ".join(["pytest", *cmd[3:]]), "selection": subset["selection"], "keyword": keyword,
            "counts": counts,
            "autocast": {"tests": subset["autocast"],
                         **{k: sum(r["outcome"] == k for r in autocast) for k in ("passed", "failed", "error",
                                                                                   "skipped")}},
            "failures": [{"test": r["test"], "message": r["message"].splitlines()[0][:300] if r["message"] else ""}
                         for r in results if r["outcome"] in ("failed", "error")]}


# ----------------------------------------------------------------------------------------------------------------
# Part 2: the kernels against SDPA (linvision-bench-kernels' timing)


def _time_once(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call (the CPU's stand-in for triton's do_bench in the dry run)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def kernels_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """Part 2, in its own process: :func:`linvision.tools.bench_kernels.time_paths` at each N, each row saved as it
    is measured."""
    import torch

    from linvision.tools import bench_kernels

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    args = bench_kernels.parse_args(["--heads", str(settings["heads"]), "--dim", str(settings["dim"]),
                                     "--dtype", settings["dtype"], "--sdpa-max-n", str(max(settings["n"]))])
    if device == "cuda":
        import triton.testing

        bench, tbps = triton.testing.do_bench, settings["hbm_tbps"] or bench_kernels.hbm_tbps(
            torch.cuda.get_device_name())
    else:
        bench, tbps = _time_once, None
    print(f"{device}: B={args.batch} H={args.heads} D=Dv={args.dim} {args.dtype} phi={args.feature_map}; "
          f"ms per call" + (f"; HBM {tbps} TB/s" if tbps else ""), flush=True)
    rows: List[Dict[str, Any]] = []
    save(rows=rows, device=device, hbm_tbps=tbps, batch=args.batch, heads=args.heads, dim=args.dim,
         dtype=args.dtype, feature_map=args.feature_map)
    itemsize = torch.finfo(dtype).bits // 8
    for n in settings["n"]:
        times = bench_kernels.time_paths(args, n, device, dtype, bench)
        for row in bench_kernels.pass_rows(args, n, times, itemsize, tbps or float("nan")):
            record = {"n": n, "pass": row["pass"], "triton_ms": row["triton"], "torch_ref_ms": row["torch ref"],
                      "sdpa_ms": row["sdpa"]}
            if row["triton"] and row["sdpa"]:
                record["sdpa_over_triton"] = row["sdpa"] / row["triton"]
            if tbps and row["hbm_pct"] is not None:
                record["hbm_pct"] = row["hbm_pct"]
            rows.append(record)
            print(f"N={n:>7d} {row['pass']:>8}: " + ", ".join(
                f"{label} {record[key]:.3f} ms" if record[key] is not None else f"{label} -"
                for label, key in (("triton", "triton_ms"), ("torch ref", "torch_ref_ms"), ("sdpa", "sdpa_ms"))),
                flush=True)
        save(rows=rows)


# ----------------------------------------------------------------------------------------------------------------
# Part 3: the models at high resolution (linvision-benchmark's sweep)


def models_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """Part 3, in its own process: :func:`linvision.benchmark.throughput.run_sweep` over the models and sizes, each
    point saved as it finishes; then each model against the twin, the results files and the plot in models/."""
    from linvision.benchmark.plots import plot_results
    from linvision.benchmark.throughput import add_comparisons, comparison_table, run_sweep, write_results

    out_dir = settings["out_dir"]
    points_path = os.path.join(out_dir, "results.jsonl")

    def log(line: str) -> None:
        print(line, flush=True)
        with open(points_path) as f:
            save(points=[json.loads(x) for x in f if x.strip()])

    kwargs = {k: settings[k] for k in ("batch_size", "device", "amp", "warmup", "iters", "point_timeout")}
    model_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in settings["model_kwargs"].items()}
    save(points=[], twin=settings["twin"], model_kwargs=settings["model_kwargs"],
         **{k: kwargs[k] for k in ("batch_size", "device", "amp", "warmup", "iters")})
    points = run_sweep(settings["models"], settings["img_size"], out_dir, log=log, train=True, flops=False,
                       model_kwargs=model_kwargs, **kwargs)
    if settings["twin"]:
        add_comparisons(points, settings["twin"])
    write_results(points, out_dir)
    plot_results(points, os.path.join(out_dir, "throughput_memory.png"),
                 title=f"{kwargs['device']}, batch {kwargs['batch_size']}, amp {kwargs['amp']}")
    failed = [p for p in points if p["status"] == "error"]
    save(points=points, table=comparison_table(points) if settings["twin"] else "",
         status="failed" if failed else "ok",
         error=f"{len(failed)} of {len(points)} points failed" if failed else "")


# ----------------------------------------------------------------------------------------------------------------
# The report


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(dry: bool) -> Dict[str, Any]:
    """The date, the GPU (None without CUDA) and the versions the report's figures were taken with."""
    import torch

    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "dry_run": dry, "gpu": torch.cuda.get_device_name() if cuda else None,
            "device": "cpu" if dry else "cuda", "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton"), "fla_core": _version("fla-core"), "python": platform.python_version(),
            "platform": platform.platform()}


def _ms(value: Any, fmt: str = ".3f") -> str:
    return f"{value:{fmt}}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def summary(part: str, result: Dict[str, Any]) -> str:
    """One line of what a part found."""
    if part == "tests" and "counts" in result:
        c = result["counts"]
        return (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
                f"({c['run']} run of {c['collected']} collected)")
    if part == "kernels" and result.get("rows"):
        ns = sorted({r["n"] for r in result["rows"]})
        return f"{len(result['rows'])} rows, N = {ns[0]}-{ns[-1]}"
    if part == "models" and "points" in result:
        points = result["points"]
        measured = sum(p["status"] == "ok" for p in points)
        return f"{measured} of {len(points)} points measured"
    return result.get("error", "")


def render(report: Dict[str, Any]) -> str:
    """report.md from the report's dictionary."""
    env = report["environment"]
    gpu = env["gpu"] or "none"
    if env["dry_run"]:
        device = f"CPU (dry run: every part at tiny sizes; GPU: {gpu})"
    else:
        device = f"{gpu} (CUDA {env['cuda']})"
    lines = ["# GPU report", "",
             f"- date: {env['date']}",
             f"- device: {device}",
             f"- torch {env['torch']}, triton {env['triton'] or 'not installed'}, fla-core "
             f"{env['fla_core'] or 'not installed'}, Python {env['python']}",
             f"- command: `{report['command']}`", "",
             "| part | status | seconds | deadline (s) | summary |", "|---|---|---:|---:|---|"]
    for part, result in report["parts"].items():
        lines.append(f"| {part} | {result['status']} | {result['seconds']:.0f} | {result['deadline_s']:g} | "
                     f"{summary(part, result).replace('|', '/')} |")
    for part, result in report["parts"].items():
        lines += ["", f"## {TITLES[part]}", "", f"Status: **{result['status']}**"
                  + (f": {result['error']}" if result.get("error") else "")
                  + f" ({result['seconds']:.0f} s; output in `{result['log']}`)."]
        lines += {"tests": _render_tests, "kernels": _render_kernels, "models": _render_models}[part](result)
        if result.get("log_tail"):
            lines += ["", "The end of its output:", "", "```", *result["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def _render_tests(result: Dict[str, Any]) -> List[str]:
    if "counts" not in result:
        return []
    c, a = result["counts"], result["autocast"]
    lines = ["", f"`{result['command']}`", "",
             "| collected | deselected | run | passed | failed | errors | skipped |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {c['collected']} | {c['deselected']} | {c['run']} | {c['passed']} | {c['failed']} | {c['error']} | "
             f"{c['skipped']} |", "",
             f"Autocast cases ({', '.join(f'`{t}`' for t in a['tests']) or 'none found'}): {a['passed']} passed, "
             f"{a['failed']} failed, {a['error']} errors, {a['skipped']} skipped."]
    if result["failures"]:
        lines += ["", "Failures:", ""] + [f"- `{f['test']}`: {f['message']}" for f in result["failures"][:50]]
        if len(result["failures"]) > 50:
            lines.append(f"- ... and {len(result['failures']) - 50} more (tests.xml)")
    return lines


def _render_kernels(result: Dict[str, Any]) -> List[str]:
    if not result.get("rows"):
        return []
    lines = ["", f"B={result['batch']} H={result['heads']} D=Dv={result['dim']} {result['dtype']}, "
                 f"phi={result['feature_map']}, on {result['device']}; ms per call"
                 + (f", % HBM of {result['hbm_tbps']} TB/s" if result.get("hbm_tbps") else "") + ".", "",
             "| N | pass | triton (ms) | torch ref (ms) | SDPA (ms) | SDPA / triton | % HBM |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['n']} | {r['pass']} | {_ms(r['triton_ms'])} | {_ms(r['torch_ref_ms'])} | "
                     f"{_ms(r['sdpa_ms'])} | {_ms(r.get('sdpa_over_triton'), '.2f')} | "
                     f"{_ms(r.get('hbm_pct'), '.1f')} |")
    return lines


def _render_models(result: Dict[str, Any]) -> List[str]:
    if not result.get("points"):
        return []
    options = f", model options {result['model_kwargs']}" if result.get("model_kwargs") else ""
    lines = ["", f"Batch {result['batch_size']}, amp {result['amp']}, on {result['device']}, mean of "
                 f"{result['iters']} timed iterations after {result['warmup']}{options}; results and plot in "
                 f"`models/`.", "",
             "| model | px | status | infer img/s | infer ms | infer MiB | train img/s | train ms | train MiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        status = p["status"] if p["status"] == "ok" else f"{p['status']}: {p['error'][:80]}"
        figures = [_ms(p["infer_img_s"], ".2f"), _ms(p["infer_ms"], ".1f"), _ms(p["infer_mem_mb"], ".0f"),
                   _ms(p["train_img_s"], ".2f"), _ms(p["train_ms"], ".1f"), _ms(p["train_mem_mb"], ".0f")]
        lines.append(f"| {p['model']} | {p['img_size']} | {status} | " + " | ".join(figures) + " |")
    if result.get("table"):
        lines += ["", f"Against the twin `{result['twin']}`:", "", result["table"]]
    return lines


def write_report(report: Dict[str, Any], out_dir: str) -> None:
    """report.json and report.md in ``out_dir``."""
    _write_json(os.path.join(out_dir, "report.json"), report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(render(_plain(report)))


# ----------------------------------------------------------------------------------------------------------------


def _repo_root() -> str:
    """The checkout whose tests/ the test part runs: the one this tool lives in, else the working directory."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root in (here, os.getcwd()):
        if os.path.isfile(os.path.join(root, "tests", "test_kernels.py")):
            return root
    raise FileNotFoundError("tests/test_kernels.py: run linvision-gpu-report in a checkout of linvision")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    import torch

    from linvision.benchmark.throughput import parse_model_spec
    from linvision.utils.factory import check_model_name

    for name in ("tests_timeout", "kernels_timeout", "models_timeout", "point_timeout"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"{name}: seconds > 0, got {getattr(args, name)}")
    if args.iters < 1 or args.warmup < 0 or args.batch_size < 1:
        raise ValueError("iters/warmup/batch_size: need iters >= 1, warmup >= 0 and batch_size >= 1")
    if min(args.n) < 1 or args.heads < 1 or args.dim < 1:
        raise ValueError(f"n/heads/dim: positive integers, got {args.n}, {args.heads}, {args.dim}")
    for spec in args.models:
        check_model_name(parse_model_spec(spec)[0])
    twin = None if args.twin.lower() == "none" else args.twin
    if twin is not None and twin not in args.models:
        raise ValueError(f"twin: {twin!r} is not one of --models (--twin none: no comparison)")
    repo = _repo_root() if "tests" in args.parts else None

    cuda = torch.cuda.is_available()
    dry = args.dry_run or not cuda
    if not cuda and not args.dry_run:
        print("no CUDA device: running the dry run (every part at tiny sizes on the CPU)", flush=True)
    out_dir = args.output
    os.makedirs(out_dir, exist_ok=True)
    report = {"tool": "linvision-gpu-report", "command": " ".join(["linvision-gpu-report", *argv]),
              "dry_run": dry, "environment": environment(dry), "parts": {}}
    env = report["environment"]
    print(f"GPU {env['gpu'] or 'none'}{' (dry run on the CPU)' if dry else ''}; torch {env['torch']}, "
          f"triton {env['triton']}, fla-core {env['fla_core']}; {env['date']}; report in {out_dir}", flush=True)
    # the dry run's tiny sizes in place of the size flags
    sizes = dict(DRY) if dry else dict(vars(args), model_kwargs={})
    device = "cpu" if dry else "cuda"
    kernel_settings = {"device": device, "hbm_tbps": args.hbm_tbps}
    kernel_settings.update({k: sizes[k] for k in ("n", "heads", "dim", "dtype")})
    model_settings = {"models": args.models, "twin": twin, "device": device, "point_timeout": args.point_timeout,
                      "out_dir": os.path.abspath(os.path.join(out_dir, "models")),
                      **{k: sizes[k] for k in ("img_size", "batch_size", "warmup", "iters", "amp", "model_kwargs")}}
    deadlines = {"tests": args.tests_timeout, "kernels": args.kernels_timeout, "models": args.models_timeout}
    for i, part in enumerate(args.parts, 1):
        print(f"[{i}/{len(args.parts)}] {part}: {TITLES[part][3:]} (deadline {deadlines[part]:g} s)", flush=True)
        try:
            if part == "tests":
                result = tests_part(args, dry, out_dir, repo)
            else:
                settings = kernel_settings if part == "kernels" else model_settings
                result = _run_child_part(part, settings, out_dir, deadlines[part], dry)
        except Exception as e:  # the report records a part that could not even start, and the next part runs
            result = {"status": "error", "error": f"{type(e).__name__}: {e}", "seconds": 0.0,
                      "deadline_s": deadlines[part], "log": f"{part}.log", "log_tail": []}
        report["parts"][part] = result
        write_report(report, out_dir)
        print(f"[{i}/{len(args.parts)}] {part}: {result['status']} in {result['seconds']:.0f} s; "
              f"{summary(part, result)}", flush=True)
    bad = [p for p, r in report["parts"].items() if r["status"] != "ok"]
    print(f"{len(args.parts) - len(bad)} of {len(args.parts)} parts ok" + (f" ({', '.join(bad)} not)" if bad else "")
          + f"; report: {os.path.join(out_dir, 'report.md')} and report.json", flush=True)
    return 1 if bad else 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
