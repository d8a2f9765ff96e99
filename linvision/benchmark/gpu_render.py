"""report.md of the GPU report (:mod:`.gpu_report`) from its dictionary: a table of the parts, then each part's
figures. In a dry run every section with figures says first that they are not speed figures."""
from __future__ import annotations

import math
from typing import Any, Dict, List

from .gpu_parts import RECURRENCES

TITLES = {"kernels": "1. Kernels against SDPA", "profile": "2. Where a small call's time goes",
          "models": "3. Models against timm's", "recurrences": "4. Recurrences on fla-core's kernels",
          "tests": "5. CUDA tests"}
DRY_NOTE = ("Dry run on the CPU: each figure is one call, the kernels in Triton's interpreter and the recurrences on "
            "the PyTorch path, so the times and their ratios check that the part runs; they are not speed figures.")


def _n(value: Any, fmt: str = ".3f") -> str:
    return f"{value:{fmt}}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def summary(part: str, result: Dict[str, Any]) -> str:
    """One line of what a part found so far."""
    if part == "tests" and "counts" in result:
        c = result["counts"]
        return (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
                f"({c['run']} run of {c['collected']} collected)")
    if part in ("kernels", "recurrences") and result.get("rows"):
        ns = sorted({r["n"] for r in result["rows"]})
        return f"{len(result['rows'])} rows, N = {ns[0]}-{ns[-1]}"
    if part == "profile" and result.get("rows"):
        return f"{len(result['rows'])} calls read"
    if part == "models" and "points" in result:
        points = result["points"]
        return f"{sum(p['status'] == 'ok' for p in points)} of {result.get('planned', len(points))} points measured"
    return result.get("error", "")


