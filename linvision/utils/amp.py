"""Mixed precision: the autocast context of an ``--amp`` choice, shared by training, evaluation and benchmarks."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast"]


def autocast(device: torch.device, amp: str):
    """Autocast context for ``amp`` in ("none", "bf16", "fp16"); ValueError names the allowed values."""
    if amp not in ("none", "bf16", "fp16"):
        raise ValueError(f"amp: expected 'none', 'bf16' or 'fp16', got {amp!r}")
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)
