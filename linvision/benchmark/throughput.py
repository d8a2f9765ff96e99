"""Throughput, latency, memory, parameters and FLOPs of models across resolutions (``linvision/tools/benchmark.py``).

Each (model, resolution) point is measured on its own: a model is built for that size (``img_size`` is
passed to models that take it, so a fixed-size ViT gets position embeddings for that grid), and an
out-of-memory or any other error is recorded in the point's ``status``/``error`` and the sweep goes on.
Results are appended to ``results.jsonl`` as each point finishes, so a crash loses only the current point.

Memory is what a pass adds above the model and its input, as :class:`linvision.utils.measure.MemoryMeter` measures
it: on CUDA the memory allocated at the peak of the pass, on CPU the peak resident set size (reset before the
pass, after freed memory is handed back to the system); the CPU figure is coarser and NaN off Linux.

A size is a side in pixels (a square image) or (height, width); a point's ``img_size`` is the side for a square
and the label ``"HxW"`` otherwise, and ``height``, ``width`` and ``pixels`` hold the size as measured.

With ``decoder`` a point measures the backbone as the encoder of a segmentation head of
segmentation_models_pytorch (smp, the ``seg`` extra), built as ``linvision-train-seg`` builds it
(:func:`linvision.training.segmenter.build_segmenter`): ``smp.UPerNet("tu-<name>", encoder_weights=None,
classes=N, **options)``, the backbone's options passed through smp to timm; its training step is the
cross-entropy of the per-pixel logits against random labels of the output's size.

Each time is the median of ``iters`` timed runs after ``warmup`` untimed ones: one run slowed by other work
on the machine moves a median less than a mean. A point records the median and the fastest and slowest runs
(``infer_ms``, ``infer_ms_min``, ``infer_ms_max``; ``infer_img_s`` from the median, ``infer_img_s_min`` from
the slowest run, ``infer_img_s_max`` from the fastest; the same for ``train_``), and the spread (slowest -
fastest) / median in percent; :func:`~.plots.plot_results` draws the median with a bar from the slowest to the
fastest run.

Models compared at one size are timed interleaved (:func:`benchmark_interleaved`, what :func:`run_sweep` does
without ``point_timeout``): all of them are built, then each timed run goes to each model in turn (A, B, C, C, B,
A, ...), so that a load that comes and goes on the machine falls on all of them alike, not on whichever model was
timed while it lasted. Each point records the 1-minute load average, the cores and the torch threads at the end of
its timing (``load``, ``cores``, ``threads``), and ``unreliable``, the reason its times do not stand (empty when
they do): a load average above the cores (:func:`busy_reason`), or a spread above :data:`SPREAD_LIMIT_PCT`. The
tables, logs and plots mark such figures rather than print them as results.

With ``point_timeout`` (seconds) each point runs in a process of its own and is stopped when it runs past the
budget; it is then recorded with status ``"timeout"`` and keeps the figures it finished (the inference figures
when only the training step ran over). Such points are timed one model after another, not interleaved.
"""
from __future__ import annotations

import csv
import gc
import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from linvision.ops import record_backends
from linvision.training.segmenter import DECODERS, build_segmenter, check_decoder
from linvision.utils.amp import autocast
from linvision.utils.factory import create_model
from linvision.utils.measure import MemoryMeter, run_in_process, timed
from linvision.utils.run_mode import COMPILE_MODES, WEIGHT_DTYPES, check_run_mode, compiled
# the threads rule lives with the tools' shared flags (every tool takes its threads the same way); re-exported here
from linvision.utils.threads import busy_cores, cores_busy_between, machine_load, threads_for_load  # noqa: F401

from .flops import count_gflops, count_params

__all__ = ["BenchmarkPoint", "benchmark_point", "run_sweep", "write_results", "DEFAULT_MODELS",
           "parse_model_spec", "gemm_gflop_s", "add_comparisons", "comparison_table", "parse_img_size", "size_label",
           "DECODERS", "check_decoder", "runs_phrase", "free_memory", "timing", "benchmark_interleaved",
           "machine_load", "busy_reason", "threads_for_load", "mark_reliability", "SPREAD_LIMIT_PCT", "unreliable_note",
           "COMPILE_MODES", "WEIGHT_DTYPES", "check_run_mode"]

# a linvision model against timm's softmax ViT and timm's MambaOut of about the same size (22-27M parameters)
DEFAULT_MODELS = ["linhier_tiny_224", "vit_small_patch16_224", "mambaout_tiny"]

BenchmarkPoint = Dict[str, Any]
Size = Union[int, Tuple[int, int]]


