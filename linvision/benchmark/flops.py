"""Parameter and FLOP counts of models, shared by the model table and the benchmark tool.

FLOPs are counted with torch's ``FlopCounterMode`` (matmuls, convolutions, SDPA; elementwise ops are not
counted) on one image in eval mode. They are reported as multiply-accumulates (torch counts 2 per MAC and the
result is halved), the convention of the GFLOPs figures that papers and timm list for vision models.

torch's counter knows SDPA only through the aten kernels it has formulas for, and which kernel a call
reaches depends on the release and the device: on CPU, recent releases run
``aten._scaled_dot_product_flash_attention_for_cpu``, which the counter does not list, so softmax attention
would count as free. :func:`register_attention_flops` (called on import) registers torch's own SDPA formulas
for every SDPA kernel the counter lacks; linvision's fused kernels register theirs where they are defined.
"""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_params", "count_gflops", "count_gflops_split", "register_attention_flops", "SDPA_OPS"]

# Every aten SDPA kernel (forward, backward) that a release may dispatch to; the ones a release lacks are skipped.
SDPA_OPS = (
    ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
    ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
    ("_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_fused_attention_overrideable_backward"),
)


def register_attention_flops() -> list:
    """Register torch's SDPA FLOP formulas for the SDPA kernels its counter has none for; returns their names.

    The forward counts the two (N x D) @ (D x N) products of attention, the backward its five, exactly as
    torch counts its own flash and efficient kernels. Idempotent.
    """
    from torch.utils.flop_counter import (flop_registry, register_flop_formula, sdpa_backward_flop_count,
                                          sdpa_flop_count)

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    added = []
    for fwd_name, bwd_name in SDPA_OPS:
        for name, formula in ((fwd_name, forward), (bwd_name, backward)):
            op = getattr(torch.ops.aten, name, None)
            if op is not None and op not in flop_registry:
                register_flop_formula(op)(formula)
                added.append(name)
    return added


register_attention_flops()


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (shared tensors counted once)."""
    seen = {}
    for p in model.parameters():
        if not trainable_only or p.requires_grad:
            seen[id(p)] = p.numel()
    return sum(seen.values())


def count_gflops(model: nn.Module, input_size: Union[int, Sequence[int]] = 224, batch_size: int = 1,
                 attention: bool = True) -> float:
    """GFLOPs (10^9 multiply-accumulates) of one forward pass per image.

    input_size: an int (square RGB image), (H, W) for RGB, or (C, H, W). The model runs in eval mode on its
    own device and dtype, under ``torch.no_grad``; its training flag is restored afterwards. On the meta device
    the count is the same, without arithmetic.
    attention: False leaves out the products of two activations, batched matmuls and SDPA, which is how attention
    multiplies tokens with tokens; projections and convolutions remain (the convention of papers whose tables
    count only convolutions and linear layers, e.g. RAVLT's).
    Raises ValueError for another input_size shape.
    """
    return count_gflops_split(model, input_size, batch_size)[0 if attention else 1]


def count_gflops_split(model: nn.Module, input_size: Union[int, Sequence[int]] = 224,
                       batch_size: int = 1) -> Tuple[float, float]:
    """:func:`count_gflops` with and without attention, from one forward pass."""
    if isinstance(input_size, int):
        size = (3, input_size, input_size)
    elif len(input_size) == 2:
        size = (3, *input_size)
    elif len(input_size) == 3:
        size = tuple(input_size)
    else:
        raise ValueError(f"input_size: expected an int, (H, W) or (C, H, W), got {input_size!r}")
    param = next(model.parameters(), None)
    x = torch.randn(batch_size, *size, device=param.device if param is not None else "cpu",
                    dtype=param.dtype if param is not None else torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    total = counter.get_total_flops()
    products = sum(n for op, n in counter.get_flop_counts()["Global"].items() if _is_attention_product(op))
    return total / 2 / 1e9 / batch_size, (total - products) / 2 / 1e9 / batch_size


def _is_attention_product(op) -> bool:
    name = str(op).rsplit(".", 1)[-1]  # aten.bmm -> bmm
    return name in ("bmm", "baddbmm") or any(name in pair for pair in SDPA_OPS) or "linear_attention" in str(op)
