"""Figures of benchmark points (:mod:`linvision.benchmark.throughput`): throughput and peak memory against
resolution (:func:`plot_results`), and the series styles and sideways dodge that the other figures of the tools
share (:func:`series_styles`, :func:`dodge`).

:func:`results_figure` draws in steps, each a function below: what the figure shows (the panels with anything
measured, the series, their styles and the x positions), the legend's entries and shape, each panel's series and
its axes, then the tick labels thinned where they would overlap.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .throughput import BenchmarkPoint, _figure, _hw, runs_phrase, unreliable_heading, unreliable_note

__all__ = ["COLOURS", "MARKERS", "LINESTYLES", "series_styles", "dodge", "results_figure", "plot_results"]

# Qualitative colours (matplotlib's tab10, then black), each series with a marker of its own as well; past eleven
# series the colours come round again with another line style and shifted markers, so no two series look alike.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#000000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
LINESTYLES = ("-", "--", ":", "-.")


def series_styles(n: int) -> List[Dict[str, str]]:
    """Colour, marker and line style of each of ``n`` series: :data:`COLOURS` in turn with :data:`MARKERS`;
    after the eleventh the same colours dashed (then dotted), the markers shifted by one."""
    styles = []
    for k in range(n):
        cycle, i = divmod(k, len(COLOURS))
        styles.append({"color": COLOURS[i], "marker": MARKERS[(i + cycle) % len(MARKERS)],
                       "linestyle": LINESTYLES[cycle % len(LINESTYLES)]})
    return styles


def dodge(k: int, n: int, width: float) -> float:
    """The factor that moves series ``k`` of ``n`` sideways on a log axis, all of them spread over ``width``
    octaves around the true position, so that the bars of one size do not hide each other."""
    return 2 ** ((k - (n - 1) / 2) * width / max(n - 1, 1)) if n > 1 else 1.0


def _spread_handle(label: str):
    """A legend entry that shows a grey point with its bar."""
    from matplotlib.collections import LineCollection
    from matplotlib.container import ErrorbarContainer
    from matplotlib.lines import Line2D

    point = Line2D([], [], color="0.35", marker="o", ms=4, linestyle="none")
    return ErrorbarContainer((point, (), (LineCollection([], colors="0.35"),)), has_xerr=False, has_yerr=True,
                             label=label)


# (key, title) of each panel, in the order they are drawn; a panel with nothing measured is left out
PANELS = (("infer_img_s", "inference images/s"), ("train_img_s", "training images/s"),
          ("infer_mem_mb", "inference peak memory (MiB)"), ("train_mem_mb", "training peak memory (MiB)"))


def _measured(p: BenchmarkPoint, key: str) -> bool:
    """Whether ``p`` has the figure ``key``: a point stopped after its inference keeps those figures."""
    return (p["status"] == "ok" or p["status"] == "timeout") and _figure(p.get(key)) and p[key] > 0


def _has_spread(p: BenchmarkPoint, key: str) -> bool:
    """Whether ``key`` is a throughput figure of ``p`` of several runs, with their range."""
    return (key.endswith("_img_s") and p.get("iters", 1) > 1 and _measured(p, key)
            and _figure(p.get(f"{key}_min")) and _figure(p.get(f"{key}_max")))


def _number(value: float, _pos=None) -> str:
    """A tick label: the value as written, without trailing zeros."""
    return f"{value:g}"


@dataclass
class _Plan:
    """What the figure of :func:`results_figure` shows, worked out before anything is drawn."""

    points: List[BenchmarkPoint]
    label_key: str  # the point's field that names its series
    panels: List[Tuple[str, str]]  # (key, title) of the panels with anything measured
    names: List[str]  # the series, in the order of their first point
    styles: Dict[str, Dict[str, str]]  # of each series, from series_styles
    square: bool  # every size square: x is the side, else the pixel count
    runs: List[int]  # the timed-run counts of the points drawn
    bars: bool  # whether any throughput point has a bar (the series are then dodged)
    ticks: Dict[int, str]  # x of each size -> its label
    width: float  # the octaves the series of one size are spread over
    not_measured: List[str]  # the statuses of points missing from a panel
    unreliable: str  # unreliable_note of the points: '' when every timing stands

    @property
    def sizes(self) -> List[int]:
        """The x of each size, in order."""
        return sorted(self.ticks)

    def x_of(self, p: BenchmarkPoint) -> int:
        """Where ``p`` sits on the x axis."""
        return _x_of(p, self.square)

    def measured(self, name: str, key: str) -> List[BenchmarkPoint]:
        """The points of series ``name`` with the figure ``key``."""
        return [p for p in self.points if str(p[self.label_key]) == name and _measured(p, key)]

    def failed(self, name: str, key: str) -> List[BenchmarkPoint]:
        """The points of series ``name`` that failed before measuring ``key``."""
        return [p for p in self.points if str(p[self.label_key]) == name and not _measured(p, key)
                and p["status"] != "ok"]


def _x_of(p: BenchmarkPoint, square: bool) -> int:
    """Where ``p`` sits on the x axis: its side when every size is ``square``, else its pixel count."""
    if square:
        return p["img_size"]
    h, w = _hw(p["img_size"])
    return h * w


def _plan(points: List[BenchmarkPoint], label_key: str) -> Optional[_Plan]:
    """The plan of the figure of ``points``, one series per distinct ``point[label_key]``; None when no point
    measured anything."""
    # A panel with nothing measured (e.g. training with --no-train) would have no log scale: leave it out.
    panels = [(key, label) for key, label in PANELS if any(_measured(p, key) for p in points)]
    if not panels:
        return None
    square = all(isinstance(p["img_size"], int) for p in points)
    names = list(dict.fromkeys(str(p[label_key]) for p in points))
    runs = sorted({int(p["iters"]) for p in points if _figure(p.get("iters")) and p["iters"] >= 1
                   and any(_measured(p, key) for key, _ in panels)})
    ticks = {_x_of(p, square): str(p["img_size"]) for p in points}
    sizes = sorted(ticks)
    gaps = [math.log2(b / a) for a, b in zip(sizes, sizes[1:])]
    not_measured = sorted({p["status"] for p in points for key, _ in panels
                           if not _measured(p, key) and p["status"] != "ok"})
    return _Plan(points, label_key, panels, names, styles=dict(zip(names, series_styles(len(names)))),
                 square=square, runs=runs, bars=any(_has_spread(p, key) for p in points for key, _ in panels),
                 ticks=ticks, width=min([0.12] + [0.25 * g for g in gaps]), not_measured=not_measured,
                 unreliable=unreliable_note(points))


def _legend_handles(plan: _Plan) -> list:
    """The legend's entries: each series, what the bars are (when there are any) and the x of a point not
    measured (with the statuses, when there is one)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ms=5, label=name, **plan.styles[name]) for name in plan.names]
    if plan.bars:
        handles.append(_spread_handle("images/s: bar from the slowest to the fastest timed run"))
    if plan.not_measured:
        handles.append(Line2D([], [], marker="x", color="0.35", linestyle="none", ms=7,
                              label=f"not measured ({', '.join(plan.not_measured)}), in the series' colour"))
    if plan.unreliable:
        handles.append(Line2D([], [], marker="o", ms=11, markerfacecolor="none", markeredgecolor="red",
                              linestyle="none", label="ringed: timing unreliable (machine busy or wide spread)"))
    return handles


