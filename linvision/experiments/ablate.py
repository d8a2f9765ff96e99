"""The MambaOut question for linear attention, behind ``linvision/tools/ablate.py``.

One macro-architecture (the hierarchical ``linhier`` family, or the isotropic ``linvit``, at a size given by
``model_kwargs``), one training recipe; only the token mixer changes (``mixers``: registry names, the same
mixer in every stage, or for linhier per-stage comma strings such as ``none,none,linear,softmax``, for linvit
per-block ones, labelled by runs: ``9xlinear+3xsoftmax``). For each mixer and each seed in ``seeds``
(default: ``seed`` alone) the tool trains a classifier with :func:`linvision.training.train.train` and evaluates
it at the training resolution and at other ones without fine-tuning; top-1 is reported as the mean over seeds
with the sample standard deviation and the per-seed values. Throughput and memory are measured once per mixer
at several resolutions after every mixer has trained, the mixers of one size timed interleaved
(:func:`~linvision.benchmark.throughput.benchmark_interleaved`: A, B, C, C, B, A, ...) so that a load on the
machine falls on all of them alike; figures taken on a busy machine or with a wide spread are marked unreliable
in the table and the plot. Parameters and FLOPs are counted per mixer. A mixer that cannot run at a size gets
that failure in the table, not a crash. On a machine already busy when it starts, the ablation runs torch on the
cores left free, by the rule every tool follows (:func:`linvision.utils.threads.set_threads`; ``--threads``
chooses).

``task: segment`` asks the same of semantic segmentation: the encoder ``model`` (with each mixer) in the smp
head ``decoder`` is trained on the offline texture mosaics (``dataset: mosaic``) by
:func:`linvision.training.seg_task.train_segmentation` with the segmentation recipe
(:class:`~linvision.training.seg_config.SegTrainConfig`: the training flags plus ``decoder``,
``decoder_kwargs``, ``mosaic_size``, ``mosaic_train``, ``mosaic_val``, ``ignore_index``); the run's ``best/``
is evaluated (mIoU and pixel accuracy over the whole validation set) on the validation mosaics rendered at each
evaluation size, the same layouts at a finer resolution, and the segmenter is benchmarked (training step:
backward of the mean logit) at the benchmark sizes.

Outputs in the run folder: ``ablation.md`` (the table), ``ablation.json``, ``accuracy.png`` (top-1 or mIoU
against evaluation resolution; with several seeds the mean with a bar of plus and minus the seeds' sample
standard deviation, with one seed the values alone), ``throughput_memory.png`` (each point the median of
``bench_iters`` timed runs, a bar from the slowest to the fastest), and one training run folder per mixer and
seed under ``runs/`` (``<mixer>`` for a single seed, ``<mixer>-s<seed>`` for several).
The table and json are rewritten after every mixer, so a run that is stopped keeps the rows it finished;
``resume`` (the folder of a stopped ablation, run with the same flags) goes on in that folder: a finished run is
scored as it is, a stopped one continues from its ``last/`` checkpoint, and the others are trained.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, Dict, List, Tuple

from linvision.benchmark.flops import count_gflops, count_params
from linvision.benchmark.plots import dodge, plot_results, series_styles
from linvision.benchmark.throughput import (
    _empty_point,
    benchmark_interleaved,
    runs_phrase,
    unreliable_note,
)
from linvision.training.seg_config import SegTrainConfig
from linvision.training.train import TrainConfig, add_train_args, train
from linvision.training.validate import validate_checkpoint
from linvision.utils.cli import add_threads_arg
from linvision.utils.config import parse_kwargs
from linvision.utils.factory import create_model
from linvision.utils.interrupt import TrainInterrupted
from linvision.utils.run_folder import claim_run_folder
from linvision.utils.threads import set_threads

__all__ = ["add_ablate_args", "run_ablation", "markdown_table"]

# the segmentation recipe's fields that the training flags lack (the encoder is --model)
SEG_FIELDS = ("decoder", "decoder_kwargs", "mosaic_size", "mosaic_train", "mosaic_val", "ignore_index")


def add_ablate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training flags plus the ablation's own (``--resume`` takes an ablation's folder here)."""
    add_train_args(parser)
    resume = next(a for a in parser._actions if a.dest == "resume")
    resume.help = ("go on with a stopped ablation: its folder (<output>/<experiment>), with the same flags; finished "
                   "runs are scored as they are, a stopped one continues from its last/")
    g = parser.add_argument_group("ablation")
    g.add_argument("--task", choices=["classify", "segment"], default="classify",
                   help="classify: top-1 of a classifier; segment: mIoU and pixel accuracy of the encoder --model "
                        "in the smp head --decoder, trained on --dataset mosaic")
    segment = parser.add_argument_group("segmentation (--task segment)")
    for f in fields(SegTrainConfig):  # the flags of linvision-train-seg, spelled and explained as there
        if f.name in SEG_FIELDS:
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            segment.add_argument(f"--{f.name.replace('_', '-')}", *f.metadata["aliases"], default=default,
                                 help=f.metadata["help"], **f.metadata["argparse"])
    g.add_argument("--mixers", nargs="+", default=["none", "linear", "linear_rope", "softmax", "causal", "hybrid"],
                   help="token mixers to compare (registry names, or comma-separated names: 4 per-stage for linhier, "
                        "one per block for linvit)")
    g.add_argument("--eval-sizes", type=int, nargs="+", default=None,
                   help="evaluation resolutions (default: 1x, 2x and 4x the training size)")
    g.add_argument("--bench-sizes", type=int, nargs="+", default=None,
                   help="benchmark resolutions (default: 1x, 2x, 4x and 8x the training size)")
    g.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="train every mixer once per seed; top-1 is the mean and spread over them (default: --seed)")
    g.add_argument("--merge", nargs="+", metavar="FOLDER", default=None,
                   help="train nothing: join the ablations in these folders (one seed each, say) into one table of "
                        "means and spreads per mixer, written to <output>/<experiment>")
    g.add_argument("--bench-batch-size", type=int, default=8, help="images per batch of the throughput and memory runs")
    g.add_argument("--bench-iters", type=int, default=5,
                   help="timed runs per throughput figure, which is their median (after one warm-up run)")
    g.add_argument("--bench-time-limit", type=float, default=None,
                   help="seconds: a benchmark size is skipped (recorded as such) when the previous size's points, "
                        "scaled by the ratio of pixels, would take longer (default: no limit)")
    add_threads_arg(g)
    return parser


