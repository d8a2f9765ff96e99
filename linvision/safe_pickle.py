"""Reading ``torch.save`` files that nobody here wrote (published research checkpoints, timm's) without running
any code they hold.

Research checkpoints (``.pth`` written by ``torch.save``) are pickles: next to the weights they hold whatever the
training script saved (a yacs config, an argparse Namespace, numpy scalars, optimizer state). ``torch.load`` with
``weights_only=True`` refuses such a file, and ``weights_only=False`` runs whatever the pickle names. Here a
TorchScript archive (which torch.load would hand to ``torch.jit.load``, running its code) is refused, and the
pickle is read by an unpickler that builds tensors, plain containers and a few harmless torch values only; every
other object the file names becomes an inert placeholder (:class:`NotLoaded`) that records the name and runs
nothing: its construction, state and items are ignored. The weights come out intact; nothing else is trusted.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

__all__ = ["NotLoaded", "read_checkpoint"]

# (module, name) pairs the reader may build: tensor rebuilders and values that run no user code.
_ALLOWED = {
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("torch", "device"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("_codecs", "encode"),
}


class NotLoaded:
    """What a checkpoint's non-tensor object becomes: its global name (``self.global_name``), nothing else.
    Construction arguments, pickled state, items and appended values are all ignored."""

    global_name = "?"

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<not loaded: {self.global_name}>"


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return type(f"NotLoaded[{module}.{name}]", (NotLoaded,), {"global_name": f"{module}.{name}"})


class _RestrictedPickleModule:
    """The ``pickle_module`` interface torch.load uses (``Unpickler``, ``load``), with the restricted unpickler."""

    Unpickler = _RestrictedUnpickler
    __name__ = "linvision_restricted_pickle"

    @staticmethod
    def load(file, **kwargs):
        return _RestrictedUnpickler(file, **kwargs).load()


def read_checkpoint(path: str, what: str = "checkpoint") -> Any:
    """The contents of a ``torch.save`` file with tensors on the CPU and every other object an inert
    :class:`NotLoaded` (no code from the file runs). FileNotFoundError for a missing file; ValueError in one line,
    naming ``what`` and the file, for one that cannot be read (truncated, not a torch file)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: file not found: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read()
        _refuse_torchscript(data)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                          pickle_module=_RestrictedPickleModule)
    except Exception as e:  # torch and pickle raise many types for unreadable files
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what}: cannot read {path} ({reason})") from None


def _refuse_torchscript(data: bytes) -> None:
    """A zip archive that holds TorchScript (a ``constants.pkl`` record, code) is handed by torch.load to
    ``torch.jit.load`` without the pickle module, which runs the archive's code: refuse it. The archive is read
    with torch's own reader, the one torch.load decides with."""
    if not data.startswith(b"PK"):
        return  # not a zip: the legacy format, read through the restricted unpickler
    records = torch._C.PyTorchFileReader(io.BytesIO(data)).get_all_records()
    if any(r == "constants.pkl" or r.endswith("/constants.pkl") or "/code/" in f"/{r}" for r in records):
        raise ValueError("a TorchScript archive (it holds code), not a checkpoint of weights")
