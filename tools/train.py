"""Train (or fine-tune) an image classifier.

    python tools/train.py --config configs/digits_demo.yaml
    python tools/train.py --dataset folder --data-dir /data/pets --model linhier_tiny_224 \
        --pretrained-path weights.safetensors --img-size 224 --epochs 30 --amp bf16
    torchrun --nproc_per_node 2 tools/train.py --config configs/digits_demo.yaml

A resumed run (--resume RUN_FOLDER, its last/ or a file in it) takes its saved config.yaml as defaults, so the
folder alone is enough; --resume FILE.pth.tar starts a new run from a timm train.py checkpoint (weights,
optimizer, EMA, epoch) with the recipe given on the command line. timm's spellings work: -b, -j, a bare --amp,
--initial-checkpoint, --dataset torch/<name>.
Flags and YAML keys are listed by --help; the run folder (<output>/<experiment>) receives config.yaml,
metrics.jsonl, summary.json and the checkpoints last/ and best/ (load them with linvision.engine.load_model).
"""
import argparse

from linvision.engine.cli import run_cli
from linvision.engine.config import add_config_arg, parse_args
from linvision.engine.train import add_train_args, resume_config, train


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-train: every training flag and --config."""
    parser = argparse.ArgumentParser(prog="linvision-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_config_arg(add_train_args(parser))


def main() -> int:
    parser = build_parser()
    args = parse_args(parser)
    if args.resume:
        args = parse_args(parser, base_config=resume_config(args.resume))
    train(args)
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