def parse_img_size(value: Any) -> Size:
    """``512``, ``"512"``, ``"2048x1024"`` (height x width) or ``(2048, 1024)`` -> a side (int) for a square, or
    (height, width); ValueError in one line for anything else."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        h, w = value
    elif isinstance(value, int) and not isinstance(value, bool):
        h = w = value
    else:
        parts = str(value).strip().lower().split("x")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"img_size: {value!r} is neither a side nor HxW (e.g. 512 or 2048x1024)")
        h, w = int(parts[0]), int(parts[-1])
    if not (isinstance(h, int) and isinstance(w, int) and h >= 1 and w >= 1):
        raise ValueError(f"img_size: {value!r}: height and width must be positive integers")
    return h if h == w else (h, w)


def size_label(size: Any) -> Union[int, str]:
    """A point's ``img_size``: the side of a square, ``"HxW"`` otherwise."""
    size = parse_img_size(size)
    return size if isinstance(size, int) else f"{size[0]}x{size[1]}"


def _hw(size: Any) -> Tuple[int, int]:
    size = parse_img_size(size)
    return (size, size) if isinstance(size, int) else size


def _build(name: str, img_size: Size, model_kwargs: Dict[str, Any]) -> nn.Module:
    return create_model(name, model_kwargs=model_kwargs, img_size=img_size)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def timing(prefix: str, times: List[float], batch_size: int) -> Dict[str, float]:
    """The figures of the timed runs ``times`` (seconds per batch): ``<prefix>_ms`` (median),
    ``<prefix>_ms_min``/``_max`` (fastest/slowest run), ``<prefix>_img_s`` (batch / median) and its
    ``_min``/``_max`` (of the slowest/fastest run), ``<prefix>_spread_pct`` ((slowest - fastest) / median in
    percent; 0 for a single run)."""
    median, fastest, slowest = _median(times), min(times), max(times)
    return {f"{prefix}_img_s": batch_size / median, f"{prefix}_img_s_min": batch_size / slowest,
            f"{prefix}_img_s_max": batch_size / fastest, f"{prefix}_ms": median * 1e3,
            f"{prefix}_ms_min": fastest * 1e3, f"{prefix}_ms_max": slowest * 1e3,
            f"{prefix}_spread_pct": 100.0 * (slowest - fastest) / median}


# the figures of a point's timed runs, in the order of its record (see timing)
TIMING_KEYS = ("img_s", "img_s_min", "img_s_max", "ms", "ms_min", "ms_max", "spread_pct")


def runs_phrase(iters: Any) -> str:
    """What a figure of ``iters`` timed runs is: ``"1 timed run"``, ``"median of 5 timed runs"``; for a list of
    counts (points timed differently) ``"median of 2 to 5 timed runs"``."""
    counts = sorted({int(n) for n in iters}) if isinstance(iters, (list, tuple, set)) else [int(iters)]
    if counts == [1]:
        return "1 timed run"
    if len(counts) == 1:
        return f"median of {counts[0]} timed runs"
    return f"median of {counts[0]} to {counts[-1]} timed runs"


def _empty_point(name: str, img_size: Any, batch_size: int, device: str, amp: str, iters: int,
                 decoder: Optional[str] = None, classes: int = 19) -> BenchmarkPoint:
    nan = float("nan")
    h, w = _hw(img_size)
    point: BenchmarkPoint = {"model": name, "img_size": size_label(img_size), "height": h, "width": w,
                             "pixels": h * w}
    if decoder is not None:
        point.update(decoder=decoder, classes=classes)
    point.update({"batch_size": batch_size, "device": str(device), "amp": amp, "status": "ok", "error": "",
                  "params_m": nan, "gflops": nan, "iters": iters})
    for prefix in ("infer", "train"):
        point.update({f"{prefix}_{key}": nan for key in TIMING_KEYS}, **{f"{prefix}_mem_mb": nan,
                                                                        f"{prefix}_compile_s": nan})
    point.update(backends="", load=nan, cores=0, threads=0, unreliable="")
    return point


def backends_label(used, before: str = "") -> str:
    """``"op: path; ..."`` of the (op, path) pairs of :func:`linvision.ops.record_backends` (and of the label
    ``before``), sorted; empty when no op dispatched (e.g. softmax attention only)."""
    pairs = {tuple(item.split(": ", 1)) for item in before.split("; ") if item} | set(used)
    return "; ".join(f"{op}: {path}" for op, path in sorted(pairs))


def _default_build(decoder: Optional[str], classes: int) -> Callable[[str, Size, Dict[str, Any]], nn.Module]:
    """timm's model for a size, or with a decoder linvision-train-seg's segmenter (it takes any size: none is
    passed)."""
    return _build if decoder is None else lambda n, _size, kw: build_segmenter(decoder, n, classes, kw)


