"""Top-1 / top-5 accuracy and loss of a checkpoint at one or several resolutions, printed as JSON.

    python tools/validate.py --checkpoint output/digits_demo --img-size 32 64 128
"""
import argparse
import json

from linvision.engine.cli import run_cli
from linvision.engine.config import add_config_arg, parse_args
from linvision.engine.validate import add_validate_args, validate_checkpoint


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-validate: the validation flags and --config."""
    parser = argparse.ArgumentParser(prog="linvision-validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_config_arg(add_validate_args(parser))


def main() -> int:
    args = parse_args(build_parser())
    if bool(args.checkpoint) == bool(args.pretrained):
        raise ValueError("checkpoint: give --checkpoint FOLDER (a checkpoint or run folder), or --model NAME "
                         "--pretrained (the model's trained weights)")
    if args.pretrained and not args.model:
        raise ValueError("model: --pretrained needs --model NAME (e.g. mlla_tiny.in1k)")
    if args.model and not args.pretrained:
        raise ValueError("model: --model is for --pretrained; a checkpoint names its own model")
    if args.batch_size < 1 or args.workers < 0 or any(s < 1 for s in args.img_size or []):
        raise ValueError(f"batch_size/workers/img_size: need batch_size >= 1, workers >= 0 and sizes >= 1, got "
                         f"{args.batch_size}, {args.workers}, {args.img_size}")
    out = validate_checkpoint(args.checkpoint, args.dataset, args.data_dir, args.img_size, args.batch_size,
                              args.workers, args.amp, args.device, args.progress,
                              pretrained=args.model if args.pretrained else None)
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
