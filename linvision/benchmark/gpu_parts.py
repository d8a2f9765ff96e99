"""The measuring parts of the GPU report (:mod:`.gpu_report`), each run in a process of its own by
:func:`child`, each saving its rows as they are measured (``save(**figures)``), so that a part stopped at its
deadline keeps what it measured:

- :func:`kernels_part`: the fused linear-attention kernels, the PyTorch reference and softmax attention (SDPA),
  forward, backward and forward+backward at each N, with the kernels' share of the HBM bandwidth;
- :func:`models_part`: the comparison a user makes, linvision's models against timm's on the same card
  (:func:`linvision.benchmark.throughput.benchmark_point` per model, size and batch), size by size, the point
  where each runs out of memory recorded (and its larger sizes at that batch skipped);
- :func:`recurrences_part`: the first call of the recurrences and of two models that use them (compilation
  included), then the bidirectional delta rule and gated recurrences on fla-core's kernels against linear
  attention with RoPE on the fused kernels, forward and backward, at each N; a call or path that fails is its
  row's status, and the part goes on.

On CUDA each part first runs :func:`warm_up` (the GPU's clocks ramp up under load). On the CPU (the dry run)
every figure is the time of one call, in Triton's interpreter for the fused kernels and on the PyTorch path for
the recurrences: the part's plumbing, not a speed.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from linvision.benchmark.throughput import free_memory

PASSES = ("fwd", "bwd", "fwd+bwd")
_HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "4090": 1.008}


def hbm_tbps(gpu_name: str) -> Optional[float]:
    """The HBM bandwidth in TB/s of a GPU by its name (torch.cuda.get_device_name()), None for one not known."""
    return next((bw for key, bw in _HBM_TBPS.items() if key in gpu_name), None)


def time_once(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call: the CPU's stand-in for triton's do_bench in the dry run."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_for(device: str) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds per call of a function: triton.testing.do_bench on CUDA, one call on the CPU."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench
    return time_once


WARMUP_S = 1.0  # seconds of matmuls before a part's first timing on a GPU
WARMUP_MAX_MATMULS = 20000  # and at most this many (at full clock a 4096^2 bf16 matmul takes ~0.2 ms)


def warm_up(device: str, seconds: float = WARMUP_S, max_matmuls: int = WARMUP_MAX_MATMULS,
            size: int = 4096) -> Optional[Dict[str, Any]]:
    """On CUDA, ``seconds`` of bf16 matmuls (``size`` x ``size``, at most ``max_matmuls``, synchronised) before a
    part's first timing: an idle GPU's clocks ramp up under load, and without this the first N timed reads the
    ramp, not the kernels. Returns what ran ({"matmuls", "seconds"}); off CUDA nothing runs and it returns
    None."""
    if device != "cuda":
        return None
    return matmul_load(device, torch.bfloat16, seconds, max_matmuls, size)


def matmul_load(device: str, dtype: torch.dtype, seconds: float, max_matmuls: int, size: int) -> Dict[str, Any]:
    """Matmuls of two ``size`` x ``size`` matrices in batches of 10, each batch synchronised, until ``seconds``
    have passed or ``max_matmuls`` have run: {"matmuls": how many, "seconds": how long}."""
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, generator=g, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty_like(a)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start, count = time.perf_counter(), 0
    while count < max_matmuls and time.perf_counter() - start < seconds:
        for _ in range(min(10, max_matmuls - count)):
            torch.matmul(a, b, out=c)
            count += 1
        sync()
    record = {"matmuls": count, "seconds": time.perf_counter() - start, "size": size}
    del a, b, c
    return record


def _warm(device: str, save: Callable[..., None], before: str, warmups: List[Dict[str, Any]]) -> None:
    """:func:`warm_up` before ``before`` (a part's first timing), printed and saved (``warmups``) when it ran."""
    record = warm_up(device)
    if record is not None:
        warmups.append({"before": before, **record})
        print(f"GPU warm-up before {before}: {record['matmuls']} bf16 matmuls of {record['size']}^2 in "
              f"{record['seconds']:.2f} s", flush=True)
        save(warmups=warmups)


def error_line(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message (at most 300 characters)."""
    message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def time_passes(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor,
                bench: Callable[[Callable[[], Any]], float]) -> Dict[str, Any]:
    """Milliseconds of ``fn(*inputs)`` forward, backward (to the inputs, against ``grad_out``) and
    forward+backward, as ``bench`` times each. A pass that raises ends the timing there: the passes timed before
    it are kept, with {"oom": message} for torch.OutOfMemoryError, else {"error": type and message}."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, times = None, {}
    try:
        with torch.no_grad():
            times["fwd"] = bench(lambda: fn(*inputs))
        out = fn(*leaves)
        times["bwd"] = bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))
        times["fwd+bwd"] = bench(lambda: torch.autograd.grad(fn(*leaves), leaves, grad_out))
    except torch.OutOfMemoryError as e:
        times["oom"] = str(e).strip().splitlines()[0][:200]
    except Exception as e:  # noqa: BLE001 - a path that fails is that row's status, and the next path runs
        traceback.print_exc()
        times["error"] = error_line(e)
    finally:
        del out, leaves
    return times


