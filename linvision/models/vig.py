"""ViG and ViG-H: isotropic and hierarchical backbones with bidirectional gated linear attention, loading the
published ImageNet-1k weights.

Liao et al. 2024, "ViG: Linear-complexity Visual Sequence Learning with Gated Linear Attention", arXiv:2405.18425;
reference code github.com/hustvl/ViG (MIT licence; classification model ``ViG`` with the configs
``configs/vig/vig-{t,s,b}.yaml``), weights on the Hugging Face hub repository ``hustvl/ViG``
(``vig_{t,s,b}_{77p2,81p7,82p6}acc.pth``; the hub repository states apache-2.0).

The network is :class:`~linvision.models.linvit.LinViT` without a class token, with:

- ViG's patch embedding (:class:`VigStem`): a 9x9 conv of stride 8 (padding 1) to C/2 channels, LayerNorm, SiLU,
  a 3x3 conv of stride 2 (padding 1) to C, LayerNorm: the grid of a 16-pixel patch embedding at multiples of 16;
- a learned absolute position embedding on the 14 x 14 grid of 224 px, resampled (bicubic, not antialiased) to
  every input's grid, so the model takes any input size;
- RMSNorm (eps 1e-6) before the mixer, before the MLP and before the mean pooling; a SwiGLU MLP of hidden size
  8/3 C without biases (:func:`swiglu_mlp`); a linear head on the mean of the normalised tokens;
- the ``"vig_gla"`` mixer (:class:`~linvision.layers.recurrent.VigGatedAttention`, beside the ``"bidir_gated"``
  mixer it derives from).

Evaluation as the authors': resize to 256/224 of the crop (bicubic), centre crop 224, ImageNet mean/std.

ViG-H (the authors' ``HierViG`` with ``configs/vig-h/vig-h-{t,s,b}.yaml``; hub files
``vig_h_{t,s,b}_{82p8,83p8,84p2}acc.pth``) is :class:`~linvision.models.linhier.LinHier` with its own layers:
LinHier's stem (two 3x3 convs of stride 2 with LayerNorm and GELU between) and 3x3 stride-2 downsampling, with
LayerNorm eps 1e-5; pre-norm blocks without CPE of ``"vig_gla"`` (without the SiLUs, output scale 1/2: the
authors' hierarchical evaluation does not halve the kernel's direction mean again) and a SwiGLU MLP of
2/3 x 4C rounded up to a multiple of 32 (:func:`gated_mlp`); a final LayerNorm, the mean and a linear head.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, Optional

from timm.layers import GluMlp, LayerNorm2d, RmsNorm, resample_abs_pos_embed, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import Tensor, nn

from linvision.layers import merge_options
from linvision.layers.options import pad_to_kernel

from .linhier import LinHier
from .linvit import LinViT
from .published import (explain_failed_download, load_published, published_cfg, published_file_overlay,
                        unwrap_state_dict)

__all__ = ["Vig", "VigH", "VigStem", "swiglu_mlp", "gated_mlp", "checkpoint_filter_fn",
           "hier_filter_fn"]

HUB_ID = "hustvl/ViG"
# The authors' training checkpoints keep the raw weights under "model" (and the EMA copy under "model_ema"); their
# evaluation of a published file loads "model" (the hub files hold one copy of the weights).
WEIGHT_KEYS = ("model", "state_dict")


class VigStem(nn.Module):
    """ViG's patch embedding, as timm's ``PatchEmbed`` is called by :class:`LinViT` (channels-last output): conv
    9x9 / 8 (padding 1) to C/2, LayerNorm (eps 1e-5), SiLU, conv 3x3 / 2 (padding 1) to C, LayerNorm. An input of
    a multiple of 16 gives the grid (H/16, W/16); other sizes give the convolutions' floor. ``patch_size`` must be
    16; ``strict_img_size`` is ignored (any size runs)."""

    def __init__(self, img_size: Any = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768,
                 output_fmt: str = "NHWC", strict_img_size: bool = False, **kwargs: Any):
        super().__init__()
        if to_2tuple(patch_size) != (16, 16) or output_fmt != "NHWC":
            raise ValueError(f"VigStem: the stem has stride 16 and gives NHWC, not patch_size={patch_size!r}, "
                             f"output_fmt={output_fmt!r}")
        self.img_size = to_2tuple(img_size)
        self.patch_size = (16, 16)
        self.grid_size = (self.img_size[0] // 16, self.img_size[1] // 16)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        half = embed_dim // 2
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, half, 9, stride=8, padding=1), LayerNorm2d(half, eps=1e-5), nn.SiLU(),
            nn.Conv2d(half, embed_dim, 3, stride=2, padding=1), LayerNorm2d(embed_dim, eps=1e-5),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(pad_to_kernel(x, self.proj[0])).permute(0, 2, 3, 1)


def swiglu_mlp(in_features: int, hidden_features: int, act_layer: type = nn.SiLU, drop: float = 0.0) -> nn.Module:
    """ViG's MLP: fc2(act(a) * b) with (a, b) = fc1(x) split in two, no biases (timm's ``GluMlp``, the gate
    first); ``hidden_features`` is the width of a and b."""
    return GluMlp(in_features, 2 * hidden_features, act_layer=act_layer, bias=False, drop=drop, gate_last=False)


def gated_mlp(in_features: int, hidden_features: int, act_layer: Optional[type] = None, drop: float = 0.0
              ) -> nn.Module:
    """ViG-H's MLP: :func:`swiglu_mlp` (SiLU, whatever ``act_layer`` the block names) with 2/3 of
    ``hidden_features`` rounded up to a multiple of 32 as the width of each half (the authors' ``gMlp``)."""
    return swiglu_mlp(in_features, 32 * math.ceil(int(hidden_features * 2 / 3) / 32), drop=drop)


class Vig(LinViT):
    """:class:`LinViT` with ViG's layers; loads the authors' files (timm's ``custom_load``). Images only: the
    conv stem does not embed NaFlex patches."""

    pos_embed_antialias = False  # the authors resample with plain bicubic interpolation

    def _embed_patches(self, patches: Tensor, patch_coord: Tensor, patch_valid: Optional[Tensor]):
        raise ValueError("ViG embeds images with its conv stem; NaFlex patch batches are not supported")

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, checkpoint_filter_fn)


