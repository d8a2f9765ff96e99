"""Softmax attention with the call shape of linear attention: the baseline every mixer is compared with."""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..common import DEFAULT_EPS, check_qkv, check_valid
from ..rope import Rope, apply_rope
from .reference import check_options

__all__ = ["softmax_attention"]


def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, *, rope: Optional[Rope] = None, causal: bool = False,
    scale: Optional[float] = None, attn_mask: Optional[Tensor] = None, valid: Optional[Tensor] = None,
) -> Tensor:
    """Softmax attention with the call shape of :func:`~.dispatch.linear_attention` (through
    ``scaled_dot_product_attention``). RoPE, when given, rotates both q and k (the usual softmax form).
    ``valid`` (B, Nk) bool: only those keys are attended to, and outputs at invalid query positions (Nq == Nk)
    are zero, as in :func:`~.dispatch.linear_attention`; not with ``attn_mask`` or ``causal``."""
    check_qkv(q, k, v, same_tokens=causal or rope is not None)
    check_options(DEFAULT_EPS, "torch", rope)
    valid = check_valid(valid, q, k)
    if valid is not None and (attn_mask is not None or causal):
        raise ValueError("valid: give a token mask or attn_mask / causal, not both")
    if rope is not None:
        q = apply_rope(q, rope).to(v.dtype)
        k = apply_rope(k, rope).to(v.dtype)
    if valid is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.masked_fill(~valid[:, None, :, None], 0) if q.shape[2] == k.shape[2] else out
