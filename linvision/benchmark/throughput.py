"""Throughput, latency, memory, parameters and FLOPs of models across resolutions (``linvision/tools/benchmark.py``).

Each (model, resolution) point is measured on its own: a model is built for that size (``img_size`` is
passed to models that take it, so a fixed-size ViT gets position embeddings for that grid), and an
out-of-memory or any other error is recorded in the point's ``status``/``error`` and the sweep goes on.
Results are appended to ``results.jsonl`` as each point finishes, so a crash loses only the current point.

Memory is what a pass adds above the model and its input:
- CUDA: ``torch.cuda.max_memory_allocated`` during the pass minus the memory allocated before it;
- CPU: the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs before the pass)
  minus its resident size before the pass, after glibc's ``malloc_trim`` has handed freed memory back to the
  system (otherwise buffers kept from an earlier point would hide this one's). It is coarser than the CUDA
  figure (it sees pages, not tensors) and depends on the allocator; it is NaN off Linux.

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

With ``point_timeout`` (seconds) each point runs in a process of its own and is stopped when it runs past the
budget; it is then recorded with status ``"timeout"`` and keeps the figures it finished (the inference figures
when only the training step ran over).
"""
from __future__ import annotations

import csv
import ctypes
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

from .flops import count_gflops, count_params

__all__ = ["BenchmarkPoint", "benchmark_point", "run_sweep", "write_results", "DEFAULT_MODELS", "MemoryMeter",
           "parse_model_spec", "gemm_gflop_s", "add_comparisons", "comparison_table", "parse_img_size", "size_label",
           "DECODERS", "check_decoder", "runs_phrase", "free_memory", "timed", "timing"]

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


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure is then an underestimate
        pass


