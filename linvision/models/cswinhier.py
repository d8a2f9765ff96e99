"""CSWin's macro-architecture on :class:`~linvision.models.linhier.LinHier`, for the published InLine-CSwin
backbones (:mod:`linvision.models.inline`).

Dong et al. 2022, "CSWin Transformer: A General Vision Transformer Backbone with Cross-Shaped Windows",
arXiv:2107.00652. The layers: a 7x7 conv of stride 4 (padding 2) and LayerNorm (:class:`CswinStem`); a 3x3 conv of
stride 2 and LayerNorm between stages (LinHier's :class:`~linvision.models.linhier.Downsample`); pre-norm blocks
without CPE or layer scale (LayerNorm eps 1e-5, timm's ``Mlp``); a final LayerNorm, the mean and a linear head.
Softmax stages use ``"cswin_stripes"`` (:class:`~linvision.layers.cswin.CswinStripeAttention`): half the heads
attend inside vertical stripes of the map, the other half inside horizontal ones, each with a LePE of v inside its
stripe. CSWin's last stage, whose map is a single stripe at 224 px, attends over the whole map: ``"softmax"``
with ``lepe=True``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from linvision.layers import RecomputeMlp, merge_options, pad_to_kernel
from linvision.layers.cswin import CswinStripeAttention

from .linhier import Downsample, LinHier
from .published import build_published, map_mixer_groups, unwrap_state_dict

__all__ = ["CswinStem", "cswin_published_name", "cswin_checkpoint_filter", "create_cswin_like"]


class CswinStem(nn.Module):
    """CSWin's stem: a 7x7 conv of stride 4 (padding 2) and LayerNorm, (B, C_in, H, W) -> (B, H/4, W/4, C)."""

    def __init__(self, in_chans: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, 7, stride=4, padding=2)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.proj(pad_to_kernel(x, self.proj)).permute(0, 2, 3, 1))


def cswin_published_name(name: str) -> Optional[str]:
    """linvision's name of a tensor of the authors' CSWin layout (``stage1_conv_embed``, ``stage{i}.{j}`` blocks
    with the block-level ``qkv`` and ``proj``, ``attns.{0,1}`` branches, ``merge{i}``), the two branches' LePE
    convs still apart (``mixer.attns.{0,1}.get_v``: :func:`cswin_checkpoint_filter` joins them)."""
    import re

    for old, new in ((r"^stage1_conv_embed\.0\.", "stem.proj."), (r"^stage1_conv_embed\.2\.", "stem.norm."),
                     (r"^merge(\d)\.", lambda m: f"stages.{int(m.group(1))}.downsample."),
                     (r"^stage(\d)\.(\d+)\.", lambda m: f"stages.{int(m.group(1)) - 1}.blocks.{m.group(2)}."),
                     (r"\.blocks\.(\d+)\.(qkv|proj)\.", r".blocks.\1.mixer.\2."),
                     (r"\.blocks\.(\d+)\.attns\.", r".blocks.\1.mixer.attns."),
                     (r"^norm\.", "final."), (r"^head\.", "head.fc.")):
        name = re.sub(old, new, name)
    return name


def cswin_checkpoint_filter(checkpoint: Dict[str, Any], model: LinHier, weight_keys: Sequence[str],
                            mixer_tensors: Callable[[str, Dict[str, Tensor], nn.Module], Dict[str, Tensor]],
                            ) -> Dict[str, Tensor]:
    """An authors' CSWin-layout checkpoint in linvision's names (:func:`cswin_published_name`). Per mixer,
    ``mixer_tensors(prefix, tensors, mixer)`` maps the branch tensors (``{prefix}.attns.{i}.*``) of a family's
    own mixer; here the stripes' two LePE convs (half the channels each) join as ``stripe_lepe`` and a single
    branch's as ``lepe``. A state dict in linvision's own names passes unchanged."""
    state = unwrap_state_dict(checkpoint, weight_keys)
    if not any(k.startswith("stage1.") for k in state):
        return state
    out: Dict[str, Tensor] = {}
    mixers: Dict[str, Dict[str, Tensor]] = {}
    for name, value in state.items():
        new = cswin_published_name(name)
        if ".mixer.attns." in new:
            mixers.setdefault(new.split(".attns.")[0], {})[new] = value
        else:
            out[new] = value

    def branches(prefix: str, tensors: Dict[str, Tensor], mixer: nn.Module) -> Dict[str, Tensor]:
        joined = {}
        if isinstance(mixer, CswinStripeAttention):
            for part in ("weight", "bias"):
                pair = [tensors.pop(f"{prefix}.attns.{i}.get_v.{part}", None) for i in (0, 1)]
                if all(t is not None for t in pair):
                    joined[f"{prefix}.stripe_lepe.{part}"] = torch.cat(pair)
        tensors = {k.replace(".attns.0.get_v.", ".lepe."): v for k, v in tensors.items()}
        return {**joined, **mixer_tensors(prefix, tensors, mixer)}

    out.update(map_mixer_groups(mixers, model, branches))
    return out


def create_cswin_like(model_cls: type, variant: str, pretrained: bool, filter_fn: Callable, sizes: Dict[str, Any],
                      **kwargs) -> LinHier:
    """A model of CSWin's layout as ``model_cls`` (a LinHier), built through :func:`build_published`; ``sizes``
    (depths, dims, heads) and ``kwargs`` (``token_mixers``, options) over the layers."""
    args = dict(stem_layer=CswinStem, downsample_layer=partial(Downsample, norm_layer=nn.LayerNorm),
                norm_layer=nn.LayerNorm, cpe=False, mlp_layer=RecomputeMlp, final_layer=nn.LayerNorm)
    return build_published(model_cls, variant, pretrained, filter_fn, **merge_options(sizes, args, **kwargs))
