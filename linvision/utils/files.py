"""Durable writes: a file or a whole folder replaced atomically and fsync'ed, so a crash at any moment leaves
the old content or the new one, and the clean-up of what killed writes leave behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict, Tuple

__all__ = ["atomic_write", "atomic_write_text", "write_checkpoint_folder", "begin_checkpoint_folder",
           "commit_checkpoint_folder", "recover_checkpoint_folder", "remove_stale_temporaries"]


def _fsync_dir(folder: str) -> None:
    """Make a rename or a new file in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write(path: str, write_fn) -> None:
    """Call ``write_fn(tmp_path)``, fsync the file, rename it to ``path`` (same folder, so the rename is
    atomic) and fsync the folder: after a crash ``path`` holds the old or the new content, never a mix."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(folder)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    """:func:`atomic_write` of a text file."""
    def write(p: str) -> None:
        with open(p, "w") as f:
            f.write(text)

    atomic_write(path, write)


def remove_stale_temporaries(folder: str) -> list:
    """Delete the hidden ``.<name>.<random>.tmp`` files that :func:`atomic_write` leaves when a process is
    killed mid-write; call it only while holding the folder (a run's lock). Returns the removed names."""
    removed = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith(".") and name.endswith(".tmp") and os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
                removed.append(name)
    return removed


def _swap_names(folder: str) -> Tuple[str, str]:
    parent, base = os.path.split(os.path.abspath(folder))
    return os.path.join(parent, f".{base}.new"), os.path.join(parent, f".{base}.old")


def recover_checkpoint_folder(folder: str) -> str:
    """Finish or undo a :func:`write_checkpoint_folder` that a crash interrupted; returns what it did.

    ``.<name>.new`` beside a present ``<name>`` is an unfinished write (removed); ``<name>`` missing with
    ``.<name>.old`` present means the crash fell between the two renames, after the new folder was complete
    (it is moved in). Call it only while holding the run (its lock)."""
    new, old = _swap_names(folder)
    done = ""
    if not os.path.isdir(folder) and os.path.isdir(old):
        if os.path.isdir(new):
            os.replace(new, folder)
            done = "completed an interrupted checkpoint swap"
        else:
            os.replace(old, folder)
            done = "restored the previous checkpoint"
    if os.path.isdir(new):
        shutil.rmtree(new)
        done = done or "removed an unfinished checkpoint"
    if os.path.isdir(old):
        shutil.rmtree(old)
    return done


def begin_checkpoint_folder(folder: str) -> str:
    """Start writing ``folder`` as one unit: finish or undo an earlier interrupted write, then create and return
    the hidden ``.<folder>.new/`` that the files (or a collective writer such as torch.distributed.checkpoint)
    go into before :func:`commit_checkpoint_folder` swaps it in."""
    recover_checkpoint_folder(folder)
    new, _ = _swap_names(folder)
    os.makedirs(new)
    return new


def commit_checkpoint_folder(folder: str) -> None:
    """Swap the complete ``.<folder>.new/`` of :func:`begin_checkpoint_folder` in for ``folder``: every file in
    it (sub-folders included) and the folders are fsync'ed, then two renames (old one aside, new one in) and the
    parent fsync'ed. A crash at any moment leaves the previous checkpoint or the new one whole (see
    :func:`recover_checkpoint_folder`), never files of both."""
    new, old = _swap_names(folder)
    for root, _, names in os.walk(new):
        for name in names:
            _fsync_file(os.path.join(root, name))
        _fsync_dir(root)
    if os.path.isdir(folder):
        os.replace(folder, old)
    os.replace(new, folder)
    _fsync_dir(os.path.dirname(os.path.abspath(folder)))
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint_folder(folder: str, files: Dict[str, Any]) -> None:
    """Write a checkpoint folder as one unit: each ``files[name](path)`` writes one file into the new folder of
    :func:`begin_checkpoint_folder`, then :func:`commit_checkpoint_folder` swaps it in."""
    new = begin_checkpoint_folder(folder)
    for name, write_fn in files.items():
        write_fn(os.path.join(new, name))
    commit_checkpoint_folder(folder)