def attention_inputs(b: int, h: int, n: int, d: int, device: str, dtype: torch.dtype) -> List[torch.Tensor]:
    """q, k, v and an output gradient (B, H, N, D) drawn from a fixed seed."""
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g, device=device, dtype=dtype) for _ in range(4)]


def time_paths(paths: Dict[str, Callable[..., torch.Tensor]], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor,
               device: str, bench: Callable) -> Dict[str, Dict[str, Any]]:
    """{label: {pass: ms}} of every path of ``paths``, one after the other on the same inputs
    (:func:`time_passes`); a path that runs out of memory or fails gets "oom" or "error" and the others still
    run."""
    times: Dict[str, Dict[str, Any]] = {}
    for label, fn in paths.items():
        times[label] = time_passes(fn, inputs, grad_out, bench)
        free_memory(torch.device(device))
    return times


def row_status(times: Dict[str, Dict[str, Any]], name: str) -> str:
    """A (N, pass) row's status: "ok", or each path's error where that pass was not timed ("label: error")."""
    errors = [f"{label}: {t['error']}" for label, t in times.items() if "error" in t and name not in t]
    return "; ".join(errors) or "ok"


def fail_on_rows(save: Callable[..., None], failed: Sequence[str]) -> None:
    """A part that measured every row but some failed ends "failed", naming the rows (the first six)."""
    if failed:
        save(status="failed", error=f"{len(failed)} rows failed: {', '.join(failed[:6])}"
                                    + (", ..." if len(failed) > 6 else ""))