class MemoryMeter:
    """Peak memory a block of work adds, in MiB (see the module docstring for the definition per device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_mb = float("nan")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif os.path.exists("/proc/self/clear_refs"):
            gc.collect()
            _malloc_trim()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
            self._base = _rss_kb("VmRSS")
        else:
            self._base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        elif self._base is not None:
            self.peak_mb = (_rss_kb("VmHWM") - self._base) / 1024


def _build(name: str, img_size: Size, model_kwargs: Dict[str, Any]) -> nn.Module:
    return create_model(name, model_kwargs=model_kwargs, img_size=img_size)


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> List[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed calls (on CUDA the device is
    synchronised before and after each timed call): the runs that :func:`timing` sums up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


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
        point.update({f"{prefix}_{key}": nan for key in TIMING_KEYS}, **{f"{prefix}_mem_mb": nan})
    point["backends"] = ""
    return point


def backends_label(used, before: str = "") -> str:
    """``"op: path; ..."`` of the (op, path) pairs of :func:`linvision.ops.record_backends` (and of the label
    ``before``), sorted; empty when no op dispatched (e.g. softmax attention only)."""
    pairs = {tuple(item.split(": ", 1)) for item in before.split("; ") if item} | set(used)
    return "; ".join(f"{op}: {path}" for op, path in sorted(pairs))


def benchmark_point(name: str, img_size: Size, batch_size: int = 8, device: str = "cpu", amp: str = "none",
                    warmup: int = 1, iters: int = 3, train: bool = True, flops: bool = True,
                    model_kwargs: Optional[Dict[str, Any]] = None,
                    build_fn: Optional[Callable[[str, Size, Dict[str, Any]], nn.Module]] = None,
                    decoder: Optional[str] = None, classes: int = 19,
                    report: Optional[Callable[[BenchmarkPoint], None]] = None) -> BenchmarkPoint:
    """Measure one model at one size (a side, ``"HxW"`` or (H, W)); never raises for a failure of the model or
    an OOM.

    Returns a dict with model, img_size (the side of a square, "HxW" otherwise), height, width, pixels,
    (decoder, classes with a decoder), batch_size, device, amp, status ("ok", "oom" or "error"), error,
    params_m, gflops (per image, multiply-accumulates), iters (timed runs per figure), infer_img_s (batch /
    median time), infer_img_s_min and infer_img_s_max (of the slowest and the fastest run), infer_ms (median per
    batch), infer_ms_min and infer_ms_max (fastest and slowest run), infer_spread_pct ((slowest - fastest) /
    median, in percent), infer_mem_mb, the same seven train_ figures (forward, backward and SGD step per
    batch), train_mem_mb, backends (which path each dispatching op took, e.g.
    "bidirectional_delta_rule_attention: fla"). Figures
    not reached before a failure are NaN. ``build_fn(name, size, kwargs)`` gets the side of a square or (H, W);
    by default timm's model, or with ``decoder`` (one of :data:`DECODERS`) the segmenter of
    :func:`~linvision.training.segmenter.build_segmenter` (whatever the size: its heads take any), whose
    training loss is per-pixel cross-entropy against random labels in [0, classes). ``report`` is called with
    the point once its inference figures are in.
    """
    if iters < 1:
        raise ValueError(f"iters: at least 1 timed iteration, got {iters}")
    dev = torch.device(device)
    size = parse_img_size(img_size)
    point = _empty_point(name, size, batch_size, str(dev), amp, iters, decoder, classes)
    if build_fn is None:  # with a decoder, linvision-train-seg's segmenter (it takes any size: none is passed)
        build_fn = _build if decoder is None else lambda n, _size, kw: build_segmenter(decoder, n, classes, kw)
    model = x = None
    try:
        model = build_fn(name, size, dict(model_kwargs or {})).to(dev)
        _count(point, model, flops)
        x = torch.randn(batch_size, 3, point["height"], point["width"], device=dev)
        _measure_inference(point, model, x, dev, amp, warmup, iters)
        if report is not None:
            report(point)
        if train:
            _measure_training(point, model, x, dev, amp, warmup, iters, decoder)
    except torch.OutOfMemoryError as e:
        point.update(status="oom", error=str(e).strip().splitlines()[0][:300])
    except Exception as e:  # the sweep records any failure of one point and goes on
        point.update(status="error", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                     if str(e).strip() else type(e).__name__)
    finally:
        del model, x
        free_memory(dev)
    return point


def _count(point: BenchmarkPoint, model: nn.Module, flops: bool) -> None:
    """The model's parameters (millions) into ``point``, and with ``flops`` its GFLOPs per image at the point's
    size."""
    point["params_m"] = count_params(model) / 1e6
    if flops:
        point["gflops"] = count_gflops(model, (point["height"], point["width"]))


def _measure_inference(point: BenchmarkPoint, model: nn.Module, x: torch.Tensor, dev: torch.device, amp: str,
                       warmup: int, iters: int) -> None:
    """The inference figures of ``point``: ``model(x)`` in eval mode without gradients, timed, with the peak
    memory it adds and the path each dispatching op took."""
    model.eval()
    with torch.no_grad():
        def infer():
            with autocast(dev, amp):
                model(x)

        with MemoryMeter(dev) as mem, record_backends() as used:
            times = timed(infer, dev, warmup, iters)
    point.update(timing("infer", times, len(x)), infer_mem_mb=mem.peak_mb, backends=backends_label(used))


def _measure_training(point: BenchmarkPoint, model: nn.Module, x: torch.Tensor, dev: torch.device, amp: str,
                      warmup: int, iters: int, decoder: Optional[str]) -> None:
    """The training figures of ``point``: forward, backward and an SGD step on ``x``, timed, with the peak
    memory they add; the loss is the output's mean, or with a ``decoder`` the per-pixel cross-entropy against
    random labels of the output's size (drawn once)."""
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

    with MemoryMeter(dev) as mem, record_backends() as used:
        times = timed(step, dev, warmup, iters)
    point["backends"] = backends_label(used, point["backends"])
    point.update(timing("train", times, len(x)), train_mem_mb=mem.peak_mb)


