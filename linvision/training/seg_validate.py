"""mIoU and pixel accuracy of a trained segmenter at one or several resolutions, behind ``linvision-validate``
for checkpoints of ``linvision-train-seg``.

The same weights are scored at every size on the validation split of the data they were trained on, or of
``data_dir``:

- ``"mosaic"``: the validation mosaics rendered at each size (the same layouts at a finer or coarser
  resolution: every region covers the same share of the image);
- ``"folder"``: the ``val/`` images and masks of ``data_dir`` as they are, or, at a size, each image and its
  mask resized alike (the mask by nearest neighbour) so that the shorter side is that size.

Masks are checked against the checkpoint's classes and the ignore index; padding to the head's stride is not
scored. A size the segmenter cannot run at gets an ``error`` entry and the other sizes are still scored.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

from linvision.data.datasets import ShardedSampler, create_loader
from linvision.data.run_data import run_data
from linvision.data.segmentation import MOSAIC_SEED, JointTransform, PadCollate, SegmentationSamples, pil_pair
from linvision.utils.distributed import cleanup, init_distributed

from .seg_metrics import evaluate_segmentation
from .segmenter import STRIDE, load_segmenter

__all__ = ["validate_segmenter", "DEFAULT_MOSAIC_VAL"]

DEFAULT_MOSAIC_VAL = 200  # validation mosaics of a checkpoint that does not record how many it was scored on


def _validation_set(dataset: str, data_dir: Optional[str], size: Optional[int], meta: Dict[str, Any],
                    mosaic_val: Optional[int]):
    """The raw validation set of ``dataset`` at ``size`` (mosaics rendered at it; a folder's images as they are,
    the resizing left to the transform) and the resize the transform applies."""
    from linvision.data.mosaic import MosaicSegmentation, SegmentationFolder

    if dataset == "mosaic":
        count = mosaic_val or meta.get("mosaic_val") or DEFAULT_MOSAIC_VAL
        size = size or meta.get("mosaic_size") or meta["img_size"]
        return MosaicSegmentation("val", size, count, seed=MOSAIC_SEED, transform=pil_pair), None
    if dataset != "folder":
        raise ValueError(f"dataset: a segmenter is scored on 'folder' or 'mosaic' data, got {dataset!r}")
    if not data_dir:
        raise ValueError("data_dir: required for dataset 'folder' (the val/ images/ and masks/ to score on)")
    val = SegmentationFolder(data_dir, "val", transform=pil_pair)
    trained = list(meta.get("classes") or [])
    if val.classes and trained and val.classes != trained:
        raise ValueError(f"dataset: the classes of {data_dir}/dataset.json differ from those the checkpoint was "
                         f"trained on ({trained[:5]}...); labels would not match")
    return val, size


def validate_segmenter(checkpoint: str, dataset: Optional[str] = None, data_dir: Optional[str] = None,
                       img_sizes: Optional[Sequence[Optional[int]]] = None, batch_size: int = 8, workers: int = 0,
                       amp: str = "none", device: str = "auto", progress: bool = False,
                       mosaic_val: Optional[int] = None) -> Dict[str, Any]:
    """Score the segmenter of ``checkpoint`` (a checkpoint folder of ``linvision-train-seg``, or its run folder:
    best/, else last/) at each of ``img_sizes``.

    ``dataset`` and ``data_dir`` default to those its run recorded (:func:`~linvision.data.run_data.run_data`:
    the run folder's config.yaml, else model.json), a one-line note on stderr saying which data it scores on;
    ``img_sizes`` default to the mosaics' training size, or a folder's images as they are (``None`` in the list
    means that too). ``mosaic_val``: how many validation mosaics (default: as many as the run scored on).

    Returns {"checkpoint", "task": "segmentation", "model", "train_img_size", "dataset", "results": [{"img_size",
    "miou", "pixel_acc", "loss", "pixels", "iou"} or {"img_size", "error"}]}, mIoU, pixel accuracy and the
    per-class IoU in percent.
    Raises FileNotFoundError for a missing checkpoint or data, ValueError for a checkpoint that holds no segmenter
    or data that does not fit it. Runs under torchrun too (each rank scores a shard; the counts are reduced).
    """
    info = init_distributed(device)
    try:
        model, meta = load_segmenter(checkpoint, device=str(info.device))
        # what is not given, as the run recorded it (its config.yaml, else model.json)
        dataset, data_dir, note = run_data(checkpoint, meta, dataset, data_dir)
        sizes: List[Optional[int]] = list(img_sizes or [None])
        collate = PadCollate(meta["ignore_index"], STRIDE[meta["decoder"]])
        results = []
        for size in sizes:
            raw, resize = _validation_set(dataset, data_dir, size, meta, mosaic_val)
            if note and info.is_main:
                print(note, file=sys.stderr, flush=True)
                note = None
            samples = SegmentationSamples(raw, meta["num_classes"], meta["ignore_index"],
                                          JointTransform(meta["mean"], meta["std"], resize=resize))
            sampler = ShardedSampler(len(samples), info.rank, info.world_size, shuffle=False)
            loader = create_loader(samples, batch_size, sampler, workers)
            loader.collate_fn = collate
            label = size if size or dataset == "folder" else raw.size
            try:
                scores = evaluate_segmentation(model, loader, meta["num_classes"], meta["ignore_index"], info, amp,
                                               progress=progress)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a size the segmenter cannot run at
                results.append({"img_size": label, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"})
                continue
            results.append({"img_size": label, **scores})
        return {"checkpoint": checkpoint, "task": "segmentation", "model": f"{meta['decoder']} on {meta['encoder']}",
                "train_img_size": meta["img_size"], "dataset": dataset, "results": results}
    finally:
        cleanup(info)