def _mixer_key(model: str) -> str:
    """The model argument that takes the mixer: ``token_mixer`` for the isotropic linvit family (one mixer for
    every block), ``token_mixers`` for linhier (one name, or one per stage)."""
    return "token_mixer" if model.startswith("linvit") else "token_mixers"


def _mixer_label(mixer: str) -> str:
    """The row's and run folder's name: per-stage or per-block names joined by "+", a run of one name as "9xlinear"."""
    runs = [(name, len(list(group))) for name, group in itertools.groupby(n.strip() for n in mixer.split(","))]
    return "+".join(name if count == 1 else f"{count}x{name}" for name, count in runs)


# What marks a folder as holding an ablation (a re-run goes to <name>-1; --overwrite deletes these).
ABLATION_FILES = ("ablation.json", "ablation.md", "accuracy.png", "throughput_memory.png", "runs")


def _log(message: str) -> None:
    print(message, flush=True)


def run_ablation(args: argparse.Namespace, log=_log) -> Dict[str, Any]:
    """Train, evaluate and benchmark ``args.model`` once per mixer in ``args.mixers``; returns the rows.

    Every run uses the same seed and recipe. The ablation owns its folder as a training run does: a folder
    that holds an earlier ablation is not overwritten (this one goes to ``<name>-1``) unless ``--overwrite``;
    ``--resume FOLDER`` goes on with the ablation in FOLDER. A run stopped by ``--stop-after-steps`` stops the
    ablation (the result then has ``stopped``: that run's folder, and no table); one stopped by a signal raises
    TrainInterrupted, whose message says how to go on. Raises ValueError for an empty mixer list (unknown mixers
    and bad training arguments raise from the training code, before anything is trained for that mixer).
    """
    if not args.mixers:
        raise ValueError("mixers: give at least one token mixer")
    seeds = getattr(args, "seeds", None)
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"seeds: give distinct seeds (at least one), got {seeds!r}")
    if getattr(args, "task", "classify") == "segment" and args.dataset != "mosaic":
        raise ValueError(f"dataset: the segmentation ablation evaluates on the mosaics rendered at each size; "
                         f"give --dataset mosaic, got {args.dataset!r}")
    if args.bench_iters < 1 or args.bench_batch_size < 1:
        raise ValueError(f"bench_iters/bench_batch_size: must be >= 1, got {args.bench_iters} and "
                         f"{args.bench_batch_size}")
    _set_threads(getattr(args, "threads", None), log)
    if getattr(args, "resume", None):
        folder = _claim_ablation_to_resume(args)
    else:
        name = args.experiment or f"ablate-{time.strftime('%Y%m%d-%H%M%S')}"
        folder = claim_run_folder(os.path.join(args.output, name), overwrite=args.overwrite,
                                  run_files=ABLATION_FILES)
    go_on = f"the same linvision-ablate command with --resume {folder.path}"
    try:
        for note in folder.notes:
            log(note)
        return _run_ablation(args, folder.path, log)
    except _RunStopped as e:  # --stop-after-steps: the ablation stops with the run, and says how to go on
        log(f"{e.run_dir} stopped after step {e.step} (--stop-after-steps); continue with: {go_on}")
        return {"run_dir": folder.path, "stopped": e.run_dir, "table": None}
    except TrainInterrupted as e:  # a signal: the run saved its last/; the ablation goes on from its folder
        raise TrainInterrupted(e.signum, e.folder, go_on) from None
    finally:
        folder.release()


