"""Non-causal linear attention in PyTorch: the reference path (and the one the fused kernels are checked against),
with a backward that recomputes the features instead of keeping them, and the checks every op of the family shares."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..common import (DEFAULT_EPS, check_backend, check_eps, check_qkv, check_rope, check_valid, feature_maps_where,
                      full_precision, is_exporting, is_tracing)
from ..feature_maps import FeatureMap, FeatureMapArg, featurize, get_feature_map
from ..rope import Rope, apply_rope, rotate_pairs

__all__ = ["check_options", "rotated_features", "reference_attention", "linear_attention_reference"]


def check_options(eps: float, backend: str, rope: Optional[Rope]) -> float:
    """Check the options every linear-attention op takes: ``backend`` one of the ops' backends, ``rope`` a
    :class:`~linvision.ops.rope.Rope` or None; returns eps as a float (ValueError unless positive)."""
    check_backend(backend)
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope: expected a linvision.ops.rope.Rope or None, got {type(rope).__name__}")
    return check_eps(eps)


def rotated_features(
    q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope]
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """phi(q), phi(k), their rotated versions (the same tensors without RoPE) and v, in the compute dtype."""
    phi_q, phi_k, vc = featurize(phi, q, k, v)
    if rope is None:
        return phi_q, phi_k, phi_q, phi_k, vc
    return phi_q, phi_k, apply_rope(phi_q, rope), apply_rope(phi_k, rope), vc


# The maps the recomputing backward below takes (FEATURE_MAPS' ``recompute``): it knows every leaf they can hand a
# gradient to (``scale``, FLatten's focused map's).
_RECOMPUTABLE_MAPS = feature_maps_where(recompute=True)


def _leaves(phi: FeatureMap, rope: Optional[Rope]) -> Tuple[Tensor, ...]:
    """The learnable tensors the features depend on besides q, k: a focused map's scale, mixed-RoPE frequencies."""
    found = [getattr(phi, "scale", None)] + ([] if rope is None else [rope.freqs_x, rope.freqs_y])
    return tuple(t for t in found if torch.is_tensor(t) and t.requires_grad)


