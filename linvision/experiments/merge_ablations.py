"""Ablations run apart, read as one table: behind ``linvision-ablate --merge``.

A long ablation is often run one seed (or one mixer) at a time, each in its own folder, so that each run can go
in the background and be resumed alone. :func:`merge_ablations` reads the ``ablation.json`` of such folders and
joins their rows per mixer: each row's score at every evaluation size becomes the mean, sample standard
deviation and per-seed values over all the runs of that mixer, as if one ablation had trained every seed. Folders
whose model options differ (a remedy given with ``--model-kwargs``) keep their rows apart, each labelled with the
options that set it apart (``linear (mixer_kwargs.lepe=True)``).

Only ablations of one task, model, training size, schedule, data set and evaluation sizes merge; a seed given
twice for one row is refused. Throughput and memory are left out of the merged table: runs timed in different
processes on a machine whose load changed are no comparison (:mod:`linvision.experiments.ablate` times the mixers
of one ablation interleaved for that reason). Each merged run records the folder it came from.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence, Tuple

from linvision.experiments.ablate import ABLATION_FILES, _metrics, _plot_accuracy, _write_results, seed_scores
from linvision.utils.run_folder import claim_run_folder

__all__ = ["merge_ablations", "write_merged"]

# what the merged ablations must share (ablation.json's keys; the last five a segmentation ablation's)
MERGE_KEYS = ("task", "model", "img_size", "epochs", "dataset", "eval_sizes", "decoder", "decoder_kwargs",
              "mosaic_size", "mosaic_train", "mosaic_val")


def merge_ablations(folders: Sequence[str]) -> Dict[str, Any]:
    """The ablations in ``folders`` as one result (ablation.json's layout, without benchmarks): their rows joined
    per mixer and options, each score the mean and spread over all the runs. Raises ValueError (one line) for a
    folder without a readable ablation.json, for ablations that differ in a key of ``MERGE_KEYS`` and for a seed
    given twice for one row."""
    if len(folders) < 2:
        raise ValueError(f"merge: give two or more ablation folders, got {len(folders)}")
    folders = [os.path.abspath(f) for f in folders]
    sources = [_read(f) for f in folders]
    first = sources[0]
    for path, source in zip(folders[1:], sources[1:]):
        differ = [k for k in MERGE_KEYS if source.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"merge: {path} is an ablation with " + ", ".join(f"{k}={source.get(k)!r}" for k in differ)
                             + f"; {folders[0]} has " + ", ".join(f"{k}={first.get(k)!r}" for k in differ)
                             + " (only ablations of one task, model, size, schedule, data set and evaluation sizes "
                               "merge, a segmentation's of one head and mosaics)")
    flat = [_flatten(s.get("model_kwargs") or {}) for s in sources]
    common = {k: v for k, v in flat[0].items() if all(k in f and f[k] == v for f in flat[1:])}
    metrics = _metrics(first)
    groups: Dict[str, Dict[str, Any]] = {}
    for path, source, options in zip(folders, sources, flat):
        own = ", ".join(f"{k}={v!r}" for k, v in options.items() if k not in common)
        for row in source["rows"]:
            if not row.get("runs"):
                raise ValueError(f"merge: {path}'s row {row['mixer']} records no runs (an ablation.json of an "
                                 f"older linvision-ablate); run that ablation again with --resume to score them")
            label = row["mixer"] + (f" ({own})" if own else "")
            group = groups.setdefault(label, {"row": row, "model_kwargs": source.get("model_kwargs") or {},
                                              "runs": []})
            for run in row["runs"]:
                twice = next((r["ablation"] for r in group["runs"] if r["seed"] == run["seed"]), None)
                if twice:
                    raise ValueError(f"merge: seed {run['seed']} of {label} is in {twice} and in {path}; give each "
                                     f"run once")
                group["runs"].append({**run, "ablation": path})
    rows = [_merged_row(label, g, metrics, first["eval_sizes"]) for label, g in groups.items()]
    seeds = sorted({r["seed"] for g in groups.values() for r in g["runs"]})
    result = {k: first[k] for k in MERGE_KEYS if k in first}
    result.update(model_kwargs=_unflatten(common), seed=seeds[0], seeds=seeds, bench_sizes=[],
                  bench_batch_size=first.get("bench_batch_size"), device=first.get("device"),
                  merged_from=list(folders), rows=rows)
    return result


def write_merged(folders: Sequence[str], output: str, experiment: str, overwrite: bool = False) -> Dict[str, Any]:
    """Merge ``folders`` (:func:`merge_ablations`) and write ablation.json, ablation.md and accuracy.png into
    ``<output>/<experiment>``, a folder claimed as an ablation's (a folder holding an earlier one is kept: this one is
    written to ``<experiment>-1`` unless ``overwrite``). Returns the result with ``run_dir``, ``table`` and ``notes``
    (what the folder's claim has to say)."""
    result = merge_ablations(folders)  # refused before any folder is made
    folder = claim_run_folder(os.path.join(output, experiment), overwrite=overwrite, run_files=ABLATION_FILES)
    try:
        result["table"] = _write_results(result, folder.path)
        _plot_accuracy(result, os.path.join(folder.path, "accuracy.png"))
    finally:
        folder.release()
    result["run_dir"], result["notes"] = folder.path, folder.notes
    return result


def _read(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, "ablation.json")
    if not os.path.isfile(path):
        raise ValueError(f"merge: {folder} holds no ablation.json; give folders linvision-ablate wrote")
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"merge: cannot read {path} ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list) or "eval_sizes" not in result:
        raise ValueError(f"merge: {path} is not an ablation's result (no rows or eval_sizes)")
    return result


def _merged_row(label: str, group: Dict[str, Any], metrics: Tuple[str, ...], eval_sizes: List[int]) -> Dict[str, Any]:
    """One row over ``group``'s runs: parameters and FLOPs of its first source row (the same model), the mean
    training time and best score, and each score's mean, spread and per-seed values, seeds in order."""
    source, runs = group["row"], sorted(group["runs"], key=lambda r: r["seed"])
    best = next(k for k in ("best_top1", "best_miou") if k in runs[0])
    return {"mixer": label, "model_kwargs": group["model_kwargs"], "params_m": source["params_m"],
            "gflops": source["gflops"], "num_classes": source.get("num_classes"),
            **seed_scores(runs, best, metrics, eval_sizes)}


def _flatten(options: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A nested dict of options as dotted keys: ``{"mixer_kwargs": {"lepe": True}}`` -> ``{"mixer_kwargs.lepe": True}``."""
    flat = {}
    for key, value in options.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _unflatten(flat: Dict[str, Any]) -> Dict[str, Any]:
    nested: Dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return nested
