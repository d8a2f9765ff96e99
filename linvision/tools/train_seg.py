r"""Train a semantic segmenter: a timm backbone (linvision's MLLA, RAVLT, linhier, linvit) as the encoder of
segmentation_models_pytorch's Unet, FPN, Segformer, UPerNet or DPT, on image/mask folders or the offline mosaics.

Fine-tune from the encoder's trained weights (MLLA's and RAVLT's: the authors' ImageNet-1k, downloaded once):

    linvision-train-seg --encoder mlla_tiny.in1k --pretrained --decoder upernet --data-dir /data/scenes \
        --img-size 512 --epochs 40 --amp

More:

    linvision-train-seg --dataset mosaic --mosaic-size 128 --img-size 96 --encoder linhier_delta_femto_224 \
        --epochs 5 -b 8 --lr 1e-3                          # offline texture mosaics, nothing to download
    linvision-train-seg --encoder ravlt_small --pretrained-path RAVLT_S.pth --decoder segformer \
        --data-dir /data/scenes --num-classes 21            # encoder weights from a local file
    linvision-train-seg --dataset mosaic --encoder linvit_small_patch16_rope_224 --decoder dpt --img-size 256
    torchrun --nproc_per_node 2 -m linvision.tools.train_seg --dataset mosaic --encoder mlla_tiny   # DDP
    linvision-train-seg --resume output/unet-mlla_tiny-20250101-120000 --epochs 20   # continue a run

--dataset folder reads <data-dir>/train/images/NAME.png with <data-dir>/train/masks/NAME.png, and val/ alike:
masks are 8-bit PNGs of class indices, --ignore-index (255) for unlabelled pixels, and <data-dir>/dataset.json
(as linvision.data.mosaic writes it) names the classes, else --num-classes gives their number.
Training crops are random resized crops of --img-size px, flipped, the same for the image and its mask;
validation runs on the whole images, and mIoU over the whole validation set picks best/. A resumed run (--resume
with its run folder, its last/ or a file in it) takes its saved config.yaml as defaults, so the folder alone is
enough. Every flag is also a key of a --config YAML file (img_size or img-size); the command line wins. The run
folder <output>/<experiment> receives config.yaml, metrics.jsonl (val_miou, val_pixel_acc, val_loss per
epoch), summary.json and the checkpoints last/ and best/ (load them with
linvision.training.segmenter.load_segmenter). Needs segmentation_models_pytorch: pip install "linvision[seg]".
"""
import argparse

from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.config import add_config_arg, parse_args
from linvision.utils.threads import set_threads
from linvision.training.resume import resume_config
from linvision.training.seg_config import add_seg_train_args


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-train-seg: every segmentation training flag and --config."""
    parser = tool_parser("linvision-train-seg", __doc__)
    return add_config_arg(add_threads_arg(add_seg_train_args(parser)))


def main() -> int:
    from linvision.training.seg_task import train_segmentation

    parser = build_parser()
    args = parse_args(parser)
    if args.resume:
        args = parse_args(parser, base_config=resume_config(args.resume))
    print(set_threads(args.threads), flush=True)
    train_segmentation(args)
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
