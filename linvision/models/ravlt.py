"""RAVLT: Rank-Augmented Vision Linear Transformer backbones, loading the published ImageNet-1k weights.

Fan et al. 2025, "Breaking the Low-Rank Dilemma of Linear Attention", CVPR 2025, arXiv:2411.07635; reference code
github.com/qhfan/RALA, weights on the Hugging Face hub repository ``aldjalkdf/RAVLT``. The repository carries no
licence file: the weights are loaded from their published location, never redistributed.

A hybrid: the first two stages mix tokens with rank-augmented linear attention (RALA), the last two with softmax
attention. The network is :class:`~linvision.models.linhier.LinHier` with RAVLT's layers:
- stem (stride 4): four 3x3 convs with bias and BN (strides 2, 1, 1, 2; GELU after the first three);
- downsampling between stages: 3x3/2 conv with bias, BN;
- blocks: CPE (3x3 depthwise) before the mixer only, LayerNorm (eps 1e-6), the mixer, layer scale, LayerNorm,
  :class:`~linvision.layers.DwConvMlp` (ratio 3.5, a residual 3x3 depthwise conv on the hidden units), layer
  scale. Both mixers (``"ravlt_rala"``, :class:`~linvision.layers.rala.RavltRala`, and ``"ravlt_softmax"``,
  :class:`~linvision.layers.mixers.RavltSoftmax`) have RAVLT's LePE (5x5 depthwise on v, added to the attention
  output), its element-wise output modulation (x (W_o x), no activation, after LePE: the mixer's ``gate``) and an
  output projection;
- a 1x1 conv head to 1024 channels with BN and SiLU, average pooling and a linear classifier.

RoPE (RALA's numerator and both sides of softmax attention): per head (64 channels, 96 in the first two stages
of base and large), rows in the first half of the pairs, frequencies 10000^-linspace(0, 1, D/4). RAVLT pairs channels (2t, 2t+1); the checkpoint's q and k rows
are reordered to the pairs (t, t + D/2) used here (:func:`linvision.ops.halves_from_interleaved`), which computes
the same outputs. Tables follow the grid of every input, as in the authors' model.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict

import torch
from torch import Tensor, nn

from timm.layers import ConvNormAct
from timm.models import generate_default_cfgs, register_model

from linvision.layers import DwConvMlp, merge_options
from linvision.ops import halves_from_interleaved

from .linhier import LinHier
from .published import build_published, load_published, published_cfg, unwrap_state_dict

__all__ = ["Ravlt", "ChannelsLastConv", "RavltStem", "checkpoint_filter_fn", "SIZES", "create_ravlt_like"]

# The weights taken from a training checkpoint: the raw weights under "model". The authors' evaluation prints the
# accuracy of both the raw and the EMA copy and neither their README nor their paper says which one is published;
# their own detection and segmentation code start from "model", so that is what a fine-tuning user gets here.
WEIGHT_KEYS = ("model", "state_dict")
# The options of RAVLT's mixers (both stages' RoPE, LePE and output modulation): the family's mixer defaults.
MIXER_DEFAULTS = dict(rope="axial", rope_theta=10000.0, rope_row_first=True, lepe=True, lepe_kernel=5, gate=True)


class ChannelsLastConv(ConvNormAct):
    """timm's ``ConvNormAct`` on channels-last tensors (B, H, W, C) -> (B, H', W', out_chs)."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int = 1, stride: int = 1, **kwargs):
        super().__init__(in_chs, out_chs, kernel_size, stride=stride, bias=True, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class RavltStem(nn.Module):
    """(B, C_in, H, W) -> (B, H/4, W/4, C): 3x3 conv-BN-GELU (stride 2, to C/2), twice 3x3 conv-BN-GELU,
    3x3 conv-BN (stride 2, to C); every conv with bias."""

    def __init__(self, in_chans: int, dim: int):
        super().__init__()
        half = dim // 2
        conv = partial(ConvNormAct, kernel_size=3, bias=True, act_layer=nn.GELU)
        self.convs = nn.Sequential(
            conv(in_chans, half, stride=2), conv(half, half), conv(half, half),
            conv(half, dim, stride=2, apply_act=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.convs(x).permute(0, 2, 3, 1)


class Ravlt(LinHier):
    """:class:`LinHier` with RAVLT's layers; loads the authors' files (timm's ``custom_load``)."""

    MIXER_DEFAULTS = MIXER_DEFAULTS

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, checkpoint_filter_fn)


def _published_name(name: str) -> str:
    """linvision's name of a tensor of the authors' layout (``layers.i`` stages ending with their downsample)."""
    import re

    m = re.match(r"^patch_embed\.proj\.(\d+)\.(.*)$", name)
    if m:
        i, rest = divmod(int(m.group(1)), 3)
        return f"stem.convs.{i}.{'conv' if rest == 0 else 'bn'}.{m.group(2)}"
    m = re.match(r"^layers\.(\d+)\.downsample\.(reduction|norm)\.(.*)$", name)
    if m:  # the downsample at the end of stage i is the one at the start of stage i + 1 here
        part = "conv" if m.group(2) == "reduction" else "bn"
        return f"stages.{int(m.group(1)) + 1}.downsample.{part}.{m.group(3)}"
    for old, new in ((r"^layers\.(\d+)\.blocks\.", r"stages.\1.blocks."), (r"\.pos\.", ".cpe1.proj."),
                     (r"\.norm(\d)\.norm\.", r".norm\1."), (r"\.gamma_(\d)$", r".ls\1.gamma"),
                     (r"\.attn\.(lepe|proj)\.", r".mixer.\1."), (r"\.ffn\.", ".mlp."),
                     (r"^proj\.", "final.conv."), (r"^norm\.", "final.bn."), (r"^head\.", "head.fc.")):
        name = re.sub(old, new, name)
    return name


def checkpoint_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' checkpoint (weights under ``model``) in linvision's names: stage ``i``'s downsample moves to the
    start of stage ``i + 1``; each 1x1 conv becomes a linear weight; the qkvo conv splits into the q/k/v projection
    (q and k rows reordered from interleaved RoPE pairs to halves: the same outputs) and the output modulation;
    the RoPE frequency buffers are dropped (recomputed). A state dict in linvision's own names passes unchanged."""
    state = unwrap_state_dict(checkpoint, WEIGHT_KEYS)
    if not any(k.startswith("layers.") or k.startswith("patch_embed.") for k in state):
        return state
    out = {}
    for name, value in state.items():
        if name.endswith(".RoPE.angle"):
            continue
        if ".attn.qkvo." in name:
            prefix = _published_name(name.split(".attn.qkvo.")[0])
            try:
                mixer = model.get_submodule(prefix + ".mixer")
            except AttributeError:  # a block this model lacks: left as it is, reported as unexpected
                out[name] = value
                continue
            kind, c = name.rsplit(".", 1)[1], mixer.dim
            value = value.flatten(1) if kind == "weight" else value
            order = halves_from_interleaved(mixer.head_dim, mixer.num_heads)
            q, k, v, o = value[:c][order], value[c:2 * c][order], value[2 * c:3 * c], value[3 * c:]
            out[f"{prefix}.mixer.qkv.{kind}"] = torch.cat([q, k, v])
            out[f"{prefix}.mixer.gate.{kind}"] = o
            continue
        new = _published_name(name)
        if new.endswith(".weight") and value.ndim == 4 and value.shape[-2:] == (1, 1) and (
                ".mlp.fc" in new or ".mixer.proj." in new or new.startswith("head.")):
            value = value.flatten(1)  # 1x1 conv -> linear
        elif new.endswith(".gamma"):
            value = value.flatten()
        out[new] = value
    return out


def _cfg(filename: str, top1: float) -> Dict[str, Any]:
    return published_cfg(
        top1, url=f"https://huggingface.co/aldjalkdf/RAVLT/resolve/main/{filename}", first_conv="stem.convs.0.conv",
        license="unknown (no licence file: load, do not redistribute)", paper_ids="arXiv:2411.07635",
        paper_name="Breaking the Low-Rank Dilemma of Linear Attention", origin_url="https://github.com/qhfan/RALA",
    )


default_cfgs = generate_default_cfgs({
    "ravlt_tiny.in1k": _cfg("RAVLT_T.pth", 82.8),
    "ravlt_small.in1k": _cfg("RAVLT_S.pth", 84.4),
    "ravlt_base.in1k": _cfg("RAVLT_B.pth", 85.5),
    "ravlt_large.in1k": _cfg("RAVLT_L.pth", 85.8),
})


# Sizes shared with MAViT (the same stages; MAViT's conv head is wider).
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 2, 6, 2), dims=(64, 128, 256, 512), num_heads=(1, 2, 4, 8), layer_scale_init=1.0),
    "small": dict(depths=(3, 5, 9, 3), dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8), layer_scale_init=1.0),
    "base": dict(depths=(4, 6, 12, 6), dims=(96, 192, 384, 512), num_heads=(1, 2, 6, 8),
                 layer_scale_init=(1.0, 1.0, 1e-6, 1e-6)),
    "large": dict(depths=(4, 7, 19, 8), dims=(96, 192, 448, 640), num_heads=(1, 2, 7, 10), layer_scale_init=1e-6),
}


