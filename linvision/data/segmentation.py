"""The data of segmentation training: the image/mask sets, the joint transforms of an image and its mask, the check
of every mask against the classes, and the padding that batches validation images of several sizes.

- Sets: ``"folder"`` reads ``data_dir/train|val/images|masks/*.png`` with
  :class:`~linvision.data.mosaic.SegmentationFolder` (masks: 8-bit class indices, the ignore index for
  unlabelled pixels); ``"mosaic"`` is :class:`~linvision.data.mosaic.MosaicSegmentation`, the offline
  texture mosaics (seed 0), with nothing on disk.
- Training samples (:class:`JointTransform` with a crop size): torchvision's ``RandomResizedCrop`` and
  ``RandomHorizontalFlip`` (``transforms.v2``) drawn once and applied to the image and its mask alike, the mask
  resized with nearest neighbour; then the image scaled to [0, 1] and normalised. Validation samples: the whole
  image, normalised.
- Masks (:class:`SegmentationSamples`): a pixel that is neither a class index (0 to num_classes - 1) nor the
  ignore index stops the run with one line naming the mask file.
- Validation batches (:class:`PadCollate`): images padded at the bottom and right to the batch's largest size,
  rounded up to the head's stride, with zeros (the mean colour after normalisation); masks with the ignore index,
  so padding is neither scored nor counted.

The random draws of the transforms come from torch's global RNG, which the trainer's checkpoints hold: a run
resumed with ``workers: 0`` repeats the uninterrupted run's crops.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["segmentation_sets", "JointTransform", "SegmentationSamples", "PadCollate", "MOSAIC_SEED"]

MOSAIC_SEED = 0


def segmentation_sets(dataset: str, data_dir: Optional[str], mosaic_size: int = 512, mosaic_train: int = 1000,
                      mosaic_val: int = 200) -> Tuple[Dataset, Dataset, List[str]]:
    """(training set, validation set, class names) of ``dataset`` ("folder" or "mosaic"); the sets return PIL
    pairs (:func:`pil_pair`) for :class:`SegmentationSamples` to transform. The class names are those of
    ``dataset.json`` for a folder (empty without one).

    Raises ValueError for another dataset or a folder set without ``data_dir``, FileNotFoundError for a missing
    folder, split or mask.
    """
    from .mosaic import MosaicSegmentation, SegmentationFolder

    if dataset == "mosaic":
        train = MosaicSegmentation("train", mosaic_size, mosaic_train, seed=MOSAIC_SEED, transform=pil_pair)
        val = MosaicSegmentation("val", mosaic_size, mosaic_val, seed=MOSAIC_SEED, transform=pil_pair)
        return train, val, list(train.classes)
    if dataset != "folder":
        raise ValueError(f"dataset: expected 'folder' or 'mosaic', got {dataset!r}")
    if not data_dir:
        raise ValueError("data_dir: required for dataset 'folder' (train/ and val/ with images/ and masks/); "
                         "'mosaic' needs none")
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data_dir: folder not found: {data_dir}")
    train = SegmentationFolder(data_dir, "train", transform=pil_pair)
    val = SegmentationFolder(data_dir, "val", transform=pil_pair)
    if train.classes and val.classes and train.classes != val.classes:
        raise ValueError(f"dataset: the classes of {data_dir}/dataset.json differ between the splits")
    return train, val, list(train.classes)


def pil_pair(image, mask):
    """The transform that leaves a sample as its (image, mask) PIL pair."""
    return image, mask


class JointTransform:
    """(RGB PIL image, mask as a PIL image or an array) -> (float32 (3, H, W) normalised by ``mean`` and ``std``,
    int64 (H, W) class indices).

    With ``crop`` (the training transform): a random resized crop of ``crop`` x ``crop`` px (area fraction in
    ``scale``, aspect ratio 3/4 to 4/3) and a horizontal flip with probability ``hflip``, the same for the image
    and the mask (torchvision's ``transforms.v2`` on an ``Image`` and a ``Mask``: bilinear with antialiasing for
    the image, nearest neighbour for the mask). Without it, the whole image; with ``resize``, the whole image and
    its mask resized alike so that the shorter side is ``resize`` px (evaluation at another scale).
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], crop: Optional[int] = None,
                 scale: Sequence[float] = (0.25, 1.0), hflip: float = 0.5,
                 ratio: Tuple[float, float] = (3 / 4, 4 / 3), resize: Optional[int] = None):
        from torchvision import tv_tensors
        from torchvision.transforms import v2

        if crop and resize:
            raise ValueError("JointTransform: crop (training) and resize (evaluation) exclude each other")
        ops = [v2.Resize(resize, antialias=True)] if resize else []
        if crop:
            ops.append(v2.RandomResizedCrop(crop, scale=tuple(scale), ratio=tuple(ratio), antialias=True))
            if hflip > 0:
                ops.append(v2.RandomHorizontalFlip(hflip))
        ops += [v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
                v2.Normalize(list(mean), list(std))]
        self.ops = v2.Compose(ops)

    def __call__(self, image, mask) -> Tuple[torch.Tensor, torch.Tensor]:
        from torchvision import tv_tensors

        x = tv_tensors.Image(torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1))
        m = tv_tensors.Mask(torch.from_numpy(np.array(mask, dtype=np.uint8)))
        x, m = self.ops(x, m)
        return x.as_subclass(torch.Tensor).contiguous(), m.as_subclass(torch.Tensor).long()