class VigH(LinHier):
    """:class:`~linvision.models.linhier.LinHier` with ViG-H's layers (the module docstring); loads the authors'
    files (timm's ``custom_load``)."""

    # The authors' hierarchical evaluation halves the scans' sum once (output scale 1/2; ViG's halves it twice).
    MIXER_DEFAULTS = {"output_scale": 0.5}

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, hier_filter_fn)


_RENAMES = (  # the authors' names -> linvision's, inside blocks.<i>.
    (".attn_norm.", ".norm1."), (".mlp_norm.", ".norm2."), (".attn.in_proj.0.", ".mixer.local."),
    (".attn.qkv_proj.", ".mixer.qkv."), (".attn.gk_proj.", ".mixer.forget_gate."),
    (".attn.g_proj.", ".mixer.mix_gate."), (".attn.g_norm.", ".mixer.norm_global."),
    (".attn.l_norm.", ".mixer.norm_local."), (".attn.o_proj.", ".mixer.proj."),
    (".mlp.gate_proj.", ".mlp.fc1."), (".mlp.down_proj.", ".mlp.fc2."),
)


def checkpoint_filter_fn(checkpoint: Any, model: Vig) -> Dict[str, Tensor]:
    """The authors' file (their names: ``attn_norm``, ``attn.qkv_proj``, ``attn.gk_proj``, ``mlp.gate_proj``, ...)
    or linvision's own weights -> this model's state dict; the position embedding resampled (bicubic, not
    antialiased, as the authors resample it at run time) to the model's grid when they differ. Names the model
    does not have are kept, so that the strict load names them."""
    state = unwrap_state_dict(checkpoint, WEIGHT_KEYS)
    out = {}
    for name, value in state.items():
        if name.startswith("blocks."):
            for old, new in _RENAMES:
                name = name.replace(old, new)
        if name == "pos_embed" and model.pos_embed is not None and value.shape != model.pos_embed.shape:
            side = math.isqrt(value.shape[1])
            value = resample_abs_pos_embed(value, new_size=model.patch_embed.grid_size, old_size=(side, side),
                                           num_prefix_tokens=0, antialias=False)
        out[name] = value
    return out


