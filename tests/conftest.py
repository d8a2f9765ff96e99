# --- linvision.kernels: run the Triton kernels in the interpreter when there is no GPU. Must be set before
# triton is imported; backend="auto" still selects the kernels for CUDA tensors only. ---
import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end linvision.kernels ---

# --- torch's CPU threads: the cores other processes leave free when the suite starts (the tools' rule,
# threads_for_load, on the cores kept busy over half a second: the load average lags a minute, so a job that has
# just ended, an install before CI's run, would still count), unless the caller sets OMP_NUM_THREADS. With the other
# core held by a process of another terminal session, two threads made small CPU calls 14-33x slower (their
# parallel regions wait for the thread the scheduler holds back) and tests/test_published.py ran past 200 s instead
# of 53 s on one thread. On a busy machine the choice (one thread) is exported, so the tools and torchrun jobs the
# tests start take it too; on idle cores it is not: torchrun then gives each rank one thread, where an exported 2
# made two ranks run four threads on two cores (docs/contributing.md has the figures). ---
_FREE_CORES = torch.get_num_threads()  # the caller's OMP_NUM_THREADS, or the rule's choice below
_LOAD, _EXPORTED = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", ""
if "OMP_NUM_THREADS" not in os.environ:
    from linvision.benchmark.throughput import machine_load, threads_for_load

    _load = machine_load(sample_s=0.5)
    _FREE_CORES = threads_for_load(_load)
    if _FREE_CORES < torch.get_num_threads():
        torch.set_num_threads(_FREE_CORES)
        os.environ["OMP_NUM_THREADS"] = str(_FREE_CORES)
    _LOAD = f"{_load['load']:.1f} of {_load['cores']} cores busy when the suite started"
    _EXPORTED = ", exported" if "OMP_NUM_THREADS" in os.environ else ""
_THREADS = f"torch threads: {torch.get_num_threads()} ({_LOAD}{_EXPORTED})"

import pytest

# --- the workers of `make test` (`-n auto`, pytest-xdist): one per core left free when the suite starts, at most
# MAX_WORKERS (each holds its own models: a worker per core of a large machine would multiply the memory), each on
# an equal share of the free cores' threads (one torch thread on 2 idle cores, exported to the tools and torchrun
# jobs its tests start); on a machine with fewer than two free cores the suite runs in this process (no workers).
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain pytest without the plugin runs as before
def pytest_xdist_auto_num_workers(config):
    return min(_FREE_CORES, MAX_WORKERS) if _FREE_CORES >= 2 else 0


def pytest_configure(config):
    global _THREADS
    workers = getattr(config.option, "numprocesses", None) or 0
    if workers and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, before it starts the workers
        share = max(1, _FREE_CORES // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        _THREADS = f"{workers} workers of {share} torch thread{'s' if share > 1 else ''} each ({_LOAD})"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        for item in items:  # their own deadline, longer than the default of pyproject.toml's timeout
            if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(3600))
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny image-folder dataset on disk (3 classes, 4 training and 2 validation images each, 16 px)."""
    from support import write_image_folder

    return write_image_folder(tmp_path_factory.mktemp("data"))


_FILE_SECONDS = {}  # test file -> seconds spent in its tests (set-up, call and tear-down)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """After the slowest tests (--durations), the slowest test files (where the run's time goes) and the torch
    threads the suite ran on."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest test files (of {total:.1f} s in tests; {_THREADS})")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:8]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:4.1f}%  {path}")


# --- the cuda marker: every test skipped for lack of CUDA carries it (pytest -m cuda is the GPU report's subset) ---
_NO_CUDA = re.compile(r"\b(GPU|CUDA)\b")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test skipped for lack of a GPU (its skip reason names a GPU or CUDA) without @pytest.mark.cuda fails,
    saying so: the GPU report's `-m cuda` would miss it."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or torch.cuda.is_available() or item.get_closest_marker("cuda") is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if _NO_CUDA.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is skipped for lack of CUDA ({reason}) but has no @pytest.mark.cuda: "
                           "add the marker, so that `pytest -m cuda` (the GPU report) runs it")
