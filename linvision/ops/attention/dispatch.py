"""The entry point of linear attention: checks the call once and runs it on the fused kernels of
``linvision.kernels`` or in PyTorch (:mod:`.reference`, :mod:`.chunk`)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import (DEFAULT_EPS, EPILOGUE_GATES, check_epilogue, check_int, check_qkv, check_rope, check_valid,
                      full_precision, is_exporting, note_backend, warn_fallback)
from ..feature_maps import FeatureMap, FeatureMapArg, get_feature_map
from ..rope import Rope
from .chunk import causal_attention
from .reference import check_options, reference_attention

__all__ = ["linear_attention", "GATE_ACTIVATIONS"]

# Device types whose tensors backend="auto" sends to the kernels (CPU kernels, interpreted, only on request).
_AUTO_DEVICES = ("cuda",)
_WARNED: Set[str] = set()


def _identity(g: Tensor) -> Tensor:
    return g


# The output gates an attention's epilogue applies, by name: (attention + residual) * act(gate). The kernels' codes
# (linvision.kernels.common.EPILOGUE_GATES) name the same activations.
GATE_ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {"identity": _identity, "silu": F.silu}
if set(GATE_ACTIVATIONS) != set(EPILOGUE_GATES):
    raise ImportError(f"GATE_ACTIVATIONS {sorted(GATE_ACTIVATIONS)} and the kernels' EPILOGUE_GATES "
                      f"{sorted(EPILOGUE_GATES)} name different activations")


def _warn_once(reason: str) -> None:
    warn_fallback(_WARNED, "linear_attention", "the fused kernels", reason, stacklevel=4)


def _fused(
    q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope], causal: bool, eps: float, backend: str,
    valid: Optional[Tensor] = None, epilogue: Tuple[Optional[Tensor], Optional[Tensor], str] = (None, None, ""),
) -> Tuple[Optional[Tensor], bool]:
    """The fused kernels' output, or None where PyTorch serves the call: ``backend="torch"``, tensors ``"auto"``
    leaves to PyTorch, or (with a warning once per reason) a call the kernels cannot run. ValueError with the
    reason when ``backend="triton"`` is forced on such a call. Second: whether the kernels applied the epilogue
    (residual, gate, activation), which they do where no gradient flows."""
    if backend == "torch" or (backend == "auto" and q.device.type not in _AUTO_DEVICES):
        return None, False
    if is_exporting():
        reason = "the call is being exported, and the fused kernels are not part of an exported graph"
        if backend == "triton":
            raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
        _warn_once(reason)
        return None, False
    try:
        from linvision.kernels import linear_attention as fused  # needs Triton
    except ImportError as exc:
        reason = f"the Triton kernels cannot be imported ({exc})"
    else:
        reason = fused.unsupported_reason(q, k, v, phi.name, rope=rope, causal=causal)
    if reason is None:
        residual, gate, activation = epilogue
        tensors = (q, k, v, residual, gate) + (() if rope is None else (rope.freqs_x, rope.freqs_y))
        if (residual is None and gate is None) or (
                torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
            return fused.run_checked(q, k, v, phi.name, rope, eps, valid=valid), False  # validated once, above
        return fused.run_checked(q, k, v, phi.name, rope, eps, valid=valid, residual=residual, gate=gate,
                                 gate_activation=activation), True
    if backend == "triton":
        raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
    _warn_once(reason)
    return None, False


def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    causal: bool = False, eps: float = DEFAULT_EPS, backend: str = "auto", chunk_size: int = 64,
    valid: Optional[Tensor] = None, residual: Optional[Tensor] = None, gate: Optional[Tensor] = None,
    gate_activation: str = "identity",
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
    residual, gate: an epilogue, out = (attention + residual) * act(gate), act ``gate_activation`` (a name of
        :data:`GATE_ACTIVATIONS`), each (B, H, Nq, Dv) of any strides (a LePE branch and an output gate). Where the
        fused kernels run the call and no gradient flows, their output kernel applies it in fp32 before its one
        rounding (no launch of its own); elsewhere it follows the attention in the output's dtype, as a caller
        would write it.

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
    if residual is not None or gate is not None:
        check_epilogue(q, v, residual, gate, gate_activation)
    out, applied = _attention(q, k, v, phi, rope, causal, eps, backend, chunk_size, valid,
                              (residual, gate, gate_activation))
    if applied:
        return out
    if residual is not None:
        out = out + residual
    return out if gate is None else out * GATE_ACTIVATIONS[gate_activation](gate)


@full_precision
def _attention(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope], causal: bool, eps: float,
               backend: str, chunk_size: int, valid: Optional[Tensor],
               epilogue: Tuple[Optional[Tensor], Optional[Tensor], str]) -> Tuple[Tensor, bool]:
    """The checked call, autocast off (its output in the autocast dtype), and whether the fused kernels applied
    the epilogue."""
    out, applied = _fused(q, k, v, phi, rope, causal, eps, backend, valid, epilogue)
    note_backend("linear_attention", "torch" if out is None else "triton")
    if out is not None:
        return out, applied
    if causal:
        return causal_attention(q, k, v, phi, rope, eps, chunk_size), False
    return reference_attention(q, k, v, phi, rope, eps, valid), False
