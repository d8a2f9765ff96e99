"""Sana-style diffusion transformer block: adaLN-single, ReLU linear self-attention, cross-attention, Mix-FFN.

Sana (Xie et al. 2024, "SANA: Efficient High-Resolution Image Synthesis with Linear Diffusion Transformers",
arXiv:2410.10629) replaces the softmax self-attention of a DiT by ReLU linear attention and the MLP by a
convolutional "Mix-FFN", so that the cost of a block grows linearly with the token count.

One block, for tokens x (B, N, C) on an H x W grid, timestep vector t_mod (B, 6C) and condition tokens
context (B, L, C):

    shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = table (6, C) + t_mod.view(B, 6, C)
    x = x + gate_a * SelfAttn(LN(x) * (1 + scale_a) + shift_a)
    x = x + CrossAttn(x, context, context_mask)
    x = x + gate_f * MixFFN(LN(x) * (1 + scale_f) + shift_f, (H, W))

``t_mod`` is computed once by the model (adaLN-single: Linear(SiLU(t_emb)) shared by all blocks); each block
only owns the (6, C) table. The LayerNorms have no affine parameters (the modulation takes their place).

Self-attention is a layers mixer (:func:`self_attention`: :class:`linvision.layers.LinearAttention` with the
ReLU feature map), so it accumulates S, z and divides in fp32 whatever the input dtype, and picks up the fused
kernels where they apply.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from linvision.layers import AttentionMixer, MixerContext, create_mixer, get_mixer_class, stage_mixer_options
from linvision.ops import check_grid

__all__ = ["modulate", "SanaAttention", "sana_attention_class", "self_attention", "CrossAttention", "MixFFN",
           "TokenMLP", "SanaBlock"]

FP16_MAX = 65504.0


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """x * (1 + scale) + shift; x (B, N, C), shift and scale (B, 1, C)."""
    return x * (1 + scale) + shift


class SanaAttention:
    """Sana's additions to an attention mixer (:class:`linvision.layers.AttentionMixer`), mixed into the mixer's
    class by :func:`sana_attention_class`:

    qk_norm: RMS-normalise q and k over all C channels (learnable gain, before the heads are split and before any
        feature map): Sana's layout, diffusers' ``qk_norm="rms_norm_across_heads"``.
    qk_norm_eps: eps of those RMSNorms (diffusers: 1e-5).
    fp16_clamp: clamp a float16 output of the mixer to +-65504 (Sana/diffusers do this after the output
        projection: weights trained under fp16 autocast can push the projection past the fp16 range, and one inf
        in a residual stream turns the next LayerNorm into NaN). Other dtypes are left alone.
    """

    def __init__(self, dim: int, num_heads: int, *, qk_norm: bool = False, qk_norm_eps: float = 1e-6,
                 fp16_clamp: bool = False, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.q_norm = nn.RMSNorm(dim, eps=qk_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(dim, eps=qk_norm_eps) if qk_norm else nn.Identity()
        self.fp16_clamp = fp16_clamp

    def project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v

    def mix(self, x: Tensor, ctx: MixerContext) -> Tensor:
        out = super().mix(x, ctx)
        if self.fp16_clamp and out.dtype == torch.float16:
            out = out.clamp(-FP16_MAX, FP16_MAX)
        return out


@lru_cache(maxsize=None)
def sana_attention_class(mixer: Type[AttentionMixer]) -> Type[AttentionMixer]:
    """The class ``mixer`` with :class:`SanaAttention`'s options (``qk_norm``, ``qk_norm_eps``, ``fp16_clamp``);
    one class per mixer class. TypeError for a mixer that is not an :class:`linvision.layers.AttentionMixer`."""
    if not (isinstance(mixer, type) and issubclass(mixer, AttentionMixer)):
        raise TypeError(f"sana_attention_class: {getattr(mixer, '__name__', mixer)!r} is not an AttentionMixer")
    return type(f"Sana{mixer.__name__}", (SanaAttention, mixer), {"__module__": __name__,
                                                                   "__doc__": SanaAttention.__doc__})


def self_attention(
    dim: int, head_dim: int = 32, attn_type: str = "linear", qk_norm: bool = False, use_rope: bool = False,
    fp16_clamp: bool = False, eps: float = 1e-4, eps_form: str = "mean", qk_norm_eps: float = 1e-6,
    options: Optional[Dict[str, Any]] = None,
) -> AttentionMixer:
    """Sana's self-attention as a layers mixer: :class:`linvision.layers.LinearAttention` with the ReLU feature
    map (or :class:`linvision.layers.SoftmaxAttention` for ``attn_type="softmax"``, or any other registered
    token mixer by name, e.g. ``"bidir_delta"`` or ``"bidir_gated"`` for a Sana-Video-style block), heads of
    ``head_dim`` channels, no qkv bias, q/k RMS-norm over C with ``qk_norm``, 2D axial RoPE with ``use_rope``
    (for linear attention it rotates the numerator only), and the fp16 clamp of the projection with
    ``fp16_clamp`` (both from :class:`SanaAttention`, mixed into the mixer's class when either is set; an
    attention mixer's class itself otherwise). ``options``: further keyword options of the mixer
    (:func:`linvision.layers.mixer_options`). The block's own choices (no qkv bias, the ReLU map and ``eps`` of
    linear attention, ``qk_norm_eps``) reach a mixer that has them, merged as every model merges its mixers'
    options (:func:`linvision.layers.stage_mixer_options`); a flag set (``use_rope``, ``qk_norm``,
    ``fp16_clamp``) or an option of ``options`` the mixer lacks is refused in one line naming it and the mixer.

    ``fp16_clamp``: Sana's released weights were trained under fp16 autocast with this clamp after the output
    projection; reproducing their behaviour in fp16 needs it. ``eps`` / ``eps_form``: see
    :class:`linvision.layers.LinearAttention` (diffusers' Sana is ``eps=1e-15, eps_form="sum"``; the default,
    mean form with 1e-4, equals the sum form with N * 1e-4).
    """
    if head_dim <= 0 or dim % head_dim != 0:
        raise ValueError(f"head_dim: must divide dim={dim}, got {head_dim}")
    cls = get_mixer_class(attn_type)  # an unknown name fails here, listing the registered ones
    if use_rope and head_dim % 4 != 0:
        raise ValueError(f"head_dim: 2D RoPE needs a multiple of 4, got {head_dim}")
    if (qk_norm or fp16_clamp) and isinstance(cls, type) and issubclass(cls, AttentionMixer):
        cls = sana_attention_class(cls)  # the mixer's class with Sana's q/k norm and clamp
    flags = dict(rope="axial" if use_rope else None, qk_norm=qk_norm, fp16_clamp=fp16_clamp)
    # the flags set are the caller's and must fit the mixer; the rest are this block's defaults, each reaching the
    # mixer only where it has that option, and the caller's options win over them
    stage_mixer_options([cls], {k: v for k, v in flags.items() if v}, name="self_attn")
    defaults: Dict[str, Any] = dict(qkv_bias=False, qk_norm_eps=qk_norm_eps, **flags)
    if attn_type == "linear":
        defaults.update(feature_map="relu", eps=eps, eps_form=eps_form)
    chosen = stage_mixer_options([cls], options, defaults, name="self_attn_options")[0]
    return create_mixer(cls, dim, dim // head_dim, **chosen)


class CrossAttention(nn.Module):
    """Softmax cross-attention from image tokens to condition tokens, with a key-padding mask.

    Rows whose condition is entirely padded receive exactly zero (instead of the NaN of a softmax over no keys).
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, qk_norm_eps: float = 1e-6):
        super().__init__()
        if num_heads <= 0 or dim % num_heads != 0:
            raise ValueError(f"num_heads: must divide dim={dim}, got {num_heads}")
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.q_norm = nn.RMSNorm(dim, eps=qk_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(dim, eps=qk_norm_eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, context: Tensor, context_mask: Optional[Tensor] = None) -> Tensor:
        """x (B, N, C), context (B, L, C), context_mask (B, L) bool, True = keep -> (B, N, C)."""
        q = self.q_norm(self.q(x))
        k, v = self.kv(context).chunk(2, dim=-1)
        k = self.k_norm(k)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.num_heads) for t in (q, k, v))
        if context_mask is None:
            out = F.scaled_dot_product_attention(q, k, v)
            return self.proj(rearrange(out, "b h n d -> b n (h d)"))
        has_keys = context_mask.any(dim=1)  # (B,)
        # A row with no kept key attends to all keys (finite), and its result is then zeroed.
        mask = context_mask | ~has_keys[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        out = self.proj(rearrange(out, "b h n d -> b n (h d)"))
        return out * has_keys[:, None, None].to(out.dtype)


class MixFFN(nn.Module):
    """Sana's Mix-FFN: 1x1 conv to 2*hidden + SiLU, 3x3 depthwise conv, value * SiLU(gate), 1x1 conv back.

    The depthwise conv mixes neighbouring tokens on the H x W grid; it is the block's only source of position
    information when RoPE is off.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.expand = nn.Conv2d(dim, 2 * hidden_dim, 1)
        self.dwconv = nn.Conv2d(2 * hidden_dim, 2 * hidden_dim, 3, padding=1, groups=2 * hidden_dim)
        self.project = nn.Conv2d(hidden_dim, dim, 1, bias=False)

    def forward(self, x: Tensor, hw: Tuple[int, int]) -> Tensor:
        """x (B, N, C) with N = H * W -> (B, N, C)."""
        h, w = check_grid(hw, x.shape[1], name="hw")
        x = rearrange(x, "b (h w) c -> b c h w", h=h, w=w)
        x = self.dwconv(F.silu(self.expand(x)))
        value, gate = x.chunk(2, dim=1)
        x = self.project(value * F.silu(gate))
        return rearrange(x, "b c h w -> b (h w) c")


class TokenMLP(nn.Module):
    """Per-token MLP (Linear, GELU, Linear): the Mix-FFN without its spatial conv, for ablations."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: Tensor, hw: Tuple[int, int]) -> Tensor:
        check_grid(hw, x.shape[1], name="hw")
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SanaBlock(nn.Module):
    """One Sana-style block (see the module docstring).

    Args:
        dim: channels C.
        num_heads: heads of the softmax cross-attention (Sana-0.6B: 16 at C=1152).
        head_dim: channels per head of the linear self-attention (Sana: 32).
        mlp_ratio: hidden = int(mlp_ratio * C) of the FFN (Sana: 2.5).
        self_attn: "linear" (ReLU linear attention), "softmax" (the same block with softmax self-attention) or
            any registered token mixer (:func:`self_attention`); ``self_attn_options``: its further options.
        ffn: "mix" (Mix-FFN, needs the grid) or "mlp" (per-token MLP; the block is then permutation-equivariant).
        cross_attn: build the cross-attention; without it ``context`` must be None.
        qk_norm: RMS-normalise q and k (self- and cross-attention), see :func:`self_attention`.
        use_rope: 2D RoPE in the self-attention's numerator, see :func:`self_attention`.
        fp16_clamp: clamp the self-attention output in fp16, as Sana does; see :func:`self_attention`.
        eps: the linear attention's epsilon, see :func:`self_attention`.
        eps_form: "mean" (linvision's) or "sum" (Sana's) placement of eps, see :func:`self_attention`.
        qk_norm_eps: epsilon of the q/k RMS norm (self- and cross-attention).
    """

    def __init__(
        self, dim: int, num_heads: int, head_dim: int = 32, mlp_ratio: float = 2.5, self_attn: str = "linear",
        ffn: str = "mix", cross_attn: bool = True, qk_norm: bool = False, use_rope: bool = False,
        fp16_clamp: bool = False, eps: float = 1e-4, eps_form: str = "mean", qk_norm_eps: float = 1e-6,
        self_attn_options: Optional[Dict[str, Any]] = None,
    ):
        super().__init__()
        if ffn not in ("mix", "mlp"):
            raise ValueError(f"ffn: unknown {ffn!r}; allowed: mix, mlp")
        self.dim = dim
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = self_attention(
            dim, head_dim, attn_type=self_attn, qk_norm=qk_norm, use_rope=use_rope, fp16_clamp=fp16_clamp,
            eps=eps, eps_form=eps_form, qk_norm_eps=qk_norm_eps, options=self_attn_options,
        )
        self.cross_attn = CrossAttention(dim, num_heads, qk_norm, qk_norm_eps) if cross_attn else None
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.ffn = MixFFN(dim, hidden) if ffn == "mix" else TokenMLP(dim, hidden)
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim ** 0.5)

    def forward(
        self, x: Tensor, hw: Tuple[int, int], t_mod: Tensor, context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """x (B, N, C) with N = H * W; t_mod (B, 6C); context (B, L, C) or None; context_mask (B, L) bool or
        None (True = keep). Returns (B, N, C) in x's dtype.

        Raises ValueError when N != H * W, t_mod is not (B, 6C), or context / context_mask do not fit.
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected (B, N, {self.dim}), got shape {tuple(x.shape)}")
        b, n, c = x.shape
        check_grid(hw, n, name="hw")
        if t_mod.shape != (b, 6 * c):
            raise ValueError(f"t_mod: expected shape ({b}, {6 * c}) = (B, 6C), got {tuple(t_mod.shape)}")
        self._check_context(x, context, context_mask)
        mods = (self.scale_shift_table[None] + t_mod.reshape(b, 6, c)).to(x.dtype).chunk(6, dim=1)
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mods  # each (B, 1, C)
        x = x + gate_a * self.attn(modulate(self.norm1(x), shift_a, scale_a), hw)
        if self.cross_attn is not None and context is not None:
            x = x + self.cross_attn(x, context, context_mask)
        x = x + gate_f * self.ffn(modulate(self.norm2(x), shift_f, scale_f), hw)
        return x

    def _check_context(self, x: Tensor, context: Optional[Tensor], context_mask: Optional[Tensor]) -> None:
        if context is None:
            if context_mask is not None:
                raise ValueError("context_mask: given without a context")
            return
        if self.cross_attn is None:
            raise ValueError("context: this block was built with cross_attn=False")
        if context.dim() != 3 or context.shape[0] != x.shape[0] or context.shape[2] != self.dim:
            raise ValueError(f"context: expected ({x.shape[0]}, L, {self.dim}), got shape {tuple(context.shape)}")
        if context_mask is not None:
            if context_mask.dtype != torch.bool:
                raise TypeError(f"context_mask: expected a bool tensor (True = keep), got {context_mask.dtype}")
            if context_mask.shape != context.shape[:2]:
                raise ValueError(
                    f"context_mask: expected shape {tuple(context.shape[:2])} (B, L), got {tuple(context_mask.shape)}"
                )