class _RunStopped(Exception):
    """A run of the ablation stopped at ``--stop-after-steps`` (its last/ saved) before its epochs ended."""

    def __init__(self, run_dir: str, step: int):
        super().__init__(run_dir)
        self.run_dir, self.step = run_dir, step


# what an ablation resumed with --resume must share with the one that wrote the folder (ablation.json's keys)
_RESUME_KEYS = ("task", "model", "model_kwargs", "img_size", "epochs", "dataset")


def _claim_ablation_to_resume(args: argparse.Namespace):
    """The folder of an earlier ablation (``args.resume``), claimed to go on in it: its finished runs are scored,
    not trained again, and a stopped one continues from its ``last/``. Refused in one line when the folder holds
    no ablation or when its ablation.json records another model, size, schedule or dataset."""
    path = os.path.abspath(args.resume)
    if not os.path.isdir(os.path.join(path, "runs")):
        raise ValueError(f"resume: {path} holds no ablation (no runs/ folder); give a folder linvision-ablate "
                         f"wrote")
    recorded_path = os.path.join(path, "ablation.json")
    if os.path.isfile(recorded_path):
        try:
            with open(recorded_path) as f:
                recorded = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"resume: cannot read {recorded_path} ({e})") from None
        given = {"task": getattr(args, "task", "classify"), "model": args.model,
                 "model_kwargs": parse_kwargs(args.model_kwargs), "img_size": args.img_size,
                 "epochs": args.epochs, "dataset": args.dataset}
        differ = [k for k in _RESUME_KEYS if k in recorded and recorded[k] != given[k]]
        if differ:
            raise ValueError(f"resume: {path} is an ablation with " + ", ".join(
                f"{k}={recorded[k]!r}" for k in differ) + "; this command gives " + ", ".join(
                f"{k}={given[k]!r}" for k in differ) + " (give the same flags, or drop --resume for a new ablation)")
    return claim_run_folder(path, resume=True, run_files=ABLATION_FILES)


def _set_threads(threads, log) -> None:
    """torch's CPU threads by the tools' rule (:func:`linvision.utils.threads.set_threads`), said in one line."""
    log(set_threads(threads))


def _seed_stats(values) -> Dict[str, Any]:
    """Mean, sample standard deviation (0 for one seed) and the values; a failure (a string) is kept as is."""
    failed = [v for v in values if isinstance(v, str)]
    if failed:
        return {"mean": failed[0], "std": float("nan"), "values": values}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "std": std, "values": values}


@dataclass(frozen=True)
class _Task:
    """What the classification and the segmentation ablation do differently, chosen once per ablation."""

    name: str  # ablation.json's "task": "classify" or "segment"
    recipe: Any  # the training flags (TrainConfig or SegTrainConfig); each run changes what differs with replace
    build: Callable[[Dict[str, Any], int, int], Any]  # (model kwargs, classes, size) -> the model of one mixer
    fit: Callable[[Any], Dict[str, Any]]  # one run's config -> its summary
    validate: Callable[[str], List[Dict[str, Any]]]  # a run folder -> its entries at the evaluation sizes
    best: str  # the summary's best validation score, kept in each run and row
    in_chans: int  # input channels of the FLOPs count
    head: str  # what the throughput figure's title calls the model
    extra: Dict[str, Any]  # the task's own fields of ablation.json


def _classify_task(args: argparse.Namespace, eval_sizes: List[int]) -> _Task:
    """The classification ablation: ``args.model`` trained by :func:`train`, scored by :func:`validate_checkpoint`."""

    def build(kwargs: Dict[str, Any], num_classes: int, size: int):
        return create_model(args.model, num_classes=num_classes, in_chans=args.in_chans, model_kwargs=kwargs,
                            img_size=size)

    def validate(run_dir: str) -> List[Dict[str, Any]]:
        return validate_checkpoint(run_dir, args.dataset, args.data_dir, eval_sizes, args.batch_size, args.workers,
                                   args.amp, args.device, args.progress)["results"]

    return _Task("classify", TrainConfig.from_namespace(args), build, train, validate, best="best_top1",
                 in_chans=args.in_chans, head=args.model, extra={})


