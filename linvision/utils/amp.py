"""Mixed precision: the autocast context of an ``--amp`` choice, shared by training, evaluation and benchmarks."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

__all__ = ["autocast"]

# torch's rms_norm given a bf16/fp16 input and an fp32 weight (ViG's norms under autocast) takes its unfused path,
# with the same result, and warns once per process: a line that lands in the middle of a progress bar
_QUIET = "Mismatch dtype between input and weight"


def autocast(device: torch.device, amp: str):
    """Autocast context for ``amp`` in ("none", "bf16", "fp16"); ValueError names the allowed values."""
    if amp not in ("none", "bf16", "fp16"):
        raise ValueError(f"amp: expected 'none', 'bf16' or 'fp16', got {amp!r}")
    if amp == "none":
        return contextlib.nullcontext()
    return _autocast(device.type, torch.bfloat16 if amp == "bf16" else torch.float16)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QUIET, category=UserWarning)
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
