"""Mean IoU, pixel accuracy and cross-entropy of a segmenter over a loader, exact across ranks.

The statistics are smp's (``segmentation_models_pytorch.metrics``): ``get_stats`` counts each class's true
positive, false positive, false negative and true negative pixels of every image, pixels of the ignore index
left out; the counts are summed over the whole set and over all ranks, then ``iou_score`` (per class) and
``recall`` (micro-averaged: the share of labelled pixels predicted right) turn them into the figures. A class
that neither appears in the masks nor is predicted has no IoU and is left out of the mean. Every score is in
percent, the per-class IoU as well, so mIoU is the mean of the per-class figures.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from linvision.utils.amp import autocast
from linvision.utils.distributed import DistInfo, all_reduce_sum

from .segmenter import import_smp

__all__ = ["evaluate_segmentation", "segmentation_scores"]


def segmentation_scores(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor, tn: torch.Tensor) -> Dict[str, Any]:
    """{"miou", "pixel_acc", "iou" (per class; None for a class without pixels)}, all in percent, of per-class
    pixel counts summed over a set, computed in float64 by smp's metrics; "miou" is the mean of the "iou" that are
    not None."""
    smp = import_smp()
    tp, fp, fn, tn = (t.double() for t in (tp, fp, fn, tn))
    iou = smp.metrics.iou_score(tp, fp, fn, tn, reduction="none", zero_division=math.nan)
    pixel_acc = smp.metrics.recall(tp, fp, fn, tn, reduction="micro")
    return {"miou": 100.0 * torch.nanmean(iou).item(), "pixel_acc": 100.0 * pixel_acc.item(),
            "iou": [None if math.isnan(v) else 100.0 * v for v in iou.tolist()]}


@torch.no_grad()
def evaluate_segmentation(model: nn.Module, loader, num_classes: int, ignore_index: int = 255,
                          info: Optional[DistInfo] = None, amp: str = "none", channels_last: bool = False,
                          progress: bool = False) -> Dict[str, Any]:
    """mIoU, pixel accuracy and per-class IoU (percent) and the mean cross-entropy per labelled pixel of
    ``model`` on ``loader`` (batches of images and int64 masks).

    Each rank evaluates its shard; the pixel counts of every class and the loss sum are reduced over ranks, so
    the figures are those of the whole set. Returns {"miou", "pixel_acc", "loss", "pixels", "iou"}.
    """
    from tqdm import tqdm

    smp = import_smp()
    info = info or DistInfo()
    model.eval()
    counts = torch.zeros(4, num_classes, dtype=torch.float64)  # tp, fp, fn, tn of each class
    sums = torch.zeros(2, dtype=torch.float64)  # loss sum, labelled pixels
    for images, masks in tqdm(loader, desc="eval", leave=False, disable=not (progress and info.is_main)):
        images, masks = images.to(info.device), masks.to(info.device)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(info.device, amp):
            logits = model(images)
        logits = logits.float()
        sums += torch.tensor([F.cross_entropy(logits, masks, ignore_index=ignore_index, reduction="sum").item(),
                              (masks != ignore_index).sum().item()], dtype=torch.float64)
        stats = smp.metrics.get_stats(logits.argmax(1).cpu(), masks.cpu(), mode="multiclass",
                                      num_classes=num_classes, ignore_index=ignore_index)
        counts += torch.stack([s.sum(0) for s in stats]).double()
    total = all_reduce_sum(torch.cat([counts.flatten(), sums]), info)
    counts, sums = total[:-2].view(4, num_classes), total[-2:]
    pixels = sums[1].item()
    return {**segmentation_scores(*counts), "loss": sums[0].item() / max(pixels, 1.0), "pixels": int(pixels)}