_HIER_RENAMES = (  # the authors' HierViG names (and the older ones their loader renames) -> linvision's
    (r"^patch_embed\.(0|proj)\.", "stem.conv1."), (r"^patch_embed\.(2|norm)\.", "stem.norm1."),
    (r"^patch_embed\.5\.", "stem.conv2."), (r"^patch_embed\.7\.", "stem.norm2."),
    (r"^layers\.(\d)\.downsample\.1\.", lambda m: f"stages.{int(m.group(1)) + 1}.downsample.conv."),
    (r"^layers\.(\d)\.downsample\.3\.", lambda m: f"stages.{int(m.group(1)) + 1}.downsample.norm."),
    (r"^layers\.(\d)\.blocks\.(\d+)\.(norm|ln_1)\.", r"stages.\1.blocks.\2.norm1."),
    (r"^layers\.(\d)\.blocks\.", r"stages.\1.blocks."), (r"\.(op|self_attention)\.", ".op."),
    (r"\.op\.in_proj\.0\.", ".mixer.local."), (r"\.op\.qkv_proj\.", ".mixer.qkv."),
    (r"\.op\.gk_proj\.", ".mixer.forget_gate."), (r"\.op\.g_proj\.", ".mixer.mix_gate."),
    (r"\.op\.g_norm\.", ".mixer.norm_global."), (r"\.op\.l_norm\.", ".mixer.norm_local."),
    (r"\.op\.o_proj\.", ".mixer.proj."), (r"^(classifier\.)?norm\.", "final."),
    (r"^(classifier\.)?head\.", "head.fc."),
)


def hier_filter_fn(checkpoint: Any, model: LinHier) -> Dict[str, Tensor]:
    """The authors' ViG-H file (their ``HierViG`` names: ``patch_embed.{0,2,5,7}``, ``layers.i`` stages ending with
    their downsampling, ``op`` for the mixer, ``classifier``; the older names their own loader renames too) or
    linvision's own weights -> this model's names. Their channels-first 1x1 projections (``Linear2d``) may be
    stored as (out, in, 1, 1): those become the linear layers' (out, in); no value changes. Names the model does
    not have are kept, so that the strict load names them."""
    import re

    state = unwrap_state_dict(checkpoint, WEIGHT_KEYS)
    if not any(k.startswith("layers.") for k in state):
        return state
    own = model.state_dict()
    out = {}
    for name, value in state.items():
        for old, new in _HIER_RENAMES:
            name = re.sub(old, new, name)
        if name in own and own[name].dim() == 2 and value.dim() == 4 and value.shape[2:] == (1, 1):
            value = value.flatten(1)
        out[name] = value
    return out


def _cfg(filename: str, top1: float) -> Dict[str, Any]:
    # custom_load "hf": timm fetches the hub file and hands its path to Vig.load_pretrained (no code from the pickle
    # runs); the url is the same file, for a timm without huggingface_hub.
    return published_cfg(
        top1, hf_hub_id=HUB_ID, hf_hub_filename=filename, custom_load="hf",
        url=f"https://huggingface.co/{HUB_ID}/resolve/main/{filename}", first_conv="patch_embed.proj.0",
        classifier="head", pool_size=None, license="mit", paper_ids="arXiv:2405.18425",
        paper_name="ViG: Linear-complexity Visual Sequence Learning with Gated Linear Attention",
        origin_url="https://github.com/hustvl/ViG",
    )


def _hier_cfg(filename: str, top1: float) -> Dict[str, Any]:
    return published_cfg(
        top1, hf_hub_id=HUB_ID, hf_hub_filename=filename, custom_load="hf",
        url=f"https://huggingface.co/{HUB_ID}/resolve/main/{filename}", first_conv="stem.conv1", license="mit",
        paper_ids="arXiv:2405.18425",
        paper_name="ViG: Linear-complexity Visual Sequence Learning with Gated Linear Attention",
        origin_url="https://github.com/hustvl/ViG",
    )


