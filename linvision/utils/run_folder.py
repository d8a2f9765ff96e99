"""A run folder is owned by one run at a time, and a finished run is never overwritten by accident.

:func:`claim_run_folder` takes an exclusive lock (``<run>/.lock``, an ``fcntl`` lock the kernel releases when
the process dies, so a killed run never leaves a stale lock) for the life of the run. A new run whose folder
already holds a run writes to the first free ``<name>-<k>`` beside it, as timm's train.py does, unless
``overwrite`` asks for the old one's files to be deleted; ``resume`` requires the folder to exist. A folder
held by another live process is refused with its pid. Under the lock the claim also finishes or undoes a
checkpoint swap a crash interrupted and deletes the temporaries killed writes left.

Nothing is left behind that no run needs: :meth:`RunFolder.release` deletes ``.lock`` and a folder the claim
created that is still empty; :meth:`RunFolder.discard` (a new run that failed before its first checkpoint)
also deletes the records it wrote, so the next run of that name takes the name, not ``<name>-1``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import List

from .files import recover_checkpoint_folder, remove_stale_temporaries

__all__ = ["RunFolder", "claim_run_folder", "RUN_FILES"]

# What a run writes into its folder; --overwrite deletes exactly these.
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "last", "best")
LOCK_NAME = ".lock"


class RunFolder:
    """An owned run folder: ``path`` and the open, locked ``.lock`` file (released by :meth:`release`);
    ``created`` says whether the claim made the folder."""

    def __init__(self, path: str, lock_file, notes: List[str], created: bool = False):
        self.path, self._lock_file, self.notes, self.created = path, lock_file, notes, created

    def release(self) -> None:
        """Delete ``.lock`` and drop the lock (in that order: a run that opens ``.lock`` meanwhile finds the file
        it locked gone and claims the folder anew), then delete the folder if the claim created it and it is
        empty."""
        if self._lock_file is None:
            return
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.path, LOCK_NAME))
        self._lock_file.close()  # closing the descriptor drops the fcntl lock
        self._lock_file = None
        if self.created:
            with contextlib.suppress(OSError):  # not empty: a run, or files of the user's
                os.rmdir(self.path)

    def discard(self, run_files=None) -> None:
        """For a new run that failed before its first checkpoint: delete the records it wrote (``run_files``,
        default :data:`RUN_FILES`), then :meth:`release`."""
        for name in run_files or RUN_FILES:
            target = os.path.join(self.path, name)
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.exists(target):
                os.remove(target)
        self.release()


def _try_lock(path: str):
    """The open lock file of ``path`` if this process could lock it, else (None, pid of the holder)."""
    import fcntl

    lock_path = os.path.join(path, LOCK_NAME)
    while True:
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            return None, holder
        try:
            same = os.stat(lock_path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()  # the owner released and deleted this file after it was opened: lock the new one
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f, None


def _holds_a_run(path: str, run_files) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in run_files)


def claim_run_folder(path: str, resume: bool = False, overwrite: bool = False,
                     run_files=RUN_FILES) -> RunFolder:
    """Lock and return the folder this run writes to (see the module docstring); ``run_files`` are the names
    that mark a folder as holding a run (and that ``overwrite`` deletes).

    Raises ValueError (one line) when the folder is held by another process, when ``resume`` names a folder
    that does not exist, or when the folder cannot be created or written (a file in its place, no write
    permission).
    """
    path = os.path.abspath(path)
    if resume and not os.path.isdir(path):
        raise ValueError(f"resume: no run folder {path}")
    candidates = [path] if resume or overwrite else [path] + [f"{path}-{k}" for k in range(1, 1000)]
    for candidate in candidates:
        try:
            created = not os.path.isdir(candidate)
            os.makedirs(candidate, exist_ok=True)
            lock, holder = _try_lock(candidate)
        except OSError as e:
            raise ValueError(f"output: cannot create or write the run folder {candidate} "
                             f"({e.strerror or type(e).__name__})") from None
        if lock is None:
            if resume or overwrite:
                raise ValueError(f"output: {candidate} is in use by another run (process {holder}); wait for it "
                                 f"to finish or choose another --experiment")
            continue
        notes = []
        if not resume and _holds_a_run(candidate, run_files):
            if not overwrite:
                RunFolder(candidate, lock, []).release()  # the earlier run's folder, without a .lock
                continue
            for name in run_files:
                target = os.path.join(candidate, name)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                elif os.path.exists(target):
                    os.remove(target)
            notes.append(f"--overwrite: deleted the earlier run in {candidate}")
        elif candidate != path:
            notes.append(f"{path} holds an earlier run; this one writes to {candidate} (--resume continues "
                         f"that run, --overwrite replaces it)")
        for sub in ("last", "best"):
            done = recover_checkpoint_folder(os.path.join(candidate, sub))
            if done:
                notes.append(f"{sub}/: {done}")
        removed = remove_stale_temporaries(candidate)  # checkpoints are swapped whole, so none inside them
        if removed:
            notes.append(f"removed {len(removed)} temporary file(s) of an interrupted write")
        return RunFolder(candidate, lock, notes, created)
    raise ValueError(f"output: no free run folder next to {path}")