def create_ravlt_like(model_cls: type, variant: str, pretrained: bool = False, head_chs: int = 1024,
                      **kwargs) -> LinHier:
    """A model of RAVLT's layout (stem, downsampling, blocks, a conv head of ``head_chs`` channels) as ``model_cls``,
    built through :func:`build_published`; ``kwargs`` override any option (``token_mixers``, sizes)."""
    args = dict(
        token_mixers="ravlt_rala,ravlt_rala,ravlt_softmax,ravlt_softmax", mlp_ratio=3.5, stem_layer=RavltStem,
        downsample_layer=partial(ChannelsLastConv, kernel_size=3, stride=2, apply_act=False),
        cpe="first", mlp_layer=DwConvMlp,
        final_layer=partial(ChannelsLastConv, act_layer=nn.SiLU), head_chs=head_chs,
    )
    return build_published(model_cls, variant, pretrained, checkpoint_filter_fn, **merge_options(args, **kwargs))


# Published training used stochastic depth 0.1 / 0.15 / 0.4 / 0.55 (T / S / B / L); the models default to none,
# as timm's do.
@register_model
def ravlt_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return create_ravlt_like(Ravlt, "ravlt_tiny", pretrained, **merge_options(SIZES["tiny"], **kwargs))


@register_model
def ravlt_small(pretrained: bool = False, **kwargs) -> LinHier:
    return create_ravlt_like(Ravlt, "ravlt_small", pretrained, **merge_options(SIZES["small"], **kwargs))


@register_model
def ravlt_base(pretrained: bool = False, **kwargs) -> LinHier:
    return create_ravlt_like(Ravlt, "ravlt_base", pretrained, **merge_options(SIZES["base"], **kwargs))


@register_model
def ravlt_large(pretrained: bool = False, **kwargs) -> LinHier:
    return create_ravlt_like(Ravlt, "ravlt_large", pretrained, **merge_options(SIZES["large"], **kwargs))