def _record_failure(point: BenchmarkPoint, e: BaseException) -> None:
    """A point's status and error after ``e``: "oom" for an out-of-memory error, else "error"."""
    if isinstance(e, torch.OutOfMemoryError):
        point.update(status="oom", error=str(e).strip().splitlines()[0][:300])
    else:
        point.update(status="error", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                     if str(e).strip() else type(e).__name__)


def benchmark_point(name: str, img_size: Size, batch_size: int = 8, device: str = "cpu", amp: str = "none",
                    warmup: int = 1, iters: int = 3, train: bool = True, flops: bool = True,
                    model_kwargs: Optional[Dict[str, Any]] = None,
                    build_fn: Optional[Callable[[str, Size, Dict[str, Any]], nn.Module]] = None,
                    decoder: Optional[str] = None, classes: int = 19,
                    report: Optional[Callable[[BenchmarkPoint], None]] = None, compile: str = "none",
                    weights: str = "fp32") -> BenchmarkPoint:
    """Measure one model at one size (a side, ``"HxW"`` or (H, W)); never raises for a failure of the model or
    an OOM.

    Returns a dict with model, img_size (the side of a square, "HxW" otherwise), height, width, pixels,
    (decoder, classes with a decoder), batch_size, device, amp, status ("ok", "oom" or "error"), error,
    params_m, gflops (per image, multiply-accumulates), iters (timed runs per figure), infer_img_s (batch /
    median time), infer_img_s_min and infer_img_s_max (of the slowest and the fastest run), infer_ms (median per
    batch), infer_ms_min and infer_ms_max (fastest and slowest run), infer_spread_pct ((slowest - fastest) /
    median, in percent), infer_mem_mb, the same seven train_ figures (forward, backward and SGD step per
    batch), train_mem_mb, backends (which path each dispatching op took, e.g.
    "bidirectional_delta_rule_attention: fla"), load, cores, threads and unreliable (:func:`mark_reliability`).
    Figures not reached before a failure are NaN. ``build_fn(name, size, kwargs)`` gets the side of a square or
    (H, W); by default timm's model, or with ``decoder`` (one of :data:`DECODERS`) the segmenter of
    :func:`~linvision.training.segmenter.build_segmenter` (whatever the size: its heads take any), whose
    training loss is per-pixel cross-entropy against random labels in [0, classes). ``report`` is called with
    the point once its inference figures are in. ``compile`` (:data:`COMPILE_MODES`): the model timed under
    torch.compile, its first call's seconds (the compilation) in ``infer_compile_s`` and ``train_compile_s``;
    ``weights`` (:data:`WEIGHT_DTYPES`): the model and input in that dtype, inference only for 16-bit weights
    (the training figures stay NaN).
    """
    if iters < 1:
        raise ValueError(f"iters: at least 1 timed iteration, got {iters}")
    check_run_mode(compile, weights, amp)
    dev = torch.device(device)
    size = parse_img_size(img_size)
    point = _empty_point(name, size, batch_size, str(dev), amp, iters, decoder, classes)
    point.update(compile=compile, weights=weights)
    build_fn = build_fn or _default_build(decoder, classes)
    model = x = None
    try:
        model = build_fn(name, size, dict(model_kwargs or {})).to(dev)
        _count(point, model, flops)
        x = torch.randn(batch_size, 3, point["height"], point["width"], device=dev)
        model, x = _prepared(point, model, x, compile, weights)
        _measure_inference(point, model, x, dev, amp, warmup, iters, compile)
        if report is not None:
            report(point)
        if train and weights == "fp32":
            _measure_training(point, model, x, dev, amp, warmup, iters, decoder, compile)
    except Exception as e:  # the sweep records any failure of one point and goes on
        _record_failure(point, e)
    finally:
        del model, x
        free_memory(dev)
    mark_reliability([point], machine_load())
    return point


def _count(point: BenchmarkPoint, model: nn.Module, flops: bool) -> None:
    """The model's parameters (millions) into ``point``, and with ``flops`` its GFLOPs per image at the point's
    size."""
    point["params_m"] = count_params(model) / 1e6
    if flops:
        point["gflops"] = count_gflops(model, (point["height"], point["width"]))


def _prepared(point: BenchmarkPoint, model: nn.Module, x: torch.Tensor, compile: str,
              weights: str) -> Tuple[nn.Module, torch.Tensor]:
    """The model and input a point times: in the ``weights`` dtype, under ``compile``."""
    dtype = WEIGHT_DTYPES[weights]
    if dtype != torch.float32:
        model, x = model.to(dtype), x.to(dtype)
    return compiled(model, compile), x


