"""Everything a GPU can tell about linvision in one run of a fixed budget, and one report (``linvision-gpu-report``).

The parts run in the order of their value, each in a process of its own stopped at its deadline, the next part
starting when it ends (:data:`PARTS`):

  models       linvision's models against timm's on the same card, each in its run modes (eager, compiled with
               CUDA graphs, bf16 weights): images/s and peak memory, batch 8 and 1, inference and a training step,
               1024, 512 and 2048 px, where each runs out of memory; linhier_tiny_224, Swin-T and ConvNeXt-T at
               1024 px, batch 8, first (:data:`DECIDING`)
  kernels      the fused kernels, the PyTorch reference and SDPA, forward and backward at 2k-131k tokens
  profile      where a small call's time goes (host against device, launches, the busiest operators): the fused
               kernels and SDPA at the smallest N, a forward at batch 1 of linhier_tiny_224 and vit_small
  recurrences  the first call of the recurrences and of vig_tiny / linhier_delta_tiny_224 (compilation
               included), then bidir_delta, bidir_gated and bidir_gated_ch against linear_rope at 4k-262k tokens
  tests        the CUDA tests, ``pytest -m cuda``

The budget (seconds, all parts together) is shared by :data:`SHARES`: a part's deadline is its share of what is
left when it starts, so what a part leaves unused goes to the parts after it. Each part saves its rows as it
measures them, and report.md and report.json are rewritten (atomically) whenever a part's rows change: a run cut
at any point keeps what it measured.

Without CUDA (or with ``dry_run``) every part runs at tiny sizes on the CPU: the kernels in Triton's interpreter,
the recurrences on the PyTorch path, the models at 32 px, the CUDA test
``-k autocast_runs_in_the_autocast_dtype``. Its figures check the plumbing; they are not speed figures, and the
report says so next to them.
"""
from __future__ import annotations

import collections
import datetime
import importlib.metadata
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

from .gpu_parts import plain, write_json
from .gpu_render import DRY_NOTE, TITLES, render

__all__ = ["PARTS", "TITLES", "SHARES", "DRY_NOTE", "MODELS", "DECIDING", "MODEL_RUN_MODES", "run_report",
           "part_deadline", "check_options"]

PARTS = ("models", "kernels", "profile", "recurrences", "tests")
SHARES = {"models": 5, "kernels": 2, "profile": 1, "recurrences": 1, "tests": 2}
DEFAULT_BUDGET = 540.0
SOFTMAX_TWIN = "linvit_small_patch16_rope_224:token_mixer=softmax"
# the bidirectional delta rule in the same ViT: it takes no prefix tokens and no RoPE (a learned position embedding)
BIDIR_DELTA_VIT = "linvit_small_patch16_rope_224:token_mixer=bidir_delta,class_token=false,global_pool=avg,rope=none"
MODELS = ["linhier_tiny_224", "mlla_tiny", "vig_h_tiny", "linvit_small_patch16_rope_224",
          BIDIR_DELTA_VIT, "swin_tiny_patch4_window7_224", "convnext_tiny",
          "vit_small_patch16_224", SOFTMAX_TWIN]
# The headline: the hierarchical model against Swin-T and ConvNeXt-T, measured first (first batch, first size)
DECIDING = ["linhier_tiny_224", "swin_tiny_patch4_window7_224", "convnext_tiny"]
# The run modes of the models part: each model in each, the compiled ones' compilation timed apart
MODEL_RUN_MODES = ["eager", "reduce-overhead", "bf16-weights"]
FIRST_MODELS = ["vig_tiny", "linhier_delta_tiny_224"]
# the profile part: a hierarchical model against timm's ViT, at batch 1 (where the host sets the time)
PROFILE_MODELS = ["linhier_tiny_224", "vit_small_patch16_224"]
# The dry run: every part at sizes a CPU runs in seconds.
DRY = {"n": [256], "rec_n": [256], "heads": 1, "dim": 16, "dtype": "float32", "img_size": [32], "batches": [2],
       "warmup": 0, "iters": 1, "amp": "none", "model_img_size": 32, "tests_k": "autocast_runs_in_the_autocast_dtype",
       "tests_paths": ["tests/test_kernels.py"], "model_modes": ["eager"]}  # compiling on a CPU takes minutes
