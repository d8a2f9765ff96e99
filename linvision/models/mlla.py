"""MLLA: Mamba-Like Linear Attention backbones with their published ImageNet-1k weights.

Han et al. 2024, "Demystify Mamba in Vision: A Linear Attention Perspective", NeurIPS 2024, arXiv:2405.16605;
weights and reference code: github.com/LeapLabTHU/MLLA (MIT licence).

The network is :class:`~linvision.models.linhier.LinHier` with MLLA's layers:
- stem (stride 4): 3x3/2 conv-BN-ReLU to C/2; a residual pair of 3x3 conv-BN(-ReLU); 3x3/2 conv-BN-ReLU to 4C;
  1x1 conv-BN to C (no conv biases);
- downsampling between stages: 1x1 conv-ReLU to 8C, 3x3/2 depthwise conv-ReLU, 1x1 conv-BN to 2C;
- blocks: CPE, LayerNorm, the ``"mlla"`` mixer (:class:`~linvision.layers.mlla.MllaMixer`: linear attention with
  RoPE on the numerator and LePE, inside a Mamba-like gated branch), CPE, LayerNorm, MLP (ratio 4);
- LayerNorm (eps 1e-5 everywhere, as published), average pooling and a linear classifier.

Every size has head dim 32. The published RoPE table is a buffer fixed to the 224 px grid; here the same
convention is computed for the grid of each input, so the weights run at any multiple of 32, square or not, and
give the published model's outputs at 224 px.

Published training used stochastic depth 0.2 / 0.3 / 0.5 (tiny / small / base); the models default to none,
as timm's do (``drop_path_rate=...`` to fine-tune like the authors).

Weights: ``pretrained=True`` downloads the authors' files; ``pretrained_cfg_overlay=dict(file=...)`` loads a local
copy. Either is read with no code run from the file (:mod:`linvision.models.published`) and converted by
:func:`checkpoint_filter_fn`; checkpoints saved by linvision load as they are.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict

import torch
from torch import Tensor, nn

from timm.layers import ConvNormAct, LayerNorm
from timm.models import generate_default_cfgs, register_model

from linvision.layers import merge_options
from linvision.ops import halves_from_interleaved

from .linhier import LinHier
from .published import build_published, load_published, published_cfg, unwrap_state_dict

__all__ = ["Mlla", "MllaStem", "MllaDownsample", "checkpoint_filter_fn"]

# The weights taken from a training checkpoint: the raw weights under "model". The authors' evaluation prints the
# accuracy of both the raw and the EMA copy and neither their README nor their paper says which one is published;
# their own detection and segmentation code start from "model", so that is what a fine-tuning user gets here.
WEIGHT_KEYS = ("model", "state_dict")
HEAD_DIM = 32  # every published size


class MllaStem(nn.Module):
    """(B, C_in, H, W) -> (B, H/4, W/4, C) channels-last: conv1 (3x3/2 -> C/2), x + conv2(x) (two 3x3 convs, the
    second without activation), conv3 (3x3/2 -> 4C, then 1x1 -> C without activation); BN after every conv."""

    def __init__(self, in_chans: int, dim: int):
        super().__init__()
        half = dim // 2
        self.conv1 = ConvNormAct(in_chans, half, 3, stride=2)
        self.conv2 = nn.Sequential(ConvNormAct(half, half, 3), ConvNormAct(half, half, 3, apply_act=False))
        self.conv3 = nn.Sequential(ConvNormAct(half, 4 * dim, 3, stride=2), ConvNormAct(4 * dim, dim, 1, apply_act=False))

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = x + self.conv2(x)
        return self.conv3(x).permute(0, 2, 3, 1)


class MllaDownsample(nn.Module):
    """(B, H, W, C_in) -> (B, H/2, W/2, C_out): 1x1 conv-ReLU to 4 C_out, 3x3/2 depthwise conv-ReLU, 1x1 conv-BN."""

    def __init__(self, in_dim: int, out_dim: int, ratio: float = 4.0):
        super().__init__()
        hidden = int(out_dim * ratio)
        self.expand = nn.Conv2d(in_dim, hidden, 1)
        self.dwconv = nn.Conv2d(hidden, hidden, 3, stride=2, padding=1, groups=hidden)
        self.act = nn.ReLU()
        self.project = ConvNormAct(hidden, out_dim, 1, bias=True, apply_act=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.expand(x.permute(0, 3, 1, 2)))
        return self.project(self.act(self.dwconv(x))).permute(0, 2, 3, 1)


class Mlla(LinHier):
    """:class:`LinHier` with MLLA's layers; loads the authors' files (timm's ``custom_load``)."""

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, checkpoint_filter_fn)


