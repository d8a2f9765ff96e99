"""Memory traffic of Triton kernels counted in the interpreter (``TRITON_INTERPRET=1``, no GPU needed).

Inside :func:`count_traffic`, every kernel launch records the distinct bytes its programs load and the
distinct bytes they store, masked lanes excluded. Distinct bytes per launch are a fair proxy for DRAM traffic:
a re-read of a small state stays in cache, a second pass over an N-sized tensor would be counted twice only
if it happened in a second launch (which is where it would really go back to DRAM).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List

import numpy as np

__all__ = ["LaunchTraffic", "count_traffic", "minimal_bytes"]


@dataclass
class LaunchTraffic:
    """Distinct bytes loaded and stored by one kernel launch."""

    kernel: str
    bytes_loaded: int = 0
    bytes_stored: int = 0
    _loads: Dict[int, List[np.ndarray]] = field(default_factory=dict, repr=False)
    _stores: Dict[int, List[np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.bytes_loaded + self.bytes_stored

    def _finish(self) -> None:
        def distinct(groups: Dict[int, List[np.ndarray]]) -> int:
            # Element addresses are unique per element size; tensors of one launch never overlap.
            return sum(itemsize * np.unique(np.concatenate(arrs)).size for itemsize, arrs in groups.items())

        self.bytes_loaded = distinct(self._loads)
        self.bytes_stored = distinct(self._stores)
        self._loads.clear()
        self._stores.clear()


def _addresses(ptrs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.asarray(ptrs)[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs))]


# The interpreter is not a public API: these are the only parameters the counter relies on (the ones after
# them changed between releases). Checked on every call, so a release that renames them fails with one line;
# _TESTED_TRITON is the release pinned in constraints.txt, on which the tests run the counter.
_LOAD_PARAMS = ("self", "ptrs", "mask")
_STORE_PARAMS = ("self", "ptrs", "value", "mask")
_TESTED_TRITON = "3.8.0"


def _check_interpreter_api(builder_cls) -> None:
    """RuntimeError naming the Triton version when the interpreter's load/store methods no longer start with
    the parameters the counter reads (a future release may rename them)."""
    import inspect

    import triton

    for name, want in (("create_masked_load", _LOAD_PARAMS), ("create_masked_store", _STORE_PARAMS)):
        method = getattr(builder_cls, name, None)
        params = tuple(inspect.signature(method).parameters)[: len(want)] if method is not None else ()
        if params != want:
            raise RuntimeError(
                f"count_traffic: Triton {triton.__version__}'s interpreter has no {name}{want[1:]} "
                f"(found {params[1:] or 'nothing'}); the counter was tested with Triton {_TESTED_TRITON}")


@contextlib.contextmanager
def count_traffic() -> Iterator[List[LaunchTraffic]]:
    """Yield a list that receives one :class:`LaunchTraffic` per kernel launch made inside the block.

    Raises RuntimeError unless Triton runs in interpreter mode (set ``TRITON_INTERPRET=1`` before importing
    triton).
    """
    import os

    from triton.runtime import interpreter

    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("count_traffic: needs TRITON_INTERPRET=1 set before triton is imported")
    builder_cls = interpreter.InterpreterBuilder
    executor_cls = interpreter.GridExecutor
    _check_interpreter_api(builder_cls)
    orig_load = builder_cls.create_masked_load
    orig_store = builder_cls.create_masked_store
    orig_call = executor_cls.__call__
    launches: List[LaunchTraffic] = []
    current: List[LaunchTraffic] = []

    # Only the leading (ptrs, mask) / (ptrs, value, mask) arguments are read; the cache and eviction
    # arguments after them changed between Triton releases and are passed through untouched.
    def load(self, ptrs, mask, *args, **kwargs):
        ret = orig_load(self, ptrs, mask, *args, **kwargs)
        if current:
            itemsize = ret.data.dtype.itemsize
            current[-1]._loads.setdefault(itemsize, []).append(_addresses(ptrs.data, mask.data))
        return ret

    def store(self, ptrs, value, mask, *args, **kwargs):
        if current:
            itemsize = np.asarray(value.data).dtype.itemsize
            current[-1]._stores.setdefault(itemsize, []).append(_addresses(ptrs.data, mask.data))
        return orig_store(self, ptrs, value, mask, *args, **kwargs)

    def call(self, *args, **kwargs):
        current.append(LaunchTraffic(getattr(self.fn, "__name__", str(self.fn))))
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            record = current.pop()
            record._finish()
            launches.append(record)

    builder_cls.create_masked_load = load
    builder_cls.create_masked_store = store
    executor_cls.__call__ = call
    try:
        yield launches
    finally:
        builder_cls.create_masked_load = orig_load
        builder_cls.create_masked_store = orig_store
        executor_cls.__call__ = orig_call


def minimal_bytes(b: int, h: int, nq: int, nk: int, d: int, dv: int, itemsize: int, backward: bool) -> int:
    """HBM floor of non-causal linear attention: each N-sized tensor read or written once.

    Forward reads q, k, v and writes o; backward reads q, k, v, dO and writes dq, dk, dv (the D x Dv state
    is ignored: it is O(D * Dv) against O(N * D))."""
    if backward:
        elems = 2 * nq * d + nq * dv + 2 * nk * d + 2 * nk * dv
    else:
        elems = nq * d + nk * d + nk * dv + nq * dv
    return b * h * elems * itemsize
