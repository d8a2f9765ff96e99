"""Throughput, latency, peak memory, parameters and GFLOPs of models across resolutions.

    python tools/benchmark.py                                   # defaults: see configs/benchmark.yaml
    python tools/benchmark.py --config configs/benchmark_cpu.yaml
    python tools/benchmark.py --models linhier_tiny_224 mambaout_tiny --img-size 224 512 1024 --batch-size 1

Writes results.jsonl (as points finish), results.json, results.csv and throughput_memory.png into
<output>/<experiment>. A point that runs out of memory or fails is recorded and the sweep goes on.
"""
import argparse
import os
import time

import torch

from linvision.engine.benchmark import DEFAULT_MODELS, plot_results, run_sweep, write_results
from linvision.engine.cli import run_cli
from linvision.engine.config import parse_args, parse_kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--img-size", type=int, nargs="+", default=[224, 512, 1024, 2048])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model-kwargs", nargs="*", default=None, help="key=value pairs given to every model")
    parser.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure training steps")
    parser.add_argument("--output", default="output")
    parser.add_argument("--experiment", default=None, help="default: benchmark-<time>")
    args = parse_args(parser)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    out_dir = os.path.join(args.output, args.experiment or f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"device {device}, threads {torch.get_num_threads()}, batch {args.batch_size}, amp {args.amp}")
    points = run_sweep(args.models, args.img_size, out_dir, batch_size=args.batch_size, device=device,
                       amp=args.amp, warmup=args.warmup, iters=args.iters, train=args.train,
                       model_kwargs=parse_kwargs(args.model_kwargs))
    write_results(points, out_dir)
    title = f"{device}, batch {args.batch_size}, amp {args.amp}"
    plot_results(points, os.path.join(out_dir, "throughput_memory.png"), title=title)
    print(f"results and plot in {out_dir}")
    return 0


if __name__ == "__main__":
    run_cli(main)
