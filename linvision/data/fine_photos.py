"""Fine-grained photo sets built offline from the nature photographs of Debian wallpaper packages.

``dataset="photos_fine"`` in the tools: 12 classes of look-alike outdoor content (foliage, leaves, flowers, water,
rock, sky), each class the crops of one photograph (:data:`PHOTOGRAPHS` names each file by its Debian package
and path). Where the ``photos`` set (:mod:`linvision.data.texture`) tells ten unlike photographs apart, here
several classes share their content (three forests, three lakes or skies at dusk, two rocky mountains), so the
set asks for detail: a held-out benchmark at the size people train ViTs.

Each photograph is scaled (Lanczos) so that its short side is ``SHORT_SIDE`` (640) pixels; the left
``TRAIN_FRACTION`` (2/3) of its width is the training part, the rest the validation part, as for ``photos``. A
sample is a square crop of ``CROP`` (128) pixels of the scaled photograph at a position drawn from a fixed seed,
entirely inside its part, resized (bilinear) to ``size`` (96 by default) px: training and validation crops never
share a pixel. 120 training and 40 validation crops per class (1440 and 480 images; one validation image is
0.21 points).

``dataset="photos_scale"`` (:class:`ScalePhotoCropsDataset`): the same kind of set at varied scale, from 12 other
nature photographs, those of Debian's ``mate-backgrounds`` (:data:`SCALE_PHOTOGRAPHS`): three flowers in close-up
(two orange, one yellow) and a dandelion's seeds before orange blossom, three greens (a leaf's veins, grass blades,
leaves with rain drops) and a ladybird on a stem among green leaves, a water drop and a storm sky (grey-blue),
dune grass, wood grain. The photographs are scaled and split as above, but each crop's side is drawn uniformly
(in whole pixels) between ``SCALE_RANGE`` (1/6 and 1/3) of its scaled photograph's height, 107 to 213 of 640
pixels, so that one class is seen from near and from farther, as the photographs people train on are; its
position is drawn after it, inside its part, and both come from the same fixed seed per split and class. Every
crop is resized (bilinear) to ``size`` (96 by default) px: a crop is shrunk by 1.1x to 2.2x. The same counts as
``photos_fine``: 120 training and 40 validation crops per class (1440 and 480 images).

Nothing is downloaded or written: the photographs are read from the installed packages (decoded and scaled once
per process). Without them a set raises FileNotFoundError in one line naming the ``apt-get install`` to run.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from .image_check import BadImageError, decode_error
from .texture import TRAIN_FRACTION, PhotoCropsDataset

__all__ = ["FinePhotoCropsDataset", "ScalePhotoCropsDataset", "PHOTOGRAPHS", "PACKAGES", "SCALE_PHOTOGRAPHS",
           "SCALE_PACKAGES", "SCALE_RANGE", "SHORT_SIDE", "CROP", "PER_CLASS", "missing_photographs",
           "scaled_photograph"]

SHORT_SIDE = 640
CROP = 128
PER_CLASS = {"train": 120, "val": 40}

_PLASMA = "plasma-workspace-wallpapers"  # Debian 12: 4:5.27.5-2
_LOMIRI = "lomiri-wallpapers-16.04"  # Debian 12: 20.04.0-2
# (class name, Debian package, path): photographs of nature with look-alike content across classes
PHOTOGRAPHS: Tuple[Tuple[str, str, str], ...] = (
    ("forest_path", _PLASMA, "/usr/share/wallpapers/Path/contents/images/2560x1600.jpg"),
    ("plants_above", _PLASMA, "/usr/share/wallpapers/OneStandsOut/contents/images/2560x1600.jpg"),
    ("fallen_leaf", _PLASMA, "/usr/share/wallpapers/FallenLeaf/contents/images/2560x1600.jpg"),
    ("lake_dusk", _PLASMA, "/usr/share/wallpapers/summer_1am/contents/images/2560x1600.jpg"),
    ("lake_boats", _PLASMA, "/usr/share/wallpapers/EveningGlow/contents/images/2560x1600.jpg"),
    ("clouds", _PLASMA, "/usr/share/wallpapers/Kite/contents/images/2560x1600.jpg"),
    ("autumn_forest", _LOMIRI, "/usr/share/backgrounds/aitzgorri_by_Aitzol_Berasategi.jpg"),
    ("stream_rocks", _LOMIRI, "/usr/share/backgrounds/life_by_Aitzol_Berasategi.jpg"),
    ("mountain_rock", _LOMIRI, "/usr/share/backgrounds/picosdeeuropa_by_Aitzol_Berasategi.jpg"),
    ("dandelions", _LOMIRI, "/usr/share/backgrounds/seeding_by_Clements_Engelhardt.jpg"),
    ("sunset_hills", _LOMIRI, "/usr/share/backgrounds/sunset_by_Aitzol_Berasategi.jpg"),
    ("leaves_sky", _LOMIRI, "/usr/share/backgrounds/Dragonfly_by_Bolly.jpg"),
)
PACKAGES: Tuple[str, ...] = tuple(dict.fromkeys(package for _, package, _ in PHOTOGRAPHS))

SCALE_RANGE = (1 / 6, 1 / 3)  # photos_scale: a crop's side as a fraction of its scaled photograph's height
_MATE = "mate-backgrounds"  # Debian 12: 1.26.0-1
_MATE_NATURE = "/usr/share/backgrounds/mate/nature/"
# photos_scale's (class name, Debian package, path): none of them is one of photos_fine's
SCALE_PHOTOGRAPHS: Tuple[Tuple[str, str, str], ...] = (
    ("water_drop", _MATE, _MATE_NATURE + "Aqua.jpg"),
    ("leaf_veins", _MATE, _MATE_NATURE + "Blinds.jpg"),
    ("dune_grass", _MATE, _MATE_NATURE + "Dune.jpg"),
    ("orange_petals", _MATE, _MATE_NATURE + "FreshFlower.jpg"),
    ("marigold", _MATE, _MATE_NATURE + "Garden.jpg"),
    ("grass_blades", _MATE, _MATE_NATURE + "GreenMeadow.jpg"),
    ("ladybird", _MATE, _MATE_NATURE + "LadyBird.jpg"),
    ("rain_drops", _MATE, _MATE_NATURE + "RainDrops.jpg"),
    ("storm_sky", _MATE, _MATE_NATURE + "Storm.jpg"),
    ("dandelion_seeds", _MATE, _MATE_NATURE + "TwoWings.jpg"),
    ("wood_grain", _MATE, _MATE_NATURE + "Wood.jpg"),
    ("yellow_flower", _MATE, _MATE_NATURE + "YellowFlower.jpg"),
)
SCALE_PACKAGES: Tuple[str, ...] = tuple(dict.fromkeys(package for _, package, _ in SCALE_PHOTOGRAPHS))


def missing_photographs(photographs: Sequence[Tuple[str, str, str]] = PHOTOGRAPHS) -> List[str]:
    """The paths of ``photographs`` that are not files here (empty when the set can be built)."""
    return [path for _, _, path in photographs if not os.path.isfile(path)]


@lru_cache(maxsize=None)
def scaled_photograph(path: str, short_side: int = SHORT_SIDE) -> Image.Image:
    """The photograph at ``path`` as RGB, scaled (Lanczos) so that its short side is ``short_side`` pixels
    (decoded once per process). Raises BadImageError naming the file when it cannot be read."""
    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
    except Exception as e:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise BadImageError(f"cannot read image file {path}: {decode_error(e)}") from None
    scale = short_side / min(img.size)
    return img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.LANCZOS)


class FinePhotoCropsDataset(PhotoCropsDataset):
    """The fine-grained photo set (see the module docstring) for ``split`` "train" or "val", crops resized to
    ``size``. ``boxes`` holds each crop's (left, top, right, bottom) in its scaled photograph.

    ``photographs`` ((class, package, path) triples; default :data:`PHOTOGRAPHS`), ``short_side``, ``crop`` and
    ``per_class`` build the same kind of set from other files. ``crop_range`` ((low, high) fractions of the
    scaled photograph's height, 0 < low <= high <= 1) draws each crop's side uniformly in whole pixels from
    ``ceil(low * height)`` to ``floor(high * height)`` instead of the fixed ``crop`` (photos_scale's
    :data:`SCALE_RANGE`). Crop sides and positions depend only on the split and the class's index (fixed seeds).
    Raises FileNotFoundError in one line, naming the packages to install, when a photograph is missing, and
    ValueError when a photograph's part is smaller than its largest crop.
    """

    num_classes = len(PHOTOGRAPHS)
    crop = CROP
    per_class = PER_CLASS
    dataset_name = "photos_fine"  # the tools' name of the set, in its messages

    def __init__(self, split: str = "train", size: int = 96, transform: Optional[Callable] = None,
                 photographs: Sequence[Tuple[str, str, str]] = PHOTOGRAPHS, short_side: int = SHORT_SIDE,
                 crop: int = CROP, per_class: Optional[Dict[str, int]] = None,
                 crop_range: Optional[Tuple[float, float]] = None):
        if crop_range is not None:
            low, high = crop_range
            if not 0 < low <= high <= 1:
                raise ValueError(f"crop_range: expected fractions 0 < low <= high <= 1 of the photograph's "
                                 f"height, got {tuple(crop_range)}")
        missing = missing_photographs(photographs)
        if missing:
            packages = list(dict.fromkeys(p for _, p, path in photographs if path in missing))
            raise FileNotFoundError(f"dataset {self.dataset_name!r}: {len(missing)} of its photographs are not "
                                    f"installed (first: {missing[0]}); install them with: apt-get install "
                                    f"{' '.join(packages)}")
        self._photos = {name: path for name, _, path in photographs}
        self.short_side, self.crop = short_side, crop
        self.crop_range = None if crop_range is None else (float(crop_range[0]), float(crop_range[1]))
        self.per_class = dict(per_class or PER_CLASS)
        self.num_classes = len(self._photos)
        super().__init__(split, size=size, transform=transform)

    def crop_sides(self, height: int) -> Tuple[int, int]:
        """(smallest, largest) side in pixels of a crop of a scaled photograph ``height`` pixels high."""
        if self.crop_range is None:
            return self.crop, self.crop
        low, high = self.crop_range
        # a hair below the exact product, so that 640 / 3 * 3 rounds to 640, not 641
        smallest = max(1, math.ceil(low * height - 1e-9))
        return smallest, max(smallest, math.floor(high * height + 1e-9))

    def _parts(self, split: str) -> List[Tuple[str, Tuple[int, int, int, int]]]:
        parts = []
        for name in self._photos:
            w, h = self._photograph(name).size
            cut = int(round(w * TRAIN_FRACTION))
            part = (0, 0, cut, h) if split == "train" else (cut, 0, w, h)
            largest = self.crop_sides(h)[1]
            if min(part[2] - part[0], part[3] - part[1]) < largest:
                raise ValueError(f"photographs: the {split} part {part} of {self._photos[name]} (scaled to "
                                 f"{w} x {h}) is smaller than a crop of {largest} px")
            parts.append((name, part))
        return parts

    def _photograph(self, name: str) -> Image.Image:
        return scaled_photograph(self._photos[name], self.short_side)

    def _crop_shapes(self, rng: np.random.RandomState, count: int, name: str):
        if self.crop_range is None:  # draws nothing: photos_fine's positions stay as they were
            return self.crop, self.crop
        smallest, largest = self.crop_sides(self._photograph(name).height)
        sides = rng.randint(smallest, largest + 1, size=count)
        return sides, sides


class ScalePhotoCropsDataset(FinePhotoCropsDataset):
    """The fine-grained photo set at varied scale (``dataset="photos_scale"``, see the module docstring): crops of
    :data:`SCALE_PHOTOGRAPHS` whose side is drawn from :data:`SCALE_RANGE` of the photograph's height, resized to
    ``size``. The options are :class:`FinePhotoCropsDataset`'s, with this set's defaults."""

    dataset_name = "photos_scale"

    def __init__(self, split: str = "train", size: int = 96, transform: Optional[Callable] = None,
                 photographs: Sequence[Tuple[str, str, str]] = SCALE_PHOTOGRAPHS, short_side: int = SHORT_SIDE,
                 per_class: Optional[Dict[str, int]] = None,
                 crop_range: Optional[Tuple[float, float]] = SCALE_RANGE):
        super().__init__(split, size=size, transform=transform, photographs=photographs, short_side=short_side,
                         per_class=per_class, crop_range=crop_range)
