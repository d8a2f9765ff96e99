"""What every benchmark shares, the diffusion stack's included: the peak memory a block of work adds
(:class:`MemoryMeter`), the seconds of timed calls (:func:`timed`) and a call in a process of its own, stopped at
a deadline (:func:`run_in_process`).

Peak memory is what the block adds above what was held when it began:
- CUDA: ``torch.cuda.max_memory_allocated`` during the block minus the memory allocated before it;
- CPU: the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs before the block) minus
  its resident size before the block, after glibc's ``malloc_trim`` has handed freed memory back to the system
  (otherwise buffers kept from earlier work would hide this block's). It is coarser than the CUDA figure (it sees
  pages, not tensors) and depends on the allocator; it is NaN off Linux.
"""
from __future__ import annotations

import ctypes
import gc
import os
import time
from typing import Any, Callable, List, NamedTuple, Sequence

import torch


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
    """Peak memory a block of work adds, in MiB (``peak_mb``; see the module docstring for the definition per
    device)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
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


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> List[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed calls (on CUDA the device is
    synchronised before and after each timed call)."""
    device = torch.device(device)
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


class ProcessOutcome(NamedTuple):
    """How a :func:`run_in_process` call ended: the last message sent, whether the target finished (sent None),
    whether it was stopped at the deadline, and the process's exit code (-9: killed by SIGKILL, as the kernel's
    out-of-memory killer does)."""
    last: Any
    done: bool
    timed_out: bool
    exitcode: Any


def run_in_process(target: Callable[..., None], args: Sequence[Any], timeout: float) -> ProcessOutcome:
    """Call ``target(conn, *args)`` in a spawned process, stopped (SIGKILL) after ``timeout`` seconds. The target
    sends what it has measured over ``conn`` as it goes and None when it has finished; the last message is kept,
    so a process stopped or killed keeps what it sent before. ``target`` and ``args`` must be picklable."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(send, *args), daemon=True)
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
    finally:  # also on Ctrl-C: the process never outlives its caller
        if not done and proc.is_alive():
            proc.kill()
            stopped = True
        proc.join()
        receive.close()
    return ProcessOutcome(last, done, stopped, proc.exitcode)
