"""Triton kernels for linear attention, installed as ``linvision.kernels``.

``linear_attention_triton`` is the fused non-causal forward and backward; ``unsupported_reason`` tells the
dispatcher in ``linvision.ops.linear_attention`` when a call must fall back to the PyTorch path.
"""
from .linear_attention import (
    FUSED_FEATURE_MAPS,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    linear_attention_triton,
    unsupported_reason,
)