def _first_pass(point: BenchmarkPoint, phase: str, step: Callable[[], None], dev: torch.device,
                compile: str) -> None:
    """A compiled step's first call, timed into ``<phase>_compile_s`` (the compilation it pays); nothing for an
    eager step."""
    if compile == "none":
        return
    start = time.perf_counter()
    step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    point[f"{phase}_compile_s"] = time.perf_counter() - start


def _infer_step(model: nn.Module, x: torch.Tensor, dev: torch.device, amp: str) -> Callable[[], None]:
    """One inference pass of ``model`` (put in eval mode) on ``x``, without gradients."""
    model.eval()

    def infer():
        with torch.no_grad(), autocast(dev, amp):
            model(x)

    return infer


def _train_step(model: nn.Module, x: torch.Tensor, dev: torch.device, amp: str,
                decoder: Optional[str]) -> Callable[[], None]:
    """One training step of ``model`` (put in train mode) on ``x``: forward, backward and an SGD step; the loss is
    the output's mean, or with a ``decoder`` the per-pixel cross-entropy against random labels of the output's
    size (drawn once)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    labels = {}

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        if decoder is None:
            return out.float().mean()
        if "y" not in labels:  # random labels of the output's own size, drawn once
            labels["y"] = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]), device=dev)
        return torch.nn.functional.cross_entropy(out.float(), labels["y"])

    def step():
        with autocast(dev, amp):
            loss = loss_of(model(x))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _measure_inference(point: BenchmarkPoint, model: nn.Module, x: torch.Tensor, dev: torch.device, amp: str,
                       warmup: int, iters: int, compile: str = "none") -> None:
    """The inference figures of ``point``: ``model(x)`` in eval mode without gradients, timed, with the peak
    memory it adds and the path each dispatching op took (a compiled model's first call timed apart)."""
    infer = _infer_step(model, x, dev, amp)
    _first_pass(point, "infer", infer, dev, compile)
    with MemoryMeter(dev) as mem, record_backends() as used:
        times = timed(infer, dev, warmup, iters)
    point.update(timing("infer", times, len(x)), infer_mem_mb=mem.peak_mb, backends=backends_label(used))


def _measure_training(point: BenchmarkPoint, model: nn.Module, x: torch.Tensor, dev: torch.device, amp: str,
                      warmup: int, iters: int, decoder: Optional[str], compile: str = "none") -> None:
    """The training figures of ``point``: :func:`_train_step` on ``x``, timed, with the peak memory it adds."""
    step = _train_step(model, x, dev, amp, decoder)
    _first_pass(point, "train", step, dev, compile)
    with MemoryMeter(dev) as mem, record_backends() as used:
        times = timed(step, dev, warmup, iters)
    point["backends"] = backends_label(used, point["backends"])
    point.update(timing("train", times, len(x)), train_mem_mb=mem.peak_mb)


# a timed figure whose runs spread more than this ((slowest - fastest) / median, in percent) is marked unreliable
SPREAD_LIMIT_PCT = 50.0


def busy_reason(load: Dict[str, Any]) -> str:
    """Why a machine with :func:`machine_load`'s figures ``load`` is too busy for CPU timings to stand, or ''
    when it is not: a load average above its cores (with half a core of slack), i.e. more threads waiting to run
    than cores to run them, the timed process's own included."""
    if _figure(load.get("load")) and load["load"] > load["cores"] + 0.5:
        return f"machine busy: load average {load['load']:.1f} on {load['cores']} cores"
    return ""


def mark_reliability(points: List[BenchmarkPoint], load: Dict[str, Any],
                     spread_limit: float = SPREAD_LIMIT_PCT) -> None:
    """Record ``load`` (:func:`machine_load`) in each point, and in ``unreliable`` why its times do not stand (''
    when they do): on a CPU the machine busy (:func:`busy_reason`), on any device a spread of the timed runs above
    ``spread_limit`` percent."""
    busy = busy_reason(load)
    for p in points:
        p.update(load=load["load"], cores=load["cores"], threads=load["threads"], unreliable="")
        if not _figure(p.get("infer_ms")):
            continue
        reasons = [busy] if busy and str(p["device"]).startswith("cpu") else []
        wide = [f"{prefix} spread {p[f'{prefix}_spread_pct']:.0f}%" for prefix in ("infer", "train")
                if _figure(p.get(f"{prefix}_spread_pct")) and p[f"{prefix}_spread_pct"] > spread_limit]
        if wide:
            reasons.append(f"{', '.join(wide)} above {spread_limit:g}%")
        p["unreliable"] = "; ".join(reasons)


class _Ticker:
    """Progress of a long measurement: ``log``'s line at most every ``every`` seconds."""

    def __init__(self, log: Optional[Callable[[str], None]], every: float = 15.0):
        self.log, self.every = log, every
        self.start = self.last = time.monotonic()

    def tick(self, what: Callable[[], str]) -> None:
        now = time.monotonic()
        if self.log is not None and now - self.last >= self.every:
            self.log(f"   ... {what()}, {now - self.start:.0f} s so far")
            self.last = now


class _Entry:
    """One model of :func:`benchmark_interleaved`: its point, model, input and current step."""

    def __init__(self, point: BenchmarkPoint):
        self.point, self.model, self.x, self.step, self.times = point, None, None, None, []

    def fail(self, e: BaseException) -> None:
        _record_failure(self.point, e)
        self.model = self.x = self.step = None


def benchmark_interleaved(models: Sequence[Tuple[str, Dict[str, Any]]], img_size: Size, batch_size: int = 8,
                          device: str = "cpu", amp: str = "none", warmup: int = 1, iters: int = 3,
                          train: bool = True, flops: bool = True,
                          build_fn: Optional[Callable[[str, Size, Dict[str, Any]], nn.Module]] = None,
                          decoder: Optional[str] = None, classes: int = 19,
                          log: Optional[Callable[[str], None]] = None, compile: str = "none",
                          weights: str = "fp32") -> List[BenchmarkPoint]:
    """:func:`benchmark_point` of each (name, model_kwargs) of ``models`` at one size, the models timed
    interleaved: all are built, then for inference and then for the training step each model makes its first
    pass (untimed: its peak memory, and the first of ``warmup`` runs; so at least one), the other warm-up runs,
    and then the ``iters`` timed runs go round the models, in turn and in reverse on every other round (A, B, B,
    A, ...), so that any load on the machine falls on all of them alike. Returns the points in the order of
    ``models``, with the fields of :func:`benchmark_point`; a model that fails is recorded and leaves the
    rotation. ``log`` gets a progress line at most every 15 s."""
    if iters < 1:
        raise ValueError(f"iters: at least 1 timed iteration, got {iters}")
    check_run_mode(compile, weights, amp)
    dev, size = torch.device(device), parse_img_size(img_size)
    build_fn = build_fn or _default_build(decoder, classes)
    entries = [_Entry({**_empty_point(name, size, batch_size, str(dev), amp, iters, decoder, classes),
                       "compile": compile, "weights": weights}) for name, _ in models]
    ticker = _Ticker(log)
    try:
        for entry, (name, kwargs) in zip(entries, models):
            try:
                entry.model = build_fn(name, size, dict(kwargs or {})).to(dev)
                _count(entry.point, entry.model, flops)
                entry.x = torch.randn(batch_size, 3, entry.point["height"], entry.point["width"], device=dev)
                entry.model, entry.x = _prepared(entry.point, entry.model, entry.x, compile, weights)
            except Exception as e:
                entry.fail(e)
            free_memory(dev)
            ticker.tick(lambda: f"{size_label(size)} px: {name} built")
        for phase in ("infer", "train") if train and weights == "fp32" else ("infer",):
            _interleaved_phase(entries, phase, dev, amp, decoder, warmup, iters, ticker, compile)
    finally:
        for entry in entries:
            entry.model = entry.x = entry.step = None
        free_memory(dev)
    points = [entry.point for entry in entries]
    mark_reliability(points, machine_load())
    return points


def _interleaved_phase(entries: List[_Entry], phase: str, dev: torch.device, amp: str, decoder: Optional[str],
                       warmup: int, iters: int, ticker: _Ticker, compile: str = "none") -> None:
    """The ``phase`` ("infer" or "train") figures of every live entry: first pass (memory, backends), warm-up,
    then the timed runs interleaved."""
    label = "inference" if phase == "infer" else "training step"
    for entry in [e for e in entries if e.model is not None]:
        try:
            entry.step = (_infer_step(entry.model, entry.x, dev, amp) if phase == "infer"
                          else _train_step(entry.model, entry.x, dev, amp, decoder))
            _first_pass(entry.point, phase, entry.step, dev, compile)
            with MemoryMeter(dev) as mem, record_backends() as used:
                entry.step()
            entry.point[f"{phase}_mem_mb"] = mem.peak_mb
            entry.point["backends"] = backends_label(used, entry.point["backends"])
            timed(entry.step, dev, max(warmup - 1, 0), 0)
            entry.times = []
        except Exception as e:
            entry.fail(e)
            free_memory(dev)
        ticker.tick(lambda: f"{entry.point['img_size']} px: {label} of {entry.point['model']} warmed up")
    for r in range(iters):
        live = [e for e in entries if e.step is not None]
        for entry in live if r % 2 == 0 else live[::-1]:
            try:
                entry.times += timed(entry.step, dev, 0, 1)
            except Exception as e:
                entry.fail(e)
                free_memory(dev)
            ticker.tick(lambda: f"{entry.point['img_size']} px: {label} run {r + 1} of {iters} "
                                f"of {len(live)} models")
    for entry in entries:
        if entry.step is not None:
            entry.point.update(timing(phase, entry.times, len(entry.x)))
        entry.step = None


def free_memory(dev: torch.device) -> None:
    """On CUDA, give back what a finished point (or one that ran out of memory) held: Python's garbage, then the
    caching allocator's free blocks. On the CPU nothing is cached to give back, and a CPU peak is measured from
    a collected heap anyway (:class:`~linvision.utils.measure.MemoryMeter`), so the collection is skipped: a full
    one costs up to a second in a large process."""
    if dev.type != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()


def _point_child(conn, threads: int, name: str, size: Size, kwargs: Dict[str, Any]) -> None:
    """A point in a process of its own: sends the point after inference, the final point, then None."""
    torch.set_num_threads(threads)
    point = benchmark_point(name, size, report=lambda p: conn.send(dict(p)), **kwargs)
    conn.send(point)
    conn.send(None)
    conn.close()


def benchmark_point_with_timeout(name: str, img_size: Size, timeout: float, **kwargs) -> BenchmarkPoint:
    """:func:`benchmark_point` in a spawned process (the same torch threads), stopped after ``timeout``
    seconds (model building and the FLOP count included; :func:`linvision.utils.measure.run_in_process`). A point
    stopped is recorded with status "timeout" and keeps what it finished; a process that dies without a word (the
    kernel's out-of-memory killer) is recorded as "oom" when killed by SIGKILL, else "error". ``build_fn`` must
    be picklable."""
    ended = run_in_process(_point_child, (torch.get_num_threads(), name, img_size, kwargs), timeout)
    last = ended.last
    if ended.done:
        return last
    point = last or _empty_point(name, img_size, kwargs.get("batch_size", 8), kwargs.get("device", "cpu"),
                                 kwargs.get("amp", "none"), kwargs.get("iters", 3), kwargs.get("decoder"),
                                 kwargs.get("classes", 19))
    reached = "inference measured, not the training step" if last else "inference not finished"
    if ended.timed_out:
        point.update(status="timeout", error=f"stopped at the {timeout:g} s budget: {reached}")
    elif ended.exitcode == -9:
        point.update(status="oom", error=f"the process was killed (SIGKILL, the kernel's out-of-memory killer); "
                                         f"{reached}")
    else:
        point.update(status="error", error=f"the process ended with exit code {ended.exitcode}; {reached}")
    return point


def _print(message: str) -> None:
    print(message, flush=True)


def parse_model_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``"name"`` or ``"name:key=value,key=value"`` (options of this model only, values without commas, e.g.
    ``linvit_tiny_patch16_rope_224:token_mixer=softmax,patch_size=8``) -> (name, kwargs); values parsed as
    YAML scalars. ValueError in one line for a malformed option."""
    from linvision.utils.config import parse_kwargs

    name, _, options = spec.partition(":")
    if not options:
        return name, {}
    pairs = options.split(",")
    bad = next((p for p in pairs if "=" not in p or not p.split("=", 1)[0]), None)
    if bad is not None:
        raise ValueError(f"models: {spec!r}: option {bad!r} is not key=value")
    return name, parse_kwargs(pairs)


def gemm_gflop_s(device: str = "cpu", m: int = 4096, k: int = 384, n: int = 1536, iters: int = 5,
                 dtype: torch.dtype = torch.float32) -> float:
    """The machine's matrix-multiply rate, GFLOP/s (2 m k n per product, the fastest of ``iters`` after a
    warm-up): the yardstick a model's forward is held against. The default shape is a ViT-S MLP layer over
    4096 tokens."""
    dev = torch.device(device)
    a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
    times = timed(lambda: a @ b, dev, 1, iters)
    return 2 * m * k * n / min(times) / 1e9


def _figure(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def add_comparisons(points: List[BenchmarkPoint], twin: Optional[str] = None,
                    gemm: Optional[float] = None) -> None:
    """Add to each point with figures, in place: with ``twin`` (a model spec of the sweep), its training and
    inference time and memory over the twin's at the same size (``*_vs_twin``, NaN where either was not
    measured); with ``gemm`` (GFLOP/s of :func:`gemm_gflop_s`), the forward's rate ``infer_gflop_s``
    (2 x multiply-accumulates per second) and ``gemm_fraction`` = that / gemm. A point stopped at the time
    budget after its inference counts with its inference figures. ValueError when ``twin`` is not one of the
    points' models."""
    if twin is not None and not any(p["model"] == twin for p in points):
        raise ValueError(f"twin: {twin!r} is not one of the benchmarked models")
    for p in points:
        if p["status"] != "ok" and not _figure(p["infer_ms"]):
            continue
        if twin is not None:
            t = next((q for q in points if q["model"] == twin and q["img_size"] == p["img_size"]
                      and (q["status"] == "ok" or _figure(q["infer_ms"]))), None)
            for key in ("train_ms", "train_mem_mb", "infer_ms", "infer_mem_mb"):
                ok = t is not None and _figure(p[key]) and _figure(t[key]) and t[key]
                p[f"{key}_vs_twin"] = p[key] / t[key] if ok else float("nan")
            p["twin"] = twin
        if gemm is not None:
            p["infer_gflop_s"] = 2 * p["gflops"] * p["batch_size"] / (p["infer_ms"] / 1e3)
            p["gemm_gflop_s"] = gemm
            p["gemm_fraction"] = p["infer_gflop_s"] / gemm