def render(report: Dict[str, Any]) -> str:
    """report.md from the report's dictionary."""
    env, dry = report["environment"], report["environment"]["dry_run"]
    gpu = env["gpu"] or "none"
    device = f"CPU (dry run: every part at tiny sizes; GPU: {gpu})" if dry else f"{gpu} (CUDA {env['cuda']})"
    lines = ["# GPU report", "", f"- date: {env['date']}", f"- device: {device}",
             f"- torch {env['torch']}, triton {env['triton'] or 'not installed'}, fla-core "
             f"{env['fla_core'] or 'not installed'}, Python {env['python']}",
             f"- command: `{report['command']}` (budget {report.get('budget_s', 0):g} s)", "",
             "| part | status | seconds | deadline (s) | summary |", "|---|---|---:|---:|---|"]
    for part, result in report["parts"].items():
        lines.append(f"| {part} | {result['status']} | {result['seconds']:.0f} | {result['deadline_s']:.0f} | "
                     f"{summary(part, result).replace('|', '/')} |")
    renderers = {"tests": _tests, "kernels": _kernels, "profile": _profile, "models": _models,
                 "recurrences": _recurrences}
    for part, result in report["parts"].items():
        lines += ["", f"## {TITLES[part]}", "", f"Status: **{result['status']}**"
                  + (f": {result['error']}" if result.get("error") else "")
                  + f" ({result['seconds']:.0f} s; output in `{result['log']}`)."]
        body = _warmups(result) + renderers[part](result)
        if dry and body and part != "tests":
            body = ["", f"**{DRY_NOTE}**"] + body
        lines += body
        if result.get("log_tail"):
            lines += ["", "The end of its output:", "", "```", *result["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def _warmups(result: Dict[str, Any]) -> List[str]:
    """The GPU warm-ups a part ran before its timings (none off CUDA)."""
    return ["", "GPU warm-up: " + "; ".join(f"{w['matmuls']} bf16 matmuls of {w['size']}^2 in {w['seconds']:.2f} s "
                                           f"before {w['before']}" for w in result["warmups"]) + "."
            ] if result.get("warmups") else []


def _status_cell(row: Dict[str, Any]) -> str:
    return row.get("status", "ok").replace("|", "/")


def _tests(result: Dict[str, Any]) -> List[str]:
    if "counts" not in result:
        return []
    c = result["counts"]
    lines = ["", f"`{result['command']}`", "", "| collected | deselected | run | passed | failed | errors | skipped |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {c['collected']} | {c['deselected']} | {c['run']} | {c['passed']} | {c['failed']} | {c['error']} | "
             f"{c['skipped']} |"]
    if result["failures"]:
        lines += ["", "Failures:", ""] + [f"- `{f['test']}`: {f['message']}" for f in result["failures"][:50]]
        if len(result["failures"]) > 50:
            lines.append(f"- ... and {len(result['failures']) - 50} more (tests.xml)")
    return lines


def _kernels(result: Dict[str, Any]) -> List[str]:
    if not result.get("rows"):
        return []
    lines = ["", f"B={result['batch']} H={result['heads']} D=Dv={result['dim']} {result['dtype']}, "
                 f"phi={result['feature_map']}, on {result['device']}; ms per call"
                 + (f", % HBM of {result['hbm_tbps']} TB/s" if result.get("hbm_tbps") else "") + ".", "",
             "| N | pass | triton (ms) | torch ref (ms) | SDPA (ms) | SDPA / triton | % HBM | status |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['n']} | {r['pass']} | {_n(r['triton_ms'])} | {_n(r['torch_ref_ms'])} | "
                     f"{_n(r['sdpa_ms'])} | {_n(r.get('sdpa_over_triton'), '.2f')} | {_n(r.get('hbm_pct'), '.1f')} | "
                     f"{_status_cell(r)} |")
    if result.get("chosen"):
        lines += _table("The configurations the autotuner chose:",
                        ["kernel", "D bucket", "N bucket", "BLOCK_N", "warps", "stages"],
                        [[f"`{c['kernel']}`", c["dim_bucket"], c["n_bucket"], c["block_n"], c["num_warps"],
                          c["num_stages"]] for c in result["chosen"]])
    return lines


def _table(intro: str, header: List[str], rows: List[List[Any]]) -> List[str]:
    """A markdown table after a line of ``intro``: the first column left-aligned, the others right."""
    return ["", intro, "", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def _grid(result: Dict[str, Any]) -> List[str]:
    """The profile part's grid sweep: the passes' ms with the programs per SM of one kind of kernel changed."""
    if not result.get("grid"):
        return []
    return _table(f"Grid sweep at N={result['grid'][0]['n']}: ms per call with the programs per SM of the split "
                  "kernels (state, query) or of the span kernels (output, key) changed, then the query kernel's "
                  "registers per thread capped; * the default.",
                  ["kernels", "programs per SM", "fwd (ms)", "bwd (ms)", "fwd+bwd (ms)"],
                  [[r["kernels"], f"{r['per_sm']}{' *' if r['default'] else ''}", _n(r["fwd_ms"]), _n(r["bwd_ms"]),
                    _n(r["fwd+bwd_ms"])] for r in result["grid"]])


def _profile(result: Dict[str, Any]) -> List[str]:
    """The profile part: per call the clocks and counts, then each call's busiest operators."""
    if not result.get("rows"):
        return []
    lines = ["", f"On {result['device']}, per call over {result['steps']} calls (after 2 untimed): wall (synchronised),"
                 " host (until the call returns), device (its kernels' own time) in ms; launches and aten ops "
                 "(nested ones included). Host-bound where wall is near host and above device.", "",
             "| call | wall (ms) | host (ms) | device (ms) | launches | aten ops |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['what']} | {_n(r['wall_ms'])} | {_n(r['host_ms'])} | {_n(r['device_ms'])} | "
                     f"{_n(r['launches'], '.0f')} | {_n(r['aten_ops'], '.0f')} |")
    for r in result["rows"]:
        lines += ["", f"{r['what']}: the operators with the most host time of their own (µs per call)", "",
                  "| operator | calls | host µs |", "|---|---:|---:|"]
        lines += [f"| `{t['op']}` | {_n(t['calls'], '.0f')} | {_n(t['self_host_us'], '.1f')} |" for t in r["top"]]
        if r.get("kernels"):
            lines += ["", f"{r['what']}: the device kernels with the most time (µs per call)", "",
                      "| kernel | calls | device µs |", "|---|---:|---:|"]
            lines += [f"| `{k['kernel'][:100]}` | {_n(k['calls'], '.0f')} | {_n(k['device_us'], '.1f')} |"
                      for k in r["kernels"]]
    return lines + _grid(result)


def _models(result: Dict[str, Any]) -> List[str]:
    if not result.get("points"):
        return []
    lines = ["", f"Batches {result['batches']}, amp {result['amp']}, on {result['device']}, the median of "
                 f"{result['iters']} timed runs after {result['warmup']}; time and memory over the twin "
                 f"`{result['twin']}` at the same size and batch.", "",
             "| batch | model | px | status | infer img/s | infer MiB | train img/s | train MiB | "
             "infer time / twin | train time / twin |", "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        status = p["status"] if p["status"] == "ok" else f"{p['status']}: {p['error'][:80]}"
        cells = [_n(p["infer_img_s"], ".2f"), _n(p["infer_mem_mb"], ".0f"), _n(p["train_img_s"], ".2f"),
                 _n(p["train_mem_mb"], ".0f"), _n(p.get("infer_ms_vs_twin"), ".2f"),
                 _n(p.get("train_ms_vs_twin"), ".2f")]
        lines.append(f"| {p['batch_size']} | {p['model']} | {p['img_size']} | {status} | " + " | ".join(cells) + " |")
    lines += _best_modes(result["points"]) + _compile_seconds(result["points"])
    if result.get("oom_at"):
        lines += ["", "Out of memory from: " + "; ".join(f"{k} at {v} px" for k, v in result["oom_at"].items())
                  + "."]
    for batch, name in (result.get("figures") or {}).items():
        lines += ["", f"![images/s and peak memory against the size, batch {batch}]({name})"]
    return lines


def _model_of(point: Dict[str, Any]) -> str:
    """A point's model without its run mode (``"name [mode]"`` -> ``"name"``)."""
    mode = point.get("mode", "eager")
    return point["model"][:-len(f" [{mode}]")] if point["model"].endswith(f" [{mode}]") else point["model"]


def _best_modes(points: List[Dict[str, Any]]) -> List[str]:
    """Where the models ran in more than one mode: each model at each batch and size in its fastest mode,
    inference and training apart (the headline's comparison: each in its best mode)."""
    if len({p.get("mode", "eager") for p in points}) < 2:
        return []
    best: Dict[tuple, Dict[str, Any]] = {}
    for p in points:
        key = (p["batch_size"], p["img_size"], _model_of(p))
        entry = best.setdefault(key, {})
        for phase in ("infer", "train"):
            value = p.get(f"{phase}_img_s")
            if isinstance(value, (int, float)) and math.isfinite(value) and value > entry.get(phase, (0, ""))[0]:
                entry[phase] = (value, p.get("mode", "eager"))
    lines = ["", "Each model in its fastest mode:", "",
             "| batch | px | model | infer img/s | infer mode | train img/s | train mode |",
             "|---:|---:|---|---:|---|---:|---|"]
    for (batch, size, model), entry in best.items():
        cells = [f"{_n(entry[ph][0], '.2f')} | {entry[ph][1]}" if ph in entry else "- | -" for ph in ("infer", "train")]
        lines.append(f"| {batch} | {size} | {model} | " + " | ".join(cells) + " |")
    return lines


def _compile_seconds(points: List[Dict[str, Any]]) -> List[str]:
    """The compiled points' first calls (their compilation, outside the timings), one line."""
    paid = [f"{p['model']} @ {p['batch_size']} x {p['img_size']} px: "
            + ", ".join(f"{phase} {_n(p.get(f'{phase}_compile_s'), '.1f')} s" for phase in ("infer", "train"))
            for p in points if any(_n(p.get(f"{ph}_compile_s")) != "-" for ph in ("infer", "train"))]
    return ["", "Compilation (each compiled point's first call, not in its timings): " + "; ".join(paid) + "."] \
        if paid else []


def _recurrences(result: Dict[str, Any]) -> List[str]:
    lines = []
    if result.get("first_calls"):
        lines += ["", f"First calls on {result['device']} (compilation included; fla's autotuners "
                      f"{'pinned' if result.get('pinned') else 'autotuning'}):", "",
                  "| first call | seconds | status |", "|---|---:|---|"]
        lines += [f"| {c['what']} | {_n(c['seconds'], '.2f')} | {_status_cell(c)} |" for c in result["first_calls"]]
    if result.get("rows"):
        lines += ["", f"B={result['batch']} H={result['heads']} D={result['dim']} {result['dtype']}, backend "
                      f"{result['backend']}; ms per call.", "",
                  "| N | pass | linear_rope (ms) | " + " | ".join(f"{k} (ms)" for k in RECURRENCES) + " | "
                  + " | ".join(f"{k} / linear_rope" for k in RECURRENCES) + " | status |",
                  "|---:|---|---:|" + "---:|" * (2 * len(RECURRENCES)) + "---|"]
        for r in result["rows"]:
            cells = [_n(r.get(f"{k}_ms")) if not r.get(f"{k}_oom") else "oom" for k in ("linear_rope", *RECURRENCES)]
            ratios = [_n(r.get(f"{k}_over_linear_rope"), ".2f") for k in RECURRENCES]
            lines.append(f"| {r['n']} | {r['pass']} | " + " | ".join(cells + ratios) + f" | {_status_cell(r)} |")
    return lines
