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
  attention with RoPE on the fused kernels, forward and backward, at each N.

On the CPU (the dry run) every figure is the time of one call, in Triton's interpreter for the fused kernels and
on the PyTorch path for the recurrences: the part's plumbing, not a speed.
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


def free(device: str) -> None:
    """Give back the caching allocator's free blocks (after an out-of-memory error above all)."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def time_passes(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor,
                bench: Callable[[Callable[[], Any]], float]) -> Dict[str, float]:
    """Milliseconds of ``fn(*inputs)`` forward, backward (to the inputs, against ``grad_out``) and
    forward+backward, as ``bench`` times each. torch.OutOfMemoryError propagates (the memory is freed first)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = None
    try:
        with torch.no_grad():
            fwd = bench(lambda: fn(*inputs))
        out = fn(*leaves)
        bwd = bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))
        both = bench(lambda: torch.autograd.grad(fn(*leaves), leaves, grad_out))
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}
    finally:
        del out, leaves


def attention_inputs(b: int, h: int, n: int, d: int, device: str, dtype: torch.dtype) -> List[torch.Tensor]:
    """q, k, v and an output gradient (B, H, N, D) drawn from a fixed seed."""
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g, device=device, dtype=dtype) for _ in range(4)]


def time_paths(paths: Dict[str, Callable[..., torch.Tensor]], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor,
               device: str, bench: Callable) -> Dict[str, Dict[str, Any]]:
    """{label: {pass: ms}} of every path of ``paths``, one after the other on the same inputs; a path that runs
    out of memory gets {"oom": message} and the others still run."""
    times: Dict[str, Dict[str, Any]] = {}
    for label, fn in paths.items():
        try:
            times[label] = time_passes(fn, inputs, grad_out, bench)
        except torch.OutOfMemoryError as e:
            times[label] = {"oom": str(e).strip().splitlines()[0][:200]}
        free(device)
    return times


