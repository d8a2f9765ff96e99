r"""Throughput, latency, peak memory, parameters and GFLOPs of models across resolutions.

    linvision-benchmark                          # linhier_tiny_224, vit_small_patch16_224, mambaout_tiny; 224-2048 px
    linvision-benchmark --config benchmark_cpu   # a config shipped with linvision (or a path): 224-896 px, batch 1
    linvision-benchmark --model linhier_tiny_224 mambaout_tiny --img-size 224 512 1024 -b 1
    linvision-benchmark --model linvit_tiny_patch16_rope_224:token_mixer=softmax \
        linvit_tiny_patch16_rope_224:token_mixer=linear_rope --model-kwargs patch_size=8 --img-size 96 -b 64 \
        --twin linvit_tiny_patch16_rope_224:token_mixer=softmax --gemm-rate
    linvision-benchmark --config benchmark_seg_twin_cpu   # Segformer on linhier_tiny_224 and its softmax twin
    linvision-benchmark --model linhier_tiny_224 --decoder upernet --classes 19 --img-size 512 2048x1024 -b 2

Writes results.jsonl (as points finish), results.json, results.csv and throughput_memory.png into
<output>/<experiment>. Each time is the median of --iters timed runs after --warmup untimed ones (a median,
so that a run slowed by other work on the machine does not move it); the results keep the median, the fastest
and the slowest run and the spread ((slowest - fastest) / median), and the plot draws each median with a bar
from the slowest to the fastest run. A model is a timm name, optionally with its own
options (name:key=value,key=value; over --model-kwargs). --twin MODEL adds each model's time and memory over
that model's (a softmax twin, say) at the same size; --gemm-rate measures the machine's matrix-multiply rate
first and adds each forward's GFLOP/s and its fraction of it; both print a table at the end and go into the
results files. A point that runs out of memory or fails is recorded and the sweep goes on; the exit status is
1 when a point failed with an error (an out-of-memory point is a measurement, not a failure), 2 for bad
arguments such as an unknown model name.

A size is a side (512) or height x width (2048x1024); the results carry its label, height, width and pixel count,
and the plot's x axis is the pixel count when a size is not square. --decoder wraps each model in that
segmentation head of segmentation_models_pytorch (pip install "linvision[seg]") as its tu- encoder, the model's
options going to timm through smp, and its training step takes per-pixel cross-entropy against random labels.
--point-timeout runs each point in a process of its own and stops it at that many seconds: the point is recorded
as "timeout" with the figures it finished (a measurement, like an out-of-memory point).
"""
import argparse
import os
import time

import torch