def comparison_table(points: List[BenchmarkPoint]) -> str:
    """A markdown table of the points with :func:`add_comparisons`' columns (where present); a figure not
    measured shows the point's status (e.g. ``timeout``), and a column that no point measured (the training
    step's without training) is left out. The times of a point marked unreliable (:func:`mark_reliability`)
    carry a dagger, explained below the table."""
    twin = any("twin" in p for p in points)
    gemm = any("gemm_fraction" in p for p in points)
    trained = any(_figure(p.get("train_ms")) for p in points)
    head = ["model", "px"]
    head += (["train ms", "train MiB"] + (["train time / twin", "train memory / twin"] if twin else [])
             if trained else [])
    head += ["infer ms", "infer MiB"] + (["infer time / twin", "infer memory / twin"] if twin else [])
    head += ["forward GFLOP/s", "of GEMM rate"] if gemm else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for p in points:
        if p["status"] != "ok" and not _figure(p["infer_ms"]):
            rows.append(f"| {p['model']} | {p['img_size']} | {p['status']}: {p['error'][:80]} |")
            continue
        rows.append("| " + " | ".join(_comparison_cells(p, twin, gemm, trained)) + " |")
    note = unreliable_note(points)
    if note:
        rows += ["", f"† {note}"]
    return "\n".join(rows)


