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
  validation crops from disjoint parts of each photograph (:mod:`linvision.data.texture`); offline.
  ``"photos_aspect"``: the same at aspect ratios from 1:3 to 3:1, each image at its own aspect (for NaFlex).
- ``"photos_fine"``: 12 classes of look-alike nature photographs (crops of one photograph each, 96 px), from
  Debian's plasma-workspace-wallpapers and lomiri-wallpapers-16.04 (:mod:`linvision.data.fine_photos`); offline.
  ``"photos_scale"``: 12 other look-alike nature photographs (Debian's mate-backgrounds), each crop's side drawn
  between 1/6 and 1/3 of its photograph's height, resized to 96 px: the same kind of set at varied scale.

Unreadable images raise :class:`BadImageError` naming the file; 16-bit greyscale images are scaled to 8 bits
(not clipped). Loader worker processes leave the run's process group, so a signal to the group is the
training loop's to handle.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from .image_check import BadImageError, decode_error
from .in_memory import InMemoryImages

__all__ = [
    "BadImageError", "InMemoryImages", "DigitsDataset", "create_dataset", "ShardedSampler", "create_loader",
    "build_transform", "resolve_data_config", "check_transform_options", "INTERPOLATIONS", "CROP_MODES",
]


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
        raise BadImageError(f"cannot read image file {path}: {decode_error(e)}") from None


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
    _check_name(dataset)
    if dataset == "digits":
        return DigitsDataset(split, size=digits_size, transform=transform)
    if dataset in ("photos", "photos_aspect"):  # crops of photographs shipped with scikit-image, scikit-learn
        from .texture import PhotoAspectCropsDataset, PhotoCropsDataset

        cls = PhotoCropsDataset if dataset == "photos" else PhotoAspectCropsDataset
        return cls(split, size=digits_size, transform=transform)
    if dataset == "photos_fine":  # crops of the nature photographs of two Debian wallpaper packages
        from .fine_photos import FinePhotoCropsDataset

        return FinePhotoCropsDataset(split, size=digits_size, transform=transform)
    if dataset == "photos_scale":  # crops at varied scale of the nature photographs of mate-backgrounds
        from .fine_photos import ScalePhotoCropsDataset

        return ScalePhotoCropsDataset(split, size=digits_size, transform=transform)
    if not data_dir:
        raise ValueError(f"data_dir: required for dataset {dataset!r} (only 'digits', 'photos', "
                         f"'photos_aspect', 'photos_fine' and 'photos_scale' need none)")
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
    raise AssertionError(dataset)  # _check_name let through a name that no branch reads


# the datasets by name (besides torchvision's, 'torch/<name>' and 'torchvision/<Name>')
DATASET_NAMES = ("folder", "digits", "photos", "photos_aspect", "photos_fine", "photos_scale")


def _check_name(dataset: str) -> None:
    """ValueError in one line for a dataset name :func:`create_dataset` does not know, with the nearest one."""
    if dataset in DATASET_NAMES or dataset.startswith(("torchvision/", "torch/")):
        return
    import difflib

    near = difflib.get_close_matches(dataset, DATASET_NAMES, n=1)
    raise ValueError(f"dataset: unknown {dataset!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                     + f"; allowed: {', '.join(map(repr, DATASET_NAMES))}, 'torch/<name>', 'torchvision/<Name>'")


# resize interpolations timm's transforms take by name, and its eval crop modes
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
CROP_MODES = ("center", "squash", "border")


def _check_triple(key: str, value, positive: bool = False) -> Optional[Tuple[float, ...]]:
    if value is None:
        return None
    try:
        values = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected 3 numbers (one per RGB channel), got {value!r}") from None
    if len(values) == 1:
        values = values * 3
    if len(values) != 3 or (positive and min(values) <= 0):
        raise ValueError(f"{key}: expected 3 {'positive ' if positive else ''}numbers (one per RGB channel), "
                         f"got {value!r}")
    return values


def check_transform_options(interpolation: Optional[str] = None, crop_pct: Optional[float] = None,
                            crop_mode: Optional[str] = None, where: str = "") -> None:
    """ValueError in one line naming the first of these transform settings that timm's transforms cannot use
    (None: not given)."""
    for key, value, allowed in (("interpolation", interpolation, INTERPOLATIONS),
                                ("crop_mode", crop_mode, CROP_MODES)):
        if value is not None and value not in allowed:
            raise ValueError(f"{key}: unknown {value!r}{where}; allowed: {', '.join(allowed)}")
    if crop_pct is not None and not (isinstance(crop_pct, (int, float)) and not isinstance(crop_pct, bool)
                                     and 0 < crop_pct <= 1):
        raise ValueError(f"crop_pct: must be within (0, 1]{where}, got {crop_pct!r}")


def resolve_data_config(model=None, pretrained_cfg: Optional[Dict[str, Any]] = None, *,
                        img_size: Optional[int] = None, interpolation: Optional[str] = None,
                        crop_pct: Optional[float] = None, crop_mode: Optional[str] = None,
                        mean: Optional[Sequence[float]] = None,
                        std: Optional[Sequence[float]] = None) -> Dict[str, Any]:
    """The settings of the training and validation transforms, as timm's ``resolve_data_config`` resolves them:
    each value given here wins; one left at None comes from ``pretrained_cfg``, else from ``model``'s pretrained
    cfg, else timm's default (224 px, bicubic, crop 0.875, centre crop, ImageNet mean and std).

    Returns {"img_size", "interpolation", "crop_pct", "crop_mode", "mean", "std"} (mean and std as lists), the
    keyword arguments of :func:`build_transform` and what a checkpoint's model.json records of its transform.
    Raises ValueError in one line for a value timm's transforms cannot use (e.g. an unknown interpolation).
    """
    from timm.data import resolve_data_config as timm_resolve_data_config

    check_transform_options(interpolation, crop_pct, crop_mode)
    if img_size is not None and not (isinstance(img_size, int) and img_size >= 1):
        raise ValueError(f"img_size: must be an integer >= 1, got {img_size!r}")
    args = {"img_size": img_size, "interpolation": interpolation, "crop_pct": crop_pct, "crop_mode": crop_mode,
            "mean": _check_triple("mean", mean), "std": _check_triple("std", std, positive=True)}
    resolved = timm_resolve_data_config(args, pretrained_cfg=dict(pretrained_cfg or {}), model=model)
    check_transform_options(resolved["interpolation"], resolved["crop_pct"], resolved["crop_mode"],
                            where=" (from the model's pretrained cfg or model.json)")
    height, width = resolved["input_size"][-2:]
    return {"img_size": int(height) if height == width else (int(height), int(width)),
            "interpolation": resolved["interpolation"], "crop_pct": float(resolved["crop_pct"]),
            "crop_mode": resolved["crop_mode"], "mean": [float(v) for v in resolved["mean"]],
            "std": [float(v) for v in resolved["std"]]}


def build_transform(img_size: Union[int, Tuple[int, int]], is_training: bool, mean, std, crop_pct: float = 1.0,
                    scale: Tuple[float, float] = (0.08, 1.0), hflip: float = 0.5, color_jitter: float = 0.0,
                    auto_augment: Optional[str] = None, interpolation: str = "bilinear",
                    re_prob: float = 0.0, no_aug: bool = False, crop_mode: str = "center") -> Callable:
    """timm's ``create_transform`` with the options the tools expose (``no_aug``: resize and crop only).

    The training and validation tools give it the settings :func:`resolve_data_config` resolves
    (``build_transform(is_training=..., **data_config)``); ``crop_pct`` and ``crop_mode`` shape the validation
    transform only, as in timm."""
    from timm.data import create_transform

    if is_training:
        return create_transform(img_size, is_training=True, no_aug=no_aug, scale=tuple(scale), hflip=hflip,
                                color_jitter=color_jitter, auto_augment=auto_augment, interpolation=interpolation,
                                mean=tuple(mean), std=tuple(std), re_prob=re_prob)
    return create_transform(img_size, is_training=False, interpolation=interpolation, mean=tuple(mean),
                            std=tuple(std), crop_pct=crop_pct, crop_mode=crop_mode)


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

    from linvision.utils.interrupt import prepare_worker_signals

    prepare_worker_signals()  # a signal to the run's process group is the main process's (it saves first)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class _Loader(DataLoader):
    """A DataLoader that forks its workers with SIGINT/SIGTERM held back (see linvision.utils.interrupt)."""

    def _get_iterator(self):
        from linvision.utils.interrupt import blocked_stop_signals

        with blocked_stop_signals():
            return super()._get_iterator()


def create_loader(dataset: Dataset, batch_size: int, sampler: Sampler, num_workers: int = 0,
                  drop_last: bool = False, pin_memory: bool = False,
                  generator: Optional[torch.Generator] = None) -> DataLoader:
    """A DataLoader over ``sampler``'s indices; ``generator`` seeds the workers instead of the global RNG."""
    return _Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      drop_last=drop_last, pin_memory=pin_memory, worker_init_fn=_seed_worker,
                      generator=generator)