# The CUDA tests by value: the kernels' files first, then the other test files (:func:`ordered_test_paths`).
TESTS_FIRST = ["tests/test_kernels.py", "tests/test_recurrent_kernels.py"]


def part_deadline(part: str, remaining: Sequence[str], left: float) -> float:
    """The deadline of ``part``: its share (:data:`SHARES`) of the ``left`` seconds among the ``remaining`` parts
    (``part`` included)."""
    return max(left, 0.0) * SHARES[part] / sum(SHARES[p] for p in remaining)


# ----------------------------------------------------------------------------------------------------------------
# A part's process: its output streamed and logged, a callback every second, stopped at the deadline


def run_process(cmd: Sequence[str], deadline: float, log_path: str, env: Optional[Dict[str, str]] = None,
                cwd: Optional[str] = None, tail: int = 30, tick: Optional[Callable[[], None]] = None
                ) -> Dict[str, Any]:
    """Run ``cmd`` in a session of its own, its output (stdout and stderr) printed as it comes and written to
    ``log_path``, ``tick()`` called about every second while it runs, and stop it and its children (SIGTERM, then
    SIGKILL) at ``deadline`` seconds. Returns timed_out, returncode, seconds and the last ``tail`` lines."""
    start = time.monotonic()
    lines: collections.deque = collections.deque(maxlen=tail)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, env=env, cwd=cwd, start_new_session=True)
        reader = threading.Thread(target=_pump, args=(proc, log, lines), daemon=True)
        reader.start()
        timed_out = False
        while proc.poll() is None:
            left = deadline - (time.monotonic() - start)
            if left <= 0:
                timed_out = True
                _stop(proc)
                break
            try:
                proc.wait(timeout=min(1.0, left))
            except subprocess.TimeoutExpired:
                pass
            if tick is not None:
                tick()
        reader.join(timeout=10)
    return {"timed_out": timed_out, "returncode": proc.returncode, "seconds": time.monotonic() - start,
            "tail": list(lines)}


def _pump(proc: subprocess.Popen, log, lines: collections.deque) -> None:
    for line in proc.stdout:
        log.write(line)
        log.flush()
        lines.append(line.rstrip("\n"))
        print("    " + line, end="", flush=True)


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


def child_env(interpret: bool) -> Dict[str, str]:
    """The environment of a part's process: unbuffered output, and Triton's interpreter on (``interpret``) or off,
    whatever this process's own environment says."""
    # PYTHONSAFEPATH: the working directory (a checkout's root) is not put first on the module path, so the installed
    # linvision is the one imported (on a GPU machine: the carried wheels), not the checkout's source folder
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _read_json(path: str) -> Dict[str, Any]:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # not written yet
        return {}


def _status(run: Dict[str, Any], deadline: float, done: bool, reported: Dict[str, Any]) -> tuple:
    if run["timed_out"]:
        return "timeout", f"stopped at the deadline of {deadline:.0f} s"
    if run["returncode"] == 0 and done:
        return reported.get("status", "ok"), reported.get("error", "")
    return "error", reported.get("error") or f"exit status {run['returncode']}: " + next(
        (line for line in reversed(run["tail"]) if line.strip()), "no output")


def run_child_part(part: str, settings: Dict[str, Any], out_dir: str, deadline: float, dry: bool,
                   update: Callable[[Dict[str, Any]], None] = lambda figures: None) -> Dict[str, Any]:
    """A measuring part (:data:`.gpu_parts.PART_FUNCTIONS`) in a Python process of its own; ``update(figures)``
    gets the figures it saved so far whenever they change, and they come back even when it failed or was
    stopped."""
    result_path = os.path.join(out_dir, f"{part}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    seen = {"mtime": None}

    def tick():
        mtime = os.path.getmtime(result_path) if os.path.exists(result_path) else None
        if mtime != seen["mtime"]:
            seen["mtime"] = mtime
            update(_read_json(result_path))

    code = "from linvision.benchmark.gpu_parts import child; child()"
    import json

    run = run_process([sys.executable, "-c", code, part, json.dumps(settings), result_path], deadline,
                      os.path.join(out_dir, f"{part}.log"), env=child_env(interpret=dry), tick=tick)
    result = _read_json(result_path)
    figures = {k: v for k, v in result.items() if k not in ("done", "error", "status")}
    status, error = _status(run, deadline, bool(result.get("done")), result)
    return {"status": status, "error": error, "seconds": run["seconds"], "deadline_s": deadline,
            "log": f"{part}.log", "log_tail": run["tail"][-12:] if status != "ok" else [], **figures}


# ----------------------------------------------------------------------------------------------------------------
# The CUDA tests: pytest -m cuda


_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_WORDS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped",
          "XPASS": "passed"}


