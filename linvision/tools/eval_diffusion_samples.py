r"""How often does a classifier recognise the class a DiT sample was conditioned on?

    linvision-eval-diffusion-samples output/diffusion_digits output/digits_linvit_cls --per-class 50

Samples --per-class images of every class from the DiT (EMA weights, fixed seed), classifies them with a
checkpoint of linvision-train (grey samples repeated to RGB, resized to the classifier's size if needed,
normalised as it was trained) and prints the fraction assigned to the conditioning class, overall and per
class. As a yardstick it also prints the classifier's accuracy on the real digits validation split, read
with the same preprocessing path.
"""
from __future__ import annotations

import argparse
import json

import torch

from linvision.diffusion.flow import SAMPLERS
from linvision.diffusion.sampling import classify_images, decoder_for, sample_classes, save_grid
from linvision.diffusion.checkpoint import load_dit
from linvision.diffusion.data import load_images
from linvision import load_model
from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.threads import set_threads


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-eval-diffusion-samples."""
    p = tool_parser("linvision-eval-diffusion-samples", __doc__)
    p.add_argument("dit", help="DiT run or checkpoint folder (of linvision-train-diffusion)")
    p.add_argument("classifier", help="classifier run or checkpoint folder (of linvision-train)")
    p.add_argument("--per-class", type=int, default=50, help="samples drawn and classified per class")
    p.add_argument("--steps", type=int, default=20, help="sampler steps from noise to image")
    p.add_argument("--cfg-scale", type=float, default=3.0, help="classifier-free guidance scale (1 = no guidance)")
    p.add_argument("--sampler", choices=SAMPLERS, default="euler",
                   help="ODE integrator: euler (one model call per step) or heun (two, but one in the last step)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    add_threads_arg(p)
    p.add_argument("--grid", default=None, help="also write the first 10 samples of each class as a PNG grid")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    return p


def main() -> int:
    args = build_parser().parse_args()
    print(set_threads(args.threads), flush=True)
    dit, dit_meta = load_dit(args.dit)
    if dit.cfg.num_classes <= 0:
        raise ValueError(f"dit: {args.dit} is a caption model; this tool evaluates class-conditional ones")
    classifier, cls_meta = load_model(args.classifier)
    classes = list(range(dit.cfg.num_classes))
    images, labels = sample_classes(dit, classes, args.per_class, steps=args.steps, cfg_scale=args.cfg_scale,
                                    sampler=args.sampler, seed=args.seed, decode=decoder_for(dit_meta))
    preds = classify_images(classifier, images, cls_meta)
    hit = (preds == labels).float()
    per_class = {c: hit[labels == c].mean().item() for c in classes}
    result = {"samples": len(labels), "steps": args.steps, "cfg_scale": args.cfg_scale, "sampler": args.sampler,
              "dit_step": dit_meta.get("step"), "agreement": hit.mean().item(), "per_class": per_class}
    if dit_meta.get("data", {}).get("dataset") == "digits" and not dit_meta["data"].get("autoencoder"):
        real, real_labels, _ = load_images("digits", dit.cfg.img_size, dit.cfg.in_chans, split="val")
        result["classifier_val_accuracy"] = (classify_images(classifier, real, cls_meta) == real_labels).float() \
            .mean().item()
    print(f"DiT step {result['dit_step']}, {args.steps} {args.sampler} steps, cfg {args.cfg_scale}: "
          f"{100 * result['agreement']:.1f}% of {len(labels)} samples classified as their conditioning class")
    print("per class: " + "  ".join(f"{c}:{100 * v:.0f}%" for c, v in per_class.items()))
    if "classifier_val_accuracy" in result:
        print(f"classifier on real validation digits: {100 * result['classifier_val_accuracy']:.1f}%")
    if args.grid:
        keep = torch.cat([torch.nonzero(labels == c).flatten()[:10] for c in classes])
        save_grid(images[keep], args.grid, ncol=min(10, args.per_class))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
