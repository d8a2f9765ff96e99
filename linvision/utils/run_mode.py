"""How a model runs for speed, as the tools take it: ``--compile`` (eager, or under torch.compile) and ``--weights``
(the dtype of the weights and of the input; 16-bit weights for inference without autocast)."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["COMPILE_MODES", "WEIGHT_DTYPES", "check_run_mode", "compiled"]

# "inductor": torch.compile's mode by default; "reduce-overhead": Inductor with CUDA graphs
COMPILE_MODES = ("none", "inductor", "reduce-overhead")
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_run_mode(compile: str, weights: str, amp: str) -> None:
    """ValueError in one line for an unknown ``compile`` or ``weights``, or 16-bit weights under autocast."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile: unknown {compile!r}; allowed: {', '.join(COMPILE_MODES)}")
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"weights: unknown {weights!r}; allowed: {', '.join(WEIGHT_DTYPES)}")
    if weights != "fp32" and amp != "none":
        raise ValueError(f"weights: {weights} weights run without autocast (the model is in that dtype); "
                         f"got amp {amp!r}: pass --amp none")


def compiled(model: nn.Module, compile: str) -> nn.Module:
    """``model`` under torch.compile (``compile`` "inductor" or "reduce-overhead"), or itself for "none"; the
    compiled module trains and switches modes as the model does."""
    if compile == "none":
        return model
    return torch.compile(model, mode=None if compile == "inductor" else compile)