class _LinearAttentionFunction(torch.autograd.Function):
    """Non-causal linear attention (the formula of :func:`linear_attention_reference`) that saves for the
    backward only q, k and v (views of the projection's output, which stays alive anyway): the feature maps,
    rotations, state and denominators are recomputed in the backward instead of being kept for every token (two
    more (N x D x Dv) products), and the gradients of the products are written out:

        dnum_i = do_i / den_i,   dden_i = -(do_i . o_i) / den_i,   d(Rq)_i = dnum_i S^T,   dS = sum_i (Rq)_i^T dnum_i
        dphi(q)_i += dden_i z,   dz = sum_i dden_i phi(q)_i,   d(Rk)_j = v_j dS^T / N,   dv_j = (Rk)_j dS / N,
        dphi(k)_j += dz / N

    The features' own backward (feature map, rotation, casts; learnable scale and frequencies included) runs on
    the recomputed graph. With a token mask the sums and N run over the valid keys of each sample, the
    gradients of the other keys are zero, and so are the outputs (and their gradients) of invalid queries. Not
    differentiable twice."""

    @staticmethod
    def forward(ctx, q, k, v, phi, rope, eps, valid, *leaves):
        ctx.phi, ctx.rope, ctx.eps, ctx.valid = phi, rope, eps, valid
        ctx.save_for_backward(q, k, v, *leaves)
        return _linear_attention_pieces(*rotated_features(q, k, v, phi, rope), eps, valid)[0].to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, *leaves = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
        with torch.enable_grad():
            phi_q, phi_k, rot_q, rot_k, vc = rotated_features(*inputs, ctx.phi, ctx.rope)
        with torch.no_grad():
            out, s, z, den = _linear_attention_pieces(phi_q, phi_k, rot_q, rot_k, vc, ctx.eps, ctx.valid)
            n, key_mask, query_mask = _token_counts(ctx.valid, q.shape[2], k.shape[2], out.dtype)
            do = grad_out.to(out.dtype)
            if query_mask is not None:
                do = do * query_mask
            dnum = do / den.unsqueeze(-1)
            dden = -(do * out).sum(-1) / den
            ds = torch.einsum("bhnd,bhne->bhde", rot_q, dnum)
            d_rot_q = torch.einsum("bhne,bhde->bhnd", dnum, s)
            d_phi_q = dden.unsqueeze(-1) * z.unsqueeze(2)
            dz = torch.einsum("bhn,bhnd->bhd", dden, phi_q) / (n if key_mask is None else n[..., 0])
            d_rot_k = torch.einsum("bhne,bhde->bhnd", vc, ds) / n
            d_vc = torch.einsum("bhnd,bhde->bhne", rot_k, ds) / n
            d_phi_k = dz.unsqueeze(2).expand_as(phi_k)
            if key_mask is not None:
                d_rot_k, d_vc, d_phi_k = d_rot_k * key_mask, d_vc * key_mask, d_phi_k * key_mask
        if ctx.rope is None:  # the rotated features are the features themselves
            outputs, grads = [phi_q, phi_k, vc], [d_rot_q + d_phi_q, d_rot_k + d_phi_k, d_vc]
        else:
            outputs, grads = [rot_q, phi_q, rot_k, phi_k, vc], [d_rot_q, d_phi_q, d_rot_k, d_phi_k, d_vc]
        wanted = [t for t in (*inputs, *leaves) if t.requires_grad]
        keep = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in keep], wanted, [g for _, g in keep], allow_unused=True)
                     if wanted and keep else [])
        result = [next(found) if t.requires_grad else None for t in (*inputs, *leaves)]
        return (*result[:3], None, None, None, None, *result[3:])


def _token_counts(valid: Optional[Tensor], nq: int, nk: int, dtype: torch.dtype):
    """(the number of keys each sample averages over: N, or (B, 1, 1, 1) valid counts; the key mask and the
    query mask as (B, 1, N, 1) of ``dtype``, or None)."""
    if valid is None:
        return nk, None, None
    key_mask = valid[:, None, :, None].to(dtype)
    n = key_mask.sum(dim=2, keepdim=True).clamp(min=1)
    return n, key_mask, (key_mask if nq == nk else None)


def _linear_attention_pieces(phi_q: Tensor, phi_k: Tensor, rot_q: Tensor, rot_k: Tensor, vc: Tensor, eps: float,
                             valid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(output, S, z, denominators) of non-causal linear attention from its features, in their dtype; with a
    token mask ``valid`` (B, Nk) the means run over each sample's valid keys and invalid queries output zero."""
    n, key_mask, query_mask = _token_counts(valid, phi_q.shape[2], phi_k.shape[2], phi_k.dtype)
    if key_mask is not None:  # padded keys' features (phi(0) is not 0) leave the state and the normaliser
        drop = ~valid[:, None, :, None]
        rot_k, phi_k = rot_k.masked_fill(drop, 0), phi_k.masked_fill(drop, 0)
    s = torch.einsum("bhnd,bhne->bhde", rot_k, vc) / n  # (B, H, D, Dv)
    z = phi_k.sum(dim=2) / (n if key_mask is None else n[..., 0])  # (B, H, D)
    den = torch.einsum("bhnd,bhd->bhn", phi_q, z) + eps
    out = torch.einsum("bhnd,bhde->bhne", rot_q, s) / den.unsqueeze(-1)
    if query_mask is not None:
        out = out.masked_fill(~valid[:, None, :, None], 0)
    return out, s, z, den


def _recomputing(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope]) -> Optional[str]:
    """How the call keeps its training memory down: "function" (eager, a map :class:`_LinearAttentionFunction`
    knows), "checkpoint" (torch.compile, which cannot trace that backward: the plain formula under a
    non-reentrant checkpoint, so the compiled graph too saves only the inputs and recomputes the features), or
    None (no gradient wanted, or torch.export, whose graphs serve inference: the plain formula)."""
    wanted = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or bool(_leaves(phi, rope)))
    if not wanted or phi.name not in _RECOMPUTABLE_MAPS or is_exporting():
        return None
    return "checkpoint" if is_tracing(*q.shape) else "function"


