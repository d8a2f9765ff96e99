r"""Linearize a trained softmax ViT: build a linvit from its weights and run attention transfer (stage 1).

    linvision-linearize --config linearize_digits            # the digits example of the manual, 200 steps
    linvision-linearize --teacher output/vit_digits --model linvit_tiny_patch16_rope_224 \
        --model-kwargs patch_size=4 embed_dim=64 depth=4 num_heads=2 --dataset digits --img-size 32 \
        --steps 200 --output output/linearized.safetensors

The teacher is a checkpoint or run folder of linvision-train (a timm VisionTransformer or a linvit with the
softmax mixer). The student's weights (safetensors) go to --output; stage 2 fine-tunes them on the target data
(the same --model and --model-kwargs in linvision-train, with --initial-checkpoint naming the student's file):

    linvision-train --config linearize_digits_student --initial-checkpoint output/linearized_digits.safetensors

Prints JSON with the per-layer attention-output error (relative mean squared error on held-out images) before
and after stage 1.
"""
import argparse
import json

import torch
from safetensors.torch import save_file

from linvision.utils.checkpoint import load_model
from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.threads import set_threads
from linvision.utils.config import add_config_arg, parse_args, parse_kwargs
from linvision.data.datasets import build_transform, create_dataset
from linvision.experiments.linearize import TRANSFER_PARAMS, attention_errors, attention_transfer, build_student


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-linearize, --config included."""
    parser = tool_parser("linvision-linearize", __doc__)
    parser.add_argument("--teacher", default=None, help="checkpoint or run folder of the softmax ViT")
    parser.add_argument("--model", default=None, help="linvit model name of the student")
    parser.add_argument("--model-kwargs", nargs="*", default=None, help="key=value options of the student")
    parser.add_argument("--dataset", default="digits",
                        help="images of the transfer and the error report: 'digits', 'photos', 'photos_fine', "
                             "'photos_scale', 'folder' or a torchvision dataset, as in linvision-train")
    parser.add_argument("--data-dir", default=None,
                        help="folder with train/ and val/ class sub-folders, or a torchvision dataset's root "
                             "(digits and the photo sets need none)")
    parser.add_argument("--img-size", type=int, default=None,
                        help="image side in pixels (default: the teacher's training size)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per transfer step and per held-out batch")
    parser.add_argument("--steps", type=int, default=200, help="attention-transfer steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the attention transfer")
    parser.add_argument("--params", default="new", choices=TRANSFER_PARAMS,
                        help="'new': parameters a softmax ViT lacks (LePE, gate, feature map); 'mixer': all")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the error report")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the student's new parameters and the data order")
    parser.add_argument("--output", default=None, help="student weights (.safetensors)")
    add_threads_arg(parser)
    return add_config_arg(parser)


def main() -> int:
    args = parse_args(build_parser())
    missing = [flag for flag in ("teacher", "model", "output") if not getattr(args, flag)]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required (on the command line or in --config)")
    if args.batch_size < 1 or args.steps < 1 or args.eval_batches < 1:
        raise ValueError(f"batch_size/steps/eval_batches: must be >= 1, got {args.batch_size}, {args.steps}, "
                         f"{args.eval_batches}")
    threads = set_threads(args.threads)  # said in the JSON report: standard output holds it alone
    torch.manual_seed(args.seed)
    teacher, meta = load_model(args.teacher)
    img_size = args.img_size or meta["img_size"]
    if img_size != meta["img_size"]:
        teacher, meta = load_model(args.teacher, img_size=img_size)
    student = build_student(args.model, teacher, img_size, **parse_kwargs(args.model_kwargs))

    transform = build_transform(img_size, False, meta["mean"], meta["std"], crop_pct=1.0)
    train_set = create_dataset(args.dataset, args.data_dir, "train", transform=transform, digits_size=img_size)
    val_set = create_dataset(args.dataset, args.data_dir, "val", transform=transform, digits_size=img_size)
    generator = torch.Generator().manual_seed(args.seed)
    train_loader = torch.utils.data.DataLoader(train_set, args.batch_size, shuffle=True, generator=generator,
                                               drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_set, args.batch_size)
    held_out = [x for _, (x, _) in zip(range(args.eval_batches), val_loader)]

    before = attention_errors(student, teacher, held_out)
    losses = attention_transfer(student, teacher, train_loader, args.steps, args.lr, args.params)
    after = attention_errors(student, teacher, held_out)
    save_file({k: v.contiguous() for k, v in student.state_dict().items()}, args.output)
    print(json.dumps({"teacher": args.teacher, "model": args.model, "img_size": img_size, "params": args.params,
                      "steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1],
                      "layer_error_before": before, "layer_error_after": after, "output": args.output,
                      "threads": threads}, indent=2))
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
