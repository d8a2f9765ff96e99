"""A fine-grained photo set built offline from the nature photographs of two Debian wallpaper packages.

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

Nothing is downloaded or written: the photographs are read from the installed packages (decoded and scaled once
per process). Without them the set raises FileNotFoundError in one line naming the ``apt-get install`` to run.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from .image_check import BadImageError, decode_error
from .texture import TRAIN_FRACTION, PhotoCropsDataset

__all__ = ["FinePhotoCropsDataset", "PHOTOGRAPHS", "PACKAGES", "SHORT_SIDE", "CROP", "PER_CLASS",
           "missing_photographs", "scaled_photograph"]

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
    ``per_class`` build the same kind of set from other files. Crop positions depend only on the split and the
    class's index (fixed seeds). Raises FileNotFoundError in one line, naming the packages to install, when a
    photograph is missing, and ValueError when a photograph's part is smaller than a crop.
    """

    num_classes = len(PHOTOGRAPHS)
    crop = CROP
    per_class = PER_CLASS

    def __init__(self, split: str = "train", size: int = 96, transform: Optional[Callable] = None,
                 photographs: Sequence[Tuple[str, str, str]] = PHOTOGRAPHS, short_side: int = SHORT_SIDE,
                 crop: int = CROP, per_class: Optional[Dict[str, int]] = None):
        missing = missing_photographs(photographs)
        if missing:
            packages = list(dict.fromkeys(p for _, p, path in photographs if path in missing))
            raise FileNotFoundError(f"dataset 'photos_fine': {len(missing)} of its photographs are not installed "
                                    f"(first: {missing[0]}); install them with: apt-get install "
                                    f"{' '.join(packages)}")
        self._photos = {name: path for name, _, path in photographs}
        self.short_side, self.crop = short_side, crop
        self.per_class = dict(per_class or PER_CLASS)
        self.num_classes = len(self._photos)
        super().__init__(split, size=size, transform=transform)

    def _parts(self, split: str) -> List[Tuple[str, Tuple[int, int, int, int]]]:
        parts = []
        for name in self._photos:
            w, h = self._photograph(name).size
            cut = int(round(w * TRAIN_FRACTION))
            part = (0, 0, cut, h) if split == "train" else (cut, 0, w, h)
            if min(part[2] - part[0], part[3] - part[1]) < self.crop:
                raise ValueError(f"photographs: the {split} part {part} of {self._photos[name]} (scaled to "
                                 f"{w} x {h}) is smaller than a crop of {self.crop} px")
            parts.append((name, part))
        return parts

    def _photograph(self, name: str) -> Image.Image:
        return scaled_photograph(self._photos[name], self.short_side)