# Top-1: the authors' README (ImageNet-1k, 224 px); the file names are those of the hub repository's listing.
# Both families' cfgs, complete before any entry point registers (timm reads them at registration).
default_cfgs = generate_default_cfgs({
    "vig_tiny.in1k": _cfg("vig_t_77p2acc.pth", 77.2),
    "vig_small.in1k": _cfg("vig_s_81p7acc.pth", 81.7),
    "vig_base.in1k": _cfg("vig_b_82p6acc.pth", 82.6),
    "vig_h_tiny.in1k": _hier_cfg("vig_h_t_82p8acc.pth", 82.8),
    "vig_h_small.in1k": _hier_cfg("vig_h_s_83p8acc.pth", 83.8),
    "vig_h_base.in1k": _hier_cfg("vig_h_b_84p2acc.pth", 84.2),
})

# vig-{t,s,b}.yaml: ViG-T has SiLU after the depthwise conv and on the mixed output, S and B neither.
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(embed_dim=192, num_heads=3, mixer_kwargs=dict(local_act=True, out_act=True)),
    "small": dict(embed_dim=384, num_heads=6, mixer_kwargs=dict(local_act=False, out_act=False)),
    "base": dict(embed_dim=768, num_heads=12, mixer_kwargs=dict(local_act=False, out_act=False)),
}
_LAYERS = dict(
    patch_size=16, depth=12, class_token=False, global_pool="avg", fc_norm=False, mlp_ratio=8 / 3,
    token_mixer="vig_gla", dynamic_img_size=True, norm_layer=partial(RmsNorm, eps=1e-6), act_layer=nn.SiLU,
    embed_layer=VigStem, mlp_layer=swiglu_mlp,
)


def _create_vig(variant: str, size: str, pretrained: bool, **kwargs: Any) -> Vig:
    mixer_kwargs = dict(SIZES[size]["mixer_kwargs"], **(kwargs.pop("mixer_kwargs", None) or {}))
    args = published_file_overlay(merge_options(_LAYERS, SIZES[size], dict(mixer_kwargs=mixer_kwargs), **kwargs))
    out_indices = args.pop("out_indices", 3)
    with explain_failed_download(variant, pretrained, args, "docs/models/published.md"):
        return build_model_with_cfg(Vig, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                    feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **args)


# Published training used stochastic depth 0 / 0.2 / 0.5 (T / S / B); the models default to none, as timm's do.
@register_model
def vig_tiny(pretrained: bool = False, **kwargs) -> Vig:
    return _create_vig("vig_tiny", "tiny", pretrained, **kwargs)


@register_model
def vig_small(pretrained: bool = False, **kwargs) -> Vig:
    return _create_vig("vig_small", "small", pretrained, **kwargs)


@register_model
def vig_base(pretrained: bool = False, **kwargs) -> Vig:
    return _create_vig("vig_base", "base", pretrained, **kwargs)


HIER_SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 2, 5, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)),
    "small": dict(depths=(2, 2, 17, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)),
    "base": dict(depths=(2, 2, 17, 2), dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32)),
}
_HIER_LAYERS = dict(token_mixers="vig_gla",
                    norm_layer=nn.LayerNorm, act_layer=nn.GELU, cpe=False, mlp_layer=gated_mlp,
                    final_layer=nn.LayerNorm)


def _create_vig_h(variant: str, size: str, pretrained: bool, **kwargs: Any) -> LinHier:
    from .published import build_published

    args = merge_options(_HIER_LAYERS, HIER_SIZES[size], **kwargs)
    return build_published(VigH, variant, pretrained, hier_filter_fn, **args)


# Published training used stochastic depth 0.2 / 0.3 / 0.6 (T / S / B); the models default to none.
@register_model
def vig_h_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_vig_h("vig_h_tiny", "tiny", pretrained, **kwargs)


@register_model
def vig_h_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_vig_h("vig_h_small", "small", pretrained, **kwargs)


@register_model
def vig_h_base(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_vig_h("vig_h_base", "base", pretrained, **kwargs)