def _rope(d: int, n: int, device: str):
    from linvision.ops import axial_rope

    width = 64 if n % 64 == 0 else n
    return axial_rope(d, (n // width, width), device=device)


# --- part 1: the fused kernels against SDPA ---


def kernels_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """The fused kernels ("triton"), the PyTorch reference and SDPA at each N of ``settings["n"]`` (B, H, D, dtype,
    feature map from ``settings``), one row per (N, pass) saved as measured, with the kernels' minimal bytes over
    their time as a share of the HBM bandwidth on a GPU. A path that fails is its rows' status; the part goes on
    and ends "failed"."""
    from linvision.kernels import chosen_configs, linear_attention_triton
    from linvision.kernels.traffic import minimal_bytes
    from linvision.ops import linear_attention_reference, softmax_attention

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    b, h, d, phi = settings["batch"], settings["heads"], settings["dim"], settings["feature_map"]
    tbps = (settings.get("hbm_tbps") or hbm_tbps(torch.cuda.get_device_name())) if device == "cuda" else None
    rows: List[Dict[str, Any]] = []
    save(rows=rows, device=device, hbm_tbps=tbps, batch=b, heads=h, dim=d, dtype=settings["dtype"], feature_map=phi)
    itemsize = torch.finfo(dtype).bits // 8
    _warm(device, save, "the first timing", [])
    for n in settings["n"]:
        q, k, v, do = attention_inputs(b, h, n, d, device, dtype)
        paths = {"triton": lambda q, k, v: linear_attention_triton(q, k, v, phi),
                 "torch ref": lambda q, k, v: linear_attention_reference(q, k, v, phi)}
        if n <= settings["sdpa_max_n"]:
            paths["sdpa"] = lambda q, k, v: softmax_attention(q, k, v)
        times = time_paths(paths, (q, k, v), do, device, bench_for(device))
        for name in PASSES:
            floor = sum(minimal_bytes(b, h, n, n, d, d, itemsize, bwd) for bwd in {
                "fwd": (False,), "bwd": (True,), "fwd+bwd": (False, True)}[name])
            row = {"n": n, "pass": name, **{f"{label.replace(' ', '_')}_ms": times.get(label, {}).get(name)
                                           for label in ("triton", "torch ref", "sdpa")}}
            if row["triton_ms"] and row["sdpa_ms"]:
                row["sdpa_over_triton"] = row["sdpa_ms"] / row["triton_ms"]
            if tbps and row["triton_ms"]:
                row["hbm_pct"] = 100 * floor / (row["triton_ms"] * 1e-3) / (tbps * 1e12)
            row["status"] = row_status(times, name)
            rows.append(row)
            print(f"N={n:>7d} {name:>8}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()
                                                      if k.endswith("_ms") and v), flush=True)
        del q, k, v, do
        save(rows=rows, chosen=chosen_configs())
    fail_on_rows(save, [f"N={r['n']} {r['pass']}" for r in rows if r["status"] != "ok"])


# --- part 2: the models a user compares ---


def comparison_order(models: Sequence[str], sizes: Sequence[Any], batches: Sequence[int],
                     twin: Optional[str] = None, deciding: Sequence[str] = ()) -> List[Tuple]:
    """(batch, size, model) in the order the comparison measures them: first the ``deciding`` models (those of
    ``models`` the headline compares) at the first batch and the first size, then batch by batch, size by size
    in the order given, every model at a size before the next size, so that a run cut short keeps whole
    comparisons; at each size the ``twin`` first, so that every point measured after it has its ratios."""
    ordered = [m for m in models if m == twin] + [m for m in models if m != twin]
    head = [(batches[0], sizes[0], m) for m in deciding if m in models] if batches and sizes else []
    return head + [(b, s, m) for b in batches for s in sizes for m in ordered if (b, s, m) not in head]


# The models part's run modes: (torch.compile mode, weights) of linvision.utils.run_mode; "eager" under the part's
# autocast, the compiled ones too, "bf16-weights" without autocast (inference only)
MODEL_MODES = {"eager": ("none", "fp32"), "inductor": ("inductor", "fp32"),
               "reduce-overhead": ("reduce-overhead", "fp32"), "bf16-weights": ("none", "bf16")}


def mode_label(spec: str, mode: str) -> str:
    """A point's model label: the spec, with its run mode in brackets unless eager."""
    return spec if mode == "eager" else f"{spec} [{mode}]"


def _skip_point(spec: str, size: Any, batch: int, settings: Dict[str, Any], reason: str) -> Dict[str, Any]:
    """The record of a point not tried (its figures NaN), as out of memory for ``reason``."""
    from linvision.benchmark.throughput import size_label

    nan = float("nan")
    point = {"model": spec, "img_size": size_label(size), "batch_size": batch, "device": settings["device"],
             "amp": settings["amp"], "status": "oom", "error": reason}
    point.update({f"{p}_{k}": nan for p in ("infer", "train") for k in ("img_s", "ms", "mem_mb")})
    return point


def models_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """Every model of ``settings["models"]`` at every size and batch (:func:`comparison_order`), inference and a
    training step under autocast (``amp``), each point saved as it finishes; a model that runs out of memory at a
    size is not tried at larger sizes with that batch (recorded as out of memory there too). With each point,
    each model's time and memory over the twin's (:func:`_compare_to_twin`), and ``oom_at``: per model and
    batch, the first size out of memory. ``planned``: how many points the part is to measure. ``modes`` (of
    :data:`MODEL_MODES`, default eager only): each model at each size in each mode, labelled by
    :func:`mode_label`, the twin's ratios taken within a mode. ``deciding``: the models measured first, in every
    mode, at the first batch and size (:func:`comparison_order`)."""
    from linvision.benchmark.throughput import benchmark_point, parse_model_spec

    points: List[Dict[str, Any]] = []
    modes = list(settings.get("modes", ["eager"]))
    order = [(batch, size, mode, spec)
             for batch, size, spec in comparison_order(settings["models"], settings["img_size"], settings["batches"],
                                                       settings["twin"], settings.get("deciding", ()))
             for mode in modes]
    save(points=points, planned=len(order), twin=settings["twin"], model_kwargs=settings["model_kwargs"],
         modes=modes, **{k: settings[k] for k in ("batches", "device", "amp", "warmup", "iters")})
    _warm(settings["device"], save, "the first model", [])
    out_at: Dict[Tuple[str, int], Any] = {}
    for batch, size, mode, spec in order:
        label = mode_label(spec, mode)
        if (label, batch) in out_at:
            point = _skip_point(label, size, batch, settings, f"not tried: out of memory at {out_at[label, batch]} px")
        else:
            name, own = parse_model_spec(spec)
            compile, weights = MODEL_MODES[mode]
            point = benchmark_point(name, size, batch_size=batch, device=settings["device"],
                                    amp=settings["amp"] if weights == "fp32" else "none",
                                    warmup=settings["warmup"], iters=settings["iters"], flops=False,
                                    model_kwargs={**settings["model_kwargs"], **own}, compile=compile,
                                    weights=weights)
            point["model"] = label
            if point["status"] == "oom":
                out_at[label, batch] = point["img_size"]
        point["mode"] = mode
        points.append(point)
        print(f"batch {batch} {label} {point['img_size']} px: {point['status']} "
              f"infer {point['infer_img_s']:.2f} img/s, train {point['train_img_s']:.2f} img/s", flush=True)
        _compare_to_twin(points, settings["twin"])
        save(points=points, oom_at=_oom_at(points))


def _compare_to_twin(points: List[Dict[str, Any]], twin: Optional[str]) -> None:
    """Each point's time and memory over the twin's at its size and batch (``*_vs_twin``,
    :func:`linvision.benchmark.throughput.add_comparisons`), in every batch whose points include the twin so far:
    recomputed after each point, so that a part stopped at its deadline keeps the ratios of what it measured."""
    from linvision.benchmark.throughput import add_comparisons

    for batch, mode in dict.fromkeys((p["batch_size"], p.get("mode", "eager")) for p in points):
        group = [p for p in points if p["batch_size"] == batch and p.get("mode", "eager") == mode]
        label = None if twin is None else mode_label(twin, mode)
        if label is not None and any(p["model"] == label for p in group):
            add_comparisons(group, label)


def _oom_at(points: List[Dict[str, Any]]) -> Dict[str, Any]:
    """{"model @ batch B": first size out of memory} for the models that ran out of memory."""
    found: Dict[str, Any] = {}
    for p in points:
        key = f"{p['model']} @ batch {p['batch_size']}"
        if p["status"] == "oom" and key not in found:
            found[key] = p["img_size"]
    return found


# --- part 3: the recurrences ---


RECURRENCES = ("bidir_delta", "bidir_gated", "bidir_gated_ch")  # timed against linear_rope


def recurrence_paths(n: int, d: int, device: str, backend: str) -> Dict[str, Callable[..., torch.Tensor]]:
    """The ops the recurrences part times, on (B, H, N, D) q, k, v: ``linear_rope`` (linear attention with 2D
    RoPE on a grid N / 64 x 64, the fused kernels on a GPU), ``bidir_delta`` (the bidirectional delta rule,
    beta 0.5), ``bidir_gated`` (the bidirectional gated form, one gate per head, gamma 0.99) and
    ``bidir_gated_ch`` (one gate per key channel, as ViG's: another kernel of fla's), the three last on
    fla-core's kernels on a GPU (``backend``)."""
    from linvision.ops import (bidirectional_delta_rule_attention, bidirectional_gated_linear_attention,
                               linear_attention)

    rope = _rope(d, n, device)

    def delta(q, k, v):
        beta = torch.full(q.shape[:3], 0.5, device=q.device)
        return bidirectional_delta_rule_attention(q, k, v, beta, backend=backend)

    def gated(q, k, v, channels=1):
        log_gate = torch.full((*q.shape[:3], channels), math.log(0.99), device=q.device)
        return bidirectional_gated_linear_attention(q, k, v, log_gate, backend=backend)

    return {"linear_rope": lambda q, k, v: linear_attention(q, k, v, "elu", rope=rope), "bidir_delta": delta,
            "bidir_gated": gated, "bidir_gated_ch": lambda q, k, v: gated(q, k, v, q.shape[-1])}


def first_call_seconds(fn: Callable[[], Any], device: str) -> float:
    """Wall seconds of one call of ``fn`` (compilations included on a first call), the device synchronised."""
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _model_step(name: str, img_size: int, device: str, amp: str) -> Callable[[], Any]:
    """One forward and backward of timm's ``name`` on a batch of one image of ``img_size`` px."""
    from linvision.utils.amp import autocast
    from linvision.utils.factory import create_model

    model = create_model(name, img_size=img_size).to(device)
    x = torch.randn(1, 3, img_size, img_size, device=device)

    def step():
        with autocast(torch.device(device), amp):
            loss = model(x).float().mean()
        loss.backward()

    return step


def _first_call(what: str, make: Callable[[], Callable[[], Any]], device: str) -> Dict[str, Any]:
    """The row of one first call: ``make()`` builds the call (its seconds are ``build_s``), then the call is timed
    (:func:`first_call_seconds`); an exception in either is the row's status (type and first line), and its
    seconds are None."""
    start = time.perf_counter()
    try:
        call = make()
        built = time.perf_counter() - start
        seconds = first_call_seconds(call, device)
    except Exception as e:  # noqa: BLE001 - the row records it and the part goes on to the next row
        traceback.print_exc()
        return {"what": what, "seconds": None, "status": error_line(e)}
    finally:
        call = None
        free_memory(torch.device(device))
    return {"what": what, "seconds": seconds, "build_s": built, "status": "ok"}


def _first_calls(settings: Dict[str, Any], save: Callable[..., None], first: List[Dict[str, Any]]) -> None:
    """The first forward+backward of each recurrence op (at the smallest N) and of each model of
    ``settings["first_models"]``, compilation included: how long a user's first call waits. A call that fails is
    recorded as its row's status, and the next one runs."""
    device, dtype, d = settings["device"], getattr(torch, settings["dtype"]), settings["dim"]
    n = min(settings["n"])
    q, k, v, do = attention_inputs(settings["batch"], settings["heads"], n, d, device, dtype)
    for label, fn in recurrence_paths(n, d, device, settings["backend"]).items():
        def make(fn=fn):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            return lambda: torch.autograd.grad(fn(*leaves), leaves, do)

        first.append(_first_call(f"{label} at N={n}", make, device))
        save(first_calls=first)
    size = settings["model_img_size"]
    for name in settings["first_models"]:
        first.append(_first_call(f"{name} at {size} px, batch 1",
                                 lambda: _model_step(name, size, device, settings["amp"]), device))
        save(first_calls=first)


def recurrences_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """The first calls (:func:`_first_calls`), then bidir_delta and bidir_gated against linear_rope
    (:func:`recurrence_paths`) at each N, forward, backward and forward+backward, one row per (N, pass). A call or
    path that fails is its row's status (the exception's type and first line), and the part goes on; the part
    then ends "failed", naming the rows."""
    from linvision.ops.recurrent import kernels as fla_kernels

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    pinned = os.environ.get(fla_kernels.AUTOTUNE_ENV, "0") != "1"
    first: List[Dict[str, Any]] = []
    rows: List[Dict[str, Any]] = []
    warmups: List[Dict[str, Any]] = []
    save(first_calls=first, rows=rows, pinned=pinned, backend=settings["backend"],
         **{k: settings[k] for k in ("device", "batch", "heads", "dim", "dtype")})
    _warm(device, save, "the first calls", warmups)
    _first_calls(settings, save, first)
    save(pinned_autotuners=len(fla_kernels._PINNED))
    _warm(device, save, "the timings", warmups)  # the first calls compile on the CPU: the GPU idled meanwhile
    for n in settings["n"]:
        q, k, v, do = attention_inputs(settings["batch"], settings["heads"], n, settings["dim"], device, dtype)
        paths = recurrence_paths(n, settings["dim"], device, settings["backend"])
        rows += _recurrence_rows(n, time_paths(paths, (q, k, v), do, device, bench_for(device)))
        del q, k, v, do
        save(rows=rows)
    fail_on_rows(save, [c["what"] for c in first if c["status"] != "ok"] + [
        f"N={r['n']} {r['pass']}" for r in rows if r["status"] != "ok"])


def _recurrence_rows(n: int, times: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows (one per pass) of the recurrence timings at ``n`` from :func:`time_paths`' ``times``."""
    rows = []
    for name in PASSES:
        row = {"n": n, "pass": name}
        for label, t in times.items():
            row[f"{label}_ms"] = t.get(name)
            if "oom" in t and name not in t:
                row[f"{label}_oom"] = True
        for label in RECURRENCES:
            if row.get(f"{label}_ms") and row.get("linear_rope_ms"):
                row[f"{label}_over_linear_rope"] = row[f"{label}_ms"] / row["linear_rope_ms"]
        row["status"] = row_status(times, name)
        rows.append(row)
    print(f"N={n}: " + "; ".join(f"{lab} {t}" for lab, t in times.items()), flush=True)
    return rows


# --- part: where a small call's time goes ---


def _profile_cases(settings: Dict[str, Any]) -> Dict[str, Callable[[], Any]]:
    """The calls the profile part reads: the fused kernels' forward and forward+backward at each N of
    ``settings["n"]`` (the kernels part's smallest and largest: the host's share, then each kernel's device time),
    SDPA's forward+backward at the smallest, and a forward at batch 1 of each of ``settings["models"]`` under the
    amp of the models part."""
    from linvision.kernels import linear_attention_triton
    from linvision.ops import softmax_attention
    from linvision.utils.amp import autocast
    from linvision.utils.factory import create_model

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    b, h, d = settings["batch"], settings["heads"], settings["dim"]
    cases: Dict[str, Callable[[], Any]] = {}
    for n in settings["n"]:
        q, k, v, do = attention_inputs(b, h, n, d, device, dtype)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def fused_fwd(q=q, k=k, v=v):
            with torch.no_grad():
                linear_attention_triton(q, k, v, "elu")

        cases[f"fused forward, N={n}"] = fused_fwd
        cases[f"fused forward+backward, N={n}"] = (
            lambda leaves=leaves, do=do: torch.autograd.grad(linear_attention_triton(*leaves, "elu"), leaves, do))
        if n == min(settings["n"]):
            cases[f"SDPA forward+backward, N={n}"] = (
                lambda leaves=leaves, do=do: torch.autograd.grad(softmax_attention(*leaves), leaves, do))
    size = settings["img_size"]
    for name in settings["models"]:
        model = create_model(name, img_size=size).to(device).eval()
        x = torch.randn(1, 3, size, size, device=device)

        def forward(model=model, x=x):
            with torch.no_grad(), autocast(torch.device(device), settings["amp"]):
                model(x)

        cases[f"{name} forward, batch 1, {size} px"] = forward
    return cases


GRID_SWEEP = (1, 2, 4, 8, 16)  # programs per SM the grid sweep gives the split kernels, then the span kernels
REGISTER_SWEEP = (128,)  # then the query kernel's registers per thread at most (176 uncapped at D=64)


def grid_sweep(settings: Dict[str, Any], save: Callable[..., None]) -> List[Dict[str, Any]]:
    """The fused kernels' forward, backward and forward+backward at the largest N with the number of programs per
    SM changed, one kind of kernel at a time: the state and query kernels (their token splits; default
    ``_SPLITS_PER_SM``), then the output and key kernels (their spans; default ``_SPANS_PER_SM``); then the query
    kernel with its registers capped (:data:`REGISTER_SWEEP`), where only one of its programs fits an SM. One row
    per setting, saved as measured: whether the kernels are short of programs to hide the memory's latency."""
    from linvision.kernels import la_launch, linear_attention as kernels

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    b, h, d, n = settings["batch"], settings["heads"], settings["dim"], max(settings["n"])
    q, k, v, do = attention_inputs(b, h, n, d, device, dtype)
    rows: List[Dict[str, Any]] = []
    defaults = {"_SPLITS_PER_SM": la_launch._SPLITS_PER_SM, "_SPANS_PER_SM": la_launch._SPANS_PER_SM}
    for constant in defaults:
        for per_sm in GRID_SWEEP:
            setattr(la_launch, constant, per_sm)
            try:
                times = time_passes(lambda q, k, v: kernels.linear_attention_triton(q, k, v, "elu"), (q, k, v), do,
                                    bench_for(device))
            finally:
                setattr(la_launch, constant, defaults[constant])
            rows.append({"n": n, "kernels": "state, query" if constant == "_SPLITS_PER_SM" else "output, key",
                         "per_sm": per_sm, "default": per_sm == defaults[constant],
                         **{f"{p}_ms": times.get(p) for p in PASSES}, "error": times.get("error")})
            print(f"grid sweep N={n} {rows[-1]['kernels']} x{per_sm}/SM: "
                  + ", ".join(f"{p} {times[p]:.3f} ms" for p in PASSES if p in times), flush=True)
            save(grid=rows)
    for cap in REGISTER_SWEEP:  # the query kernel, its registers capped: two programs per SM where it fitted one
        with la_launch.register_cap("_query_bwd_kernel", cap):
            times = time_passes(lambda q, k, v: kernels.linear_attention_triton(q, k, v, "elu"), (q, k, v), do,
                                bench_for(device))
        rows.append({"n": n, "kernels": f"query at most {cap} registers", "per_sm": la_launch._SPLITS_PER_SM,
                     "default": False, **{f"{p}_ms": times.get(p) for p in PASSES}, "error": times.get("error")})
        print(f"grid sweep N={n} {rows[-1]['kernels']}: "
              + ", ".join(f"{p} {times[p]:.3f} ms" for p in PASSES if p in times), flush=True)
        save(grid=rows)
    return rows


def profile_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """Each call of :func:`_profile_cases` read by :func:`linvision.benchmark.host_profile.profile_call`: wall,
    host and device ms, launches and aten ops per call, the operators with the most host time and the kernels
    with the most device time, one row per call saved as measured; then :func:`grid_sweep`."""
    from linvision.benchmark.host_profile import profile_call

    rows: List[Dict[str, Any]] = []
    save(rows=rows, device=settings["device"], steps=settings["steps"])
    _warm(settings["device"], save, "the profiles", [])
    for what, fn in _profile_cases(settings).items():
        rows.append({"what": what, **profile_call(fn, settings["device"], steps=settings["steps"])})
        print(f"{what}: " + ", ".join(f"{key} {rows[-1][key]:.3g}" for key in
                                      ("wall_ms", "host_ms", "device_ms", "launches", "aten_ops")), flush=True)
        save(rows=rows)
        free_memory(torch.device(settings["device"]))
    grid_sweep(settings, save)


# --- the process of a part ---

PART_FUNCTIONS = {"kernels": kernels_part, "profile": profile_part, "models": models_part,
                  "recurrences": recurrences_part}


def write_json(path: str, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (a temporary file renamed over it); NaN and infinities as null."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(plain(data), f, indent=2, allow_nan=False)
    os.replace(tmp, path)


def plain(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has neither) and tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def child() -> None:
    """The entry of a part's process: ``python -c ... PART SETTINGS_JSON RESULT_PATH``. The part saves its figures
    to RESULT_PATH as it goes; an exception is saved as the part's error (exit status 1)."""
    part, settings, result_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    state: Dict[str, Any] = {"done": False}

    def save(**figures):
        state.update(figures)
        write_json(result_path, state)

    try:
        PART_FUNCTIONS[part](settings, save)
        save(done=True)
    except Exception as e:
        traceback.print_exc()
        save(error=error_line(e))
        sys.exit(1)