class SegmentationSamples(Dataset):
    """The samples of ``dataset`` (a set of :func:`segmentation_sets`) through ``transform``, each mask checked
    first: a value that is neither a class index below ``num_classes`` nor ``ignore_index`` is a ValueError
    naming the mask."""

    def __init__(self, dataset: Dataset, num_classes: int, ignore_index: int, transform):
        self.dataset, self.num_classes, self.ignore_index, self.transform = dataset, num_classes, ignore_index, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def _name(self, index: int) -> str:
        names = getattr(self.dataset, "names", None)
        if names is not None:  # SegmentationFolder
            return os.path.join(self.dataset.masks_dir, os.path.splitext(names[index])[0] + ".png")
        return f"the mask of {getattr(self.dataset, 'split', 'the')} mosaic {index}"

    def __getitem__(self, index: int):
        image, mask = self.dataset[index]
        counts = np.bincount(np.asarray(mask, dtype=np.uint8).ravel(), minlength=256)
        present = np.flatnonzero(counts)
        bad = present[(present >= self.num_classes) & (present != self.ignore_index)]
        if bad.size:
            raise ValueError(f"mask: {self._name(index)} holds the value {int(bad[0])} ({int(counts[bad].sum())} "
                             f"pixels), neither a class index (0 to {self.num_classes - 1} for num_classes "
                             f"{self.num_classes}) nor the ignore index {self.ignore_index}")
        return self.transform(image, mask)


class PadCollate:
    """Batch samples of several sizes: each image padded at the bottom and right with zeros and each mask with
    ``ignore_index`` to the batch's largest height and width, rounded up to a multiple of ``multiple``."""

    def __init__(self, ignore_index: int, multiple: int = 32):
        self.ignore_index, self.multiple = ignore_index, multiple

    def __call__(self, batch):
        images, masks = zip(*batch)
        height = math.ceil(max(x.shape[-2] for x in images) / self.multiple) * self.multiple
        width = math.ceil(max(x.shape[-1] for x in images) / self.multiple) * self.multiple
        x = images[0].new_zeros((len(images), images[0].shape[0], height, width))
        m = masks[0].new_full((len(masks), height, width), self.ignore_index)
        for i, (image, mask) in enumerate(batch):
            x[i, :, :image.shape[-2], :image.shape[-1]] = image
            m[i, :mask.shape[-2], :mask.shape[-1]] = mask
        return x, m
