"""Stopping a run on SIGINT/SIGTERM between steps, after its checkpoint is written, shared by the trainers.

The main process records the signal (:class:`StopFlag`) and the loop saves and raises
:class:`TrainInterrupted`, which the tools turn into exit status 128 + signal. DataLoader worker processes
leave the run's process group (:func:`leave_process_group`, called in each worker), so a signal sent to the
whole group (Ctrl-C in a shell, ``timeout``) does not kill the workers before the main process has saved.
(Ignoring the signals in the workers instead would leave workers that the DataLoader or multiprocessing can
no longer end with SIGTERM, and a process that hangs at exit.)
"""
from __future__ import annotations

import signal

__all__ = ["StopFlag", "TrainInterrupted", "leave_process_group", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainInterrupted(Exception):
    """Raised after the checkpoint is written when a signal stopped training; ``signum`` is the signal."""

    def __init__(self, signum: int, folder: str):
        super().__init__(f"interrupted by {signal.Signals(signum).name}; checkpoint saved in {folder}")
        self.signum, self.folder = signum, folder


class StopFlag:
    """Records SIGINT/SIGTERM so the loop can stop between steps (after saving) instead of dying mid-write."""

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def __enter__(self):
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def leave_process_group() -> None:
    """In a worker process: move to a process group of its own, so that a signal sent to the run's group
    (Ctrl-C in a shell, ``timeout``, ``kill -- -PGID``) reaches only the main process, which saves and then
    ends the workers. The worker keeps the default handlers: a SIGTERM sent to it alone (how the DataLoader and
    multiprocessing end workers that do not stop) still ends it."""
    import os

    os.setpgid(0, 0)
