"""The pre-norm block every model family is built from, on channels-last tokens (B, H, W, C), or on a token
sequence (B, P + H*W, C) with P prefix tokens (class / register tokens) before the grid, given with its grid:

    x = x + cpe1(x)                                     (with ``cpe``) 3x3 depthwise conv: conditional pos. enc.
    x = x + drop_path(ls1 * mixer(norm1(x), ctx))       any registered token mixer, or a mixer class; ctx: the
                                                        grid, prefix tokens, layout and the block's input x
    x = x + cpe2(x)                                     (with ``cpe=True``, not with ``cpe="first"``)
    x = x + drop_path(ls2 * mlp(norm2(x)))

ls1, ls2: per-channel layer scale (with ``layer_scale_init``), else 1. Without CPE it is the ViT/DeiT block; with
CPE it is the block of MLLA (Han et al. 2024, arXiv:2405.16605), whose CPE follows CPVT (Chu et al. 2021,
arXiv:2102.10882); with CPE before the mixer only, layer scale and :class:`DwConvMlp` it is RAVLT's block (Fan et
al. 2025, arXiv:2411.07635).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Type, Union

import torch.nn.functional as F
from timm.layers import DropPath, LayerNorm, LayerScale, register_notrace_module
from torch import Tensor, nn

from .derived import derived
from .layout import TokenLayout
from .recompute import RecomputeMlp
from .context import MixerContext
from .registry import create_mixer

__all__ = ["ConvPosEnc", "DwConvMlp", "MixerBlock", "RecomputeMlp"]

CPE_MODES = (False, True, "first")


@register_notrace_module  # a leaf of timm's FX graphs: a traced model folds the residual as the eager one does
class ConvPosEnc(nn.Module):
    """Conditional position encoding: x + dwconv3x3(x) on channels-last x (B, H, W, C). For inference the residual
    is folded into the convolution (a 1 added at the centre of each kernel, formed once: derived), one launch
    instead of two."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x: Tensor) -> Tensor:
        proj = self.proj
        folded = derived(self, "residual", (proj.weight,), lambda: (_with_identity(proj.weight),))
        if folded is None:
            return x + proj(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return F.conv2d(x.permute(0, 3, 1, 2), folded[0], proj.bias, padding=1, groups=proj.groups).permute(0, 2, 3, 1)


def _with_identity(weight: Tensor) -> Tensor:
    """A depthwise kernel (C, 1, k, k) plus the identity: 1 added at its centre."""
    out = weight.clone()
    out[:, 0, weight.shape[2] // 2, weight.shape[3] // 2] += 1
    return out


class DwConvMlp(nn.Module):
    """MLP with a residual 3x3 depthwise conv on its hidden activations, on channels-last x (B, H, W, C):
    h = act(fc1(x)); h = h + dwconv(h); fc2(h) (RAVLT's feed-forward network). Arguments as timm's ``Mlp``."""

    def __init__(self, in_features: int, hidden_features: int, act_layer: Type[nn.Module] = nn.GELU,
                 drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.dwconv = nn.Conv2d(hidden_features, hidden_features, 3, padding=1, groups=hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc1(x))
        h = h + self.dwconv(h.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return self.drop(self.fc2(self.drop(h)))


class MixerBlock(nn.Module):
    """Pre-norm token mixer and MLP residuals on channels-last x (B, H, W, C), optionally with CPE.

    Args:
        dim: channels of the block.
        num_heads: heads of the mixer.
        token_mixer: a registered mixer name or a mixer class (built as ``cls(dim, num_heads, **mixer_kwargs)``).
        mixer_kwargs: options of the mixer.
        mlp_ratio: MLP hidden size / dim.
        drop_path: stochastic-depth rate of both residual branches.
        proj_drop: dropout inside the MLP.
        cpe: a 3x3 depthwise-conv position encoding before the mixer and before the MLP (True), before the mixer
            only ("first"), or none (False).
        layer_scale_init: initial value of a learnable per-channel scale on both branches (None: no scale).
        mlp_layer: the MLP class, built as ``mlp_layer(dim, hidden, act_layer=..., drop=...)`` (:class:`RecomputeMlp`,
            timm's ``Mlp`` keeping less for the backward).
    Raises ValueError for another ``cpe``.
    """

    def __init__(
        self, dim: int, num_heads: int, token_mixer: Union[str, Type[nn.Module]] = "linear",
        mixer_kwargs: Optional[Dict] = None, mlp_ratio: float = 4.0, drop_path: float = 0.0,
        proj_drop: float = 0.0, cpe: Union[bool, str] = False, norm_layer: Type[nn.Module] = LayerNorm,
        act_layer: Type[nn.Module] = nn.GELU, layer_scale_init: Optional[float] = None,
        mlp_layer: Type[nn.Module] = RecomputeMlp,
    ):
        super().__init__()
        if cpe not in CPE_MODES:
            raise ValueError(f"cpe: unknown {cpe!r}; allowed: {CPE_MODES}")
        scale = (lambda: LayerScale(dim, layer_scale_init)) if layer_scale_init is not None else nn.Identity
        self.cpe = cpe
        self.cpe1 = ConvPosEnc(dim) if cpe else nn.Identity()
        self.norm1 = norm_layer(dim)
        self.mixer = create_mixer(token_mixer, dim, num_heads, **(mixer_kwargs or {}))
        self.ls1 = scale()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.cpe2 = ConvPosEnc(dim) if cpe and cpe != "first" else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.ls2 = scale()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, hw: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 0,
                layout: Optional[TokenLayout] = None) -> Tensor:
        """x: a channels-last grid (B, H, W, C) (``hw`` None), or tokens (B, P + H*W, C) on the grid ``hw`` after
        P = ``num_prefix_tokens`` prefix tokens (class / register tokens; the mixer must take them), or tokens
        (B, P + M, C) of images of different sizes placed by ``layout`` (the mixer must take it). Returns x's
        layout. The mixer is called once, with a :class:`~linvision.layers.MixerContext` of all that and the
        block's input before its norm. Raises ValueError for tokens given to a block with CPE, which convolves a
        grid."""
        if hw is None:
            b, h, w, c = x.shape
            x = self.cpe1(x)
            ctx = MixerContext((h, w), block_input=x)
            mixed = self.mixer(self.norm1(x).reshape(b, h * w, c), ctx).reshape(b, h, w, c)
            x = x + self.drop_path1(self.ls1(mixed))
            x = self.cpe2(x)
        else:
            if self.cpe:
                raise ValueError("hw: a block with CPE runs on a channels-last grid (B, H, W, C), not on tokens")
            ctx = MixerContext(hw, num_prefix_tokens, layout, x)
            x = x + self.drop_path1(self.ls1(self.mixer(self.norm1(x), ctx)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