def _published_names(name: str) -> str:
    """linvision's name of a tensor of the authors' layout (``layers.i`` stages ending with their downsample)."""
    import re

    name = re.sub(r"^patch_embed\.conv(\d)", r"stem.conv\1", name)
    name = re.sub(r"\.norm\.(weight|bias|running_mean|running_var|num_batches_tracked)$", r".bn.\1", name) \
        if name.startswith("stem.") or ".downsample." in name else name
    m = re.match(r"^layers\.(\d+)\.downsample\.conv\.(\d)\.(.*)$", name)
    if m:  # the downsample at the end of stage i is the one at the start of stage i + 1 here
        part = {"0": "expand", "1": "dwconv", "2": "project"}[m.group(2)]
        rest = m.group(3).removeprefix("conv.") if part != "project" else m.group(3)
        return f"stages.{int(m.group(1)) + 1}.downsample.{part}.{rest}"
    name = re.sub(r"^layers\.(\d+)\.blocks\.", r"stages.\1.blocks.", name)
    name = re.sub(r"\.cpe(\d)\.(weight|bias)$", r".cpe\1.proj.\2", name)
    name = re.sub(r"\.blocks\.(\d+)\.(in_proj|act_proj|dwc|out_proj)\.", r".blocks.\1.mixer.\2.", name)
    name = re.sub(r"\.blocks\.(\d+)\.attn\.qk\.", r".blocks.\1.mixer.attn.qkv.", name)
    name = re.sub(r"\.blocks\.(\d+)\.attn\.lepe\.", r".blocks.\1.mixer.attn.lepe.", name)
    name = re.sub(r"^norm\.", "final.", name)
    return re.sub(r"^head\.", "head.fc.", name)


def checkpoint_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' checkpoint (weights under ``model``, see WEIGHT_KEYS) in
    linvision's names: stage ``i``'s downsample moves to the start of stage ``i + 1``, the q/k projection rows are
    reordered from interleaved RoPE pairs to halves (the same outputs), the RoPE buffers built for 224 px are
    dropped (recomputed for each input). A state dict in linvision's own names passes unchanged."""
    state = unwrap_state_dict(checkpoint, WEIGHT_KEYS)
    if not any(k.startswith("layers.") or k.startswith("patch_embed.") for k in state):
        return state
    out = {}
    for name, value in state.items():
        if name.endswith(".attn.rope.rotations"):
            continue
        new = _published_names(name)
        if new.endswith((".mixer.attn.qkv.weight", ".mixer.attn.qkv.bias")):
            try:
                attn = model.get_submodule(new.rsplit(".qkv.", 1)[0])
            except AttributeError:  # a block this model lacks: left as it is, reported as unexpected
                out[new] = value
                continue
            order = halves_from_interleaved(attn.head_dim, attn.num_heads)
            value = torch.cat([value[:attn.dim][order], value[attn.dim:][order]])
        out[new] = value
    return out


def _published(url: str, filename: str, top1: float) -> Dict[str, Any]:
    # (url, file name): the links end in "/?dl=1", from which timm's download cache cannot name a file
    return published_cfg(
        top1, url=(url, filename), first_conv="stem.conv1.conv", license="mit", paper_ids="arXiv:2405.16605",
        paper_name="Demystify Mamba in Vision: A Linear Attention Perspective",
        origin_url="https://github.com/LeapLabTHU/MLLA",
    )


default_cfgs = generate_default_cfgs({
    "mlla_tiny.in1k": _published(
        "https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1", "mlla_tiny_in1k.pth", 83.5),
    "mlla_small.in1k": _published(
        "https://cloud.tsinghua.edu.cn/f/0e5d0b1409d540aaa80c/?dl=1", "mlla_small_in1k.pth", 84.4),
    "mlla_base.in1k": _published(
        "https://cloud.tsinghua.edu.cn/f/91c85c5a1061496d8796/?dl=1", "mlla_base_in1k.pth", 85.3),
})


def _create_mlla(variant: str, pretrained: bool = False, **kwargs) -> LinHier:
    args = dict(
        token_mixers="mlla", mlp_ratio=4.0, stem_layer=MllaStem, downsample_layer=MllaDownsample,
        norm_layer=partial(LayerNorm, eps=1e-5), final_layer=partial(LayerNorm, eps=1e-5),
    )
    return build_published(Mlla, variant, pretrained, checkpoint_filter_fn, **merge_options(args, **kwargs))


def _heads(dims):
    return tuple(d // HEAD_DIM for d in dims)


@register_model
def mlla_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    dims = (64, 128, 256, 512)
    args = dict(depths=(2, 4, 8, 4), dims=dims, num_heads=_heads(dims))
    return _create_mlla("mlla_tiny", pretrained, **merge_options(args, **kwargs))


@register_model
def mlla_small(pretrained: bool = False, **kwargs) -> LinHier:
    dims = (64, 128, 256, 512)
    args = dict(depths=(3, 6, 21, 6), dims=dims, num_heads=_heads(dims))
    return _create_mlla("mlla_small", pretrained, **merge_options(args, **kwargs))


@register_model
def mlla_base(pretrained: bool = False, **kwargs) -> LinHier:
    dims = (96, 192, 384, 768)
    args = dict(depths=(3, 6, 21, 6), dims=dims, num_heads=_heads(dims))
    return _create_mlla("mlla_base", pretrained, **merge_options(args, **kwargs))
