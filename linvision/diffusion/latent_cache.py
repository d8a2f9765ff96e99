"""The on-disk cache of an autoencoder's latents of a training set, shared by runs and by ranks.

A cache is a folder::

    source.json               what the latents were encoded from (autoencoder, data, image size, count)
    latents-00000.safetensors  "latents" (shard_size, C, h, w) fp32 of images [0, shard_size), and so on
    cache.json                written last: the cache is complete (source, count, latent shape, shard size)

Each shard is written atomically, so a run killed while encoding keeps every finished shard and the next run
(any run naming the same folder with the same source) encodes only what is missing; runs sharing a folder build
it one at a time (a lock). Under torchrun the ranks split the missing shards. Reading takes single rows from the memory-mapped shards: a rank holds only its
batches, never the whole cache.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from linvision.utils.distributed import DistInfo, barrier, on_main
from linvision.utils.files import atomic_write, atomic_write_text, remove_stale_temporaries

__all__ = ["CACHE_FILE", "SOURCE_FILE", "build_latent_cache", "LatentCache"]

CACHE_FILE = "cache.json"
SOURCE_FILE = "source.json"


def _shard_path(folder: str, i: int) -> str:
    return os.path.join(folder, f"latents-{i:05d}.safetensors")


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"latent_cache: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def _check_source(folder: str, source: Dict[str, Any]) -> None:
    """ValueError naming the first key in which ``folder``'s recorded source differs from ``source``."""
    path = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(path):
        return
    theirs = _read_json(path)
    for key, value in source.items():
        if theirs.get(key) != value:
            raise ValueError(f"latent_cache: {folder} holds latents of {key}={theirs.get(key)!r}, this run asks for "
                             f"{value!r} (name another folder)")


def _lock(folder: str, log: Callable[[str], None]):
    """An exclusive fcntl lock on ``folder/.lock`` (released when the returned file is closed), waiting for a
    run that holds it."""
    import fcntl

    f = open(os.path.join(folder, ".lock"), "a")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log(f"latent cache: waiting for the run that is building {folder}")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    return f


def build_latent_cache(folder: str, source: Dict[str, Any], count: int, images: Callable[[range], Tensor],
                       encode: Callable[[Tensor], Tensor], shard_size: int = 1024, info: Optional[DistInfo] = None,
                       log: Callable[[str], None] = print) -> None:
    """Make ``folder`` a complete cache of ``encode(images(range))`` for the ``count`` images ``source``
    describes (a JSON-able dict: autoencoder, dataset, size ...), keeping what an earlier run finished.

    Every rank of ``info`` calls this; the shards still missing are split between them. Rank 0 holds the
    folder's lock meanwhile, so runs sharing the folder build it one at a time. ValueError (on every rank) when
    ``folder`` holds latents of another source or shard size.
    """
    info = info or DistInfo()
    source = {**source, "count": count, "shard_size": shard_size}
    lock = None

    def prepare() -> bool:
        nonlocal lock
        os.makedirs(folder, exist_ok=True)
        lock = _lock(folder, log)
        _check_source(folder, source)
        if os.path.isfile(os.path.join(folder, CACHE_FILE)):
            return True
        remove_stale_temporaries(folder)  # what a killed run left half written
        if not os.path.isfile(os.path.join(folder, SOURCE_FILE)):
            atomic_write_text(os.path.join(folder, SOURCE_FILE), json.dumps(source, indent=2))
        return False

    try:
        if on_main(prepare, info):
            return
        shards = math.ceil(count / shard_size)
        missing = [i for i in range(shards) if not os.path.isfile(_shard_path(folder, i))]
        barrier(info)  # every rank listed the same files before any writes one
        mine = missing[info.rank::info.world_size]
        start = time.perf_counter()
        for done, i in enumerate(mine):
            rows = range(i * shard_size, min(count, (i + 1) * shard_size))
            latents = encode(images(rows)).float().contiguous()
            atomic_write(_shard_path(folder, i), lambda p: save_file({"latents": latents}, p))
            log(f"latent cache: shard {i + 1}/{shards} ({len(rows)} images) encoded, {done + 1}/{len(mine)} of "
                f"this rank's ({shards - len(missing)} kept from an earlier run), {time.perf_counter() - start:.0f}s")
        barrier(info)
        if info.is_main:
            with safe_open(_shard_path(folder, 0), framework="pt") as f:
                shape = list(f.get_slice("latents").get_shape()[1:])
            meta = {"source": source, "count": count, "shard_size": shard_size, "latent_shape": shape}
            atomic_write_text(os.path.join(folder, CACHE_FILE), json.dumps(meta, indent=2))
        barrier(info)
    finally:
        if lock is not None:
            lock.close()


class LatentCache:
    """A complete cache folder of :func:`build_latent_cache`: ``latents(indices)`` -> (len, C, h, w) fp32, read
    row by row from the memory-mapped shards. FileNotFoundError / ValueError in one line for a folder that is
    not a complete cache or a missing shard."""

    def __init__(self, folder: str):
        path = os.path.join(folder, CACHE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"latent_cache: no {CACHE_FILE} in {folder} (not a complete latent cache)")
        meta = _read_json(path)
        self.folder = folder
        self.count: int = meta["count"]
        self.shard_size: int = meta["shard_size"]
        self.latent_shape: List[int] = meta["latent_shape"]
        self.source: Dict[str, Any] = meta["source"]
        self._files: Dict[int, Any] = {}

    def __len__(self) -> int:
        return self.count

    def _shard(self, i: int):
        if i not in self._files:
            path = _shard_path(self.folder, i)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"latent_cache: shard {path} is missing")
            self._files[i] = safe_open(path, framework="pt").get_slice("latents")
        return self._files[i]

    def latents(self, indices) -> Tensor:
        """The latents of the images at ``indices`` (a sequence or 1-D tensor of ints), in that order."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).tolist()
        bad = next((i for i in idx if not 0 <= i < self.count), None)
        if bad is not None:
            raise ValueError(f"indices: {bad} is outside the cache's {self.count} images")
        if not idx:
            return torch.empty(0, *self.latent_shape)
        rows = [self._shard(i // self.shard_size)[i % self.shard_size:i % self.shard_size + 1] for i in idx]
        return torch.cat(rows)
