"""MAViT: Magnitude-Aware Vision Transformer backbones, loading the published ImageNet-1k weights.

Fan et al. 2025, "Rectifying Magnitude Neglect in Linear Attention", ICCV 2025, arXiv:2507.00698; reference code
github.com/qhfan/MALA (classification model ``MALA_T/S/B/L``), weights on the Hugging Face hub repository
``aldjalkdf/MAViT`` (``MAViT_{T,S,B,L}.pth``). Neither repository carries a licence: the weights are loaded from
their published location, never redistributed.

MAViT is RAVLT (:mod:`linvision.models.ravlt`, by the same authors) with magnitude-aware linear attention (MALA) in
place of RALA in the first two stages and a wider conv head (2048 channels; 2560 for large). The network is
:class:`~linvision.models.linhier.LinHier` with RAVLT's layers (stem, 3x3/2 conv-BN downsampling, blocks with a CPE
before the mixer, layer scale and :class:`~linvision.layers.DwConvMlp`, the conv head with BN and SiLU) and:

- stages 1-2: the ``"mavit_mala"`` mixer (:class:`~linvision.layers.mala.MavitMala`):
  :class:`~linvision.layers.mala.MALAttention` (elu+1 map, score scale D^-1/2, eps 1e-6) with RAVLT's RoPE on the
  first term, LePE (5x5 depthwise on v) and the element-wise output modulation (attention + LePE) * (W_o x) before
  the projection;
- stages 3-4: RAVLT's softmax mixer (``"ravlt_softmax"``), which is MAViT's too.

The sizes are RAVLT's (``linvision.models.ravlt.SIZES``); the authors' checkpoints share RAVLT's layout, so
:func:`linvision.models.ravlt.checkpoint_filter_fn` maps them (q and k rows reordered to the RoPE pairs used here,
the same outputs; the magnitude term m_i = s phi(q_i).kbar is a dot product, unchanged by the reordering).
Evaluation as the authors': resize to 256/224 of the crop (bicubic), centre crop 224, ImageNet mean/std.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from timm.models import generate_default_cfgs, register_model

from linvision.layers import merge_options

from .linhier import LinHier
from .published import published_cfg
from .ravlt import SIZES, Ravlt, create_ravlt_like
from .ravlt import checkpoint_filter_fn  # noqa: F401  (MAViT's files have RAVLT's layout)

__all__ = ["Mavit"]

HUB_ID = "aldjalkdf/MAViT"


class Mavit(Ravlt):
    """:class:`LinHier` with MAViT's layers; loads the authors' files (timm's ``custom_load``)."""


def _cfg(filename: str, top1: Optional[float]) -> Dict[str, Any]:
    # custom_load "hf": timm fetches the hub file and hands its path to Mavit.load_pretrained (no code from the
    # pickle runs); the url is the same file, for a timm without huggingface_hub.
    return published_cfg(
        top1, hf_hub_id=HUB_ID, hf_hub_filename=filename, custom_load="hf",
        url=f"https://huggingface.co/{HUB_ID}/resolve/main/{filename}", first_conv="stem.convs.0.conv",
        license="unknown (no licence file: load, do not redistribute)", paper_ids="arXiv:2507.00698",
        paper_name="Rectifying Magnitude Neglect in Linear Attention", origin_url="https://github.com/qhfan/MALA",
    )


# Top-1: the paper's abstract states the small model's (84.7%, 27M parameters, 4.6 GFLOPs); neither repository's
# README states any, and the others are not recorded here.
default_cfgs = generate_default_cfgs({
    "mavit_tiny.in1k": _cfg("MAViT_T.pth", None),
    "mavit_small.in1k": _cfg("MAViT_S.pth", 84.7),
    "mavit_base.in1k": _cfg("MAViT_B.pth", None),
    "mavit_large.in1k": _cfg("MAViT_L.pth", None),
})

_MIXERS = dict(token_mixers="mavit_mala,mavit_mala,ravlt_softmax,ravlt_softmax")


def _create_mavit(variant: str, size: str, head: int, pretrained: bool, **kwargs) -> LinHier:
    args = merge_options(SIZES[size], _MIXERS, dict(head_chs=head), **kwargs)  # the caller's head_chs wins
    return create_ravlt_like(Mavit, variant, pretrained, **args)


# Published training used stochastic depth 0.1 / 0.15 / 0.4 / 0.55 (T / S / B / L); the models default to none,
# as timm's do.
@register_model
def mavit_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_mavit("mavit_tiny", "tiny", 2048, pretrained, **kwargs)


@register_model
def mavit_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_mavit("mavit_small", "small", 2048, pretrained, **kwargs)


@register_model
def mavit_base(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_mavit("mavit_base", "base", 2048, pretrained, **kwargs)


@register_model
def mavit_large(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_mavit("mavit_large", "large", 2560, pretrained, **kwargs)