def _comparison_cells(p: BenchmarkPoint, twin: bool, gemm: bool, trained: bool) -> List[str]:
    """One row of :func:`comparison_table`."""
    mark = "†" if p.get("unreliable") else ""

    def cell(key: str, fmt: str = ".0f", scale: float = 1.0, timing: bool = False) -> str:
        value = p.get(key, float("nan"))
        if _figure(value):
            return f"{scale * value:{fmt}}" + (mark if timing else "")
        return p["status"] if p["status"] != "ok" else "-"

    cells = [p["model"], str(p["img_size"])]
    if trained:
        cells += [cell("train_ms", timing=True), cell("train_mem_mb")]
        if twin:
            cells += [cell("train_ms_vs_twin", ".2f", timing=True), cell("train_mem_mb_vs_twin", ".2f")]
    cells += [cell("infer_ms", timing=True), cell("infer_mem_mb")]
    if twin:
        cells += [cell("infer_ms_vs_twin", ".2f", timing=True), cell("infer_mem_mb_vs_twin", ".2f")]
    if gemm:
        cells += [cell("infer_gflop_s", timing=True), cell("gemm_fraction", ".0f", 100.0, timing=True) + "%"]
    return cells


def run_sweep(models: Sequence[str], img_sizes: Sequence[Any], out_dir: Optional[str] = None,
              log: Callable[[str], None] = _print, point_timeout: Optional[float] = None,
              interleave: bool = True, **point_kwargs) -> List[BenchmarkPoint]:
    """Every model at every size (a side, ``"HxW"`` or (H, W)); points go to ``out_dir/results.jsonl`` as they
    finish (if out_dir). A model is a spec of :func:`parse_model_spec`: its own options go over
    ``model_kwargs``, and the points keep the spec as their ``model``. The models of one size are timed
    interleaved (:func:`benchmark_interleaved`) unless ``interleave`` is False or with ``point_timeout``
    (seconds: each point in a process of its own, stopped at that budget,
    :func:`benchmark_point_with_timeout`). Returns the points model by model, each model's sizes in order; ends
    with a line naming the points whose times do not stand (:func:`mark_reliability`)."""
    sizes = [parse_img_size(s) for s in img_sizes]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, "results.jsonl"), "w").close()
    common = dict(point_kwargs.pop("model_kwargs", None) or {})
    specs = [(spec, *parse_model_spec(spec)) for spec in models]
    done: Dict[Tuple[str, Any], BenchmarkPoint] = {}

    def finished(spec: str, size: Size, point: BenchmarkPoint) -> None:
        point["model"] = spec
        done[(spec, size)] = point
        if out_dir:
            with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
                f.write(json.dumps(point) + "\n")
        log(_format(point))

    if interleave and point_timeout is None:
        for size in sizes:
            points = benchmark_interleaved([(name, {**common, **own}) for _, name, own in specs], size, log=log,
                                           **point_kwargs)
            for (spec, _, _), point in zip(specs, points):
                finished(spec, size, point)
    else:
        for spec, name, own in specs:
            for size in sizes:
                if point_timeout is None:
                    point = benchmark_point(name, size, model_kwargs={**common, **own}, **point_kwargs)
                else:
                    point = benchmark_point_with_timeout(name, size, point_timeout,
                                                         model_kwargs={**common, **own}, **point_kwargs)
                    mark_reliability([point], machine_load())
                finished(spec, size, point)
    points = [done[(spec, size)] for spec, _, _ in specs for size in sizes]
    note = unreliable_note(points)
    if note:
        log(note)
    return points


