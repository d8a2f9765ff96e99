"""Images for the diffusion trainer, as tensors in [-1, 1].

The digits data is :class:`linvision.data.datasets.DigitsDataset` (the same 8x8 upscaling the classification
tool uses), kept as one grey channel; an image folder (``<root>/<class>/*``) is resized and centre-cropped,
image by image when a batch asks for it (:class:`ImageSet`) or all at once (:func:`load_images`).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["ImageSet", "load_images", "CaptionEmbeddings"]


def _digits_tensors(img_size: int, split: str) -> Tuple[Tensor, Tensor]:
    from linvision.data.datasets import DigitsDataset

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

    def preload(self, max_bytes: int = 2 ** 30) -> bool:
        """Hold all images in memory when they take at most ``max_bytes`` (a small folder is then decoded once
        instead of at every batch); returns whether they are held."""
        if self._tensor is None:
            first = self.images([0])
            if len(self) * first.numel() * first.element_size() > max_bytes:
                return False
            self._tensor = self.images(range(len(self)))
        return True

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


class CaptionEmbeddings:
    """A safetensors file of caption embeddings, one per image: ``context`` (N, L, C') and ``mask`` (N, L),
    read row by row from the memory-mapped file (``rows(indices)`` -> context fp32, mask bool), so the file
    need not fit in memory. FileNotFoundError / ValueError in one line naming the file, the tensor and the
    shape expected (``count`` images, ``channels`` C' when given)."""

    def __init__(self, path: str, count: Optional[int] = None, channels: Optional[int] = None):
        from safetensors import safe_open

        try:
            f = safe_open(path, framework="pt")
        except FileNotFoundError:
            raise FileNotFoundError(f"captions: file not found: {path}") from None
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise ValueError(f"captions: cannot read {path} ({str(e).strip()[:200]})") from None
        if not {"context", "mask"} <= set(f.keys()):
            raise ValueError(f"captions: {path} needs tensors 'context' and 'mask', has {sorted(f.keys())}")
        self._context, self._mask = f.get_slice("context"), f.get_slice("mask")
        shape, mask_shape = tuple(self._context.get_shape()), tuple(self._mask.get_shape())
        if len(shape) != 3 or (count is not None and shape[0] != count) or (channels and shape[2] != channels):
            want = f"({count if count is not None else 'N'}, L, {channels or 'C'})"
            raise ValueError(f"captions: 'context' in {path} has shape {shape}; expected {want}"
                             f"{f' for {count} training images' if count is not None else ''}")
        if mask_shape != shape[:2]:
            raise ValueError(f"captions: 'mask' in {path} has shape {mask_shape}; expected {shape[:2]}")
        self.path, self.count = path, shape[0]

    def __len__(self) -> int:
        return self.count

    def rows(self, indices) -> Tuple[Tensor, Tensor]:
        """(context (len, L, C') fp32, mask (len, L) bool) of the captions at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).tolist()
        context = torch.cat([self._context[i:i + 1] for i in idx]).float()
        mask = torch.cat([self._mask[i:i + 1] for i in idx]).bool()
        return context, mask
