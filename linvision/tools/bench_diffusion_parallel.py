r"""Memory per rank of diffusion training, replicated (DDP) against sharded (FSDP2), at several world sizes.

    linvision-bench-diffusion-parallel                   # sana_600m's blocks, depth 4, 16 x 16 latents
    linvision-bench-diffusion-parallel --depth 8 --ranks 1 2 4 --latent 32 --batch 8 --out results/fsdp_mem

Each (mode, ranks) point is its own torchrun job (gloo on CPU, nccl with one GPU per rank) that builds the
model of --model at --depth, the EMA copy and AdamW as linvision-train-diffusion does, spreads them with
linvision.diffusion.parallel and takes --steps training steps (linvision.diffusion.train.optimizer_step) of
--batch images over all ranks on random latents. Modes: ddp (every rank holds the whole model; one rank is a
plain process), fsdp (FSDP2, --param-dtype compute), fsdp+ckpt (the same with activation checkpointing).
Every rank reports:

  - state: the bytes it holds of weights, EMA weights, gradients and optimizer states (its shards under FSDP);
  - peak: CUDA's max allocated bytes on a GPU; on CPU the process's peak resident set minus the resident set
    before the model was built (so it includes the gathered blocks, activations and communication buffers);
  - step time (the mean of the steps after the first).

The largest rank's figures make the table (printed, and written as <out>.md and <out>.json). The measurements
are linvision.diffusion.parallel_memory's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from linvision.diffusion.parallel_memory import MODES, ParallelMemoryConfig, check_sweep, run_sweep, table
from linvision.utils.cli import run_cli, tool_parser
from linvision.utils.files import atomic_write_text


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-diffusion-parallel."""
    p = tool_parser("linvision-bench-diffusion-parallel", __doc__)
    p.add_argument("--model", default="sana_600m", help="a config of linvision.diffusion.DIT_CONFIGS")
    p.add_argument("--depth", type=int, default=4, help="blocks (sana_600m has 28)")
    p.add_argument("--latent", type=int, default=16, help="latent height and width")
    p.add_argument("--batch", type=int, default=2, help="images per step over all ranks")
    p.add_argument("--steps", type=int, default=3, help="training steps per point (the step time leaves out the first)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                   help="world sizes to measure (each must divide --batch)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="ddp: replicated; fsdp: FSDP2 shards; fsdp+ckpt: FSDP2 with activation checkpointing")
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="fsdp compute dtype")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    return p


def main() -> int:
    args = build_parser().parse_args()
    cfg = ParallelMemoryConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ParallelMemoryConfig)})
    check_sweep(cfg, args.ranks)
    points = run_sweep(cfg, args.ranks, args.modes, log=lambda line: print(line, flush=True))
    text = table(points, cfg)
    print(text)
    if args.out:
        atomic_write_text(args.out + ".md", text + "\n")
        atomic_write_text(args.out + ".json", json.dumps({"args": vars(args), "points": points}, indent=2))
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