def _legend_shape(handles: list, fig_w: float) -> Tuple[int, float]:
    """(columns, height in inches) of the legend: as many columns as fit the figure's width ``fig_w`` (about 16
    characters per inch at fontsize 9)."""
    longest = max(len(str(h.get_label())) for h in handles)
    legend_cols = max(1, min(len(handles), int(16 * fig_w) // (longest + 6)))
    legend_rows = math.ceil(len(handles) / legend_cols)
    return legend_cols, 0.25 + 0.22 * legend_rows


def _draw_panel(ax, plan: _Plan, key: str) -> None:
    """The series of figure ``key`` on log axes: throughput with bars (the series dodged) when the figure has
    any, and each failed point as an x at the bottom of the panel, in its series' colour."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    spread = key.endswith("_img_s") and plan.bars
    for n, name in enumerate(plan.names):
        rows = plan.measured(name, key)
        shift = dodge(n, len(plan.names), plan.width) if spread else 1.0
        xs, ys = [plan.x_of(p) * shift for p in rows], [p[key] for p in rows]
        if spread:
            low = [p[key] - p[f"{key}_min"] if _has_spread(p, key) else 0.0 for p in rows]
            high = [p[f"{key}_max"] - p[key] if _has_spread(p, key) else 0.0 for p in rows]
            ax.errorbar(xs, ys, yerr=[low, high], ms=4, capsize=2.5, elinewidth=1, label=name,
                        **plan.styles[name])
        else:
            ax.plot(xs, ys, ms=4, label=name, **plan.styles[name])
        ringed = [(x, y) for x, y, p in zip(xs, ys, rows) if p.get("unreliable") and key.endswith("_img_s")]
        if ringed:
            ax.plot(*zip(*ringed), "o", ms=11, markerfacecolor="none", markeredgecolor="red", linestyle="none")
    ax.autoscale_view()
    bottom, top = ax.get_ylim()
    for name in plan.names:
        failed = [plan.x_of(p) for p in plan.failed(name, key)]
        if failed:
            ax.plot(failed, [bottom] * len(failed), "x", color=plan.styles[name]["color"], ms=8, clip_on=False)
    ax.set_ylim(bottom, top)


def _format_axes(ax, plan: _Plan, label: str) -> None:
    """A tick at every size, labelled with it; y ticks at 1, 2 and 5 times the powers of ten; the axis label,
    the panel's title ``label`` and its grid."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(plan.sizes, [plan.ticks[s] for s in plan.sizes])
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
    ax.yaxis.set_major_formatter(FuncFormatter(_number))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(labelsize=8)
    ax.set_xlabel("resolution (px)" if plan.square else "pixels (ticks: side or height x width)", fontsize=9)
    ax.set_title(label, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)


def _thin_tick_labels(fig, axes: list, plan: _Plan) -> None:
    """Blank each x tick label of ``axes`` that would overlap its right neighbour, keeping the largest size's."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        labels = ax.get_xticklabels()
        boxes = [t.get_window_extent(renderer) for t in labels]
        keep = [True] * len(labels)
        right = math.inf
        for k in range(len(labels) - 1, -1, -1):  # from the largest size leftwards
            if boxes[k].x1 + 3 > right:
                keep[k] = False
            else:
                right = boxes[k].x0
        ax.set_xticks(plan.sizes, [plan.ticks[s] if kept else "" for s, kept in zip(plan.sizes, keep)])


def results_figure(points: List[BenchmarkPoint], title: str = "", label_key: str = "model"):
    """The figure of :func:`plot_results` (a matplotlib Figure, not closed), or None when no point measured
    anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = _plan(points, label_key)
    if plan is None:
        return None
    handles = _legend_handles(plan)
    ncols = min(2, len(plan.panels))
    nrows = math.ceil(len(plan.panels) / ncols)
    fig_w = 4.6 * ncols
    legend_cols, legend_h = _legend_shape(handles, fig_w)
    heading = [title] if title else []
    heading.append(f"images/s: {runs_phrase(plan.runs or [1])} per point; memory: peak added by a pass")
    if plan.unreliable:
        heading += textwrap.wrap(unreliable_heading(plan.points), int(11 * fig_w))
    title_h = 0.25 + 0.2 * len(heading)
    height = 3.2 * nrows + legend_h + title_h
    fig, axes = plt.subplots(nrows, ncols, figsize=(fig_w, height), squeeze=False)
    panel_axes = [axes[i // ncols][i % ncols] for i in range(len(plan.panels))]
    for ax, (key, label) in zip(panel_axes, plan.panels):
        _draw_panel(ax, plan, key)
        _format_axes(ax, plan, label)
    for j in range(len(plan.panels), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    fig.suptitle("\n".join(heading), fontsize=10)
    fig.legend(handles=handles, loc="lower center", ncol=legend_cols, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, legend_h / height, 1, 1))  # tight_layout leaves the title its room
    _thin_tick_labels(fig, panel_axes, plan)
    return fig


def plot_results(points: List[BenchmarkPoint], path: str, title: str = "", label_key: str = "model") -> bool:
    """PNG with inference and training throughput and peak memory against resolution (log axes), one series per
    distinct ``point[label_key]``; returns whether it was written (False when no point measured anything). The
    x axis is the side when every size is square, else the pixel count, each tick labelled with its size.

    Each throughput point is the median of the point's timed runs, with a bar from its slowest to its fastest
    run (points of one run have none); the series of one size are set a little apart sideways so that their bars
    stay visible. Every series has its own colour and marker. The panels sit two to a row under the title (the
    number of timed runs is its last line) with one legend below them all, outside every panel: the series, what
    the bars are, and the x that marks a point not measured (at the bottom of its panel, in its series' colour,
    with the statuses in the legend). Every measured resolution has a tick, and a tick label that would run into
    its neighbour is left out (the largest size keeps its label).
    """
    import matplotlib.pyplot as plt

    fig = results_figure(points, title, label_key)
    if fig is None:
        return False
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
