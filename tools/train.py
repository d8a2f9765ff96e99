"""Train (or fine-tune) an image classifier.

    python tools/train.py --config configs/digits_demo.yaml
    python tools/train.py --dataset folder --data-dir /data/pets --model linhier_tiny_224 \
        --pretrained-path weights.safetensors --img-size 224 --epochs 30 --amp bf16
    torchrun --nproc_per_node 2 tools/train.py --config configs/digits_demo.yaml

Flags and YAML keys are listed by --help; the run folder (<output>/<experiment>) receives config.yaml,
metrics.jsonl, summary.json and the checkpoints last/ and best/ (load them with linvision.engine.load_model).
"""
import argparse

from linvision.engine.cli import run_cli
from linvision.engine.config import parse_args
from linvision.engine.train import add_train_args, train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = parse_args(add_train_args(parser))
    train(args)
    return 0


if __name__ == "__main__":
    run_cli(main)