def _rope(d: int, n: int, device: str):
    from linvision.ops import axial_rope

    width = 64 if n % 64 == 0 else n
    return axial_rope(d, (n // width, width), device=device)


# --- part 1: the fused kernels against SDPA ---


def kernels_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """The fused kernels ("triton"), the PyTorch reference and SDPA at each N of ``settings["n"]`` (B, H, D, dtype,
    feature map from ``settings``), one row per (N, pass) saved as measured, with the kernels' minimal bytes over
    their time as a share of the HBM bandwidth on a GPU."""
    from linvision.kernels import linear_attention_triton
    from linvision.kernels.traffic import minimal_bytes
    from linvision.ops import linear_attention_reference, softmax_attention

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    b, h, d, phi = settings["batch"], settings["heads"], settings["dim"], settings["feature_map"]
    tbps = (settings.get("hbm_tbps") or hbm_tbps(torch.cuda.get_device_name())) if device == "cuda" else None
    rows: List[Dict[str, Any]] = []
    save(rows=rows, device=device, hbm_tbps=tbps, batch=b, heads=h, dim=d, dtype=settings["dtype"], feature_map=phi)
    itemsize = torch.finfo(dtype).bits // 8
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
            rows.append(row)
            print(f"N={n:>7d} {name:>8}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()
                                                      if k.endswith("_ms") and v), flush=True)
        del q, k, v, do
        save(rows=rows)


# --- part 2: the models a user compares ---


def comparison_order(models: Sequence[str], sizes: Sequence[Any], batches: Sequence[int]) -> List[Tuple]:
    """(batch, size, model) in the order the comparison measures them: batch by batch, size by size (the
    smallest first), every model at a size before the next size, so that a run cut short keeps whole
    comparisons."""
    return [(b, s, m) for b in batches for s in sizes for m in models]


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
    size is not tried at larger sizes with that batch (recorded as out of memory there too). Then, per batch,
    each model's time and memory over the twin's, and ``oom_at``: per model and batch, the first size out of
    memory."""
    from linvision.benchmark.throughput import add_comparisons, benchmark_point, parse_model_spec

    points: List[Dict[str, Any]] = []
    save(points=points, twin=settings["twin"], model_kwargs=settings["model_kwargs"],
         **{k: settings[k] for k in ("batches", "device", "amp", "warmup", "iters")})
    out_at: Dict[Tuple[str, int], Any] = {}
    for batch, size, spec in comparison_order(settings["models"], settings["img_size"], settings["batches"]):
        if (spec, batch) in out_at:
            point = _skip_point(spec, size, batch, settings, f"not tried: out of memory at {out_at[spec, batch]} px")
        else:
            name, own = parse_model_spec(spec)
            point = benchmark_point(name, size, batch_size=batch, device=settings["device"], amp=settings["amp"],
                                    warmup=settings["warmup"], iters=settings["iters"], flops=False,
                                    model_kwargs={**settings["model_kwargs"], **own})
            point["model"] = spec
            if point["status"] == "oom":
                out_at[spec, batch] = point["img_size"]
        points.append(point)
        print(f"batch {batch} {spec} {point['img_size']} px: {point['status']} "
              f"infer {point['infer_img_s']:.2f} img/s, train {point['train_img_s']:.2f} img/s", flush=True)
        save(points=points, oom_at=_oom_at(points))
    for batch in settings["batches"]:
        group = [p for p in points if p["batch_size"] == batch]
        if settings["twin"] and group:
            add_comparisons(group, settings["twin"])
    save(points=points, oom_at=_oom_at(points))


def _oom_at(points: List[Dict[str, Any]]) -> Dict[str, Any]:
    """{"model @ batch B": first size out of memory} for the models that ran out of memory."""
    found: Dict[str, Any] = {}
    for p in points:
        key = f"{p['model']} @ batch {p['batch_size']}"
        if p["status"] == "oom" and key not in found:
            found[key] = p["img_size"]
    return found


# --- part 3: the recurrences ---


def recurrence_paths(n: int, d: int, device: str, backend: str) -> Dict[str, Callable[..., torch.Tensor]]:
    """The ops the recurrences part times, on (B, H, N, D) q, k, v: ``linear_rope`` (linear attention with 2D
    RoPE on a grid N / 64 x 64, the fused kernels on a GPU), ``bidir_delta`` (the bidirectional delta rule,
    beta 0.5) and ``bidir_gated`` (the bidirectional gated form, one gate per head, gamma 0.99), the two last on
    fla-core's kernels on a GPU (``backend``)."""
    from linvision.ops import (bidirectional_delta_rule_attention, bidirectional_gated_linear_attention,
                               linear_attention)

    rope = _rope(d, n, device)

    def delta(q, k, v):
        beta = torch.full(q.shape[:3], 0.5, device=q.device)
        return bidirectional_delta_rule_attention(q, k, v, beta, backend=backend)

    def gated(q, k, v):
        log_gate = torch.full((*q.shape[:3], 1), math.log(0.99), device=q.device)
        return bidirectional_gated_linear_attention(q, k, v, log_gate, backend=backend)

    return {"linear_rope": lambda q, k, v: linear_attention(q, k, v, "elu", rope=rope), "bidir_delta": delta,
            "bidir_gated": gated}


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


def _first_calls(settings: Dict[str, Any], save: Callable[..., None], first: List[Dict[str, Any]]) -> None:
    """The first forward+backward of each recurrence op (at the smallest N) and of each model of
    ``settings["first_models"]``, compilation included: how long a user's first call waits."""
    device, dtype, d = settings["device"], getattr(torch, settings["dtype"]), settings["dim"]
    n = min(settings["n"])
    q, k, v, do = attention_inputs(settings["batch"], settings["heads"], n, d, device, dtype)
    for label, fn in recurrence_paths(n, d, device, settings["backend"]).items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        seconds = first_call_seconds(lambda: torch.autograd.grad(fn(*leaves), leaves, do), device)
        first.append({"what": f"{label} at N={n}", "seconds": seconds})
        save(first_calls=first)
    for name in settings["first_models"]:
        start = time.perf_counter()
        step = _model_step(name, settings["model_img_size"], device, settings["amp"])
        seconds = first_call_seconds(step, device)
        first.append({"what": f"{name} at {settings['model_img_size']} px, batch 1", "seconds": seconds,
                      "build_s": time.perf_counter() - start - seconds})
        del step
        free(device)
        save(first_calls=first)


def recurrences_part(settings: Dict[str, Any], save: Callable[..., None]) -> None:
    """The first calls (:func:`_first_calls`), then bidir_delta and bidir_gated against linear_rope
    (:func:`recurrence_paths`) at each N, forward, backward and forward+backward, one row per (N, pass)."""
    from linvision.ops.recurrent import kernels as fla_kernels

    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    pinned = os.environ.get(fla_kernels.AUTOTUNE_ENV, "0") != "1"
    first: List[Dict[str, Any]] = []
    rows: List[Dict[str, Any]] = []
    save(first_calls=first, rows=rows, pinned=pinned, backend=settings["backend"],
         **{k: settings[k] for k in ("device", "batch", "heads", "dim", "dtype")})
    _first_calls(settings, save, first)
    save(pinned_autotuners=len(fla_kernels._PINNED))
    for n in settings["n"]:
        q, k, v, do = attention_inputs(settings["batch"], settings["heads"], n, settings["dim"], device, dtype)
        paths = recurrence_paths(n, settings["dim"], device, settings["backend"])
        times = time_paths(paths, (q, k, v), do, device, bench_for(device))
        for name in PASSES:
            row = {"n": n, "pass": name}
            for label in paths:
                row[f"{label}_ms"] = times[label].get(name)
                if "oom" in times[label]:
                    row[f"{label}_oom"] = True
            for label in ("bidir_delta", "bidir_gated"):
                if row[f"{label}_ms"] and row["linear_rope_ms"]:
                    row[f"{label}_over_linear_rope"] = row[f"{label}_ms"] / row["linear_rope_ms"]
            rows.append(row)
        print(f"N={n}: " + "; ".join(f"{lab} {t}" for lab, t in times.items()), flush=True)
        del q, k, v, do
        save(rows=rows)


# --- the process of a part ---

PART_FUNCTIONS = {"kernels": kernels_part, "models": models_part, "recurrences": recurrences_part}


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
        message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        save(error=f"{type(e).__name__}: {message}" if message else type(e).__name__)
        sys.exit(1)
