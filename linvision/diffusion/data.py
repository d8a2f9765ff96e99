"""Images for the diffusion trainer, as tensors in [-1, 1] held in memory.

The digits data is :class:`linvision.engine.data.DigitsDataset` (the same 8x8 upscaling the classification
tool uses), kept as one grey channel; an image folder (``<root>/<class>/*``) is resized, centre-cropped and held
in memory, which suits the small data sets a CPU run can use.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["load_images"]


def _digits_tensors(img_size: int, split: str) -> Tuple[Tensor, Tensor]:
    from linvision.engine.data import DigitsDataset

    ds = DigitsDataset(split, size=img_size)
    grey = np.stack([np.asarray(img)[:, :, 0] for img in ds.images])  # the RGB channels are equal
    x = torch.from_numpy(grey).float().div(127.5).sub(1.0).unsqueeze(1)  # (B, 1, S, S) in [-1, 1]
    return x, torch.tensor(ds.targets, dtype=torch.int64)


def _folder_tensors(root: str, img_size: int, in_chans: int) -> Tuple[Tensor, Tensor, List[str]]:
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    if not os.path.isdir(root):
        raise FileNotFoundError(f"data_dir: folder not found: {root}")
    tf = [transforms.Resize(img_size), transforms.CenterCrop(img_size)]
    if in_chans == 1:
        tf.append(transforms.Grayscale(1))
    ds = ImageFolder(root, transform=transforms.Compose(tf + [transforms.ToTensor()]))
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(xs).mul(2.0).sub(1.0), torch.tensor(ys, dtype=torch.int64), list(ds.classes)


def load_images(dataset: str, img_size: int, in_chans: int, data_dir: Optional[str] = None,
                split: str = "train") -> Tuple[Tensor, Tensor, List[str]]:
    """(images (B, in_chans, S, S) fp32 in [-1, 1], labels (B,) int64, class names).

    dataset: "digits" (1 channel, offline) or "folder" (``data_dir/<class>/*``, 1 or 3 channels).
    Raises ValueError for an unknown dataset or a channel count the data cannot give, FileNotFoundError for a
    missing folder.
    """
    if dataset == "digits":
        if in_chans != 1:
            raise ValueError(f"in_chans: the digits data has 1 channel, got in_chans={in_chans}")
        x, y = _digits_tensors(img_size, split)
        return x, y, [str(i) for i in range(10)]
    if dataset == "folder":
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans: an image folder gives 1 or 3 channels, got {in_chans}")
        if not data_dir:
            raise ValueError("data_dir: required for dataset 'folder'")
        return _folder_tensors(data_dir, img_size, in_chans)
    raise ValueError(f"dataset: unknown {dataset!r}; allowed: digits, folder")
