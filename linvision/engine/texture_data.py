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

No file is written and nothing is downloaded; the images are decoded once per process.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, List, Optional, Tuple

import numpy as np
from PIL import Image
from .in_memory import InMemoryImages

__all__ = ["PhotoCropsDataset", "photograph", "photo_parts", "CLASSES", "CROP", "TRAIN_FRACTION"]

CROP = 64
TRAIN_FRACTION = 2 / 3
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
    sees the same crops; ``size`` only changes the rendering (bilinear resize of the 64-pixel crop).
    """

    num_classes = len(CLASSES)

    def __init__(self, split: str = "train", size: int = 64, transform: Optional[Callable] = None):
        if split not in PER_CLASS:
            raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
        if size < 1:
            raise ValueError(f"size: must be >= 1, got {size}")
        self.images, self.targets, self.boxes = [], [], []
        self.classes = list(CLASSES)
        for label, (name, (left, top, right, bottom)) in enumerate(photo_parts(split)):
            rng = np.random.RandomState(1000 * label + (0 if split == "train" else 1))
            xs = rng.randint(left, right - CROP + 1, size=PER_CLASS[split])
            ys = rng.randint(top, bottom - CROP + 1, size=PER_CLASS[split])
            photo = photograph(name)
            for x, y in zip(xs.tolist(), ys.tolist()):
                box = (x, y, x + CROP, y + CROP)
                self.boxes.append(box)
                self.images.append(photo.crop(box).resize((size, size), Image.BILINEAR))
                self.targets.append(label)
        self.transform = transform
