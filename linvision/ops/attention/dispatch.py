"""The entry point of linear attention: checks the call once and runs it on the fused kernels of
``linvision.kernels`` or in PyTorch (:mod:`.reference`, :mod:`.chunk`)."""
from __future__ import annotations

from typing import Optional, Set

from torch import Tensor

from ..common import (DEFAULT_EPS, check_int, check_qkv, check_rope, check_valid, full_precision, is_exporting,
                      note_backend, warn_fallback)
from ..feature_maps import FeatureMap, FeatureMapArg, get_feature_map
from ..rope import Rope
from .chunk import causal_attention
from .reference import check_options, reference_attention

__all__ = ["linear_attention"]

# Device types whose tensors backend="auto" sends to the kernels (CPU kernels, interpreted, only on request).
_AUTO_DEVICES = ("cuda",)
_WARNED: Set[str] = set()


def _warn_once(reason: str) -> None:
    warn_fallback(_WARNED, "linear_attention", "the fused kernels", reason, stacklevel=4)


def _fused(
    q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope], causal: bool, eps: float, backend: str,
    valid: Optional[Tensor] = None,
) -> Optional[Tensor]:
    """The fused kernels' output, or None where PyTorch serves the call: ``backend="torch"``, tensors ``"auto"``
    leaves to PyTorch, or (with a warning once per reason) a call the kernels cannot run. ValueError with the
    reason when ``backend="triton"`` is forced on such a call."""
    if backend == "torch" or (backend == "auto" and q.device.type not in _AUTO_DEVICES):
        return None
    if is_exporting():
        reason = "the call is being exported, and the fused kernels are not part of an exported graph"
        if backend == "triton":
            raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
        _warn_once(reason)
        return None
    try:
        from linvision.kernels import linear_attention as fused  # needs Triton
    except ImportError as exc:
        reason = f"the Triton kernels cannot be imported ({exc})"
    else:
        reason = fused.unsupported_reason(q, k, v, phi.name, rope=rope, causal=causal)
    if reason is None:
        return fused.run_checked(q, k, v, phi.name, rope, eps, valid=valid)  # checked above: validated once
    if backend == "triton":
        raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
    _warn_once(reason)
    return None


@full_precision
def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    causal: bool = False, eps: float = DEFAULT_EPS, backend: str = "auto", chunk_size: int = 64,
    valid: Optional[Tensor] = None,
) -> Tensor:
    """Linear attention of q, k (B, H, N, D) and v (B, H, N, Dv); returns (B, H, N, Dv) in q's dtype.

    feature_map: a name of :func:`linvision.ops.feature_maps.get_feature_map`, a callable or a FeatureMap.
    rope: a :class:`linvision.ops.rope.Rope` for the N tokens, applied to the numerator only.
    causal: token i attends to tokens j <= i (raster order for images); chunked with ``chunk_size``.
    backend: "torch" (reference), "triton" (fused kernels; raises if they cannot run this call) or "auto"
    (kernels for CUDA tensors where they apply, e.g. non-causal with a fusable feature map; PyTorch otherwise,
    with a RuntimeWarning once per reason when a CUDA call cannot run in the kernels).
    valid: None, or a (B, Nk) bool mask of the keys that count (non-causal only): the sums and means of the
        state and normaliser run over each sample's valid keys, so a sample padded to a longer batch gets the
        outputs it gets alone; outputs at invalid query positions (Nq == Nk) are zero.

    Raises TypeError for non-tensors, integer or mixed dtypes; ValueError for mismatched shapes, devices,
    RoPE tables that do not fit, unknown feature-map names or backends, a bad eps or chunk_size.
    """
    check_qkv(q, k, v, same_tokens=causal or rope is not None)
    eps = check_options(eps, backend, rope)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    valid = check_valid(valid, q, k)
    if causal and valid is not None:
        raise ValueError("valid: the causal form takes no token mask (pad at the end of the sequence instead: "
                         "later tokens never reach earlier ones)")
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    if rope is not None:
        check_rope(rope, phi.output_dim(q.shape[-1]), q.shape[2], q.shape[1], q.shape[0])
    out = _fused(q, k, v, phi, rope, causal, eps, backend, valid)
    note_backend("linear_attention", "torch" if out is None else "triton")
    if out is not None:
        return out
    if causal:
        return causal_attention(q, k, v, phi, rope, eps, chunk_size)
    return reference_attention(q, k, v, phi, rope, eps, valid)
