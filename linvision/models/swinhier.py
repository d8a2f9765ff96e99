"""Swin's macro-architecture on :class:`~linvision.models.linhier.LinHier`, shared by the published Swin-shaped
backbones (Pola-Swin in :mod:`linvision.models.polaformer`, InLine-Swin in :mod:`linvision.models.inline`).

Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", arXiv:2103.14030. The
layers: a 4x4 patch embedding of stride 4 with LayerNorm (timm's ``PatchEmbed``), timm's ``PatchMerging`` between
stages (2x2 neighbours concatenated, LayerNorm, a linear map without bias to twice the channels), pre-norm blocks
without CPE or layer scale (LayerNorm eps 1e-5, timm's ``Mlp``), a final LayerNorm, then mean pooling and a
linear head. Softmax stages use ``"swin_window"`` (:class:`~linvision.layers.window.SwinWindowAttention`): the
windows of every second block of a stage are shifted by half a window (:func:`swin_layout`).

The published linear-attention Swins use a window of 56 in their linear stages, which at 224 px holds the whole
56 x 56, 28 x 28 and 14 x 14 maps: here those stages attend over the whole map at every size.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from timm.models.swin_transformer import PatchMerging
from torch import Tensor, nn

from linvision.layers import RecomputeMlp, merge_options
from linvision.layers.registry import MixerSpec, mixer_options

from .linhier import LinHier, StageSpec, linhier_layout
from .pvthier import PvtPatchEmbed
from .published import build_published, unwrap_state_dict

__all__ = ["SwinHier", "swin_layout", "swin_stem", "swin_published_name",
           "swin_checkpoint_filter", "create_swin_like"]

# Buffers of the authors' Swin code that the model recomputes.
RECOMPUTED = (".relative_position_index", ".attn_mask")


def swin_stem(in_chans: int, dim: int) -> nn.Module:
    """Swin's patch embedding: a 4x4 conv of stride 4 and LayerNorm, channels-last out (timm's ``PatchEmbed``, as
    PVT's stage entry without a position embedding: an image smaller than 4x4 is padded to one patch)."""
    return PvtPatchEmbed(in_chans, dim, 4)


def swin_layout(*, lead: Optional[Sequence[Optional[Tuple[int, MixerSpec]]]] = None, **sizes: Any
                ) -> Tuple[StageSpec, ...]:
    """Swin's stages (:func:`~linvision.models.linhier.linhier_layout` of ``sizes``): the ``"swin_window"``
    blocks at odd places in their stage shifted (Swin's alternation), and ``lead``: per stage None or (n, mixer),
    the first n blocks of that stage taking ``mixer`` (the published "mixed" stages: a few linear-attention
    blocks, then window attention)."""
    stages = linhier_layout(lead=lead, **sizes)
    return tuple(replace(stage, blocks=tuple(
        replace(block, options={**block.options, "shift": j % 2 == 1}) if "shift" in mixer_options(block.mixer)
        else block for j, block in enumerate(stage.blocks))) for stage in stages)


class SwinHier(LinHier):
    """:class:`LinHier` with Swin's stages (:func:`swin_layout`; the layers: :func:`create_swin_like`). The
    window side of the softmax stages: ``mixer_kwargs=dict(window=...)`` (7, the family's mixer default)."""

    MIXER_DEFAULTS = {"window": 7}

    def __init__(self, *, layout: Optional[Callable[..., Sequence[StageSpec]]] = None, **kwargs):
        super().__init__(layout=layout or swin_layout, **kwargs)


def swin_published_name(name: str) -> str:
    """linvision's name of a tensor of the authors' Swin layout (``layers.i`` stages ending with their patch
    merging, ``attn`` for the mixer)."""
    import re

    m = re.match(r"^layers\.(\d+)\.downsample\.(.*)$", name)
    if m:  # the merging at the end of stage i is the one at the start of stage i + 1 here
        return f"stages.{int(m.group(1)) + 1}.downsample.{m.group(2)}"
    for old, new in ((r"^patch_embed\.", "stem."), (r"^layers\.(\d+)\.blocks\.", r"stages.\1.blocks."),
                     (r"\.attn\.", ".mixer."), (r"^norm\.", "final."), (r"^head\.", "head.fc.")):
        name = re.sub(old, new, name)
    return name


def swin_checkpoint_filter(checkpoint: Dict[str, Any], model: LinHier, weight_keys: Sequence[str],
                           mixer_tensor: Optional[Callable[[str, Tensor, nn.Module], Dict[str, Tensor]]] = None,
                           ) -> Dict[str, Tensor]:
    """An authors' Swin-layout checkpoint in linvision's names (:func:`swin_published_name`), the recomputed
    buffers dropped. ``mixer_tensor(name, value, mixer)``: a family's own mapping of a mixer's tensor (its
    linvision name, before the family's renaming), returning the tensors it becomes. A state dict in linvision's
    own names passes unchanged."""
    state = unwrap_state_dict(checkpoint, weight_keys)
    if not any(k.startswith("layers.") for k in state):
        return state
    out = {}
    for name, value in state.items():
        if name.endswith(RECOMPUTED):
            continue
        new = swin_published_name(name)
        if mixer_tensor is not None and ".mixer." in new:
            try:
                mixer = model.get_submodule(new.split(".mixer.")[0] + ".mixer")
            except AttributeError:  # a block this model lacks: left as it is, reported as unexpected
                out[new] = value
                continue
            out.update(mixer_tensor(new, value, mixer))
            continue
        out[new] = value
    return out


def create_swin_like(model_cls: type, variant: str, pretrained: bool, filter_fn: Callable, sizes: Dict[str, Any],
                     lead: Optional[Sequence[Optional[Tuple[int, MixerSpec]]]] = None, **kwargs) -> LinHier:
    """A model of Swin's layout as ``model_cls`` (a :class:`SwinHier`), built through :func:`build_published`;
    ``sizes`` (depths, dims, heads) and ``kwargs`` (``token_mixers``, options) over the layers; ``lead``: the
    mixed stages' leading blocks (:func:`swin_layout`)."""
    args = dict(layout=partial(swin_layout, lead=lead), stem_layer=swin_stem, downsample_layer=partial(PatchMerging, norm_layer=nn.LayerNorm),
                norm_layer=nn.LayerNorm, cpe=False, mlp_layer=RecomputeMlp, final_layer=nn.LayerNorm)
    return build_published(model_cls, variant, pretrained, filter_fn, **merge_options(sizes, args, **kwargs))
