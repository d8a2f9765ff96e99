r"""Sample a trained linear-attention DiT with classifier-free guidance and write a PNG grid.

    linvision-sample-diffusion output/diffusion_digits --per-class 8 --steps 20 --cfg-scale 3 \
        --out output/diffusion_digits/samples.png

One row per class (--classes picks them), --per-class columns; Euler or Heun over --steps. A caption model
samples one row per caption (--captions, default: its training captions). A model trained on latents is
decoded with the autoencoder its checkpoint names.
"""
from __future__ import annotations

import argparse
import os

import torch

from linvision.diffusion.flow import SAMPLERS
from linvision.diffusion.data import CaptionEmbeddings
from linvision.diffusion.sampling import decoder_for, sample_captions, sample_classes, save_grid
from linvision.diffusion.checkpoint import load_dit
from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.threads import set_threads


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-sample-diffusion."""
    p = tool_parser("linvision-sample-diffusion", __doc__)
    p.add_argument("checkpoint", help="run folder (uses its last/) or checkpoint folder")
    p.add_argument("--classes", type=int, nargs="*", default=None,
                   help="class indices to sample, a row each (default: every class)")
    p.add_argument("--captions", default=None, help="caption model: a safetensors file of 'context' (K, L, C') and "
                   "'mask' (K, L) (default: the training captions)")
    p.add_argument("--num-captions", type=int, default=8, help="caption model: sample the first this many captions")
    p.add_argument("--per-class", type=int, default=8, help="samples per class or caption (the grid's columns)")
    p.add_argument("--steps", type=int, default=20, help="sampler steps from noise to image")
    p.add_argument("--cfg-scale", type=float, default=3.0, help="1 = no guidance")
    p.add_argument("--sampler", choices=SAMPLERS, default="euler",
                   help="ODE integrator: euler (one model call per step) or heun (two, but one in the last step)")
    p.add_argument("--shift", type=float, default=1.0, help="time shift (> 1: more steps at high noise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    p.add_argument("--no-ema", action="store_true", help="sample the raw weights instead of the EMA")
    p.add_argument("--out", default=None, help="PNG path (default: <checkpoint>/samples.png)")
    add_threads_arg(p)
    return p


def main() -> int:
    args = build_parser().parse_args()
    print(set_threads(args.threads), flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, meta = load_dit(args.checkpoint, ema=not args.no_ema, device=device)
    options = dict(steps=args.steps, cfg_scale=args.cfg_scale, sampler=args.sampler, shift=args.shift, seed=args.seed,
                   decode=decoder_for(meta, device))
    out = args.out or os.path.join(args.checkpoint, "samples.png")
    if model.cfg.caption_channels > 0:
        path = args.captions or meta["data"].get("captions")
        if not path:
            raise ValueError("captions: a caption model needs --captions (a safetensors file of 'context', 'mask')")
        captions = CaptionEmbeddings(path, channels=model.cfg.caption_channels)
        context, mask = captions.rows(range(min(args.num_captions, len(captions))))
        context, mask = context.repeat_interleave(args.per_class, 0), mask.repeat_interleave(args.per_class, 0)
        images = sample_captions(model, context, mask, **options)
        what = f"{len(images) // args.per_class} captions of {path}"
    else:
        classes = args.classes if args.classes is not None else list(range(model.cfg.num_classes))
        images, _ = sample_classes(model, classes, args.per_class, **options)
        what = f"{len(classes)} classes"
    save_grid(images, out, ncol=args.per_class)
    print(f"wrote {len(images)} samples ({what} x {args.per_class}) to {out}")

    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
