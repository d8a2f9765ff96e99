"""The segmentation ablation (--task segment): each mixer's segmenter is trained on the offline mosaics, and the
mIoU and pixel accuracy reported per evaluation size are those of the run's saved best/ on the validation
mosaics rendered at that size, computed here from an explicit confusion matrix in float64. A benchmark size the
time limit rules out is recorded as skipped; a dataset other than the mosaics is one error.

Tiny encoders (one block per stage, 8-16 channels), 64 px crops of 128 px mosaics, one epoch."""
import argparse
import json

import numpy as np
import pytest
import torch

pytest.importorskip("segmentation_models_pytorch")

from linvision.experiments.ablate import add_ablate_args, run_ablation  # noqa: E402
from linvision.utils.config import parse_args  # noqa: E402
from linvision.data.mosaic import MosaicSegmentation  # noqa: E402
from linvision.data.segmentation import JointTransform  # noqa: E402
from linvision.training.segmenter import load_segmenter  # noqa: E402

VAL = 2


def _args(tmp_path, *extra):
    flags = ["--task", "segment", "--dataset", "mosaic", "--mosaic-size", "128", "--mosaic-train", "4",
             "--mosaic-val", str(VAL), "--img-size", "64", "--model", "linhier_tiny_224", "--decoder", "segformer",
             "--decoder-kwargs", "decoder_segmentation_channels=16",
             "--model-kwargs", '{"depths": [1, 1, 1, 1], "dims": [8, 16, 16, 16], "num_heads": [1, 1, 1, 1]}',
             "--epochs", "1", "--batch-size", "4", "--lr", "0.003", "--eval-sizes", "128", "256",
             "--bench-sizes", "64", "128", "--bench-batch-size", "1", "--bench-iters", "1", "--device", "cpu",
             "--output", str(tmp_path), "--experiment", "ab", "--no-progress", *extra]
    return parse_args(add_ablate_args(argparse.ArgumentParser()), flags)


def _confusion_scores(run_dir, size):
    """mIoU and pixel accuracy (%) of run_dir's best/ on the first VAL validation mosaics at ``size``."""
    model, meta = load_segmenter(run_dir)
    transform = JointTransform(meta["mean"], meta["std"])
    n = meta["num_classes"]
    confusion = np.zeros((n, n), dtype=np.float64)
    for mosaic in (MosaicSegmentation("val", size, VAL).mosaic(i) for i in range(VAL)):
        image, mask = transform(mosaic.image, mosaic.mask)
        with torch.no_grad():
            pred = model(image[None])[0].argmax(0).numpy()
        confusion += np.bincount(mask.numpy().ravel() * n + pred.ravel(), minlength=n * n).reshape(n, n)
    tp = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - tp
    iou = tp[union > 0] / union[union > 0]
    return 100 * iou.mean(), 100 * tp.sum() / confusion.sum()


def test_segmentation_ablation_scores_each_runs_best_at_each_size(tmp_path):
    result = run_ablation(_args(tmp_path, "--mixers", "none", "linear_rope", "--bench-time-limit", "0"),
                          log=lambda m: None)
    assert [r["mixer"] for r in result["rows"]] == ["none", "linear_rope"]
    table = (tmp_path / "ab" / "ablation.md").read_text()
    for col in ("mIoU @128", "mIoU @256", "pixel acc @128", "pixel acc @256", "infer img/s @64"):
        assert f"| {col} |" in table or f" {col} |" in table
    with open(tmp_path / "ab" / "ablation.json") as f:
        saved = json.load(f)
    for row in saved["rows"]:
        run_dir = tmp_path / "ab" / "runs" / row["mixer"]
        with open(run_dir / "summary.json") as f:
            summary = json.load(f)
        for size in (128, 256):
            miou, pixel_acc = _confusion_scores(str(run_dir), size)
            assert row["miou"][str(size)] == pytest.approx(miou, abs=1e-6)
            assert row["pixel_acc"][str(size)] == pytest.approx(pixel_acc, abs=1e-6)
            assert f"| {row['mixer']} | {row['params_m']:.3f} |" in table and f"| {miou:.2f} |" in table
        # the validation of training is the 128 px mosaics: its best is the 128 px column
        assert row["miou"]["128"] == pytest.approx(summary["best_miou"], abs=1e-9)
        assert row["miou_std"]["128"] == 0.0 and row["runs"][0]["seed"] == 0
        assert row["bench"]["64"]["status"] == "ok" and row["bench"]["64"]["infer_img_s"] > 0
        assert row["bench"]["128"]["status"] == "skipped"
        assert "over --bench-time-limit 0 s" in row["bench"]["128"]["error"]
    assert saved["task"] == "segment" and saved["decoder"] == "segformer" and saved["eval_sizes"] == [128, 256]
    assert "linear_rope benchmark @128: skipped" in table
    assert (tmp_path / "ab" / "accuracy.png").stat().st_size > 0


def test_segmentation_ablation_needs_the_mosaics(tmp_path):
    with pytest.raises(ValueError, match="dataset: the segmentation ablation evaluates on the mosaics"):
        run_ablation(_args(tmp_path, "--mixers", "none", "--dataset", "folder"), log=lambda m: None)
    with pytest.raises(ValueError, match="eval_sizes: the mosaics are rendered at 128 to 1024 px"):
        run_ablation(_args(tmp_path, "--mixers", "none", "--eval-sizes", "64"), log=lambda m: None)
