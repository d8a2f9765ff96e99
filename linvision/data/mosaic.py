"""A real semantic-segmentation set built offline: texture mosaics of the photographs of the "photos" set.

An image of ``size`` x ``size`` px is divided into 3 to 6 regions of random, curved shape: a Voronoi partition of
random seeds in which every point is first displaced by a smooth random field (a sum of three sinusoids per axis),
so boundaries bend. Each region shows one class's photograph (the 10 classes of
:mod:`linvision.data.texture`, all distinct within an image), and the mask holds that class's index at
every pixel of the region.

What a region shows: a window of ``WINDOW`` (128) x 128 source pixels of its photograph, at a position drawn
inside the part of the photograph the split owns (texture_data's parts: the left ``TRAIN_FRACTION`` of the
width for "train", the rest for "val"), cropped and then resized (bilinear) to ``size`` x ``size``; the region's
pixels are that rendering's pixels at the same places. A window never reaches past its part, so training and
validation images never share a source pixel. At ``size`` 128 the rendering is the window itself, pixel for pixel.

Everything is drawn from (split, index, seed) alone, so a sample is the same in every process, and the layout
(the regions, their classes and windows) does not depend on ``size``: a larger ``size`` renders the same
mosaic at a finer resolution.

Masks hold class indices 0-9 (:data:`CLASSES` order) as uint8; every pixel of a generated mask belongs to a
class. :data:`IGNORE_INDEX` (255) is the value the set reserves for pixels without a label (padding or the
borders of geometric augmentation): a loss or a metric skips it (``F.cross_entropy(..., ignore_index=255)``).

On disk (:func:`write_mosaic_folders`)::

    root/dataset.json          {"classes": [...], "ignore_index": 255, "size": ..., "seed": ..., "splits": {...}}
    root/train/images/00000.png  RGB, size x size
    root/train/masks/00000.png   8-bit greyscale ("L"), the class index of each pixel (255: ignore)
    root/val/images/...          the same for the validation split

An image and its mask share the file name. :class:`SegmentationFolder` reads such a folder back.

No file is read but the photographs shipped with scikit-image and scikit-learn, and nothing is downloaded.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from linvision.utils.files import atomic_write_text

from .texture import CLASSES, photo_parts, photograph

__all__ = ["Mosaic", "make_mosaic", "render_window", "MosaicSegmentation", "SegmentationFolder",
           "write_mosaic_folders", "to_tensors", "CLASSES", "IGNORE_INDEX", "WINDOW", "MIN_SIZE", "MAX_SIZE", "MEAN", "STD"]

WINDOW = 128
IGNORE_INDEX = 255
MIN_SIZE, MAX_SIZE = 128, 1024
REGIONS = (3, 6)  # the fewest and the most regions of an image
LENGTH = {"train": 1000, "val": 200}
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as the pretrained configs of the published backbones
STD = (0.229, 0.224, 0.225)
_SPLITS = ("train", "val")


@dataclass(frozen=True)
class Mosaic:
    """One rendered sample.

    Attributes:
        image: the RGB image, ``size`` x ``size``.
        mask: (size, size) uint8, the class index of every pixel.
        sources: one (class index, (left, top, right, bottom)) per region: the class the region shows and the
            window of that class's photograph (its pixel coordinates) rendered to ``size`` x ``size``. A region
            the displacement left without a pixel centre is listed but absent from the mask.
    """

    image: Image.Image
    mask: np.ndarray
    sources: Tuple[Tuple[int, Tuple[int, int, int, int]], ...]


def _check(split: str, size: int) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"size: must be {MIN_SIZE} to {MAX_SIZE} px, got {size}")


def _layout(split: str, index: int, seed: int):
    """(seed points (k, 2), warp (amplitudes, frequencies, phases) per axis, classes (k,), windows (k, 4)), drawn
    from (split, index, seed) alone."""
    if index < 0:
        raise IndexError(f"index: must be >= 0, got {index}")
    rng = np.random.default_rng([int(seed), _SPLITS.index(split), int(index)])
    k = int(rng.integers(REGIONS[0], REGIONS[1] + 1))
    points = rng.random((k, 2))
    # three sinusoids per axis: 1 to 3 cycles across the image in a random direction, 0.01-0.05 of its side each
    amplitude = rng.uniform(0.01, 0.05, size=(2, 3))
    direction = rng.uniform(0, 2 * np.pi, size=(2, 3))
    frequency = rng.uniform(1.0, 3.0, size=(2, 3, 1)) * np.stack([np.cos(direction), np.sin(direction)], axis=-1)
    phase = rng.uniform(0, 2 * np.pi, size=(2, 3))
    classes = rng.choice(len(CLASSES), size=k, replace=False)
    parts = photo_parts(split)
    windows = []
    for c in classes.tolist():
        left, top, right, bottom = parts[c][1]
        x = int(rng.integers(left, right - WINDOW + 1))
        y = int(rng.integers(top, bottom - WINDOW + 1))
        windows.append((x, y, x + WINDOW, y + WINDOW))
    return points, (amplitude, frequency, phase), classes, windows


def _regions(points: np.ndarray, warp, size: int) -> np.ndarray:
    """(size, size) int64: the region of each pixel centre, in coordinates of [0, 1] across the image."""
    amplitude, frequency, phase = warp
    centres = (np.arange(size, dtype=np.float64) + 0.5) / size
    u, v = np.meshgrid(centres, centres)  # u across (x), v down (y)
    moved = []
    for axis, base in enumerate((u, v)):
        offset = sum(amplitude[axis, i] * np.sin(2 * np.pi * (frequency[axis, i, 0] * u + frequency[axis, i, 1] * v)
                                                 + phase[axis, i]) for i in range(3))
        moved.append(base + offset)
    d = (moved[0][..., None] - points[:, 0]) ** 2 + (moved[1][..., None] - points[:, 1]) ** 2
    return np.argmin(d, axis=-1)


def render_window(class_index: int, window: Tuple[int, int, int, int], size: int) -> Image.Image:
    """The ``window`` of photograph ``class_index`` cropped, then resized (bilinear) to ``size`` x ``size``:
    what every pixel of a region showing that window is taken from."""
    crop = photograph(CLASSES[class_index]).crop(window)
    return crop if crop.size == (size, size) else crop.resize((size, size), Image.BILINEAR)


def make_mosaic(split: str, index: int, size: int = 256, seed: int = 0) -> Mosaic:
    """Sample ``index`` of ``split`` ("train" or "val") for ``seed``, rendered at ``size`` (128 to 1024) px.

    Raises:
        ValueError: for another split or a size out of range.
    """
    _check(split, size)
    points, warp, classes, windows = _layout(split, index, seed)
    region = _regions(points, warp, size)
    image = np.zeros((size, size, 3), dtype=np.uint8)
    for r, (c, window) in enumerate(zip(classes.tolist(), windows)):
        inside = region == r
        if inside.any():
            image[inside] = np.asarray(render_window(c, window, size))[inside]
    mask = classes.astype(np.uint8)[region]
    return Mosaic(Image.fromarray(image), mask, tuple(zip(classes.tolist(), windows)))


def to_tensors(image: Image.Image, mask) -> Tuple[torch.Tensor, torch.Tensor]:
    """(RGB image, mask as a PIL image or an array) -> (float32 (3, H, W) normalised by :data:`MEAN` and
    :data:`STD`, int64 (H, W) class indices); the default transform of the datasets here."""
    x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    x = (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    return x, torch.from_numpy(np.asarray(mask, dtype=np.int64).copy())


class MosaicSegmentation(Dataset):
    """``length`` mosaics of ``split`` ("train" or "val") at ``size`` px for ``seed``, rendered when indexed.

    ``dataset[i]`` is ``transform(image, mask)``: the RGB PIL image and the mask as an 8-bit PIL image ("L", class
    indices). Without a transform it is :func:`to_tensors`'s pair: a float32 (3, size, size) image normalised with
    ImageNet's mean and std, and an int64 (size, size) mask. A transform that moves or resizes pixels must move
    the mask's with them (nearest neighbour for the mask) and fill what it adds to the mask with
    :data:`IGNORE_INDEX`. :meth:`mosaic` gives a sample with the windows it was made from.

    Args:
        split: "train" or "val" (disjoint parts of every photograph).
        size: side of the images, 128 to 1024 px.
        length: number of samples; default 1000 for "train", 200 for "val".
        seed: draws another set of mosaics (of the same parts of the photographs).
        transform: ``(image, mask) -> sample``, both PIL images.
    """

    classes = list(CLASSES)
    num_classes = len(CLASSES)
    ignore_index = IGNORE_INDEX

    def __init__(self, split: str = "train", size: int = 256, length: Optional[int] = None, seed: int = 0,
                 transform: Optional[Callable] = None):
        _check(split, size)
        self.split, self.size, self.seed, self.transform = split, size, seed, transform
        self.length = LENGTH[split] if length is None else int(length)
        if self.length < 1:
            raise ValueError(f"length: must be >= 1, got {length}")

    def __len__(self) -> int:
        return self.length

    def mosaic(self, index: int) -> Mosaic:
        """Sample ``index`` as a :class:`Mosaic` (the image, the mask and the windows it was made from)."""
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        return make_mosaic(self.split, index, self.size, self.seed)

    def __getitem__(self, index: int):
        m = self.mosaic(index)
        mask = Image.fromarray(m.mask)
        return self.transform(m.image, mask) if self.transform is not None else to_tensors(m.image, mask)


def write_mosaic_folders(root: str, size: int = 256, train: int = LENGTH["train"], val: int = LENGTH["val"],
                         seed: int = 0) -> str:
    """Write ``train`` and ``val`` mosaics of ``size`` px as the image/mask folders of the module docstring, and
    ``root/dataset.json`` last (a folder without it is incomplete). Returns ``root``.

    Raises:
        FileExistsError: when ``root`` already holds a train/ or val/ folder.
    """
    for split in _SPLITS:
        if os.path.exists(os.path.join(root, split)):
            raise FileExistsError(f"{os.path.join(root, split)} exists: write the mosaics into a new folder")
    counts = {"train": int(train), "val": int(val)}
    for split, count in counts.items():
        data = MosaicSegmentation(split, size, count, seed)
        images, masks = os.path.join(root, split, "images"), os.path.join(root, split, "masks")
        os.makedirs(images)
        os.makedirs(masks)
        for i in range(count):
            m = data.mosaic(i)
            m.image.save(os.path.join(images, f"{i:05d}.png"))
            Image.fromarray(m.mask).save(os.path.join(masks, f"{i:05d}.png"))
    meta = dict(classes=list(CLASSES), ignore_index=IGNORE_INDEX, size=size, seed=seed, splits=counts,
                source="linvision.data.mosaic")
    atomic_write_text(os.path.join(root, "dataset.json"), json.dumps(meta, indent=1) + "\n")
    return root


class SegmentationFolder(Dataset):
    """The ``split`` of an image/mask folder (``root/<split>/images/NAME.png`` and ``root/<split>/masks/NAME.png``,
    the layout :func:`write_mosaic_folders` writes); samples in the order of the sorted file names, returned as
    :class:`MosaicSegmentation` returns them. ``classes`` comes from ``root/dataset.json`` when present.

    Raises:
        FileNotFoundError: when the split has no images, or an image has no mask of the same name.
    """

    ignore_index = IGNORE_INDEX

    def __init__(self, root: str, split: str = "train", transform: Optional[Callable] = None):
        self.images_dir = os.path.join(root, split, "images")
        self.masks_dir = os.path.join(root, split, "masks")
        names = sorted(os.listdir(self.images_dir)) if os.path.isdir(self.images_dir) else []
        if not names:
            raise FileNotFoundError(f"no images in {self.images_dir}")
        missing = [n for n in names if not os.path.isfile(self._mask_path(n))]
        if missing:
            raise FileNotFoundError(f"{len(missing)} images have no mask in {self.masks_dir}, first: {missing[0]}")
        self.names: List[str] = names
        self.transform = transform
        meta_path = os.path.join(root, "dataset.json")
        meta: Dict = {}
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
        self.classes = list(meta.get("classes", []))
        self.num_classes = len(self.classes) or None

    def __len__(self) -> int:
        return len(self.names)

    def _mask_path(self, name: str) -> str:
        return os.path.join(self.masks_dir, os.path.splitext(name)[0] + ".png")

    def sample_files(self) -> List[Tuple[str, str]]:
        """(image file, mask file) of each sample (what the data check reads)."""
        return [(os.path.join(self.images_dir, name), self._mask_path(name)) for name in self.names]

    def keep_samples(self, keep: Sequence[int]) -> None:
        """Keep only the samples at the indices ``keep`` (those whose files can be read)."""
        self.names = [self.names[i] for i in keep]

    def __getitem__(self, index: int):
        name = self.names[index]
        with Image.open(os.path.join(self.images_dir, name)) as img:
            image = img.convert("RGB")
        with Image.open(self._mask_path(name)) as m:
            mask = m.convert("L") if m.mode != "L" else m.copy()
        if image.size != mask.size:
            raise ValueError(f"{name}: image {image.size} and mask {mask.size} differ in size")
        return self.transform(image, mask) if self.transform is not None else to_tensors(image, mask)
