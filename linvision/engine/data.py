"""Datasets and loaders for the tools: image folders, torchvision datasets on disk, and offline digits.

Four sources, chosen by ``dataset``:
- ``"folder"``: ``data_dir/train/<class>/*.png`` and ``data_dir/val/<class>/*`` (``val`` may be named
  ``validation``), read with torchvision's ImageFolder;
- ``"torch/name"`` (timm's spelling, e.g. ``torch/cifar10``) or ``"torchvision/NAME"`` (e.g.
  ``torchvision/CIFAR10``): a torchvision dataset already under ``data_dir`` (nothing is downloaded); the name
  is matched without regard to case;
- ``"digits"``: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes, shipped with scikit-learn),
  upscaled to RGB images, split 80/20 with a fixed seed. It needs no file and no network.
- ``"photos"``: 10 classes of crops of the photographs shipped with scikit-image and scikit-learn, training and
  validation crops from disjoint parts of each photograph (:mod:`linvision.engine.texture_data`); offline.

Unreadable images raise :class:`BadImageError` naming the file; 16-bit greyscale images are scaled to 8 bits
(not clipped). Loader worker processes leave the run's process group, so a signal to the group is the
training loop's to handle.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from .in_memory import InMemoryImages

__all__ = [
    "BadImageError", "InMemoryImages", "DigitsDataset", "create_dataset", "ShardedSampler", "create_loader", "build_transform",
]


class BadImageError(ValueError):
    """An image file that cannot be decoded; the message names the file."""


def _to_8bit(img: Image.Image) -> Image.Image:
    """16- and 32-bit integer greyscale (16-bit PNGs open as "I;16" or "I") scaled to 8 bits by the range of
    16-bit data, where PIL's convert would clip every value above 255."""
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        arr = np.asarray(img, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(arr * (255.0 / 65535.0)), 0, 255).astype(np.uint8), mode="L")
    return img


def _load_rgb(path: str) -> Image.Image:
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            img.load()
            return _to_8bit(img).convert("RGB")
    except Exception as e:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise BadImageError(f"cannot read image file {path}: {type(e).__name__}: {e}") from None


class DigitsDataset(InMemoryImages):
    """scikit-learn's 8x8 digits as RGB PIL images of ``size`` x ``size`` (bilinear upscaling).

    ``split`` is "train" (80%) or "val" (20%), from a fixed permutation so every run sees the same split.
    """

    num_classes = 10

    def __init__(self, split: str = "train", size: int = 32, transform: Optional[Callable] = None):
        from sklearn.datasets import load_digits

        if split not in ("train", "val"):
            raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
        digits = load_digits()
        order = np.random.RandomState(0).permutation(len(digits.target))
        cut = int(0.8 * len(order))
        keep = order[:cut] if split == "train" else order[cut:]
        pixels = (digits.images[keep] * (255.0 / 16.0)).astype(np.uint8)  # values 0..16 -> 0..255
        self.images = [Image.fromarray(p).resize((size, size), Image.BILINEAR).convert("RGB") for p in pixels]
        self.targets = [int(t) for t in digits.target[keep]]
        self.classes = [str(i) for i in range(10)]
        self.transform = transform