def _segment_task(args: argparse.Namespace, eval_sizes: List[int]) -> _Task:
    """The segmentation ablation: the encoder ``args.model`` in the smp head ``args.decoder``, trained on the
    mosaics and scored on the validation mosaics rendered at each evaluation size. Raises ValueError for an
    evaluation size the mosaics are not rendered at."""
    from linvision.data.mosaic import MAX_SIZE, MIN_SIZE
    from linvision.training.seg_task import train_segmentation
    from linvision.training.seg_validate import validate_segmenter
    from linvision.training.segmenter import build_segmenter

    bad = [s for s in eval_sizes if not MIN_SIZE <= s <= MAX_SIZE]
    if bad:
        raise ValueError(f"eval_sizes: the mosaics are rendered at {MIN_SIZE} to {MAX_SIZE} px, got {bad}")
    recipe = SegTrainConfig.from_namespace(args).replace(encoder=args.model)
    decoder_kwargs = parse_kwargs(recipe.decoder_kwargs, "decoder_kwargs")

    def build(kwargs: Dict[str, Any], num_classes: int, size: int):
        return build_segmenter(recipe.decoder, args.model, num_classes, kwargs, decoder_kwargs)

    def validate(run_dir: str) -> List[Dict[str, Any]]:
        return validate_segmenter(run_dir, "mosaic", None, eval_sizes, args.batch_size, args.workers, args.amp,
                                  str(_device(args)), args.progress, mosaic_val=recipe.mosaic_val)["results"]

    extra = {"decoder": recipe.decoder, "decoder_kwargs": decoder_kwargs, "mosaic_size": recipe.mosaic_size,
             "mosaic_train": recipe.mosaic_train, "mosaic_val": recipe.mosaic_val}
    return _Task("segment", recipe, build, train_segmentation, validate, best="best_miou", in_chans=3,
                 head=f"{args.decoder} on {args.model}", extra=extra)


def _run_ablation(args: argparse.Namespace, run_dir: str, log) -> Dict[str, Any]:
    """Train every mixer once per seed in ``run_dir``, score and benchmark it, rewriting the table and json after
    each; then draw the figures. Returns the result (ablation.json's content) with the folder and the table."""
    base_kwargs = parse_kwargs(args.model_kwargs)
    eval_sizes = args.eval_sizes or [args.img_size * f for f in (1, 2, 4)]
    bench_sizes = args.bench_sizes or [args.img_size * f for f in (1, 2, 4, 8)]
    seeds = list(getattr(args, "seeds", None) or [args.seed])
    make_task = _segment_task if getattr(args, "task", "classify") == "segment" else _classify_task
    task = make_task(args, eval_sizes)
    rows, bench_points = [], []
    result = {"task": task.name, "model": args.model, "model_kwargs": base_kwargs, "img_size": args.img_size,
              "epochs": args.epochs, "seed": args.seed, "seeds": seeds, "dataset": args.dataset,
              "eval_sizes": eval_sizes, "bench_sizes": bench_sizes, "bench_batch_size": args.bench_batch_size,
              "device": str(_device(args)), "rows": rows, **task.extra}
    metrics = _metrics(result)
    # every model is built once before any training, so that a mixer the model cannot take (a grid mixer in a
    # linvit with a class token) fails at once, not after the mixers before it have trained
    for mixer in args.mixers:
        task.build({**base_kwargs, _mixer_key(args.model): mixer}, 2, args.img_size)
    start = time.time()
    for index, mixer in enumerate(args.mixers):
        label = _mixer_label(mixer)
        mixer_kwargs = {**base_kwargs, _mixer_key(args.model): mixer}
        runs = []
        for seed in seeds:
            log(f"== token mixer {mixer} ({index + 1} of {len(args.mixers)}), seed {seed}; "
                f"{time.time() - start:.0f} s so far: training {args.epochs} epochs at {args.img_size} px")
            # only the training flags, so each run folder can be resumed or inspected with linvision-train (-seg);
            # a fresh ablation folder holds no runs to overwrite; a resumed one continues or scores its own (_fit)
            run_cfg = task.recipe.replace(model_kwargs=mixer_kwargs, seed=seed, output=os.path.join(run_dir, "runs"),
                                          resume=None, experiment=label if len(seeds) == 1 else f"{label}-s{seed}",
                                          overwrite=False)
            runs.append(_train_and_score(task, run_cfg, seed, metrics, eval_sizes, log,
                                         resume=bool(getattr(args, "resume", None))))
        row = _mixer_row(args, task, label, mixer_kwargs, runs, metrics, eval_sizes)
        row["num_classes"] = runs[0]["num_classes"]
        rows.append(row)
        log(_score_line(row, metrics[0], spread=len(seeds) > 1))  # one seed has no spread to print
        _write_results(result, run_dir)  # after every mixer: a stopped run keeps what it finished
    _plot_accuracy(result, os.path.join(run_dir, "accuracy.png"))
    bench_points = _benchmark(args, task, rows, [{**base_kwargs, _mixer_key(args.model): m} for m in args.mixers],
                              bench_sizes, log)
    for row, points in zip(rows, bench_points):
        row["bench"] = {str(size): {k: point[k] for k in BENCH_KEYS} for size, point in zip(bench_sizes, points)}
    table = _write_results(result, run_dir)
    bench_points = [p for points in bench_points for p in points]
    note = unreliable_note(bench_points)
    if note:
        log(note)
    plot_results(bench_points, os.path.join(run_dir, "throughput_memory.png"), label_key="mixer",
                 title=f"{task.head} {base_kwargs}, batch {args.bench_batch_size}")
    result["run_dir"] = run_dir
    result["table"] = table
    return result


