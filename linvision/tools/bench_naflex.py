r"""Images/s and peak memory on a mixed-aspect workload in timm's NaFlex batches: linvit (linear attention) against
timm's naflexvit (softmax attention) of the same width and depth, and against linvit on square images of the same
token count, at sequence budgets (patches per image) from 256 to 16384.

    linvision-bench-naflex                                   # the default models at 256 1024 4096 16384 patches
    linvision-bench-naflex --budgets 256 1024 --modes infer --batch 2 --plot naflex.png
    linvision-bench-naflex --models linvit_tiny_patch16_224 naflexvit_tiny_patch16 \
        --model-kwargs embed_dim=64 depth=2 num_heads=1 --budgets 16 64 --iters 2 --output tiny.csv

The workload: --batches batches of --batch images, drawn once from --seed. Each image has a random aspect ratio
between 1:--max-aspect and --max-aspect:1 (log-uniform), its longer side between --min-side and --max-side pixels
and every side at least --min-side, and holds uniform noise. At each budget every image goes through timm's NaFlex
functions: resized to as many patches as fit the budget with its aspect ratio kept (ResizeToSequence, as timm's
NaFlex evaluation transform does, upsampling a small image), cut into patches (Patchify), and batched, padded to the
budget, by NaFlexCollator. The square baseline (--square) runs a model's plain image path on square images of
floor(sqrt(budget)) patches a side: the budget's token count, every token valid, no padding.

Models are timm names, each optionally with its own options (name:key=value,key=value, over --model-kwargs).
naflexvit_tiny_patch16 stands for timm's naflexvit_base_patch16_gap at ViT-Ti size (embed 192, depth 12, 3
heads, patch 16) with linvit's class-token pooling (reg_tokens=0, class_token=true, global_pool=token,
fc_norm=false, init_values=null); --model-kwargs and its own options go over those.

Modes: infer is a forward under inference_mode; train is a forward, the backward of the logits' mean and an SGD
step. Each figure is the median of --iters timed runs after --warmup untimed ones, the runs going round the
batches; peak memory is what the pass adds above the model and its inputs, as linvision-benchmark measures it
(CUDA: max_memory_allocated; CPU: the peak resident set size). --dtype bfloat16 runs under autocast.

Guards: a model with softmax attention (timm's Attention, linvision's softmax mixer) is skipped at a budget where
its projected attention matrix, batch x heads x L^2 elements of the compute dtype (L: tokens per image, prefix
tokens included), passes --memory-limit-gib; an out-of-memory error is caught and recorded. A model whose first
run at a point, and then its second, takes more than --slow-factor times the median of the reference
(--reference, the first of --models by default) at that budget and mode is recorded from that second run (status
slow; from the first when that one took longer than --max-run-s). A model skipped, out of memory or slow at a
budget is not run at the larger budgets of that mode (status skipped, with the reason). With --max-run-s, a point
whose first run takes longer than that is recorded from that run alone (status ok, one timed run, the reason
saying so): the large budgets cost one run each. The last lines printed say, for each model against the
reference, from which budget it did not fit or took more than --slow-factor times the reference's time.

Writes --output (CSV, one row per model x input x budget x mode, rewritten as each point finishes), prints each
point as it finishes and a table at the end, and with --plot a PNG of images/s and peak memory against the budget.
--from-csv FILE measures nothing: the table and the plot of a CSV written before (an interrupted run's, say).
The exit status is 1 when a point failed with an error, 2 for bad arguments (one line on stderr).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

from linvision.benchmark.naflex import (DEFAULT_BUDGETS, DEFAULT_MODELS, DTYPES, MODES, SweepConfig, image_sizes,
                                        limits, parse_budgets, plot, plot_title, read_csv, resolve_spec, run_sweep,
                                        table)
from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.threads import set_threads
from linvision.utils.config import parse_kwargs


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-naflex; a bad flag is one line on stderr and exit status 2."""
    p = tool_parser("linvision-bench-naflex", __doc__)

    def one_line_error(message: str):
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)

    p.error = one_line_error
    p.add_argument("--models", "--model", nargs="+", default=list(DEFAULT_MODELS),
                   help="models run on the NaFlex batches: timm names, each optionally name:key=value,key=value")
    p.add_argument("--square", nargs="*", default=["linvit_tiny_patch16_224"],
                   help="models run on square images of the budget's token count (none: no square baseline)")
    p.add_argument("--reference", default=None,
                   help="the model (one of --models) the others' time is compared with (default: the first)")
    p.add_argument("--model-kwargs", "--model-args", nargs="*", default=None,
                   help="key=value options given to every model, e.g. embed_dim=64 depth=2 num_heads=1")
    p.add_argument("--budgets", nargs="+", default=[str(b) for b in DEFAULT_BUDGETS],
                   help="sequence budgets: most patches per image, e.g. 256 1024 4096 16384 (or 256,1024)")
    p.add_argument("--modes", nargs="+", default=["infer"], choices=MODES,
                   help="infer: forward under inference_mode; train: forward, backward and SGD step")
    p.add_argument("--batch", type=int, default=4, help="images per batch")
    p.add_argument("--batches", type=int, default=2, help="distinct batches of the workload; the runs go round them")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the models' initialisation")
    p.add_argument("--min-side", type=int, default=128, help="shortest image side in pixels")
    p.add_argument("--max-side", type=int, default=1536, help="longest image side in pixels")
    p.add_argument("--max-aspect", type=float, default=3.0, help="aspect ratios from 1:this to this:1")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="'auto': CUDA when available, else CPU")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="compute dtype; bfloat16 runs under autocast")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument("--iters", type=int, default=3, help="timed runs per figure; the figure is their median")
    add_threads_arg(p)
    p.add_argument("--memory-limit-gib", type=float, default=16.0,
                   help="skip a softmax model where its projected attention matrix passes this many GiB")
    p.add_argument("--slow-factor", type=float, default=10.0,
                   help="a model this many times slower than the reference is timed once, not run at larger "
                        "budgets, and named in the last lines")
    p.add_argument("--max-run-s", type=float, default=None,
                   help="seconds: a point whose first run takes longer is recorded from that run alone")
    p.add_argument("--output", default="naflex_results.csv", help="the CSV written")
    p.add_argument("--plot", default=None, help="also write this PNG: images/s and peak memory against the budget")
    p.add_argument("--from-csv", default=None,
                   help="measure nothing: print the table of a CSV this tool wrote and draw its --plot")
    return p