def create_dataset(dataset: str, data_dir: Optional[str], split: str, transform: Optional[Callable] = None,
                   digits_size: int = 32) -> Dataset:
    """Build the dataset ``dataset`` for ``split`` ("train" or "val"); it has ``.classes``.

    Raises FileNotFoundError when ``data_dir`` or the split folder is missing, ValueError for an unknown
    ``dataset``.
    """
    if dataset == "digits":
        return DigitsDataset(split, size=digits_size, transform=transform)
    if dataset == "photos":  # crops of photographs shipped with scikit-image and scikit-learn (texture_data.py)
        from .texture_data import PhotoCropsDataset

        return PhotoCropsDataset(split, size=digits_size, transform=transform)
    if not data_dir:
        raise ValueError(f"data_dir: required for dataset {dataset!r} (only 'digits' and 'photos' need none)")
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data_dir: folder not found: {data_dir}")
    if dataset == "folder":
        from torchvision.datasets import ImageFolder

        names = ["train"] if split == "train" else ["val", "validation"]
        for name in names:
            root = os.path.join(data_dir, name)
            if os.path.isdir(root):
                return ImageFolder(root, transform=transform, loader=_load_rgb)
        raise FileNotFoundError(f"data_dir: no {' or '.join(names)} folder (class sub-folders) in {data_dir}")
    if dataset.startswith(("torchvision/", "torch/")):
        import torchvision.datasets as tvd

        name = dataset.split("/", 1)[1]
        # timm spells them torch/cifar10; torchvision's class is CIFAR10
        by_lower = {n.lower(): n for n in dir(tvd) if isinstance(getattr(tvd, n), type)}
        cls = getattr(tvd, by_lower.get(name.lower(), name), None)
        if cls is None or not isinstance(cls, type):
            raise ValueError(f"dataset: torchvision has no dataset {name!r}")
        name = cls.__name__
        try:
            return cls(data_dir, train=(split == "train"), transform=transform, download=False)
        except TypeError:  # datasets such as Flowers102 take split= instead of train=
            return cls(data_dir, split=split, transform=transform, download=False)
        except RuntimeError as e:  # torchvision reports missing files this way
            raise FileNotFoundError(f"data_dir: {name} not found under {data_dir} ({e})") from None
    raise ValueError(f"dataset: unknown {dataset!r}; allowed: 'folder', 'digits', 'photos', 'torch/<name>', "
                     f"'torchvision/<Name>'")


def build_transform(img_size: int, is_training: bool, mean, std, crop_pct: float = 1.0,
                    scale: Tuple[float, float] = (0.08, 1.0), hflip: float = 0.5, color_jitter: float = 0.0,
                    auto_augment: Optional[str] = None, interpolation: str = "bilinear",
                    re_prob: float = 0.0, no_aug: bool = False) -> Callable:
    """timm's ``create_transform`` with the options the tools expose (``no_aug``: resize and crop only)."""
    from timm.data import create_transform

    if is_training:
        return create_transform(img_size, is_training=True, no_aug=no_aug, scale=tuple(scale), hflip=hflip,
                                color_jitter=color_jitter, auto_augment=auto_augment, interpolation=interpolation,
                                mean=tuple(mean), std=tuple(std), re_prob=re_prob)
    return create_transform(img_size, is_training=False, interpolation=interpolation, mean=tuple(mean),
                            std=tuple(std), crop_pct=crop_pct)


class ShardedSampler(Sampler[int]):
    """Each rank's share of one epoch's order, able to start part-way through the epoch.

    The order of epoch e depends only on (seed, e), so a resumed run sees the same batches as an uninterrupted
    one. With ``shuffle`` the permutation is padded by wrapping to a multiple of ``world_size`` (as
    DistributedSampler does); without it no index is repeated, so ranks may hold one sample more or less,
    which keeps evaluation exact once the sums are reduced.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, shuffle: bool = True, seed: int = 0):
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use epoch ``epoch``'s order, skipping its first ``start`` indices of this rank."""
        self.epoch, self.start = epoch, start

    def _indices(self) -> List[int]:
        if not self.shuffle:
            return list(range(self.rank, self.num_samples, self.world_size))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=g).tolist()
        total = math.ceil(self.num_samples / self.world_size) * self.world_size
        order += order[: total - len(order)]
        return order[self.rank:total:self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return len(self._indices()) - self.start


def _seed_worker(worker_id: int) -> None:
    # numpy and random in workers follow torch's per-worker seed, so augmentations are reproducible
    import random

    from .interrupt import prepare_worker_signals

    prepare_worker_signals()  # a signal to the run's process group is the main process's (it saves first)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class _Loader(DataLoader):
    """A DataLoader that forks its workers with SIGINT/SIGTERM held back (see linvision.engine.interrupt)."""

    def _get_iterator(self):
        from .interrupt import blocked_stop_signals

        with blocked_stop_signals():
            return super()._get_iterator()


def create_loader(dataset: Dataset, batch_size: int, sampler: Sampler, num_workers: int = 0,
                  drop_last: bool = False, pin_memory: bool = False,
                  generator: Optional[torch.Generator] = None) -> DataLoader:
    """A DataLoader over ``sampler``'s indices; ``generator`` seeds the workers instead of the global RNG."""
    return _Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      drop_last=drop_last, pin_memory=pin_memory, worker_init_fn=_seed_worker,
                      generator=generator)
