"""The benchmark with a segmentation head of segmentation_models_pytorch, non-square sizes and a per-point time
budget."""
import json
import math
import sys

import pytest
import torch

from linvision.benchmark.plots import plot_results
from linvision.benchmark.throughput import (
    add_comparisons,
    benchmark_point,
    benchmark_point_with_timeout,
    check_decoder,
    comparison_table,
    parse_img_size,
    run_sweep,
    size_label,
)
from linvision.training.segmenter import build_segmenter

smp = pytest.importorskip("segmentation_models_pytorch")

TINY = {"depths": (1, 1, 1, 1), "dims": (16, 16, 32, 32), "num_heads": (1, 1, 2, 2)}
LINEAR, SOFTMAX = "linhier_tiny_224", "linhier_tiny_224:token_mixers=softmax"


def test_sizes_square_or_height_by_width():
    assert parse_img_size(512) == parse_img_size("512") == parse_img_size("512x512") == 512
    assert parse_img_size("2048x1024") == parse_img_size([2048, 1024]) == (2048, 1024)
    assert size_label(512) == 512 and size_label("2048x1024") == "2048x1024"
    for bad in ("2048x", "x1024", "big", "0", "1x2x3"):
        with pytest.raises(ValueError, match="img_size"):
            parse_img_size(bad)


def test_segmenter_point_at_a_non_square_size():
    """smp's Segformer on a tiny linhier at 64 x 96: measured, with smp's own parameter count and the size as
    measured; the training step's loss is per-pixel cross-entropy (finite figures, memory above inference)."""
    p = benchmark_point("linhier_tiny_224", "64x96", batch_size=1, iters=1, warmup=0, decoder="segformer",
                        classes=3, model_kwargs=TINY)
    assert p["status"] == "ok", p["error"]
    assert (p["img_size"], p["height"], p["width"], p["pixels"]) == ("64x96", 64, 96, 64 * 96)
    assert (p["decoder"], p["classes"]) == ("segformer", 3)
    own = smp.Segformer("tu-linhier_tiny_224", encoder_weights=None, classes=3, **TINY)
    assert p["params_m"] == pytest.approx(sum(t.numel() for t in own.parameters()) / 1e6)
    assert p["gflops"] > 0 and p["infer_ms"] > 0 and p["train_ms"] > 0
    model = build_segmenter("segformer", "linhier_tiny_224", 3, dict(TINY, token_mixers="softmax"))
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 64, 96)).shape == (1, 3, 64, 96)


@pytest.mark.parametrize("decoder, name, kwargs", [
    ("fpn", "linhier_tiny_224", TINY),
    ("dpt", "linvit_tiny_patch16_224", {"embed_dim": 48, "num_heads": 2}),
])
def test_a_point_measures_the_segmenter_linvision_train_seg_builds(decoder, name, kwargs):
    """The benchmark's segmenter is segmenter.build_segmenter's: the same parameters, FPN among the heads, and DPT
    on a linvit with a fixed-size position embedding at 64 x 96 (dynamic_img_size, as in training)."""
    p = benchmark_point(name, "64x96", batch_size=1, iters=1, warmup=0, decoder=decoder, classes=3,
                        model_kwargs=kwargs, train=False, flops=False)
    assert p["status"] == "ok", p["error"]
    own = build_segmenter(decoder, name, 3, kwargs)
    assert p["params_m"] == pytest.approx(sum(t.numel() for t in own.parameters()) / 1e6)
    assert p["infer_ms"] > 0


def test_twin_sweep_with_sizes_as_measured(tmp_path):
    """A linear model against its softmax twin, a square and a non-square size: the ratio columns, the table
    and a plot whose x axis is the pixel count."""
    points = run_sweep([LINEAR, SOFTMAX], [64, "64x96"], str(tmp_path), log=lambda s: None, batch_size=1,
                       iters=1, warmup=0, train=False, flops=False, decoder="unet", classes=2, model_kwargs=TINY)
    assert [(p["model"], p["img_size"], p["status"]) for p in points] == [
        (LINEAR, 64, "ok"), (LINEAR, "64x96", "ok"), (SOFTMAX, 64, "ok"), (SOFTMAX, "64x96", "ok")]
    add_comparisons(points, twin=SOFTMAX)
    for p in points:
        assert {"infer_ms_vs_twin", "infer_mem_mb_vs_twin", "train_ms_vs_twin", "train_mem_mb_vs_twin"} <= set(p)
        t = next(q for q in points if q["model"] == SOFTMAX and q["img_size"] == p["img_size"])
        assert p["infer_ms_vs_twin"] == pytest.approx(p["infer_ms"] / t["infer_ms"])
        assert math.isnan(p["train_ms_vs_twin"])  # no training step measured
    assert f"| {LINEAR} | 64x96 |" in comparison_table(points)
    with open(tmp_path / "results.jsonl") as f:
        assert [json.loads(line)["pixels"] for line in f] == [4096, 4096, 6144, 6144]  # as each size finishes
    assert plot_results(points, str(tmp_path / "plot.png"))


def test_a_point_past_its_time_budget_is_stopped_and_recorded():
    p = benchmark_point_with_timeout("linhier_tiny_224", "64x96", 0.2, batch_size=1, iters=1, warmup=0,
                                     decoder="segformer", model_kwargs=TINY)
    assert p["status"] == "timeout" and "0.2 s budget: inference not finished" in p["error"]
    assert p["img_size"] == "64x96" and math.isnan(p["infer_ms"])


def test_unknown_decoder_or_missing_smp_fails_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match="decoder: unknown 'upernett'; one of unet, fpn, segformer, upernet"):
        check_decoder("upernett")
    monkeypatch.setitem(sys.modules, "segmentation_models_pytorch", None)  # as if not installed
    with pytest.raises(ValueError, match=r'pip install "linvision\[seg\]"'):
        check_decoder("upernet")


def test_cli_refuses_an_unknown_decoder_before_measuring(tmp_path, monkeypatch, capsys):
    from linvision.tools import benchmark as tool

    monkeypatch.setattr(sys, "argv", ["linvision-benchmark", "--model", "linhier_tiny_224", "--decoder", "upernett",
                                      "--img-size", "64x96", "--output", str(tmp_path), "--experiment", "x"])
    with pytest.raises(SystemExit) as e:
        tool.cli()
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: decoder: unknown 'upernett'; one of unet, fpn, segformer, upernet, dpt"]
    assert not (tmp_path / "x").exists()
