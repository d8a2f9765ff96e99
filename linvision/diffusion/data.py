"""Images for the diffusion trainer, as tensors in [-1, 1].

The digits data is :class:`linvision.engine.data.DigitsDataset` (the same 8x8 upscaling the classification
tool uses), kept as one grey channel; an image folder (``<root>/<class>/*``) is resized and centre-cropped,
image by image when a batch asks for it (:class:`ImageSet`) or all at once (:func:`load_images`).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["ImageSet", "load_images"]


def _digits_tensors(img_size: int, split: str) -> Tuple[Tensor, Tensor]:
    from linvision.engine.data import DigitsDataset

    ds = DigitsDataset(split, size=img_size)
    grey = np.stack([np.asarray(img)[:, :, 0] for img in ds.images])  # the RGB channels are equal
    x = torch.from_numpy(grey).float().div(127.5).sub(1.0).unsqueeze(1)  # (B, 1, S, S) in [-1, 1]
    return x, torch.tensor(ds.targets, dtype=torch.int64)


class ImageSet:
    """The images of a dataset, read when asked for: ``images(indices)`` -> (len, in_chans, S, S) fp32 in
    [-1, 1]; ``labels`` (N,) int64 and ``classes`` are known up front.

    dataset: "digits" (1 channel, offline, held in memory) or "folder" (``data_dir/<class>/*``, 1 or 3 channels;
    each image is read from disk, resized and centre-cropped when asked for, so the set may exceed memory).
    Raises ValueError for an unknown dataset or a channel count the data cannot give, FileNotFoundError for a
    missing folder.
    """

    def __init__(self, dataset: str, img_size: int, in_chans: int, data_dir: Optional[str] = None,
                 split: str = "train"):
        self._tensor: Optional[Tensor] = None
        if dataset == "digits":
            if in_chans != 1:
                raise ValueError(f"in_chans: the digits data has 1 channel, got in_chans={in_chans}")
            self._tensor, self.labels = _digits_tensors(img_size, split)
            self.classes = [str(i) for i in range(10)]
        elif dataset == "folder":
            from torchvision import transforms
            from torchvision.datasets import ImageFolder

            if in_chans not in (1, 3):
                raise ValueError(f"in_chans: an image folder gives 1 or 3 channels, got {in_chans}")
            if not data_dir:
                raise ValueError("data_dir: required for dataset 'folder'")
            if not os.path.isdir(data_dir):
                raise FileNotFoundError(f"data_dir: folder not found: {data_dir}")
            tf = [transforms.Resize(img_size), transforms.CenterCrop(img_size)]
            if in_chans == 1:
                tf.append(transforms.Grayscale(1))
            self._folder = ImageFolder(data_dir, transform=transforms.Compose(tf + [transforms.ToTensor()]))
            self.labels = torch.tensor(self._folder.targets, dtype=torch.int64)
            self.classes = list(self._folder.classes)
        else:
            raise ValueError(f"dataset: unknown {dataset!r}; allowed: digits, folder")

    def __len__(self) -> int:
        return len(self.labels)

    def images(self, indices) -> Tensor:
        """The images at ``indices`` (a sequence or 1-D tensor of ints), in that order."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if self._tensor is not None:
            return self._tensor[idx]
        return torch.stack([self._folder[i][0] for i in idx.tolist()]).mul(2.0).sub(1.0)


def load_images(dataset: str, img_size: int, in_chans: int, data_dir: Optional[str] = None,
                split: str = "train") -> Tuple[Tensor, Tensor, List[str]]:
    """(images (B, in_chans, S, S) fp32 in [-1, 1], labels (B,) int64, class names): the whole
    :class:`ImageSet` in memory."""
    data = ImageSet(dataset, img_size, in_chans, data_dir, split)
    return data.images(range(len(data))), data.labels, data.classes
