r"""Top-1 / top-5 accuracy and loss of a checkpoint at one or several resolutions, printed as JSON; for a
segmenter's checkpoint (linvision-train-seg), mIoU, pixel accuracy and loss.

    linvision-validate --checkpoint output/digits_demo --img-size 32 64 128     # a run's weights at 3 sizes
    linvision-validate --model mlla_tiny.in1k --pretrained --data-dir /data/imagenet   # published weights
    linvision-validate --checkpoint output/seg_mosaics --img-size 512 1024      # a segmenter at 2 sizes
    linvision-validate --checkpoint output/ft_linvit --naflex-loader --naflex-max-seq-len 1024  # native aspect

--checkpoint takes a run folder (its best/, else last/) or a checkpoint folder; the data, size, interpolation,
crop and normalisation default to the checkpoint's, the data being the dataset and folder its run recorded
(the run folder's config.yaml, else model.json; a line on stderr says which data it used). --model NAME
--pretrained evaluates a model's trained weights as timm's pretrained=True loads them, on data with the weights'
classes (e.g. ImageNet's val/<class>/ folders), with the interpolation, crop and normalisation of their
pretrained config, at its size unless --img-size is given. --interpolation and --crop-pct override either. A
size the model cannot run at is reported as an error entry; the other sizes are still evaluated. --model-kwargs
builds the same weights with other options that keep their shapes, e.g. a RoPE model trained at 96 px (patch 8)
with its positions interpolated to that grid at every size: --model-kwargs '{"mixer_kwargs": {"rope_ref_grid": 12}}'.

A segmenter is scored on the validation split it was trained with (or --dataset/--data-dir): mosaics are
rendered at each --img-size (default: their training size); a folder's val/ images and masks are scored as
they are, or at a size resized alike (masks by nearest neighbour) so that the shorter side is that size.
"""
import argparse
import json

from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.config import add_config_arg, parse_args, parse_kwargs
from linvision.utils.threads import set_threads
from linvision.training.validate import add_validate_args, validate_checkpoint


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-validate: the validation flags and --config."""
    parser = tool_parser("linvision-validate", __doc__)
    return add_config_arg(add_threads_arg(add_validate_args(parser)))


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
    threads = set_threads(args.threads)  # said in the JSON: standard output holds it alone
    out = validate_checkpoint(args.checkpoint, args.dataset, args.data_dir, args.img_size, args.batch_size,
                              args.workers, args.amp, args.device, args.progress,
                              pretrained=args.model if args.pretrained else None,
                              interpolation=args.interpolation, crop_pct=args.crop_pct,
                              naflex_max_seq_len=args.naflex_max_seq_len if args.naflex_loader else None,
                              model_kwargs=parse_kwargs(args.model_kwargs), compile=args.compile,
                              weights=args.weights)
    out["threads"] = threads
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
