"""The plots of the benchmark and the ablation, read through matplotlib's objects: the medians and the bars of their
timed runs, one colour and marker per series, the legend outside the panels, and titles that say what a point is."""
import math

import matplotlib
import pytest
from matplotlib.colors import to_hex
from matplotlib.container import ErrorbarContainer

from linvision.experiments.ablate import _accuracy_figure
from linvision.benchmark.plots import results_figure, series_styles
from linvision.benchmark.throughput import _empty_point, benchmark_point, runs_phrase, timing, write_results

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _point(model, size, seconds, status="ok"):
    """A point of batch 2 whose timed runs took ``seconds`` (the same for training, doubled)."""
    p = _empty_point(model, size, 2, "cpu", "none", len(seconds))
    p.update(timing("infer", seconds, 2), infer_mem_mb=10.0 * size)
    p.update(timing("train", [2 * s for s in seconds], 2), train_mem_mb=30.0 * size)
    p["status"] = status
    return p


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _legend_outside(fig, legend):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        if ax.get_visible():
            assert not _overlap(box, ax.get_window_extent(renderer)), f"the legend covers {ax.get_title()!r}"


def test_timing_keeps_the_median_and_the_range():
    t = timing("infer", [0.3, 0.1, 1.0, 0.2, 0.4], 4)  # seconds of five runs of a batch of 4
    assert t["infer_ms"] == pytest.approx(300.0) and t["infer_img_s"] == pytest.approx(4 / 0.3)
    assert t["infer_ms_min"] == pytest.approx(100.0) and t["infer_ms_max"] == pytest.approx(1000.0)
    assert t["infer_img_s_min"] == pytest.approx(4 / 1.0) and t["infer_img_s_max"] == pytest.approx(4 / 0.1)
    assert t["infer_spread_pct"] == pytest.approx(100 * 0.9 / 0.3)
    even = timing("train", [0.1, 0.4, 0.2, 0.3], 1)
    assert even["train_ms"] == pytest.approx(250.0)  # the mean of the middle two
    one = timing("train", [0.5], 1)
    assert one["train_img_s"] == one["train_img_s_min"] == one["train_img_s_max"] == 2.0
    assert one["train_spread_pct"] == 0.0


def test_point_and_results_files_record_median_and_spread(tmp_path):
    """A measured point has the median between its fastest and slowest run, throughput and time agree, and
    results.json/results.csv carry every one of those figures."""
    from torch import nn

    p = benchmark_point("flat", 8, batch_size=2, iters=5, warmup=0, flops=False,
                        build_fn=lambda *a: nn.Sequential(nn.Flatten(), nn.Linear(3 * 64, 2)))
    assert p["status"] == "ok" and p["iters"] == 5
    for kind in ("infer", "train"):
        assert p[f"{kind}_ms_min"] <= p[f"{kind}_ms"] <= p[f"{kind}_ms_max"]
        assert p[f"{kind}_img_s_min"] <= p[f"{kind}_img_s"] <= p[f"{kind}_img_s_max"]
        assert p[f"{kind}_img_s"] * p[f"{kind}_ms"] == pytest.approx(2000.0)
        assert p[f"{kind}_img_s_min"] * p[f"{kind}_ms_max"] == pytest.approx(2000.0)
        assert p[f"{kind}_spread_pct"] == pytest.approx(
            100 * (p[f"{kind}_ms_max"] - p[f"{kind}_ms_min"]) / p[f"{kind}_ms"])
    write_results([p], str(tmp_path))
    header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    for key in ("infer_ms", "infer_ms_min", "infer_ms_max", "infer_img_s", "infer_img_s_min", "infer_img_s_max",
                "infer_spread_pct", "train_ms_min", "train_img_s_max", "train_spread_pct"):
        assert key in header


def test_throughput_panels_draw_medians_with_the_range_of_their_runs():
    runs = {"a": [0.10, 0.12, 0.30, 0.11, 0.13], "b": [0.2, 0.21, 0.22, 0.5, 0.2], "c": [0.4, 0.41, 0.39, 0.5, 0.6]}
    points = [_point(m, size, [s * size / 32 for s in seconds]) for m, seconds in runs.items() for size in (32, 64)]
    points.append(_empty_point("c", 128, 2, "cpu", "none", 5))
    points[-1]["status"] = "timeout"
    fig = results_figure(points, title="cpu, batch 2")
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(axes) == {"inference images/s", "training images/s", "inference peak memory (MiB)",
                         "training peak memory (MiB)"}
    assert fig.get_suptitle() == "cpu, batch 2\nimages/s: median of 5 timed runs per point; memory: peak " \
                                       "added by a pass"
    (legend,) = fig.legends
    _legend_outside(fig, legend)
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[:3] == ["a", "b", "c"]
    assert "images/s: bar from the slowest to the fastest timed run" in labels
    assert "not measured (timeout), in the series' colour" in labels
    series = legend.legend_handles[:3]
    assert len({to_hex(h.get_color()) for h in series}) == 3 and len({h.get_marker() for h in series}) == 3
    for key, title in (("infer_img_s", "inference images/s"), ("train_img_s", "training images/s")):
        bars = [c for c in axes[title].containers if isinstance(c, ErrorbarContainer)]
        assert [c.get_label() for c in bars] == ["a", "b", "c"]
        for container, model in zip(bars, "abc"):
            line, _, (barlines,) = container.lines
            mine = [p for p in points if p["model"] == model and p["status"] == "ok"]
            assert list(line.get_ydata()) == pytest.approx([p[key] for p in mine])
            spans = [sorted(seg[:, 1]) for seg in barlines.get_segments()]
            assert spans == [pytest.approx([p[f"{key}_min"], p[f"{key}_max"]]) for p in mine]
            assert to_hex(line.get_color()) == to_hex(legend.legend_handles["abc".index(model)].get_color())
    for title in ("inference peak memory (MiB)", "training peak memory (MiB)"):  # one peak per point: no bars
        assert not [c for c in axes[title].containers if isinstance(c, ErrorbarContainer)]
        crosses = [line for line in axes[title].get_lines() if line.get_marker() == "x"]
        assert [list(line.get_xdata()) for line in crosses] == [[128]]