def _train_and_score(task: _Task, run_cfg: Any, seed: int, metrics: Tuple[str, ...], eval_sizes: List[int],
                     log, resume: bool = False) -> Dict[str, Any]:
    """Train one run (one mixer, one seed) and score it at every evaluation size: its entry of the row's runs.
    Its training time is the sum of its epochs' (metrics.jsonl's ``time_s``: each epoch once, however often the
    run was stopped and continued, without the evaluations)."""
    summary = _fit(task, run_cfg, resume, log)
    if "stopped_at_step" in summary:
        raise _RunStopped(summary["run_dir"], summary["stopped_at_step"])
    log(f"   evaluating at {', '.join(map(str, eval_sizes))} px")
    val = task.validate(summary["run_dir"])
    return {"seed": seed, "train_s": _epochs_time(summary["run_dir"]), task.best: summary[task.best],
            "num_classes": summary["num_classes"],
            **{metric: _per_size(val, _RESULT_KEYS[metric]) for metric in metrics}}


def _fit(task: _Task, run_cfg: Any, resume: bool, log) -> Dict[str, Any]:
    """The run's summary: trained now, or, in a resumed ablation, read from a run that finished (its
    summary.json) or continued from its ``last/``; a run stopped before its first checkpoint starts again."""
    path = os.path.join(run_cfg.output, run_cfg.experiment)
    if not resume or not os.path.isdir(path):
        return task.fit(run_cfg)
    summary_path = os.path.join(path, "summary.json")
    if os.path.isfile(summary_path):
        try:
            with open(summary_path) as f:
                summary = json.load(f)
        except ValueError as e:
            raise ValueError(f"resume: {summary_path} is not readable JSON ({e}); delete it to train that run "
                             f"again") from None
        log(f"   {path} finished earlier: scored as it is, not trained again")
        return summary
    if os.path.isfile(os.path.join(path, "last", "train_state.pt")):
        log(f"   continuing {path} from its last/ checkpoint")
        return task.fit(run_cfg.replace(resume=path))
    log(f"   {path} stopped before its first checkpoint: trained from the start")
    return task.fit(run_cfg.replace(overwrite=True))


def _epochs_time(run_dir: str) -> float:
    """Seconds of training in the epochs recorded in ``run_dir``'s metrics.jsonl (the last record of an epoch
    counts, so an epoch a stop cut and a resume redid counts once)."""
    times = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if record.get("kind") == "epoch":
                times[record["epoch"]] = record.get("time_s", 0.0)
    return float(sum(times.values()))


def _per_size(results: List[Dict[str, Any]], key: str) -> Dict[str, Any]:
    """``key`` of each validation entry by its size (a string), or the entry's error where that size failed."""
    return {str(r["img_size"]): r.get(key, r.get("error")) for r in results}


def _mixer_row(args: argparse.Namespace, task: _Task, label: str, mixer_kwargs: Dict[str, Any],
               runs: List[Dict[str, Any]], metrics: Tuple[str, ...], eval_sizes: List[int]) -> Dict[str, Any]:
    """One mixer's row (without its benchmark): parameters and FLOPs of its model, the mean training time and best
    score, and each score's mean, spread and per-seed values over ``runs`` at every evaluation size."""
    model = task.build(mixer_kwargs, runs[0]["num_classes"], args.img_size)
    row = {"mixer": label, "params_m": count_params(model) / 1e6,
           "gflops": count_gflops(model, (task.in_chans, args.img_size, args.img_size))}
    row.update(seed_scores(runs, task.best, metrics, eval_sizes))
    return row


def seed_scores(runs: List[Dict[str, Any]], best: str, metrics: Tuple[str, ...],
                eval_sizes: List[int]) -> Dict[str, Any]:
    """A row's scores over ``runs`` (one per seed): the mean training time and ``best`` score, for each metric its
    mean, sample standard deviation and per-seed values at every evaluation size (the keys ``<metric>``,
    ``<metric>_std``, ``<metric>_seeds``), and the runs themselves."""
    scores = {"train_s": sum(r["train_s"] for r in runs) / len(runs),
              best: _seed_stats([r[best] for r in runs])["mean"]}
    for metric in metrics:
        stats = {str(s): _seed_stats([r[metric][str(s)] for r in runs]) for s in eval_sizes}
        scores[metric] = {s: st["mean"] for s, st in stats.items()}
        scores[f"{metric}_std"] = {s: st["std"] for s, st in stats.items()}
        scores[f"{metric}_seeds"] = {s: st["values"] for s, st in stats.items()}
    scores["runs"] = runs
    return scores


