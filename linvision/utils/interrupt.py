"""Stopping a run on SIGINT/SIGTERM between steps, after its checkpoint is written, shared by the trainers.

The main process records the signal (:class:`StopFlag`) and the loop saves and raises
:class:`TrainInterrupted`, which the tools turn into exit status 128 + signal. DataLoader worker processes
are forked with the signals blocked (:func:`blocked_stop_signals`) and leave the run's process group first
thing (:func:`prepare_worker_signals`), so a signal sent to the whole group (Ctrl-C in a shell, ``timeout``)
does not kill the workers before the main process has saved, while a SIGTERM sent to a worker alone still
ends it (ignoring SIGTERM in the workers would leave processes that the DataLoader or multiprocessing can no
longer end, and a program that hangs at exit).
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

__all__ = ["StopFlag", "TrainInterrupted", "blocked_stop_signals", "prepare_worker_signals", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainInterrupted(Exception):
    """Raised after the checkpoint is written when a signal stopped training; ``signum`` is the signal and
    ``resume`` the command that continues the run (its message ends with it)."""

    def __init__(self, signum: int, folder: str, resume: str):
        super().__init__(f"interrupted by {signal.Signals(signum).name}; checkpoint saved in {folder}; continue "
                         f"with: {resume}")
        self.signum, self.folder, self.resume = signum, folder, resume


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


@contextlib.contextmanager
def blocked_stop_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back (delivered at the end of the block) while DataLoader workers are forked: a
    signal to the run's group in that moment then never reaches a worker that has not yet left the group."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def prepare_worker_signals() -> None:
    """In a worker process (forked with the stop signals blocked): move to a process group of its own, so a
    signal to the run's group (Ctrl-C in a shell, ``timeout``, ``kill -- -PGID``) reaches only the main
    process, which saves and then ends the workers; drop a group signal that arrived before the move; leave
    Ctrl-C to the main process and give SIGTERM its default action, so that a SIGTERM sent to this worker alone
    (how the DataLoader and multiprocessing end workers that do not stop) ends it. (A forked worker would
    otherwise inherit the main process's stop flag handler and survive SIGTERM: a process hanging at exit.)"""
    import os

    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # discards a pending group SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