def test_one_timed_run_has_no_bar_and_says_one_run():
    points = [_point(m, size, [0.1 * size / 32]) for m in ("a", "b") for size in (32, 64)]
    fig = results_figure(points)
    assert fig.get_suptitle() == "images/s: 1 timed run per point; memory: peak added by a pass"
    assert not [c for ax in fig.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]
    assert results_figure([_empty_point("a", 32, 2, "cpu", "none", 1) | {"status": "error"}]) is None


def test_series_styles_and_the_words_for_the_runs():
    styles = series_styles(11)
    assert len({s["color"] for s in styles}) == 11 and len({s["marker"] for s in styles}) == 11
    assert len({tuple(s.values()) for s in series_styles(30)}) == 30
    assert runs_phrase(1) == "1 timed run" and runs_phrase(10) == "median of 10 timed runs"
    assert runs_phrase([2, 5, 2]) == "median of 2 to 5 timed runs" and runs_phrase([3]) == "median of 3 timed runs"


def _ablation(mixers, seeds):
    rows = []
    for k, mixer in enumerate(mixers):
        rows.append({"mixer": mixer, "accuracy": {"64": 90.0 - k, "96": 70.0 - 2 * k, "128": 50.0 - 3 * k},
                     "accuracy_std": {"64": 1.0 + k / 10, "96": 2.0, "128": 3.0 if len(seeds) > 1 else 0.0}})
    if len(seeds) == 1:
        for row in rows:
            row["accuracy_std"] = {s: 0.0 for s in row["accuracy"]}
    return {"task": "classify", "model": "linhier_tiny_224", "dataset": "photos", "img_size": 64,
            "eval_sizes": [64, 96, 128], "seeds": seeds, "seed": seeds[0], "rows": rows}


def test_accuracy_plot_of_several_seeds():
    """Eleven mixers over three seeds: eleven colours and markers, a bar of plus and minus the standard deviation
    at every point, and the legend to the right of the axes, clear of every point (64 px ones included)."""
    mixers = ["none", "linear", "linear_rope", "softmax", "hybrid", "bidir_delta", "pola", "inline", "rala", "mala",
              "agent"]
    result = _ablation(mixers, [0, 1, 2])
    fig = _accuracy_figure(result)
    (ax,) = fig.axes
    _legend_outside(fig, ax.get_legend())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == mixers
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 11
    lines = [c.lines[0] for c in bars]
    assert len({to_hex(line.get_color()) for line in lines}) == 11 and len({line.get_marker() for line in lines}) == 11
    for container, row in zip(bars, result["rows"]):
        line, _, (barlines,) = container.lines
        assert list(line.get_ydata()) == pytest.approx([row["accuracy"][s] for s in ("64", "96", "128")])
        spans = [sorted(seg[:, 1]) for seg in barlines.get_segments()]
        assert spans == [pytest.approx([row["accuracy"][s] - row["accuracy_std"][s],
                                        row["accuracy"][s] + row["accuracy_std"][s]]) for s in ("64", "96", "128")]
        # set apart sideways by less than a tenth of an octave
        assert all(abs(math.log2(x / s)) < 0.1 for x, s in zip(line.get_xdata(), (64, 96, 128)))
    title = ax.get_title()
    assert title.startswith("linhier_tiny_224, photos data: top-1 per token mixer")
    assert "mean of seeds 0, 1, 2, its bar ± their sample standard deviation" in title


def test_accuracy_plot_of_one_seed_draws_no_spread():
    result = _ablation(["none", "linear", "softmax"], [0])
    fig = _accuracy_figure(result)
    (ax,) = fig.axes
    assert not [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[64, 96, 128]] * 3  # none moved sideways
    assert "one seed (0): no spread to show" in ax.get_title() and "±" not in ax.get_title()
    _legend_outside(fig, ax.get_legend())
