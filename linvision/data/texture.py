"""A texture-rich real image set built offline from the photographs that ship with installed packages.

``dataset="photos"`` in the tools: 10 classes, one photograph each, told apart by texture and colour:

- scikit-image's ``skimage.data`` (shipped in its wheel): ``brick``, ``grass``, ``gravel`` (512 x 512 greyscale
  texture photographs), ``immunohistochemistry`` (stained tissue), ``hubble_deep_field``, ``coffee``,
  ``chelsea`` (a cat), ``astronaut``;
- scikit-learn's ``load_sample_images``: ``china.jpg`` (a temple among trees) and ``flower.jpg``.

The left ``TRAIN_FRACTION`` (2/3) of each photograph's width is its training part, the rest its validation part.
A sample is a square crop of ``CROP`` (64) source pixels at a position drawn from a fixed seed, entirely inside
its part, resized (bilinear) to ``size`` px: training and validation crops never share a pixel. 120 training and
36 validation crops per class (1200 and 360 images; as for the digits, one validation image is 0.28 points).
A validation crop shows content the model has not seen (other bricks, other branches, another part of the cat),
so the set measures transfer of texture, not recall of places. Greyscale photographs are repeated over RGB.

``dataset="photos_aspect"`` (:class:`PhotoAspectCropsDataset`) is the same set at mixed aspect ratios: each
crop's width / height is drawn log-uniformly from ``ASPECT_RANGE`` (1:3 to 3:1), its area about ``CROP`` x ``CROP``
source pixels (within 2% after rounding), from the same training and validation parts, its shape and position
fixed per split and class. Its images keep their aspect ratio (PIL images of different sizes, scaled by
``size / CROP``: at size 64 the crop as cut), so timm's NaFlex loader sees each at its own aspect, while a square
pipeline resizes and crops them to squares as it does any image.

No file is written and nothing is downloaded; the images are decoded once per process.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, List, Optional, Tuple

import numpy as np
from PIL import Image
from .in_memory import InMemoryImages

__all__ = ["PhotoCropsDataset", "PhotoAspectCropsDataset", "photograph", "photo_parts", "CLASSES", "CROP",
           "TRAIN_FRACTION", "ASPECT_RANGE"]

CROP = 64
TRAIN_FRACTION = 2 / 3
ASPECT_RANGE = (1 / 3, 3.0)  # width / height of photos_aspect's crops
PER_CLASS = {"train": 120, "val": 36}
SKIMAGE_PHOTOS = ("brick", "grass", "gravel", "immunohistochemistry", "hubble_deep_field", "coffee", "chelsea",
                  "astronaut")
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")
CLASSES = SKIMAGE_PHOTOS + tuple(n.split(".")[0] for n in SKLEARN_PHOTOS)


@lru_cache(maxsize=None)
def photograph(name: str) -> Image.Image:
    """The photograph of class ``name`` as an RGB PIL image (decoded once per process)."""
    if name in SKIMAGE_PHOTOS:
        try:
            import skimage.data
        except ImportError:
            raise ImportError("dataset 'photos': needs scikit-image for its bundled photographs "
                              "(pip install scikit-image)") from None
        return Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB")
    import sklearn.datasets

    path = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images", name + ".jpg")
    with Image.open(path) as img:
        return img.convert("RGB")


def photo_parts(split: str) -> List[Tuple[str, Tuple[int, int, int, int]]]:
    """(class name, (left, top, right, bottom)) of the part of every photograph that ``split`` crops from."""
    parts = []
    for name in CLASSES:
        w, h = photograph(name).size
        cut = int(round(w * TRAIN_FRACTION))
        parts.append((name, (0, 0, cut, h) if split == "train" else (cut, 0, w, h)))
    return parts


class PhotoCropsDataset(InMemoryImages):
    """The photo-crops set (see the module docstring) for ``split`` "train" or "val", crops resized to ``size``.

    The crop positions depend only on the split and class (fixed seeds), so every run and every evaluation size
    sees the same crops; ``size`` only changes the rendering (bilinear resize of the 64-pixel crop). ``boxes``
    holds each crop's (left, top, right, bottom) in its photograph.
    """

    num_classes = len(CLASSES)
    crop = CROP  # side of a square crop in source pixels
    per_class = PER_CLASS  # crops per class of each split

    def __init__(self, split: str = "train", size: int = 64, transform: Optional[Callable] = None):
        if split not in self.per_class:
            raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
        if size < 1:
            raise ValueError(f"size: must be >= 1, got {size}")
        self.images, self.targets, self.boxes = [], [], []
        parts = self._parts(split)
        self.classes = [name for name, _ in parts]
        count = self.per_class[split]
        for label, (name, (left, top, right, bottom)) in enumerate(parts):
            rng = np.random.RandomState(1000 * label + (0 if split == "train" else 1))
            widths, heights = self._crop_shapes(rng, count, name)  # the square set's draw none: crops stay put
            xs = rng.randint(left, right - widths + 1, size=count)
            ys = rng.randint(top, bottom - heights + 1, size=count)
            photo = self._photograph(name)
            for x, y, w, h in zip(xs.tolist(), ys.tolist(), np.broadcast_to(widths, count).tolist(),
                                  np.broadcast_to(heights, count).tolist()):
                box = (x, y, x + w, y + h)
                self.boxes.append(box)
                self.images.append(photo.crop(box).resize(self._rendered_size(w, h, size), Image.BILINEAR))
                self.targets.append(label)
        self.transform = transform

    def _parts(self, split: str) -> List[Tuple[str, Tuple[int, int, int, int]]]:
        """(class name, box) of every class's part of its photograph for ``split``, in label order."""
        return photo_parts(split)

    def _photograph(self, name: str) -> Image.Image:
        """The RGB photograph that class ``name`` is cropped from (its boxes' coordinates)."""
        return photograph(name)

    def _crop_shapes(self, rng: np.random.RandomState, count: int, name: str):
        """(widths, heights) in source pixels of class ``name``'s ``count`` crops: ints, or arrays drawn from
        ``rng``."""
        return self.crop, self.crop

    @staticmethod
    def _rendered_size(width: int, height: int, size: int) -> Tuple[int, int]:
        """(width, height) of a crop of ``width`` x ``height`` source pixels rendered at ``size``."""
        return size, size


class PhotoAspectCropsDataset(PhotoCropsDataset):
    """The photo crops at mixed aspect ratios (``dataset="photos_aspect"``, see the module docstring): crops of
    width / height log-uniform in ``ASPECT_RANGE`` and about ``CROP`` x ``CROP`` source pixels, from the same
    parts as :class:`PhotoCropsDataset`'s, each rendered at ``size / CROP`` times its source size with its aspect
    ratio kept (at the default 64: as cut). Shapes and positions depend only on the split and class."""

    @staticmethod
    def _crop_shapes(rng: np.random.RandomState, count: int, name: str = ""):
        low, high = ASPECT_RANGE
        aspect = np.exp(rng.uniform(np.log(low), np.log(high), size=count))
        heights = np.maximum(1, np.round(CROP / np.sqrt(aspect))).astype(np.int64)
        widths = np.round(CROP * np.sqrt(aspect)).astype(np.int64)
        # rounding never takes a crop past the range
        widths = np.clip(widths, np.ceil(heights * low), np.floor(heights * high)).astype(np.int64)
        return widths, heights

    @staticmethod
    def _rendered_size(width: int, height: int, size: int) -> Tuple[int, int]:
        scale = size / CROP
        return max(1, int(round(width * scale))), max(1, int(round(height * scale)))
