"""The fine-grained photo set (photos_fine): the builder's logic on photographs the test makes, and the real set
from the Debian wallpaper packages where they are installed."""
import os

import numpy as np
import pytest
from PIL import Image

from linvision.data.fine_photos import (PACKAGES, PHOTOGRAPHS, FinePhotoCropsDataset, missing_photographs,
                                        scaled_photograph)
from linvision.data.texture import TRAIN_FRACTION

SMALL = dict(short_side=90, crop=24, per_class={"train": 7, "val": 4})


@pytest.fixture
def photographs(tmp_path):
    """Three noise photographs of different sizes and orientations, as (class, package, path)."""
    rng = np.random.RandomState(0)
    out = []
    for name, (w, h) in (("a", (300, 180)), ("b", (180, 180)), ("c", (150, 240))):
        path = str(tmp_path / f"{name}.png")
        Image.fromarray(rng.randint(0, 256, size=(h, w, 3), dtype=np.uint8)).save(path)
        out.append((name, f"pkg-{name}", path))
    return out


def _cut(dataset, label):
    """The column that splits class ``label``'s scaled photograph into its training and validation parts."""
    return int(round(dataset._photograph(dataset.classes[label]).width * TRAIN_FRACTION))


def test_crops_come_from_disjoint_parts_of_each_scaled_photograph(photographs):
    train = FinePhotoCropsDataset("train", size=16, photographs=photographs, **SMALL)
    val = FinePhotoCropsDataset("val", size=16, photographs=photographs, **SMALL)
    assert train.classes == val.classes == ["a", "b", "c"] and train.num_classes == 3
    assert np.bincount(train.targets).tolist() == [7] * 3 and np.bincount(val.targets).tolist() == [4] * 3
    assert {im.size for im in train.images + val.images} == {(16, 16)}
    # short side scaled to 90 px: 300 x 180 -> 150 x 90, 180 x 180 -> 90 x 90, 150 x 240 -> 90 x 144
    assert [train._photograph(n).size for n in train.classes] == [(150, 90), (90, 90), (90, 144)]
    for label in range(3):
        cut = _cut(train, label)
        w, h = train._photograph(train.classes[label]).size
        tboxes = [b for b, t in zip(train.boxes, train.targets) if t == label]
        vboxes = [b for b, t in zip(val.boxes, val.targets) if t == label]
        assert all(r - l == 24 and b - t == 24 and 0 <= t and b <= h for l, t, r, b in tboxes + vboxes)
        assert min(l for l, _, _, _ in tboxes) >= 0 and max(r for _, _, r, _ in tboxes) <= cut
        assert min(l for l, _, _, _ in vboxes) >= cut and max(r for _, _, r, _ in vboxes) <= w
    # each image is its box of the scaled photograph, resized (bilinear) to the size asked for
    for ds in (train, val):
        for i in (0, len(ds) - 1):
            photo = scaled_photograph(photographs[ds.targets[i]][2], 90)
            want = photo.crop(ds.boxes[i]).resize((16, 16), Image.BILINEAR)
            assert np.array_equal(np.asarray(ds.images[i]), np.asarray(want))


def test_crops_are_deterministic_and_the_size_only_renders_them(photographs):
    first = FinePhotoCropsDataset("val", size=16, photographs=photographs, **SMALL)
    again = FinePhotoCropsDataset("val", size=16, photographs=photographs, **SMALL)
    assert again.boxes == first.boxes and again.targets == first.targets
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(again.images, first.images))
    larger = FinePhotoCropsDataset("val", size=40, photographs=photographs, **SMALL)
    assert larger.boxes == first.boxes and {im.size for im in larger.images} == {(40, 40)}
    # the positions come from fixed seeds per split and class, not from the global random state
    np.random.seed(123)
    assert FinePhotoCropsDataset("val", size=16, photographs=photographs, **SMALL).boxes == first.boxes
    assert len(set(first.boxes)) > 1


def test_missing_photographs_name_the_packages_to_install(photographs, tmp_path):
    gone = [("x", "pkg-x", str(tmp_path / "nowhere.jpg"))]
    assert missing_photographs(photographs) == [] and missing_photographs(gone + photographs) == [gone[0][2]]
    with pytest.raises(FileNotFoundError, match=r"^dataset 'photos_fine': 1 of its photographs are not installed "
                                                r"\(first: .*nowhere\.jpg\); install them with: apt-get install "
                                                r"pkg-x$"):
        FinePhotoCropsDataset("train", photographs=gone + photographs, **SMALL)


def test_parts_smaller_than_a_crop_and_bad_splits_fail_in_one_line(photographs):
    with pytest.raises(ValueError, match=r"^photographs: the val part .* is smaller than a crop of 40 px$"):
        FinePhotoCropsDataset("val", photographs=photographs, short_side=90, crop=40)
    with pytest.raises(ValueError, match="split: expected 'train' or 'val', got 'test'"):
        FinePhotoCropsDataset("test", photographs=photographs, **SMALL)


def test_ci_installs_the_packages_the_set_reads():
    """CI's entry point installs the packages PHOTOGRAPHS names, so the real set is tested there."""
    with open(os.path.join(os.path.dirname(__file__), "..", ".ci", "run")) as f:
        ci = f.read()
    assert PACKAGES == ("plasma-workspace-wallpapers", "lomiri-wallpapers-16.04")
    assert all(f" {p}" in ci for p in PACKAGES)


@pytest.mark.skipif(bool(missing_photographs()), reason="photos_fine needs its photographs: apt-get install "
                                                        + " ".join(PACKAGES))
def test_the_real_set_from_the_wallpaper_packages():
    from linvision.data.datasets import create_dataset

    train = create_dataset("photos_fine", None, "train", digits_size=96)
    val = create_dataset("photos_fine", None, "val", digits_size=96)
    assert train.classes == val.classes == [name for name, _, _ in PHOTOGRAPHS] and len(train.classes) == 12
    assert np.bincount(train.targets).tolist() == [120] * 12 and np.bincount(val.targets).tolist() == [40] * 12
    assert {im.size for im in train.images[::97] + val.images[::31]} == {(96, 96)}
    for label in range(12):
        photo = train._photograph(train.classes[label])
        assert min(photo.size) == 640
        cut = _cut(train, label)
        assert max(r for (_, _, r, _), t in zip(train.boxes, train.targets) if t == label) <= cut
        assert min(l for (l, _, _, _), t in zip(val.boxes, val.targets) if t == label) >= cut
    # the crops are photographs, not flat fills: every class's crops vary within and between themselves
    pixels = np.stack([np.asarray(im, dtype=np.float64) for im in val.images])
    assert all(pixels[np.array(val.targets) == c].std() > 5 for c in range(12))
