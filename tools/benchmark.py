"""Throughput, latency, peak memory, parameters and GFLOPs of models across resolutions.

    linvision-benchmark                                         # defaults: see configs/benchmark.yaml
    linvision-benchmark --config benchmark_cpu                  # a config shipped with linvision, or a path
    linvision-benchmark --model linhier_tiny_224 mambaout_tiny --img-size 224 512 1024 -b 1

(or ``python tools/benchmark.py ...`` in a checkout). Writes results.jsonl (as points finish), results.json,
results.csv and throughput_memory.png into <output>/<experiment>. Each figure is the mean of --iters timed
iterations after --warmup untimed ones; its spread ((slowest - fastest) / mean) is printed and stored. A point
that runs out of memory or fails is recorded and the sweep goes on; the exit status is 1 when a point failed
with an error (an out-of-memory point is a measurement, not a failure), 2 for bad arguments such as an unknown
model name.
"""
import argparse
import os
import time

import torch

from linvision.engine.benchmark import DEFAULT_MODELS, plot_results, run_sweep, write_results
from linvision.engine.factory import check_model_name
from linvision.engine.cli import add_amp_arg, run_cli
from linvision.engine.config import parse_args, parse_kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", "--model", nargs="+", default=DEFAULT_MODELS, help="timm model names")
    parser.add_argument("--img-size", type=int, nargs="+", default=[224, 512, 1024, 2048])
    parser.add_argument("--batch-size", "-b", type=int, default=8)
    parser.add_argument("--model-kwargs", nargs="*", default=None, help="key=value pairs given to every model")
    add_amp_arg(parser)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations before the timed ones")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per figure")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure training steps")
    parser.add_argument("--output", default="output")
    parser.add_argument("--experiment", default=None, help="default: benchmark-<time>")
    args = parse_args(parser)
    for name in args.models:
        check_model_name(name)
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"iters/warmup: need iters >= 1 and warmup >= 0, got {args.iters} and {args.warmup}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    out_dir = os.path.join(args.output, args.experiment or f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"device {device}, threads {torch.get_num_threads()}, batch {args.batch_size}, amp {args.amp}, "
          f"{args.warmup} warm-up + {args.iters} timed iterations per figure", flush=True)
    points = run_sweep(args.models, args.img_size, out_dir, batch_size=args.batch_size, device=device,
                       amp=args.amp, warmup=args.warmup, iters=args.iters, train=args.train,
                       model_kwargs=parse_kwargs(args.model_kwargs))
    write_results(points, out_dir)
    title = f"{device}, batch {args.batch_size}, amp {args.amp}, mean of {args.iters} iterations"
    plotted = plot_results(points, os.path.join(out_dir, "throughput_memory.png"), title=title)
    failed = [p for p in points if p["status"] == "error"]
    oom = sum(p["status"] == "oom" for p in points)
    print(f"{len(points) - len(failed) - oom} of {len(points)} points measured, {oom} out of memory, "
          f"{len(failed)} failed; results in {out_dir}"
          + (" with throughput_memory.png" if plotted else " (no plot: no point was measured)"), flush=True)
    return 1 if failed else 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
