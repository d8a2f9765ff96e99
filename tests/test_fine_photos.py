"""The fine-grained photo sets (photos_fine, and photos_scale at varied crop scale): the builder's logic on
photographs the test makes, and the real sets from the Debian wallpaper packages where they are installed."""
import math
import os

import numpy as np
import pytest
from PIL import Image

from linvision.data.fine_photos import (PACKAGES, PHOTOGRAPHS, SCALE_PACKAGES, SCALE_PHOTOGRAPHS, SCALE_RANGE,
                                        FinePhotoCropsDataset, ScalePhotoCropsDataset, missing_photographs,
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
    assert SCALE_PACKAGES == ("mate-backgrounds",)
    assert all(f" {p}" in ci for p in PACKAGES + SCALE_PACKAGES)


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


# photos_scale's logic: crops whose side is drawn from a range of the scaled photograph's height
RANGE = dict(short_side=90, per_class={"train": 30, "val": 12}, crop_range=(1 / 6, 1 / 3))


def test_crop_sides_are_drawn_from_the_range_of_each_photographs_height(photographs):
    photographs = photographs[:2]  # landscape and square: a third of the height fits a third of the width
    train = FinePhotoCropsDataset("train", size=16, photographs=photographs, **RANGE)
    val = FinePhotoCropsDataset("val", size=16, photographs=photographs, **RANGE)
    assert np.bincount(train.targets).tolist() == [30] * 2 and np.bincount(val.targets).tolist() == [12] * 2
    assert {im.size for im in train.images + val.images} == {(16, 16)}
    for label in range(2):
        w, h = train._photograph(train.classes[label]).size  # (150, 90), (90, 90): crops of 15 to 30 px
        low, high = math.ceil(h / 6), math.floor(h / 3)
        assert train.crop_sides(h) == (low, high)
        cut = _cut(train, label)
        tboxes = [b for b, t in zip(train.boxes, train.targets) if t == label]
        vboxes = [b for b, t in zip(val.boxes, val.targets) if t == label]
        sides = [r - l for l, _, r, _ in tboxes + vboxes]
        # square, inside the range, and of more than one scale within a class
        assert all(r - l == b - t for l, t, r, b in tboxes + vboxes)
        assert min(sides) >= low and max(sides) <= high and len(set(sides)) > 3
        assert all(0 <= t and b <= h for _, t, _, b in tboxes + vboxes)
        # the training and validation parts never share a pixel, whatever a crop's size
        assert min(l for l, _, _, _ in tboxes) >= 0 and max(r for _, _, r, _ in tboxes) <= cut
        assert min(l for l, _, _, _ in vboxes) >= cut and max(r for _, _, r, _ in vboxes) <= w
    # each image is its box of the scaled photograph, resized (bilinear) to the size asked for
    for ds in (train, val):
        for i in (0, len(ds) // 2, len(ds) - 1):
            photo = scaled_photograph(photographs[ds.targets[i]][2], 90)
            want = photo.crop(ds.boxes[i]).resize((16, 16), Image.BILINEAR)
            assert np.array_equal(np.asarray(ds.images[i]), np.asarray(want))


def test_varied_crops_are_deterministic_and_the_size_only_renders_them(photographs):
    photographs = photographs[:2]
    first = FinePhotoCropsDataset("train", size=16, photographs=photographs, **RANGE)
    np.random.seed(7)
    again = FinePhotoCropsDataset("train", size=40, photographs=photographs, **RANGE)
    assert again.boxes == first.boxes and {im.size for im in again.images} == {(40, 40)}
    # a range of one side is the fixed crop: the same boxes as photos_fine's builder draws
    fixed = FinePhotoCropsDataset("val", size=16, photographs=photographs, short_side=90, crop=24,
                                  per_class={"train": 7, "val": 4})
    assert fixed.crop_range is None and fixed.crop_sides(90) == (24, 24)


def test_a_bad_range_and_parts_smaller_than_the_largest_crop_fail_in_one_line(photographs):
    for bad in ((0.0, 0.5), (0.5, 0.25), (0.2, 1.5)):
        with pytest.raises(ValueError, match=r"^crop_range: expected fractions 0 < low <= high <= 1 of the "
                                             r"photograph's height, got "):
            FinePhotoCropsDataset("train", photographs=photographs, short_side=90, crop_range=bad)
    # the validation part of the 90 x 90 photograph is 30 px wide: too narrow for crops up to 45 px (and that
    # of the 90 x 144 portrait one for a third of its height, 48 px)
    photographs = photographs[:2]
    with pytest.raises(ValueError, match=r"^photographs: the val part \(60, 0, 90, 90\) of .*b\.png \(scaled to "
                                         r"90 x 90\) is smaller than a crop of 45 px$"):
        FinePhotoCropsDataset("val", photographs=photographs, short_side=90, crop_range=(1 / 6, 1 / 2))


def test_photos_scale_reads_other_photographs_and_names_its_package(photographs, tmp_path):
    photographs = photographs[:2]
    assert len(SCALE_PHOTOGRAPHS) == 12 and SCALE_RANGE == (1 / 6, 1 / 3)
    assert len({name for name, _, _ in SCALE_PHOTOGRAPHS}) == 12
    assert not {path for _, _, path in SCALE_PHOTOGRAPHS} & {path for _, _, path in PHOTOGRAPHS}
    ds = ScalePhotoCropsDataset("val", size=16, photographs=photographs, short_side=90,
                                per_class={"train": 5, "val": 3})
    assert ds.crop_range == SCALE_RANGE and ds.classes == ["a", "b"]
    gone = [("x", "mate-backgrounds", str(tmp_path / "nowhere.jpg"))]
    with pytest.raises(FileNotFoundError, match=r"^dataset 'photos_scale': 1 of its photographs are not installed "
                                                r"\(first: .*nowhere\.jpg\); install them with: apt-get install "
                                                r"mate-backgrounds$"):
        ScalePhotoCropsDataset("train", photographs=gone + photographs)


def test_photos_scale_is_a_dataset_name_of_the_tools():
    from linvision.data.datasets import DATASET_NAMES, _check_name

    assert "photos_scale" in DATASET_NAMES
    with pytest.raises(ValueError, match=r"did you mean 'photos_scale'\?"):
        _check_name("photos_scal")


@pytest.mark.skipif(bool(missing_photographs(SCALE_PHOTOGRAPHS)),
                    reason="photos_scale needs its photographs: apt-get install " + " ".join(SCALE_PACKAGES))
def test_the_real_varied_scale_set_from_the_wallpaper_package():
    from linvision.data.datasets import create_dataset

    train = create_dataset("photos_scale", None, "train", digits_size=96)
    val = create_dataset("photos_scale", None, "val", digits_size=96)
    assert train.classes == val.classes == [name for name, _, _ in SCALE_PHOTOGRAPHS] and len(train.classes) == 12
    assert np.bincount(train.targets).tolist() == [120] * 12 and np.bincount(val.targets).tolist() == [40] * 12
    assert {im.size for im in train.images[::97] + val.images[::31]} == {(96, 96)}
    for label in range(12):
        photo = train._photograph(train.classes[label])
        assert min(photo.size) == 640 and photo.height == 640  # every photograph is landscape
        cut = _cut(train, label)
        tboxes = [b for b, t in zip(train.boxes, train.targets) if t == label]
        vboxes = [b for b, t in zip(val.boxes, val.targets) if t == label]
        assert max(r for _, _, r, _ in tboxes) <= cut and min(l for l, _, _, _ in vboxes) >= cut
        sides = np.array([r - l for l, _, r, _ in tboxes + vboxes])
        # 107 to 213 px of 640, spread over the range in both splits
        assert sides.min() >= 107 and sides.max() <= 213 and 140 < sides.mean() < 180
        assert min(r - l for l, _, r, _ in vboxes) < 125 and max(r - l for l, _, r, _ in vboxes) > 195
    # the crops are photographs, not flat fills: every class's crops vary within and between themselves
    pixels = np.stack([np.asarray(im, dtype=np.float64) for im in val.images])
    assert all(pixels[np.array(val.targets) == c].std() > 5 for c in range(12))
