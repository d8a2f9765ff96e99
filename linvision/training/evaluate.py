"""Top-1 / top-5 accuracy and cross-entropy of a classifier over a loader, exact across ranks."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from linvision.utils.amp import autocast
from linvision.utils.distributed import DistInfo, all_reduce_sum

__all__ = ["evaluate", "to_device"]


def to_device(images, device: torch.device):
    """A batch of images (a tensor, or timm's NaFlex dict of patches, patch_coord and patch_valid) on
    ``device``."""
    if isinstance(images, dict):
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in images.items()}
    return images.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, loader, info: Optional[DistInfo] = None, amp: str = "none",
             channels_last: bool = False, progress: bool = False,
             dtype: Optional[torch.dtype] = None) -> Dict[str, float]:
    """Accuracy (percent) and mean cross-entropy of ``model`` on ``loader``; ``dtype``: the images cast to it (a
    model in bf16 or fp16 weights).

    Each rank evaluates its shard; sums of correct predictions, losses and counts are reduced over ranks, so
    the figures are those of the whole set (the sharding repeats no sample). Returns
    {"top1", "top5", "loss", "count"}.
    """
    from tqdm import tqdm

    info = info or DistInfo()
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # correct@1, correct@5, loss sum, count
    for images, targets in tqdm(loader, desc="eval", leave=False, disable=not (progress and info.is_main)):
        images, targets = to_device(images, info.device), targets.to(info.device)
        if channels_last and not isinstance(images, dict):
            images = images.contiguous(memory_format=torch.channels_last)
        if dtype is not None and not isinstance(images, dict):
            images = images.to(dtype)
        with autocast(info.device, amp):
            logits = model(images)
        logits = logits.float()
        k = min(5, logits.shape[-1])
        top = logits.topk(k, dim=-1).indices  # (B, k)
        hit = top == targets[:, None]
        sums += torch.tensor([hit[:, 0].sum().item(), hit.any(-1).sum().item(),
                              F.cross_entropy(logits, targets, reduction="sum").item(), len(targets)],
                             dtype=torch.float64)
    sums = all_reduce_sum(sums, info)
    count = max(sums[3].item(), 1.0)
    return {"top1": 100.0 * sums[0].item() / count, "top5": 100.0 * sums[1].item() / count,
            "loss": sums[2].item() / count, "count": int(sums[3].item())}