def junit_results(path: str) -> Optional[List[Dict[str, str]]]:
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
                outcome, message = name, (found.get("message") or found.text or "").strip()
                break
        results.append({"test": test, "outcome": outcome, "message": message})
    return results


def line_results(lines: List[str]) -> List[Dict[str, str]]:
    """The outcomes pytest -v printed so far (a run stopped before it wrote its JUnit file)."""
    return [{"test": m.group(1), "outcome": _WORDS[m.group(2)], "message": ""} for m in map(_OUTCOME.match, lines)
            if m]


def tests_figures(lines: List[str], results: List[Dict[str, str]]) -> Dict[str, Any]:
    """Counts (collected, deselected, run, passed, failed, error, skipped) and the failures of a pytest run."""
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "error", "skipped")}
    collected = next((m for m in map(re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?").search, lines)
                      if m), None)
    counts["collected"] = int(collected.group(1)) if collected else len(results)
    counts["deselected"] = int(collected.group(2) or 0) if collected else 0
    counts["run"] = len(results)
    failures = [{"test": r["test"], "message": r["message"].splitlines()[0][:300] if r["message"] else ""}
                for r in results if r["outcome"] in ("failed", "error")]
    return {"counts": counts, "failures": failures}


def _log_lines(path: str) -> List[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def ordered_test_paths(repo: str, first: Sequence[str] = TESTS_FIRST) -> List[str]:
    """The test files of ``repo``'s tests/, ``first`` first and the others after them in name order, each named
    once. pytest runs the files named on its command line in that order; a folder named after some of its files
    (``... tests/test_kernels.py tests``) is collected in its own name order instead, files named before
    included."""
    names = sorted(f for f in os.listdir(os.path.join(repo, "tests")) if f.startswith("test_") and f.endswith(".py"))
    return [*first, *(p for p in (f"tests/{f}" for f in names) if p not in first)]


def tests_part(repo: str, out_dir: str, deadline: float, keyword: Optional[str], interpret: bool,
               update: Callable[[Dict[str, Any]], None] = lambda figures: None,
               paths: Sequence[str] = ("tests",)) -> Dict[str, Any]:
    """``pytest -m cuda`` (and ``-k keyword``) over ``paths`` of ``repo`` in a process stopped at ``deadline``,
    the fused kernels not autotuned (LINVISION_KERNEL_AUTOTUNE=0: each new shape would benchmark every offered
    configuration); the counts so far go to ``update`` every second."""
    from linvision.kernels.la_launch import AUTOTUNE_ENV

    xml, log = os.path.abspath(os.path.join(out_dir, "tests.xml")), os.path.join(out_dir, "tests.log")
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *(["-k", keyword] if keyword else []), *paths]
    command = " ".join([f"{AUTOTUNE_ENV}=0", "pytest", *cmd[3:]])
    run = run_process(cmd, deadline, log, env={**child_env(interpret), AUTOTUNE_ENV: "0"}, cwd=repo,
                      tick=lambda: update({"command": command, **tests_figures(*_lines_and_results(log))}))
    lines, results = _log_lines(log), junit_results(xml)
    results = line_results(lines) if results is None else results
    figures = tests_figures(lines, results)
    c, rc = figures["counts"], run["returncode"]
    if run["timed_out"]:
        status, error = "timeout", f"stopped at the deadline of {deadline:.0f} s"
    elif rc == 0 and results:
        status, error = "ok", ""
    elif rc == 1 and c["failed"] + c["error"]:
        status, error = "failed", f"{c['failed']} failed, {c['error']} errors"
    else:  # pytest could not run the tests (a collection error, no test selected, no pytest)
        status = "error"
        error = f"pytest exit status {rc}: " + next((x for x in reversed(run["tail"]) if x.strip()), "no output")
    return {"status": status, "error": error, "seconds": run["seconds"], "deadline_s": deadline, "log": "tests.log",
            "log_tail": run["tail"][-12:] if status not in ("ok", "failed") else [], "command": command,
            "keyword": keyword, **figures}


def _lines_and_results(log: str) -> tuple:
    lines = _log_lines(log)
    return lines, line_results(lines)


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


def write_report(report: Dict[str, Any], out_dir: str) -> None:
    """report.json and report.md in ``out_dir``, each written atomically."""
    write_json(os.path.join(out_dir, "report.json"), report)
    tmp = os.path.join(out_dir, f"report.md.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(render(plain(report)))
    os.replace(tmp, os.path.join(out_dir, "report.md"))


# ----------------------------------------------------------------------------------------------------------------
# The run


def part_settings(options: Dict[str, Any], dry: bool) -> Dict[str, Dict[str, Any]]:
    """The settings of each measuring part from the report's ``options`` (the flags of linvision-gpu-report), the
    dry run's tiny sizes (:data:`DRY`) in place of the sizes without CUDA."""
    o = dict(options, **DRY) if dry else dict(options)
    device = "cpu" if dry else "cuda"
    common = {"device": device, "heads": o["heads"], "dim": o["dim"], "dtype": o["dtype"], "batch": 1}
    return {
        "kernels": {**common, "n": o["n"], "feature_map": "elu", "hbm_tbps": o.get("hbm_tbps"),
                    "sdpa_max_n": max(o["n"]) if dry else o.get("sdpa_max_n", 131072)},
        "profile": {**common, "n": sorted({min(o["n"]), max(o["n"])}), "models": o.get("profile_models", PROFILE_MODELS),
                    "img_size": 32 if dry else 512, "amp": o["amp"], "steps": 1 if dry else 5},
        "models": {"models": o["models"], "twin": o["twin"], "device": device, "img_size": o["img_size"],
                   "batches": o["batches"], "amp": o["amp"], "warmup": o["warmup"], "iters": o["iters"],
                   "model_kwargs": {}, "modes": list(o.get("model_modes") or ["eager"]),
                   "deciding": list(o.get("deciding", DECIDING))},
        "recurrences": {**common, "n": o["rec_n"], "backend": "torch" if dry else "triton",
                        "first_models": o.get("first_models", FIRST_MODELS), "amp": o["amp"],
                        "model_img_size": o.get("model_img_size", 1024)},
    }


def _header(options: Dict[str, Any], dry: bool, argv: Sequence[str]) -> Dict[str, Any]:
    return {"tool": "linvision-gpu-report", "command": " ".join(["linvision-gpu-report", *argv]), "dry_run": dry,
            "budget_s": options["budget"], "environment": environment(dry), "parts": {}}


def run_report(options: Dict[str, Any], argv: Sequence[str] = ()) -> int:
    """Run the parts of ``options["parts"]`` in that order within ``options["budget"]`` seconds and write the
    report into ``options["output"]`` as the figures come (see the module docstring). Returns 0 when every part
    passed, 1 when one failed or ran out of time."""
    import torch

    cuda = torch.cuda.is_available()
    dry = bool(options.get("dry_run")) or not cuda
    if not cuda and not options.get("dry_run"):
        print("no CUDA device: running the dry run (every part at tiny sizes on the CPU)", flush=True)
    out_dir = options["output"]
    os.makedirs(out_dir, exist_ok=True)
    report = _header(options, dry, argv)
    env = report["environment"]
    print(f"GPU {env['gpu'] or 'none'}{' (dry run on the CPU)' if dry else ''}; torch {env['torch']}, triton "
          f"{env['triton']}, fla-core {env['fla_core']}; budget {options['budget']:g} s; report in {out_dir}",
          flush=True)
    settings, parts = part_settings(options, dry), list(options["parts"])
    start = time.monotonic()
    for i, part in enumerate(parts):
        deadline = part_deadline(part, parts[i:], options["budget"] - (time.monotonic() - start))
        print(f"[{i + 1}/{len(parts)}] {part}: {TITLES[part][3:]} (deadline {deadline:.0f} s)", flush=True)
        result = _run_part(part, settings, options, out_dir, deadline, dry, report)
        report["parts"][part] = result
        if part == "models":
            result["figures"] = model_figures(result, out_dir, env["gpu"] or "CPU (dry run)")
        write_report(report, out_dir)
        print(f"[{i + 1}/{len(parts)}] {part}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    bad = [p for p, r in report["parts"].items() if r["status"] != "ok"]
    print(f"{len(parts) - len(bad)} of {len(parts)} parts ok" + (f" ({', '.join(bad)} not)" if bad else "")
          + f"; report: {os.path.join(out_dir, 'report.md')} and report.json", flush=True)
    return 1 if bad else 0


def model_figures(result: Dict[str, Any], out_dir: str, device: str) -> Dict[str, str]:
    """models_b<batch>.png in ``out_dir`` for each batch of the models part with a measured point: images/s and
    peak memory against the size, one series per model (:func:`linvision.benchmark.plots.plot_results`).
    Returns {batch: file name} of the figures written."""
    from linvision.benchmark.plots import plot_results

    figures = {}
    for batch in result.get("batches", []):
        points = [p for p in result.get("points", []) if p["batch_size"] == batch]
        name = f"models_b{batch}.png"
        title = f"{device}, amp {result.get('amp')}, batch {batch}: linvision's models against timm's"
        if points and plot_results(points, os.path.join(out_dir, name), title=title):
            figures[str(batch)] = name
    return figures


def _run_part(part: str, settings: Dict[str, Dict[str, Any]], options: Dict[str, Any], out_dir: str,
              deadline: float, dry: bool, report: Dict[str, Any]) -> Dict[str, Any]:
    """One part, the report rewritten with its figures so far whenever they change; a part that cannot even
    start is recorded as an error."""
    def update(figures: Dict[str, Any]) -> None:
        report["parts"][part] = {"status": "running", "error": "", "seconds": 0.0, "deadline_s": deadline,
                                 "log": f"{part}.log", "log_tail": [], **figures}
        write_report(report, out_dir)

    update({})
    if deadline < 1:
        return {"status": "timeout", "error": "no time left in the budget", "seconds": 0.0, "deadline_s": deadline,
                "log": f"{part}.log", "log_tail": []}
    try:
        if part == "tests":
            keyword = options.get("tests_k") if options.get("tests_k") is not None else (
                DRY["tests_k"] if dry else None)
            import torch

            return tests_part(options["repo"], out_dir, deadline, keyword, not torch.cuda.is_available(), update,
                              DRY["tests_paths"] if dry else ordered_test_paths(options["repo"]))
        return run_child_part(part, settings[part], out_dir, deadline, dry, update)
    except Exception as e:  # the report records a part that could not even start, and the next part runs
        return {"status": "error", "error": f"{type(e).__name__}: {e}", "seconds": 0.0, "deadline_s": deadline,
                "log": f"{part}.log", "log_tail": []}


def check_options(options: Dict[str, Any]) -> None:
    """ValueError in one line for an option the report cannot run with (before anything runs)."""
    from linvision.benchmark.throughput import parse_model_spec
    from linvision.utils.factory import check_model_name

    if options["budget"] <= 0:
        raise ValueError(f"budget: seconds > 0, got {options['budget']}")
    if options["iters"] < 1 or options["warmup"] < 0 or min(options["batches"]) < 1:
        raise ValueError("iters/warmup/batches: need iters >= 1, warmup >= 0 and every batch >= 1")
    if min(options["n"] + options["rec_n"]) < 1 or options["heads"] < 1 or options["dim"] < 1:
        raise ValueError(f"n/rec_n/heads/dim: positive integers, got {options['n']}, {options['rec_n']}, "
                         f"{options['heads']}, {options['dim']}")
    for spec in options["models"]:
        check_model_name(parse_model_spec(spec)[0])
    for name in [*options.get("first_models", []), *options.get("profile_models", [])]:
        check_model_name(name)
    if options["twin"] is not None and options["twin"] not in options["models"]:
        raise ValueError(f"twin: {options['twin']!r} is not one of --models (--twin none: no comparison)")


def repo_root() -> str:
    """The checkout whose tests/ the tests part runs: the one this package lives in, else the working directory."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for root in (here, os.getcwd()):
        if os.path.isfile(os.path.join(root, "tests", "test_kernels.py")):
            return root
    raise FileNotFoundError("tests/test_kernels.py: run linvision-gpu-report in a checkout of linvision")
