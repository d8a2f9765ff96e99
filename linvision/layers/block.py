"""The pre-norm block both model families are built from, on channels-last tokens (B, H, W, C):

    x = x + cpe1(x)                              (with ``cpe=True``) 3x3 depthwise conv, conditional position encoding
    x = x + drop_path(mixer(norm1(x), (H, W)))   any registered token mixer, or a mixer class
    x = x + cpe2(x)                              (with ``cpe=True``)
    x = x + drop_path(mlp(norm2(x)))

Without CPE it is the ViT/DeiT block; with CPE it is the block of MLLA (Han et al. 2024, arXiv:2405.16605),
whose CPE follows CPVT (Chu et al. 2021, arXiv:2102.10882).
"""
from __future__ import annotations

from typing import Dict, Optional, Type, Union

from timm.layers import DropPath, LayerNorm, Mlp
from torch import Tensor, nn

from .registry import create_mixer

__all__ = ["ConvPosEnc", "MixerBlock"]


class ConvPosEnc(nn.Module):
    """Conditional position encoding: x + dwconv3x3(x) on channels-last x (B, H, W, C)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class MixerBlock(nn.Module):
    """Pre-norm token mixer and MLP residuals on channels-last x (B, H, W, C), optionally with CPE.

    Args:
        dim, num_heads: channels and heads of the mixer.
        token_mixer: a registered mixer name or a mixer class (built as ``cls(dim, num_heads, **mixer_kwargs)``).
        mixer_kwargs: options of the mixer.
        mlp_ratio: MLP hidden size / dim.
        drop_path: stochastic-depth rate of both residual branches.
        proj_drop: dropout inside the MLP.
        cpe: a 3x3 depthwise-conv position encoding before the mixer and before the MLP.
    """

    def __init__(
        self, dim: int, num_heads: int, token_mixer: Union[str, Type[nn.Module]] = "linear",
        mixer_kwargs: Optional[Dict] = None, mlp_ratio: float = 4.0, drop_path: float = 0.0,
        proj_drop: float = 0.0, cpe: bool = False, norm_layer: Type[nn.Module] = LayerNorm,
        act_layer: Type[nn.Module] = nn.GELU,
    ):
        super().__init__()
        self.cpe1 = ConvPosEnc(dim) if cpe else nn.Identity()
        self.norm1 = norm_layer(dim)
        self.mixer = create_mixer(token_mixer, dim, num_heads, **(mixer_kwargs or {}))
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.cpe2 = ConvPosEnc(dim) if cpe else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        b, h, w, c = x.shape
        x = self.cpe1(x)
        x = x + self.drop_path1(self.mixer(self.norm1(x).reshape(b, h * w, c), (h, w)).reshape(b, h, w, c))
        x = self.cpe2(x)
        return x + self.drop_path2(self.mlp(self.norm2(x)))
