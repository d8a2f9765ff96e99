"""Accuracy of a trained checkpoint at one or several resolutions, behind ``tools/validate.py``.

The same weights are evaluated at every resolution (images resized, then centre-cropped with the
checkpoint's ``crop_pct``). The model is rebuilt for each size: models with RoPE or convolutions run at any
size as they are, a learned absolute position embedding is resampled to the size's grid; a model that cannot
run at a size gets an ``error`` entry for it and the other sizes are still evaluated.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence

from .checkpoint import checkpoint_task, load_model, read_checkpoint_meta, resolve_checkpoint
from .cli import add_amp_arg
from .data import ShardedSampler, build_transform, create_dataset, create_loader
from .distributed import barrier, cleanup, init_distributed
from .evaluate import evaluate
from .factory import check_pretrained, create_model

__all__ = ["add_validate_args", "validate_checkpoint"]


def add_validate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=False, default=None, help="checkpoint or run folder")
    parser.add_argument("--model", default=None,
                        help="with --pretrained instead of --checkpoint: a timm model name whose trained weights "
                             "are evaluated (e.g. mlla_tiny.in1k)")
    parser.add_argument("--pretrained", action="store_true",
                        help="evaluate --model's trained weights, as timm's pretrained=True loads them (downloaded "
                             "once into timm's cache); the data's classes must be the weights' (e.g. ImageNet's)")
    parser.add_argument("--dataset", default=None,
                        help="'folder', 'digits' or a torchvision dataset, as in linvision-train; for a "
                             "segmenter 'folder' or 'mosaic' (default: the dataset the checkpoint was trained on; "
                             "with --pretrained, 'folder')")
    parser.add_argument("--data-dir", default=None,
                        help="folder with the val/ class sub-folders (a segmenter's: val/images and val/masks), "
                             "or a torchvision dataset's root (digits, photos and mosaics need none)")
    parser.add_argument("--img-size", type=int, nargs="+", default=None,
                        help="resolutions to evaluate (default: the training one)")
    parser.add_argument("--batch-size", "-b", type=int, default=64, help="images per batch on each rank")
    parser.add_argument("--workers", "-j", type=int, default=0, help="data-loading worker processes per rank")
    add_amp_arg(parser)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="'auto': CUDA when available, else CPU")
    parser.add_argument("--output", default=None, help="write the JSON results to this file as well")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                        help="progress bars (default: off)")
    return parser


def _check_classes(meta: Dict[str, Any], val_set, checkpoint: str) -> None:
    """ValueError when the data's classes are not the ones the checkpoint was trained on (by name where both
    list names, else by count against the head): its accuracy would be meaningless."""
    trained = list(meta.get("classes") or [])
    data = list(getattr(val_set, "classes", []) or [])
    if trained and data and trained != data:
        missing = [c for c in trained if c not in data]
        extra = [c for c in data if c not in trained]
        raise ValueError(f"dataset: its classes differ from those {checkpoint} was trained on (missing: "
                         f"{missing[:5]}, not trained on: {extra[:5]}); labels would not match")
    if data and len(data) > meta["num_classes"]:
        raise ValueError(f"dataset: {len(data)} classes, but {checkpoint} has a head of {meta['num_classes']}")


def _pretrained_meta(name: str) -> Dict[str, Any]:
    """What validation needs to know of ``name``'s trained weights, from its pretrained cfg (as a checkpoint's
    model.json says it of a trained run)."""
    from timm.models import get_pretrained_cfg

    check_pretrained(name)
    cfg = get_pretrained_cfg(name)
    return {"model": name, "num_classes": cfg.num_classes, "img_size": cfg.input_size[-1], "mean": list(cfg.mean),
            "std": list(cfg.std), "crop_pct": cfg.crop_pct, "classes": [], "dataset": "folder"}


def validate_checkpoint(checkpoint: Optional[str], dataset: Optional[str] = None, data_dir: Optional[str] = None,
                        img_sizes: Optional[Sequence[int]] = None, batch_size: int = 64, workers: int = 0,
                        amp: str = "none", device: str = "auto", progress: bool = False,
                        pretrained: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate ``checkpoint`` (or, with ``pretrained`` naming a model, that model's trained weights as
    ``timm.create_model(pretrained=True)`` loads them) on the validation split at each of ``img_sizes``.

    Returns {"checkpoint", "model", "results": [{"img_size", "top1", "top5", "loss", "count"} or
    {"img_size", "error"}]}; a segmenter's checkpoint (``linvision-train-seg``) is scored by
    :func:`~linvision.engine.seg_validate.validate_segmenter` instead (mIoU and pixel accuracy). Raises
    FileNotFoundError for a missing checkpoint or data folder, ValueError for a model without trained weights.
    Runs under torchrun too (each rank evaluates a shard; the figures are reduced).
    """
    if (checkpoint is None) == (pretrained is None):
        raise ValueError("checkpoint: give a checkpoint (or run folder), or a model name with --pretrained")
    if checkpoint and checkpoint_task(checkpoint) == "segmentation":  # a checkpoint of linvision-train-seg
        from .seg_validate import validate_segmenter

        return validate_segmenter(checkpoint, dataset, data_dir, img_sizes, batch_size, workers, amp, device,
                                  progress)
    info = init_distributed(device)
    try:
        meta = read_checkpoint_meta(resolve_checkpoint(checkpoint)) if checkpoint else _pretrained_meta(pretrained)
        source = checkpoint or f"{pretrained} (trained weights)"
        dataset = dataset or meta.get("dataset", "folder")
        sizes: List[int] = list(img_sizes or [meta["img_size"]])
        results = []
        for size in sizes:
            # built for each size (a fixed position-embedding grid is resampled to it)
            if checkpoint:
                model, _ = load_model(checkpoint, device=str(info.device), img_size=size)
            else:
                if size == sizes[0] and not info.is_main:
                    barrier(info)  # rank 0 fills timm's cache first
                model = create_model(pretrained, img_size=size, pretrained=True).to(info.device).eval()
                if size == sizes[0] and info.is_main:
                    barrier(info)
            transform = build_transform(size, False, meta["mean"], meta["std"], crop_pct=meta.get("crop_pct", 1.0))
            val_set = create_dataset(dataset, data_dir, "val", transform=transform, digits_size=size)
            _check_classes(meta, val_set, source)
            sampler = ShardedSampler(len(val_set), info.rank, info.world_size, shuffle=False)
            loader = create_loader(val_set, batch_size, sampler, workers)
            try:
                res = evaluate(model, loader, info, amp=amp, progress=progress)
            except (RuntimeError, ValueError, AssertionError) as e:  # a model tied to one input size
                res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
            results.append({"img_size": size, **res})
        barrier(info)
        return {"checkpoint": checkpoint or "pretrained", "model": meta["model"], "train_img_size": meta["img_size"],
                "results": results}
    finally:
        cleanup(info)
