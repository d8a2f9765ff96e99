r"""Train or fine-tune an image classifier: any timm model, on a folder of images or a torchvision dataset.

Fine-tune from trained weights (MLLA's and RAVLT's are the authors' ImageNet-1k weights, downloaded once):

    linvision-train --config finetune_mlla_tiny --data-dir /data/pets        # the recipe of the shipped config
    linvision-train --model mlla_tiny --pretrained --dataset folder --data-dir /data/pets --img-size 224 \
        --epochs 30 --amp

More:

    linvision-train --config digits_demo                  # offline digits, about 15 s on a CPU
    linvision-train --model ravlt_small --pretrained-path RAVLT_S.pth --dataset folder --data-dir /data/pets \
        --img-size 224 --epochs 30 --amp                   # weights from a local file
    torchrun --nproc_per_node 2 -m linvision.tools.train --config digits_demo      # DDP, 2 processes
    linvision-train --resume output/digits_demo --epochs 10                         # continue a run

--dataset folder reads <data-dir>/train/<class>/ and <data-dir>/val/<class>/. A resumed run (--resume with
its run folder, its last/ or a file in it) takes its saved config.yaml as defaults, so the folder alone is
enough; --resume FILE.pth.tar starts a new run from a timm train.py checkpoint (weights, optimizer, EMA, epoch)
with the recipe given on the command line. timm's spellings work: -b, -j, a bare --amp (bf16),
--initial-checkpoint, --dataset torch/<name>. Every flag is also a key of a --config YAML file (img_size or
img-size); the command line wins. The run folder <output>/<experiment> receives config.yaml, metrics.jsonl,
summary.json and the checkpoints last/ and best/ (load them with linvision.load_model).
"""
import argparse

from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.config import add_config_arg, parse_args
from linvision.utils.threads import set_threads
from linvision.training.train import add_train_args, resume_config, train


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-train: every training flag and --config."""
    parser = tool_parser("linvision-train", __doc__)
    add_threads_arg(add_train_args(parser))
    return add_config_arg(parser)


def main() -> int:
    parser = build_parser()
    args = parse_args(parser)
    if args.resume:
        args = parse_args(parser, base_config=resume_config(args.resume))
    set_threads(args.threads)  # said in the run's opening line
    train(args)
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