def _benchmark(args: argparse.Namespace, task: _Task, rows: List[Dict[str, Any]],
               mixer_kwargs: List[Dict[str, Any]], sizes: List[int], log) -> List[List[Dict[str, Any]]]:
    """Every mixer's benchmark points at ``sizes`` (a list per row, each point labelled with its mixer), the mixers
    of one size timed interleaved; a size is skipped (recorded as such) when the previous size's points, scaled by
    the ratio of pixels, would take longer than ``--bench-time-limit``."""
    log(f"== benchmarking {len(rows)} mixers interleaved at {', '.join(map(str, sizes))} px "
        f"({runs_phrase(args.bench_iters)} of batch {args.bench_batch_size} per figure)")
    limit = getattr(args, "bench_time_limit", None)
    device = str(_device(args))
    per_row: List[List[Dict[str, Any]]] = [[] for _ in rows]
    previous = None  # (size, seconds) of the last size measured
    for size in sizes:
        predicted = previous[1] * (size / previous[0]) ** 2 if previous else 0.0
        if limit is not None and predicted > limit:
            why = (f"the {previous[0]} px points took {previous[1]:.0f} s; {size} px would take at least "
                   f"{predicted:.0f} s, over --bench-time-limit {limit:g} s")
            points = [_skipped_point(args.model, size, args.bench_batch_size, device, args.amp, why) for _ in rows]
        else:
            t0 = time.time()
            points = benchmark_interleaved(
                [(args.model, kw) for kw in mixer_kwargs], size, batch_size=args.bench_batch_size, device=device,
                amp=args.amp, warmup=1, iters=args.bench_iters, flops=False, log=log,
                build_fn=lambda name, size, kw: task.build(kw, rows[0]["num_classes"], size))
            previous = (size, time.time() - t0)
            busy = next((p["unreliable"] for p in points if p["unreliable"]), "")
            log(f"   {size} px: " + ", ".join(f"{row['mixer']} {_cell(p['infer_img_s'], '.1f')}"
                                              for row, p in zip(rows, points))
                + " inference img/s" + (f" (UNRELIABLE: {busy})" if busy else ""))
        for row, point, own in zip(rows, points, per_row):
            point["mixer"] = row["mixer"]
            own.append(point)
    return per_row


def _score_line(row: Dict[str, Any], metric: str, spread: bool) -> str:
    """The console's line of a finished mixer: ``metric`` at each evaluation size (with ``spread``, plus and minus
    the seeds' standard deviation), parameters, FLOPs and training time."""
    scores = ", ".join(f"{s} px {_cell(v, '.2f')}" + (f" +- {_cell(row[metric + '_std'][s], '.2f')}"
                                                      if spread and not isinstance(v, str) else "")
                       for s, v in row[metric].items())
    return (f"   {_SCORE_LABEL[metric]} {scores}; {row['params_m']:.3f} M params, {row['gflops']:.4f} GFLOPs, "
            f"trained in {row['train_s']:.0f} s per seed")


_SCORE_LABEL = {"accuracy": "top-1", "miou": "mIoU", "pixel_acc": "pixel acc"}

# the key of each score in the entries that validation returns per size
_RESULT_KEYS = {"accuracy": "top1", "miou": "miou", "pixel_acc": "pixel_acc"}


# what ablation.json keeps of each benchmark point: enough to draw throughput_memory.png again
BENCH_KEYS = ("status", "error", "iters", "infer_img_s", "infer_img_s_min", "infer_img_s_max", "infer_spread_pct",
              "infer_mem_mb", "train_img_s", "train_img_s_min", "train_img_s_max", "train_spread_pct",
              "train_mem_mb", "backends", "load", "cores", "threads", "unreliable")


def _skipped_point(model: str, size: int, batch_size: int, device: str, amp: str, why: str) -> Dict[str, Any]:
    point = _empty_point(model, size, batch_size, device, amp, 0)
    point.update(status="skipped", error=why)
    return point


