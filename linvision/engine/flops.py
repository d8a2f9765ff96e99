"""Parameter and FLOP counts of models, shared by the model table and the benchmark tool.

FLOPs are counted with torch's ``FlopCounterMode`` (matmuls, convolutions, SDPA; elementwise ops are not
counted) on one image in eval mode. They are reported as multiply-accumulates (torch counts 2 per MAC and the
result is halved), the convention of the GFLOPs figures that papers and timm list for vision models.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_params", "count_gflops"]


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (shared tensors counted once)."""
    seen = {}
    for p in model.parameters():
        if not trainable_only or p.requires_grad:
            seen[id(p)] = p.numel()
    return sum(seen.values())


def count_gflops(model: nn.Module, input_size: Union[int, Sequence[int]] = 224, batch_size: int = 1) -> float:
    """GFLOPs (10^9 multiply-accumulates) of one forward pass per image.

    input_size: an int (square RGB image), (H, W) for RGB, or (C, H, W). The model runs in eval mode on its
    own device and dtype, under ``torch.no_grad``; its training flag is restored afterwards.
    Raises ValueError for another input_size shape.
    """
    if isinstance(input_size, int):
        size = (3, input_size, input_size)
    elif len(input_size) == 2:
        size = (3, *input_size)
    elif len(input_size) == 3:
        size = tuple(input_size)
    else:
        raise ValueError(f"input_size: expected an int, (H, W) or (C, H, W), got {input_size!r}")
    param = next(model.parameters())
    x = torch.randn(batch_size, *size, device=param.device, dtype=param.dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    return counter.get_total_flops() / 2 / 1e9 / batch_size