def unreliable_note(points: List[BenchmarkPoint]) -> str:
    """One line for the points whose times do not stand (:func:`mark_reliability`): how many, the load they saw
    and the largest spread; '' when every measured point's times stand."""
    bad = [p for p in points if p.get("unreliable")]
    if not bad:
        return ""
    busy = [p for p in bad if "machine busy" in p["unreliable"]]
    wide = [max(p.get(f"{k}_spread_pct", 0.0) for k in ("infer", "train") if _figure(p.get(f"{k}_spread_pct")))
            for p in bad if "spread" in p["unreliable"]]
    why = []
    if busy:
        loads = sorted(p["load"] for p in busy)
        span = f"{loads[0]:.1f}" if loads[0] == loads[-1] else f"{loads[0]:.1f}-{loads[-1]:.1f}"
        why.append(f"machine busy at {len(busy)}: load average {span} on {busy[0]['cores']} cores")
    if wide:
        why.append(f"spread of the timed runs above {SPREAD_LIMIT_PCT:g}% at {len(wide)} (largest {max(wide):.0f}%)")
    return (f"UNRELIABLE timings at {len(bad)} of {len(points)} points ({'; '.join(why)}): not a result; "
            f"compare them only after a re-run on an idle machine")


def unreliable_heading(points: List[BenchmarkPoint]) -> str:
    """The short form of :func:`unreliable_note` for a figure's title ('' when every timing stands)."""
    note = unreliable_note(points)
    return note.split(": not a result")[0].replace("UNRELIABLE timings at", "ringed: UNRELIABLE timings at")