def _write_results(result: Dict[str, Any], run_dir: str) -> str:
    with open(os.path.join(run_dir, "ablation.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = markdown_table(result)
    with open(os.path.join(run_dir, "ablation.md"), "w") as f:
        f.write(table)
    return table


def _device(args: argparse.Namespace) -> str:
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _cell(value: Any, fmt: str) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return format(value, fmt)
    return "fails" if isinstance(value, str) else "-"


def _metrics(result: Dict[str, Any]):
    """The per-size scores of the rows: mIoU and pixel accuracy of a segmentation ablation, else top-1."""
    return ("miou", "pixel_acc") if result.get("task") == "segment" else ("accuracy",)


def markdown_table(result: Dict[str, Any]) -> str:
    """The ablation as a Markdown table: accuracy (top-1, or mIoU and pixel accuracy) per evaluation size, speed
    and memory per benchmark size."""
    evals, benches = result["eval_sizes"], result["bench_sizes"]
    metrics = _metrics(result)
    row_seeds = [_row_seeds(row, result) for row in result["rows"]]
    apart = len({tuple(s) for s in row_seeds}) > 1  # rows over different seeds (merged ablations): a column says which
    head = (["mixer"] + (["seeds"] if apart else []) + ["params (M)", f"GFLOPs @{result['img_size']}"]
            + [f"{_SCORE_LABEL[m]} @{s}" for m in metrics for s in evals]
            + ([f"infer img/s @{s}" for s in benches] + [f"train img/s @{benches[-1]}",
                                                         f"infer mem MiB @{benches[-1]}",
                                                         f"train mem MiB @{benches[-1]}"] if benches else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    seeds = result.get("seeds") or [result.get("seed")]
    for row, own_seeds in zip(result["rows"], row_seeds):
        cells = ([row["mixer"]] + ([", ".join(map(str, own_seeds))] if apart else [])
                 + [f"{row['params_m']:.3f}", f"{row['gflops']:.4f}"])
        for metric in metrics:
            for s in evals:
                acc = row[metric][str(s)]
                std = row.get(f"{metric}_std", {}).get(str(s))
                spread = f" ± {_cell(std, '.2f')}" if len(own_seeds) > 1 and not isinstance(acc, str) else ""
                cells.append(_cell(acc, ".2f") + spread)
                if isinstance(acc, str) and metric == metrics[0]:
                    notes.append(f"{row['mixer']} @{s}: {acc}")
        bench = row.get("bench") or {}  # none yet while the mixers train
        for s in benches:
            b = bench.get(str(s), {})
            cells.append(_timing_cell(b, "infer_img_s"))
            if b and b["status"] != "ok":
                notes.append(f"{row['mixer']} benchmark @{s}: {b['status']}: {b['error']}")
        if benches:
            last = bench.get(str(benches[-1]), {})
            cells += [_timing_cell(last, "train_img_s"), _cell(last.get("infer_mem_mb"), ".1f"),
                      _cell(last.get("train_mem_mb"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    text += _cost_note(result)
    names = " and ".join({"accuracy": "Top-1", "miou": "mIoU", "pixel_acc": "pixel accuracy"}[m] for m in metrics)
    if apart:
        text += (f"\n{names}: mean ± sample standard deviation over each row's seeds (one training run per seed; "
                 f"one seed has no spread; per-seed values in ablation.json).\n")
    elif len(seeds) > 1:
        text += (f"\n{names}: mean ± sample standard deviation over seeds {', '.join(map(str, seeds))} (one training "
                 f"run per seed; per-seed values in ablation.json).\n")
    if result.get("merged_from"):
        parents = {os.path.dirname(f) for f in result["merged_from"]}
        sources = (f"{', '.join(os.path.basename(f) for f in result['merged_from'])} in {parents.pop()}"
                   if len(parents) == 1 else ", ".join(result["merged_from"]))
        text += (f"\nMerged (linvision-ablate --merge) from {sources}. No throughput or memory: runs timed in "
                 f"separate processes are no comparison.\n")
    if result.get("task") == "segment":
        text += (f"\n{result['decoder']} head; mIoU and pixel accuracy (%) of each run's best/ on "
                 f"{result['mosaic_val']} validation mosaics rendered at each size (trained on {result['img_size']} "
                 f"px crops of {result['mosaic_size']} px mosaics).\n")
    benched = [b for row in result["rows"] for b in (row.get("bench") or {}).values()]
    spreads = sorted(b[key] for b in benched for key in ("infer_spread_pct", "train_spread_pct")
                     if isinstance(b.get(key), (int, float)) and math.isfinite(b[key]))
    if spreads:
        iters = max(b.get("iters", 0) for b in benched)
        spread = (f"; spread of the runs ((slowest - fastest) / median) median {spreads[len(spreads) // 2]:.0f}%, "
                  f"largest {spreads[-1]:.0f}%" if iters > 1 else "")
        text += (f"\nThroughput: {runs_phrase(iters)} of batch {result['bench_batch_size']} after one warm-up run, "
                 f"the mixers of each size timed interleaved, on {result['device']}{spread}. Memory: peak added by "
                 f"one pass.\n")
        note = unreliable_note(benched)
        if note:
            text += f"\n† {note}.\n"
    if notes:
        text += "\nFailures:\n" + "".join(f"- {n}\n" for n in notes)
    return text


def _row_seeds(row: Dict[str, Any], result: Dict[str, Any]) -> List[int]:
    """The seeds of a row's runs (of the ablation, for a row without runs)."""
    return [r["seed"] for r in row["runs"]] if row.get("runs") else (result.get("seeds") or [result.get("seed")])


def _timing_cell(bench: Dict[str, Any], key: str) -> str:
    """A throughput figure of the table, daggered when its point's times do not stand."""
    return _cell(bench.get(key), ".1f") + ("†" if bench.get("unreliable") and _cell(bench.get(key), ".1f") != "-"
                                           else "")


def _cost_note(result: Dict[str, Any]) -> str:
    """What softmax attention costs against each linear mixer at the largest benchmark size (times, the inverse
    of the throughput ratio), the figures daggered and called unreliable when their points were; '' without a
    softmax row or with nothing measured."""
    if not result["bench_sizes"]:
        return ""
    size = str(result["bench_sizes"][-1])
    bench = {row["mixer"]: (row.get("bench") or {}).get(size) for row in result["rows"]}
    soft = bench.get("softmax")
    parts, unreliable = [], bool(soft and soft.get("unreliable"))
    for mixer in ("linear", "linear_rope"):
        other = bench.get(mixer)
        if not (soft and other):
            continue
        ratios = [other[k] / soft[k] for k in ("infer_img_s", "train_img_s")
                  if _cell(other.get(k), "g") != "-" and _cell(soft.get(k), "g") != "-" and soft[k] > 0]
        if len(ratios) == 2:
            parts.append(f"{ratios[0]:.1f}x the inference time of `{mixer}` and {ratios[1]:.1f}x its training step")
            unreliable |= bool(other.get("unreliable"))
    if not parts:
        return ""
    mark = "† (UNRELIABLE: timed on a busy machine or with a wide spread, see below)" if unreliable else ""
    return f"\nCost at {size} px: softmax attention takes {'; '.join(parts)}{mark}.\n"


def _accuracy_figure(result: Dict[str, Any]):
    """The figure of accuracy.png (a matplotlib Figure, not closed): the first score (top-1, or mIoU) of every
    mixer against evaluation resolution, each mixer in its own colour and marker, the legend to the right of the
    axes. With several seeds a point is their mean with a bar of plus and minus their sample standard deviation
    (the mixers of one size set a little apart sideways so that the bars stay visible); a row of one seed has no
    bar. The title names the model, the data and what the points are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    metric = _metrics(result)[0]
    seeds = result.get("seeds") or [result.get("seed")]
    row_seeds = [_row_seeds(row, result) for row in rows]
    several = any(len(own) > 1 for own in row_seeds)
    sizes = [int(s) for s in result["eval_sizes"]]
    gaps = [math.log2(b / a) for a, b in zip(sorted(sizes), sorted(sizes)[1:]) if b > a]
    width = min([0.12] + [0.25 * g for g in gaps]) if several else 0.0
    apart = len({tuple(own) for own in row_seeds}) > 1  # rows over different seeds: the legend gives each its count
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    handles = []
    for k, (row, style) in enumerate(zip(rows, series_styles(len(rows)))):
        label = row["mixer"] + (f", n={len(row_seeds[k])}" if apart else "")
        pts = [(int(s), v, row.get(f"{metric}_std", {}).get(s, 0.0)) for s, v in row[metric].items()
               if isinstance(v, (int, float))]
        xs = [p[0] * dodge(k, len(rows), width) for p in pts]
        if len(row_seeds[k]) > 1:
            bars = ax.errorbar(xs, [p[1] for p in pts], yerr=[p[2] for p in pts], ms=5, capsize=2.5, elinewidth=1,
                               label=label, **style)
            for artist in (*bars.lines[1], *bars.lines[2]):  # bars and caps lighter than the line they belong to
                artist.set_alpha(0.6)
            handles.append(bars)
        else:
            handles += ax.plot(xs, [p[1] for p in pts], ms=5, label=label, **style)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel(f"evaluation resolution (px), trained at {result['img_size']}")
    score = {"accuracy": "top-1 (%)", "miou": "mIoU (%)"}[metric]
    ax.set_ylabel(score)
    ax.grid(True, alpha=0.3)
    if apart:
        points = "each point the mean of its n seeds, its bar ± their sample s.d."
    elif several:
        points = f"each point the mean of seeds {', '.join(map(str, seeds))}, its bar ± their sample standard deviation"
    else:
        points = f"one seed ({seeds[0]}): no spread to show"
    head = f"{result.get('decoder')} on {result['model']}" if result.get("task") == "segment" else result["model"]
    ax.set_title(f"{head}, {result.get('dataset', '?')} data: {score.split(' (')[0]} per token mixer\n{points}",
                 fontsize=9)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False,
              title="token mixer", title_fontsize=8, alignment="left")
    fig.tight_layout()
    return fig


def _plot_accuracy(result: Dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = _accuracy_figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)
