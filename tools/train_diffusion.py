"""Train a class-conditional linear-attention DiT (Sana-style blocks) with rectified flow.

    python tools/train_diffusion.py --config configs/diffusion_digits.yaml
    python tools/train_diffusion.py --config configs/diffusion_digits.yaml --resume
    python tools/train_diffusion.py --dataset folder --data-dir /data/pets/train --model digits \
        --model-kwargs img_size=64 in_chans=3 patch_size=4 num_classes=37 --steps 20000

The run folder <output>/<experiment> receives config.yaml and the checkpoint last/ (model.safetensors,
ema.safetensors, model.json, train_state.pt); sample from it with tools/sample_diffusion.py.
"""
from __future__ import annotations

import argparse
import os

import torch

from linvision.diffusion.model import DIT_CONFIGS, DiTConfig
from linvision.diffusion.train import DiffusionTrainConfig, train_dit
from linvision.engine.files import atomic_write
from linvision.engine.cli import run_cli
from linvision.engine.config import parse_args, parse_kwargs, save_yaml
from linvision.engine.run_folder import claim_run_folder


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DiffusionTrainConfig()
    p.add_argument("--model", default="digits", help=f"base model config: {', '.join(DIT_CONFIGS)}")
    p.add_argument("--model-kwargs", nargs="*", default=None,
                   help="overrides of the model config as key=value pairs or a JSON object, e.g. depth=6")
    p.add_argument("--dataset", default=d.dataset, help="'digits' (offline) or 'folder' (<data-dir>/<class>/*)")
    p.add_argument("--data-dir", default=d.data_dir)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="stop after this much training time")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--ema-decay", type=float, default=d.ema_decay)
    p.add_argument("--class-dropout", type=float, default=d.class_dropout,
                   help="probability of the null class during training (for classifier-free guidance)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--output", default="output")
    p.add_argument("--experiment", default="diffusion_digits")
    p.add_argument("--resume", action="store_true", help="continue from <output>/<experiment>/last")
    p.add_argument("--overwrite", action="store_true",
                   help="delete an earlier run in the folder (without it a new run goes to <experiment>-<k>)")
    return p


def main() -> int:
    args = parse_args(build_parser())
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model not in DIT_CONFIGS:
        raise ValueError(f"model: unknown {args.model!r}; allowed: {', '.join(DIT_CONFIGS)}")
    model_cfg = {**DIT_CONFIGS[args.model].to_dict(), **parse_kwargs(args.model_kwargs)}
    DiTConfig.from_dict(model_cfg)  # fails early on an unknown key
    cfg = DiffusionTrainConfig(
        model=model_cfg, dataset=args.dataset, data_dir=args.data_dir, steps=args.steps,
        max_minutes=args.max_minutes, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, ema_decay=args.ema_decay,
        class_dropout=args.class_dropout, seed=args.seed, log_every=args.log_every, save_every=args.save_every,
    )
    cfg.check()
    folder = claim_run_folder(os.path.join(args.output, args.experiment), resume=args.resume,
                              overwrite=args.overwrite)
    try:
        for note in folder.notes:
            print(note, flush=True)
        run_dir = folder.path
        recipe = {k: v for k, v in vars(args).items() if k not in ("config", "overwrite", "resume")}
        atomic_write(os.path.join(run_dir, "config.yaml"), lambda p: save_yaml(p, recipe))
        result = train_dit(cfg, run_dir, resume=args.resume)
    finally:
        folder.release()
    print(f"done: step {result['step']}, {result['elapsed_s']:.0f}s, checkpoint {os.path.join(run_dir, 'last')}")
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