from linvision.benchmark.plots import plot_results
from linvision.benchmark.throughput import (
    DECODERS,
    DEFAULT_MODELS,
    add_comparisons,
    check_decoder,
    check_run_mode,
    comparison_table,
    gemm_gflop_s,
    parse_img_size,
    parse_model_spec,
    run_sweep,
    write_results,
)
from linvision.utils.factory import check_model_name
from linvision.utils.cli import add_amp_arg, add_run_mode_args, add_threads_arg, arg_type, run_cli, tool_parser
from linvision.utils.threads import set_threads
from linvision.utils.config import add_config_arg, parse_args, parse_kwargs


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-benchmark, --config included."""
    parser = tool_parser("linvision-benchmark", __doc__)
    parser.add_argument("--models", "--model", nargs="+", default=DEFAULT_MODELS,
                        help="timm model names, each optionally with its own options: name:key=value,key=value")
    parser.add_argument("--twin", default=None, help="one of --models: the others' time and memory over its")
    parser.add_argument("--gemm-rate", action="store_true",
                        help="measure the fp32 matrix-multiply rate and each forward's fraction of it")
    parser.add_argument("--img-size", type=arg_type(parse_img_size), nargs="+", default=[224, 512, 1024, 2048],
                        help="input sizes: a side in pixels (square) or HxW, e.g. 2048x1024; every model at each")
    parser.add_argument("--batch-size", "-b", type=int, default=8, help="images per forward and per training step")
    parser.add_argument("--model-kwargs", nargs="*", default=None, help="key=value pairs given to every model")
    parser.add_argument("--decoder", default=None,
                        help=f"wrap each model in this segmentation head of smp as its tu- encoder: "
                             f"{', '.join(DECODERS)}")
    parser.add_argument("--classes", type=int, default=19, help="output classes of the --decoder head")
    parser.add_argument("--flops", action=argparse.BooleanOptionalAction, default=True,
                        help="count each forward's GFLOPs (one more forward per point)")
    parser.add_argument("--point-timeout", type=float, default=None,
                        help="seconds: each point in a process of its own, stopped at this budget")
    add_amp_arg(parser)
    add_run_mode_args(parser, ", its seconds recorded apart (infer_compile_s, train_compile_s); no training "
                              "step is timed with 16-bit --weights")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="'auto': CUDA when available, else CPU")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed ones")
    parser.add_argument("--iters", type=int, default=10,
                        help="timed runs per figure; the figure is their median, their range its spread")
    add_threads_arg(parser)
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure training steps")
    parser.add_argument("--output", default="output", help="parent folder of the results folder <output>/<experiment>")
    parser.add_argument("--experiment", default=None,
                        help="results folder name under --output (default: benchmark-<time>)")
    return add_config_arg(parser)


def main() -> int:
    args = parse_args(build_parser())
    for spec in args.models:
        check_model_name(parse_model_spec(spec)[0])
    if args.twin is not None and args.twin not in args.models:
        raise ValueError(f"twin: {args.twin!r} is not one of --models")
    args.img_size = [parse_img_size(s) for s in args.img_size]  # a config's values are not typed by argparse
    if args.decoder is not None:
        check_decoder(args.decoder)
        if args.classes < 1:
            raise ValueError(f"classes: at least 1, got {args.classes}")
    if args.point_timeout is not None and args.point_timeout <= 0:
        raise ValueError(f"point_timeout: seconds > 0, got {args.point_timeout}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"iters/warmup: need iters >= 1 and warmup >= 0, got {args.iters} and {args.warmup}")
    check_run_mode(args.compile, args.weights, args.amp)
    threads = set_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    out_dir = os.path.join(args.output, args.experiment or f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    seg = f", {args.decoder} head ({args.classes} classes)" if args.decoder else ""
    budget = f", {args.point_timeout:g} s per point" if args.point_timeout else ""
    mode = "" if args.compile == "none" else f", torch.compile {args.compile}"
    mode += "" if args.weights == "fp32" else f", {args.weights} weights (inference only)"
    print(f"device {device}, {threads}, batch {args.batch_size}, amp {args.amp}{mode}, "
          f"{args.warmup} warm-up + {args.iters} timed runs per figure (their median){seg}{budget}", flush=True)
    gemm = None
    if args.gemm_rate:
        gemm = gemm_gflop_s(device)
        print(f"fp32 GEMM 4096x384x1536: {gemm:.1f} GFLOP/s", flush=True)
    points = run_sweep(args.models, args.img_size, out_dir, batch_size=args.batch_size, device=device,
                       amp=args.amp, warmup=args.warmup, iters=args.iters, train=args.train, flops=args.flops,
                       model_kwargs=parse_kwargs(args.model_kwargs), point_timeout=args.point_timeout,
                       compile=args.compile, weights=args.weights,
                       **(dict(decoder=args.decoder, classes=args.classes) if args.decoder else {}))
    if args.twin is not None or gemm is not None:
        add_comparisons(points, args.twin, gemm)
        table = comparison_table(points)
        print(table, flush=True)
        with open(os.path.join(out_dir, "comparison.md"), "w") as f:
            f.write(table + "\n")
    write_results(points, out_dir)
    title = f"{device}, batch {args.batch_size}, amp {args.amp}{mode}"  # the plot adds how many runs each point is
    title = f"{args.decoder} head, {title}" if args.decoder else title
    plotted = plot_results(points, os.path.join(out_dir, "throughput_memory.png"), title=title)
    failed = [p for p in points if p["status"] == "error"]
    oom = sum(p["status"] == "oom" for p in points)
    late = sum(p["status"] == "timeout" for p in points)
    over = f", {late} stopped at the {args.point_timeout:g} s budget" if args.point_timeout else ""
    print(f"{len(points) - len(failed) - oom - late} of {len(points)} points measured, {oom} out of memory, "
          f"{len(failed)} failed{over}; results in {out_dir}"
          + (" with throughput_memory.png" if plotted else " (no plot: no point was measured)"), flush=True)
    return 1 if failed else 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
