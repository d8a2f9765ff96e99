"""How many CPU threads torch runs on: one rule for every tool (``--threads``, :func:`linvision.utils.cli.add_threads_arg`).

On a machine that other work keeps busy, each parallel region of torch waits for its slowest thread, which the
scheduler holds back: on 2 cores at load 6 a training step of the digits demo's model took 5-15 s on 2 threads
and 0.35 s on 1. So a tool takes, in this order:

1. ``--threads N``, when given;
2. ``OMP_NUM_THREADS``, when set (torchrun sets it for its ranks; the test suite exports its choice);
3. the cores that other processes leave free (:func:`threads_for_load`): the cores less those kept busy over half
   a second before the tool's own work starts (:func:`machine_load` with ``sample_s``; the load average lags a
   minute behind, so a job that has just ended would still count in it), at least 1 and at most torch's default.

:func:`set_threads` applies the rule and returns the line that says what it chose and why.
"""
from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

__all__ = ["machine_load", "busy_cores", "cores_busy_between", "threads_for_load", "set_threads", "threads_note",
           "LOAD_SAMPLE_S"]

# the seconds over which the busy cores are counted before a tool starts its work
LOAD_SAMPLE_S = 0.5


def _figure(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def machine_load(sample_s: Optional[float] = None) -> Dict[str, Any]:
    """``load`` (the 1-minute load average; NaN where the system keeps none), ``cores`` (those this process may run
    on) and ``threads`` (torch's CPU threads). With ``sample_s``, ``load`` is instead the cores kept busy during
    the next ``sample_s`` seconds (:func:`busy_cores`; the load average where /proc/stat is missing): the load
    average lags a minute behind, so a job that has just ended still counts in it."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = float("nan")
    if sample_s is not None:
        busy = busy_cores(sample_s)
        load = busy if _figure(busy) else load
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"load": load, "cores": cores, "threads": torch.get_num_threads()}


def busy_cores(sample_s: float, stat_path: str = "/proc/stat") -> float:
    """How many cores were busy over the next ``sample_s`` seconds (time neither idle nor waiting for I/O, a
    hypervisor's stolen time included), from two readings of ``stat_path``; NaN where it cannot be read."""
    try:
        before = Path(stat_path).read_text()
        time.sleep(sample_s)
        return cores_busy_between(before, Path(stat_path).read_text())
    except (OSError, ValueError):
        return float("nan")


def cores_busy_between(before: str, after: str) -> float:
    """The busy cores between two readings of /proc/stat: the share of the machine's time (its first ``cpu`` line:
    user, nice, system, idle, iowait, irq, softirq, steal, ...) not spent idle or in I/O wait, times the number of
    ``cpuN`` lines."""
    def totals(text: str):
        lines = text.splitlines()
        total = next((line for line in lines if line.startswith("cpu ")), None)
        if total is None:
            raise ValueError("/proc/stat: no 'cpu' line")
        fields = [int(v) for v in total.split()[1:]]
        cores = sum(1 for line in lines if re.match(r"cpu\d+ ", line))
        return sum(fields[:8]), fields[3] + fields[4], cores

    (total0, idle0, cores), (total1, idle1, _) = totals(before), totals(after)
    if total1 <= total0:
        raise ValueError("/proc/stat: no time passed between the readings")
    return cores * (1 - (idle1 - idle0) / (total1 - total0))


def threads_for_load(load: Optional[Dict[str, Any]] = None) -> int:
    """torch CPU threads for the cores that other work leaves free, by :func:`machine_load` taken before this
    process's own work starts (by default over half a second of busy cores, ``sample_s=LOAD_SAMPLE_S``): the cores
    less the load (rounded), at least 1 and at most torch's count."""
    load = load or machine_load(sample_s=LOAD_SAMPLE_S)
    free = load["cores"] - math.floor(load["load"] + 0.5) if _figure(load["load"]) else load["cores"]
    return max(1, min(load["threads"], free))


_CHOICE: Dict[str, str] = {}  # what the last set_threads call of this process chose, said as it said it


def threads_note() -> str:
    """The phrase of this process's last :func:`set_threads` call, or torch's count when none was made."""
    n = torch.get_num_threads()
    said = _CHOICE.get("said")
    return said if said and _CHOICE.get("threads") == str(n) else f"torch threads: {n}"


def set_threads(threads: Optional[int] = None) -> str:
    """Set torch's CPU threads by the module's rule (``threads`` given, else ``OMP_NUM_THREADS``, else the cores
    left free) and return what was chosen and why, as one phrase for the tool to print (``torch threads: 1 of 2
    (1.4 of 2 cores busy; --threads to choose)``). ValueError in one line for ``threads`` below 1."""
    said = _choose(threads)
    _CHOICE.update(threads=str(torch.get_num_threads()), said=said)
    return said


def _choose(threads: Optional[int]) -> str:
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: at least 1, got {threads!r}")
        torch.set_num_threads(threads)
        return f"torch threads: {threads} (--threads)"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        return f"torch threads: {torch.get_num_threads()} (OMP_NUM_THREADS={env})"
    default = torch.get_num_threads()
    if default <= 1:  # nothing to take away: no need to watch the machine
        return "torch threads: 1 (torch's default here; --threads to choose)"
    load = machine_load(sample_s=LOAD_SAMPLE_S)
    fit = threads_for_load(load)
    torch.set_num_threads(fit)
    busy = f"{load['load']:.1f} of {load['cores']} cores busy" if _figure(load["load"]) else "load unknown"
    return f"torch threads: {fit} of {default} ({busy}; --threads to choose)"