def free_memory(dev: torch.device) -> None:
    """Give back what a finished point held: Python's garbage, and on CUDA the caching allocator's free blocks."""
    gc.collect()
    if dev.type == "cuda":
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
    seconds (model building and the FLOP count included). A point stopped is recorded with status "timeout"
    and keeps what it finished; a process that dies without a word (the kernel's out-of-memory killer) is
    recorded as "oom" when killed by SIGKILL, else "error". ``build_fn`` must be picklable."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_point_child, args=(send, torch.get_num_threads(), name, img_size, kwargs),
                       daemon=True)
    start = time.monotonic()
    proc.start()
    send.close()
    last, done, stopped = None, False, False
    try:
        while not done:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                break
            if receive.poll(min(left, 1.0)):
                try:
                    message = receive.recv()
                except EOFError:  # the process died
                    break
                done = message is None
                last = message if message is not None else last
            elif not proc.is_alive() and not receive.poll():
                break
    finally:  # also on Ctrl-C: the point's process never outlives the sweep
        if not done and proc.is_alive():
            proc.kill()
            stopped = True
        proc.join()
        receive.close()
    if done:
        return last
    point = last or _empty_point(name, img_size, kwargs.get("batch_size", 8), kwargs.get("device", "cpu"),
                                 kwargs.get("amp", "none"), kwargs.get("iters", 3), kwargs.get("decoder"),
                                 kwargs.get("classes", 19))
    reached = "inference measured, not the training step" if last else "inference not finished"
    if stopped:
        point.update(status="timeout", error=f"stopped at the {timeout:g} s budget: {reached}")
    elif proc.exitcode == -9:
        point.update(status="oom", error=f"the process was killed (SIGKILL, the kernel's out-of-memory killer); "
                                         f"{reached}")
    else:
        point.update(status="error", error=f"the process ended with exit code {proc.exitcode}; {reached}")
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
    measured shows the point's status (e.g. ``timeout``)."""
    twin = any("twin" in p for p in points)
    gemm = any("gemm_fraction" in p for p in points)
    head = ["model", "px", "train ms", "train MiB"]
    head += ["train time / twin", "train memory / twin"] if twin else []
    head += ["infer ms", "infer MiB"] + (["infer time / twin", "infer memory / twin"] if twin else [])
    head += ["forward GFLOP/s", "of GEMM rate"] if gemm else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for p in points:
        if p["status"] != "ok" and not _figure(p["infer_ms"]):
            rows.append(f"| {p['model']} | {p['img_size']} | {p['status']}: {p['error'][:80]} |")
            continue

        def cell(key: str, fmt: str = ".0f", scale: float = 1.0) -> str:
            value = p.get(key, float("nan"))
            if _figure(value):
                return f"{scale * value:{fmt}}"
            return p["status"] if p["status"] != "ok" else "nan"

        cells = [p["model"], str(p["img_size"]), cell("train_ms"), cell("train_mem_mb")]
        if twin:
            cells += [cell("train_ms_vs_twin", ".2f"), cell("train_mem_mb_vs_twin", ".2f")]
        cells += [cell("infer_ms"), cell("infer_mem_mb")]
        if twin:
            cells += [cell("infer_ms_vs_twin", ".2f"), cell("infer_mem_mb_vs_twin", ".2f")]
        if gemm:
            cells += [cell("infer_gflop_s"), cell("gemm_fraction", ".0f", 100.0) + "%"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_sweep(models: Sequence[str], img_sizes: Sequence[Any], out_dir: Optional[str] = None,
              log: Callable[[str], None] = _print, point_timeout: Optional[float] = None,
              **point_kwargs) -> List[BenchmarkPoint]:
    """Every model at every size (a side, ``"HxW"`` or (H, W)); points go to ``out_dir/results.jsonl`` as they
    finish (if out_dir). A model is a spec of :func:`parse_model_spec`: its own options go over
    ``model_kwargs``, and the points keep the spec as their ``model``. ``point_timeout`` (seconds): each point
    in a process of its own, stopped at that budget (:func:`benchmark_point_with_timeout`)."""
    points = []
    sizes = [parse_img_size(s) for s in img_sizes]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, "results.jsonl"), "w").close()
    common = dict(point_kwargs.pop("model_kwargs", None) or {})
    for spec in models:
        name, own = parse_model_spec(spec)
        for size in sizes:
            if point_timeout is None:
                point = benchmark_point(name, size, model_kwargs={**common, **own}, **point_kwargs)
            else:
                point = benchmark_point_with_timeout(name, size, point_timeout, model_kwargs={**common, **own},
                                                     **point_kwargs)
            point["model"] = spec
            points.append(point)
            if out_dir:
                with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
                    f.write(json.dumps(point) + "\n")
            log(_format(point))
    return points


def _format(p: BenchmarkPoint) -> str:
    head = f"{p['model']:<28} {p['img_size']:>5}px"
    if p["status"] != "ok" and not _figure(p["infer_ms"]):
        return f"{head}  {p['status']}: {p['error']}"
    line = (f"{head}  infer {p['infer_img_s']:9.2f} img/s {p['infer_ms']:9.1f} ms "
            f"(spread {p['infer_spread_pct']:4.0f}%) {p['infer_mem_mb']:8.1f} MiB")
    if p["status"] != "ok":
        return f"{line} | {p['status']}: {p['error']}"
    return (f"{line} | train {p['train_img_s']:8.2f} img/s (spread {p['train_spread_pct']:4.0f}%) "
            f"{p['train_mem_mb']:8.1f} MiB | {p['params_m']:6.2f} M params {p['gflops']:8.2f} GFLOPs"
            f" | {runs_phrase(p['iters'])}" + (f" | {p['backends']}" if p.get("backends") else ""))


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

