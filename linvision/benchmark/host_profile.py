"""Where the time of a small call goes: the host's work (Python, dispatch, launches) against the device's.

A call of the fused kernels, or a model's forward at batch 1, can take longer than its device work when the host
cannot enqueue the work as fast as the device runs it: then the call's time is the host's, whatever the size.
:func:`profile_call` reads one call with torch.profiler and a pair of clocks:

- ``wall_ms``: per call, the device synchronised after the timed calls (what a user waits);
- ``host_ms``: per call, until the Python call returns, not synchronised (the host's enqueueing; on a CPU, where
  nothing is asynchronous, the whole call);
- ``device_ms``: per call, the summed self time of the device's kernels in the profile (0 on a CPU);
- ``launches``: device launches per call (the runtime's and the driver's kernel-launch calls in the profile);
- ``aten_ops``: aten operators per call, nested ones included (``aten::linear`` and the ``aten::addmm`` it calls
  are two);
- ``top``: the operators with the most host time of their own, per call;
- ``kernels``: the device kernels with the most device time, per call (none on a CPU).

A call is host-bound where ``wall_ms`` is close to ``host_ms`` and well above ``device_ms``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import torch

__all__ = ["profile_call"]

_LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _clocks(fn: Callable[[], Any], device: str, steps: int) -> Dict[str, float]:
    """Milliseconds per call: until the calls return (host) and until the device has finished them (wall)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - start
    _sync(device)
    wall = time.perf_counter() - start
    return {"wall_ms": wall * 1e3 / steps, "host_ms": host * 1e3 / steps}


def _device_us(event: Any) -> float:
    """An averaged event's self time on the device in microseconds (the attribute's name moved across torch
    releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _is_kernel(event: Any) -> bool:
    """Whether an averaged event is a device kernel (or copy) rather than a host operator."""
    kind = getattr(event, "device_type", None)
    return kind is not None and str(kind).endswith("CUDA")


def _profile(fn: Callable[[], Any], device: str, steps: int, top: int) -> Dict[str, Any]:
    """launches, aten ops, device time and the top host operators per call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in _LAUNCH_NAMES)
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    device_us = sum(_device_us(e) for e in events if _is_kernel(e))
    ops = sorted((e for e in events if not _is_kernel(e)), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows: List[Dict[str, Any]] = [{"op": e.key, "calls": e.count / steps, "self_host_us": e.self_cpu_time_total / steps}
                                  for e in ops[:top]]
    kernels = sorted((e for e in events if _is_kernel(e)), key=_device_us, reverse=True)
    return {"launches": launches / steps, "aten_ops": aten / steps, "device_ms": device_us / 1e3 / steps,
            "top": rows, "kernels": [{"kernel": e.key, "calls": e.count / steps, "device_us": _device_us(e) / steps}
                                     for e in kernels[:top]]}


def profile_call(fn: Callable[[], Any], device: str, *, steps: int = 5, warmup: int = 2, top: int = 8) -> Dict[str, Any]:
    """The clocks (:func:`_clocks`) and the profile (:func:`_profile`) of ``fn`` per call, over ``steps`` calls
    after ``warmup`` untimed ones (compilations and autotuning happen there); see the module's docstring for each
    figure. ``device``: "cuda" or "cpu"."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps: expected >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    return {**_clocks(fn, device, steps), **_profile(fn, device, steps, top)}
