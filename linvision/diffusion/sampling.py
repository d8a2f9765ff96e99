"""Class-conditional sampling helpers for the tools: per-class batches with a fixed seed, PNG grids."""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from linvision.utils.files import atomic_write

from .flow import caption_condition, sample_flow
from .model import LinDiT

__all__ = ["decoder_for", "sample_classes", "sample_captions", "to_unit_range", "save_grid", "classify_images"]


def decoder_for(meta: dict, device: str = "cpu") -> Optional[Callable[[Tensor], Tensor]]:
    """The latent decoder of a checkpoint trained on an autoencoder's latents (model.json's
    ``data.autoencoder``), None for one trained on images."""
    path = meta.get("data", {}).get("autoencoder")
    if not path:
        return None
    from .latents import decode_latents, load_autoencoder

    ae = load_autoencoder(path, device)
    return lambda z: decode_latents(ae, z)


@torch.no_grad()
def _sample_batches(model: LinDiT, cond: Dict[str, Tensor], steps: int, cfg_scale: float, sampler: str,
                    shift: float, seed: int, batch_size: int, decode: Optional[Callable[[Tensor], Tensor]]) -> Tensor:
    """One sample per row of the condition tensors, in batches; all noise drawn first from one CPU generator."""
    device = next(model.parameters()).device
    cfg = model.cfg
    shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
    count = len(next(iter(cond.values())))
    noise = torch.randn((count, *shape), generator=torch.Generator().manual_seed(seed))
    out = []
    for start in range(0, count, batch_size):
        part = {k: v[start:start + batch_size].to(device) for k, v in cond.items()}
        x = sample_flow(model, part.get("y"), shape, steps=steps, cfg_scale=cfg_scale, sampler=sampler, shift=shift,
                        noise=noise[start:start + batch_size].to(device), context=part.get("context"),
                        context_mask=part.get("context_mask"))
        out.append((decode(x) if decode is not None else x).cpu())
    return torch.cat(out).clamp(-1.0, 1.0)


def sample_classes(
    model: LinDiT, classes: Sequence[int], per_class: int, steps: int = 20, cfg_scale: float = 3.0,
    sampler: str = "euler", shift: float = 1.0, seed: int = 0, batch_size: int = 256,
    decode: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """``per_class`` samples of each class, class by class: (images (K, C, H, W) fp32 in [-1, 1] (clamped),
    labels (K,) int64) with K = len(classes) * per_class. ``decode`` maps the model's samples to images (a
    latent model's autoencoder; :func:`decoder_for`).

    All noise comes from one CPU generator seeded with ``seed``, drawn before any model call, so a given
    (seed, classes, per_class, batch_size) gives the same samples on every run.
    """
    labels = torch.tensor([c for c in classes for _ in range(per_class)], dtype=torch.int64)
    images = _sample_batches(model, {"y": labels}, steps, cfg_scale, sampler, shift, seed, batch_size, decode)
    return images, labels


def sample_captions(
    model: LinDiT, context: Tensor, context_mask: Optional[Tensor] = None, steps: int = 20, cfg_scale: float = 3.0,
    sampler: str = "euler", shift: float = 1.0, seed: int = 0, batch_size: int = 256,
    decode: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """One sample per caption embedding (context (K, L, C'), mask (K, L)) of a caption model, as
    :func:`sample_classes` does for labels (same noise rule; the unconditional half of guidance is the caption
    all padded): images (K, C, H, W) fp32 in [-1, 1] (clamped)."""
    cond = caption_condition(context, context_mask)
    return _sample_batches(model, cond, steps, cfg_scale, sampler, shift, seed, batch_size, decode)


def to_unit_range(images: Tensor) -> Tensor:
    """[-1, 1] -> [0, 1]."""
    return (images.clamp(-1.0, 1.0) + 1.0) / 2.0


def save_grid(images: Tensor, path: str, ncol: int) -> None:
    """Write images (K, C, H, W) in [-1, 1] as one PNG grid with ``ncol`` columns (atomically)."""
    from torchvision.utils import save_image

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda p: save_image(to_unit_range(images), p, nrow=ncol, padding=2, format="png"))


@torch.no_grad()
def classify_images(classifier: torch.nn.Module, images: Tensor, meta: dict, batch_size: int = 256) -> Tensor:
    """Predicted classes (K,) of images (K, C, H, W) in [-1, 1] by a classifier of
    :func:`linvision.load_model`: grey images are repeated to the classifier's channels, resized
    (bilinear) to its ``img_size`` when they differ, and normalised with its ``mean`` / ``std``."""
    device = next(classifier.parameters()).device
    x = to_unit_range(images)
    in_chans = meta.get("in_chans", 3)
    if x.shape[1] == 1 and in_chans != 1:
        x = x.expand(-1, in_chans, -1, -1)
    size = meta.get("img_size")
    if size and tuple(x.shape[-2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    mean = torch.tensor(meta["mean"], dtype=x.dtype).view(1, -1, 1, 1)
    std = torch.tensor(meta["std"], dtype=x.dtype).view(1, -1, 1, 1)
    x = (x - mean) / std
    preds = [classifier(x[i:i + batch_size].to(device)).argmax(-1).cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(preds)