def _fill_padded_keys(k: Tensor, valid: Tensor) -> Tensor:
    """k with each sample's padded keys replaced by a copy of its first valid key. A map's key stabiliser (the max
    of ``exp`` and ``performer``, taken over all keys) then sees the values of the valid keys alone, as it does for
    the sample alone; the padded keys' features are dropped after the map."""
    first = valid.to(torch.uint8).argmax(dim=1)  # the first True of each row (0 for a row without one)
    src = k.gather(2, first[:, None, None, None].expand(-1, k.shape[1], 1, k.shape[3]))  # (B, H, 1, D)
    return torch.where(valid[:, None, :, None], k, src)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, rope: Optional[Rope], eps: float,
                        valid: Optional[Tensor] = None) -> Tensor:
    """:func:`linear_attention_reference` on inputs already checked, with the feature map resolved."""
    if valid is not None:  # padding may hold anything: replaced before any feature, so its gradients are zeros
        keep = valid[:, None, :, None]
        k, v = _fill_padded_keys(k, valid), v.masked_fill(~keep, 0)
        q = q.masked_fill(~keep, 0) if q.shape[2] == k.shape[2] else q
    how = _recomputing(q, k, v, phi, rope)
    if how == "function":
        return _LinearAttentionFunction.apply(q, k, v, phi, rope, eps, valid, *_leaves(phi, rope))
    if how == "checkpoint":  # the RoPE tables made outside the region: inside it, a symbolic grid cannot build them
        tables = None if rope is None else rope.tables()
        return checkpoint(_attention_on_tables, q, k, v, phi, tables, eps, valid, use_reentrant=False)
    return _linear_attention_pieces(*rotated_features(q, k, v, phi, rope), eps, valid)[0].to(q.dtype)


def _attention_on_tables(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, tables: Optional[Tuple[Tensor, Tensor]],
                         eps: float, valid: Optional[Tensor]) -> Tensor:
    """The formula with RoPE given as its (cos, sin) tables (None: no RoPE), autograd keeping what it keeps."""
    phi_q, phi_k, vc = featurize(phi, q, k, v)
    rot_q, rot_k = phi_q, phi_k
    if tables is not None:
        cos, sin = (t.to(device=phi_q.device, dtype=phi_q.dtype) for t in tables)
        rot_q, rot_k = rotate_pairs(phi_q, cos, sin), rotate_pairs(phi_k, cos, sin)
    return _linear_attention_pieces(phi_q, phi_k, rot_q, rot_k, vc, eps, valid)[0].to(q.dtype)


@full_precision
def linear_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMapArg = "elu", *, rope: Optional[Rope] = None,
    eps: float = DEFAULT_EPS, valid: Optional[Tensor] = None,
) -> Tensor:
    """Non-causal linear attention in plain PyTorch; memory ``O(N*D + D*Dv)``, no N x N matrix. With a gradient
    wanted, the features are recomputed in the backward (:class:`_LinearAttentionFunction`) rather than kept.

    Arguments as :func:`~linvision.ops.attention.dispatch.linear_attention`; raises as it does.
    """
    check_qkv(q, k, v, same_tokens=rope is not None)
    eps = check_options(eps, "torch", rope)
    valid = check_valid(valid, q, k)
    phi = get_feature_map(feature_map, dim=q.shape[-1])
    if rope is not None:
        check_rope(rope, phi.output_dim(q.shape[-1]), q.shape[2], q.shape[1], q.shape[0])
    return reference_attention(q, k, v, phi, rope, eps, valid)