def _format(p: BenchmarkPoint) -> str:
    head = f"{p['model']:<28} {p['img_size']:>5}px"
    if p["status"] != "ok" and not _figure(p["infer_ms"]):
        return f"{head}  {p['status']}: {p['error']}"
    line = (f"{head}  infer {p['infer_img_s']:9.2f} img/s {p['infer_ms']:9.1f} ms "
            f"(spread {p['infer_spread_pct']:4.0f}%) {p['infer_mem_mb']:8.1f} MiB")
    flag = f" | UNRELIABLE: {p['unreliable']}" if p.get("unreliable") else ""
    compiled = [f"{phase} {p[f'{phase}_compile_s']:.1f} s" for phase in ("infer", "train")
                if _figure(p.get(f"{phase}_compile_s"))]
    flag = (f" | compiled ({p.get('compile')}): " + ", ".join(compiled) if compiled else "") + flag
    if p["status"] != "ok":
        return f"{line} | {p['status']}: {p['error']}{flag}"
    if not _figure(p["train_ms"]):  # training not measured (--no-train): no columns for it
        return f"{line} | {p['params_m']:6.2f} M params{_gflops(p)} | {runs_phrase(p['iters'])}{flag}"
    return (f"{line} | train {p['train_img_s']:8.2f} img/s (spread {p['train_spread_pct']:4.0f}%) "
            f"{p['train_mem_mb']:8.1f} MiB | {p['params_m']:6.2f} M params{_gflops(p)}"
            f" | {runs_phrase(p['iters'])}" + (f" | {p['backends']}" if p.get("backends") else "") + flag)


def _gflops(p: BenchmarkPoint) -> str:
    return f" {p['gflops']:8.2f} GFLOPs" if _figure(p["gflops"]) else ""


def write_results(points: List[BenchmarkPoint], out_dir: str) -> None:
    """results.json and results.csv in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(points, f, indent=2)
    if points:
        with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
            fields = list(dict.fromkeys(k for p in points for k in p))  # comparison columns only where measured
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(points)

