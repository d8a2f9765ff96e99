"""Softmax attention with the call shape of linear attention: the baseline every mixer is compared with."""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..common import DEFAULT_EPS, check_qkv
from ..rope import Rope, apply_rope
from .reference import check_options

__all__ = ["softmax_attention"]


def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, *, rope: Optional[Rope] = None, causal: bool = False,
    scale: Optional[float] = None, attn_mask: Optional[Tensor] = None,
) -> Tensor:
    """Softmax attention with the call shape of :func:`~.dispatch.linear_attention` (through
    ``scaled_dot_product_attention``). RoPE, when given, rotates both q and k (the usual softmax form)."""
    check_qkv(q, k, v, same_tokens=causal or rope is not None)
    check_options(DEFAULT_EPS, "torch", rope)
    if rope is not None:
        q = apply_rope(q, rope).to(v.dtype)
        k = apply_rope(k, rope).to(v.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)