def check_args(args) -> SweepConfig:
    """The sweep the flags ask for; ValueError in one line for bad input."""
    budgets = parse_budgets(args.budgets)
    common = parse_kwargs(args.model_kwargs)
    if not args.models:
        raise ValueError("models: give at least one")
    for spec in list(args.models) + list(args.square):
        resolve_spec(spec, common)
    if args.reference is not None and args.reference not in args.models:
        raise ValueError(f"reference: {args.reference!r} is not one of --models")
    for flag, value, low in (("batch", args.batch, 1), ("batches", args.batches, 1), ("iters", args.iters, 1),
                             ("warmup", args.warmup, 0)):
        if value < low:
            raise ValueError(f"{flag}: at least {low}, got {value}")
    if args.max_run_s is not None and not args.max_run_s > 0:
        raise ValueError(f"max_run_s: seconds > 0, got {args.max_run_s:g}")
    if not args.memory_limit_gib > 0 or not args.slow_factor > 0:
        raise ValueError(f"memory_limit_gib/slow_factor: need positive numbers, got {args.memory_limit_gib:g} and "
                         f"{args.slow_factor:g}")
    image_sizes(0, args.seed, args.min_side, args.max_side, args.max_aspect)  # checks the three
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA is not available; use --device cpu")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"plot: {args.plot!r} is not a .png file name")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    return SweepConfig(
        models=list(args.models), square=list(args.square), reference=args.reference, common_kwargs=common,
        budgets=budgets, modes=list(dict.fromkeys(args.modes)), batch=args.batch,
        batches=args.batches, seed=args.seed, min_side=args.min_side, max_side=args.max_side,
        max_aspect=args.max_aspect, device=device, dtype=args.dtype, warmup=args.warmup, iters=args.iters,
        memory_limit_gib=args.memory_limit_gib, slow_factor=args.slow_factor, max_run_s=args.max_run_s,
        output=args.output)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = check_args(args)
    if args.from_csv:
        rows = read_csv(args.from_csv)
        return report(rows, cfg, args.plot, rows[0]["model"])
    threads = set_threads(args.threads)
    print(f"device {cfg.device}, {threads}, dtype {cfg.dtype}, {cfg.batches} batches of "
          f"{cfg.batch} images (seed {cfg.seed}; aspect 1:{cfg.max_aspect:g} to {cfg.max_aspect:g}:1, sides "
          f"{cfg.min_side}-{cfg.max_side} px), budgets {' '.join(map(str, cfg.budgets))}, modes "
          f"{' '.join(cfg.modes)}, {cfg.warmup} warm-up + {cfg.iters} timed runs per figure (their median), "
          f"reference {cfg.reference}", flush=True)
    rows = run_sweep(cfg, log=lambda line: print(line, flush=True))
    print(f"results in {cfg.output}", flush=True)
    return report(rows, cfg, args.plot, cfg.reference)


def report(rows: List[Dict[str, Any]], cfg: SweepConfig, plot_path: Optional[str], reference: str) -> int:
    """Print the table and the limits of the rows, draw the plot; the exit status (1 when a point failed)."""
    print(table(rows))
    for line in limits(rows, reference, cfg.slow_factor):
        print(line)
    if plot_path:
        if plot(rows, plot_path, plot_title(rows, cfg)):
            print(f"plot in {plot_path}", flush=True)
        else:
            print("no plot: no point was measured", flush=True)
    return 1 if any(r["status"] == "error" for r in rows) else 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
