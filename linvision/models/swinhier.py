"""Swin's macro-architecture on :class:`~linvision.models.linhier.LinHier`, shared by the published Swin-shaped
backbones (Pola-Swin in :mod:`linvision.models.polaformer`, InLine-Swin in :mod:`linvision.models.inline`).

Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", arXiv:2103.14030. The
layers: a 4x4 patch embedding of stride 4 with LayerNorm (timm's ``PatchEmbed``), timm's ``PatchMerging`` between
stages (2x2 neighbours concatenated, LayerNorm, a linear map without bias to twice the channels), pre-norm blocks
without CPE or layer scale (LayerNorm eps 1e-5, timm's ``Mlp``), a final LayerNorm, then mean pooling and a
linear head. Softmax stages use ``"swin_window"`` (:class:`SwinWindowAttention`, registered here): the windows of
every second block of a stage are shifted by half a window.

The published linear-attention Swins use a window of 56 in their linear stages, which at 224 px holds the whole
56 x 56, 28 x 28 and 14 x 14 maps: here those stages attend over the whole map at every size.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import Mlp, trunc_normal_
from timm.models.swin_transformer import PatchMerging, get_relative_position_index
from torch import Tensor, nn

from linvision.layers import check_size, merge_options, register_mixer
from linvision.layers.mixers import AttentionMixer, window_merge, window_partition
from linvision.layers.registry import MixerSpec, mixer_options
from linvision.ops import Rope

from .linhier import LinHier, StageSpec, linhier_layout
from .pvthier import PvtPatchEmbed
from .published import build_published, unwrap_state_dict

__all__ = ["SwinHier", "SwinWindowAttention", "swin_layout", "swin_stem", "swin_published_name",
           "swin_checkpoint_filter", "create_swin_like"]

# Buffers of the authors' Swin code that the model recomputes.
RECOMPUTED = (".relative_position_index", ".attn_mask")


@register_mixer("swin_window")
class SwinWindowAttention(AttentionMixer):
    """Swin's window attention: softmax attention (scale D^-1/2) inside ``window`` x ``window`` windows, with a
    learned bias per head and relative offset (``relative_position_bias_table``, (2 window - 1)^2 x heads).
    ``shift``: the windows are shifted by half a window (Swin's odd blocks; along an axis no longer than the
    window, nothing shifts), tokens brought together across the map's edge by the shift kept apart by a bias of
    -100, as Swin does. The map is padded at the bottom and right to whole windows; padded keys take no weight.
    No RoPE, no prefix tokens."""

    takes_prefix_tokens = False
    exports_fixed_grid = True  # the window count, padding and shift follow the size: exported at one size

    def __init__(self, dim: int, num_heads: int, *, window: int = 7, shift: bool = False, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        check_size("window", window)
        if self.rope_type is not None:
            raise ValueError(f"rope: swin_window places tokens by its relative position bias, not RoPE; got "
                             f"{self.rope_type!r}")
        self.window, self.shift = window, bool(shift)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", get_relative_position_index(window, window).flatten(),
                             persistent=False)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return super().no_weight_decay() | {"relative_position_bias_table"}

    def _shifts(self, hw: Tuple[int, int]) -> Tuple[int, int]:
        s = self.window // 2 if self.shift else 0
        return tuple(s if n > self.window else 0 for n in hw)

    def _bias(self, padded: Tuple[int, int], shifts: Tuple[int, int], valid: Tensor, dtype: torch.dtype) -> Tensor:
        """(heads, windows, w*w, w*w): the relative position bias, -100 between tokens of different regions of
        the padded, shifted map (Swin's regions: the last ``shift`` rows and columns are those the roll brought
        round), -inf for padded keys; ``valid``: (windows, w*w), the real tokens."""
        area = self.window * self.window
        table = self.relative_position_bias_table.to(dtype)
        bias = table[self.relative_position_index].reshape(area, area, -1).permute(2, 0, 1)[:, None]
        (hp, wp), (sh, sw) = padded, shifts
        rows = torch.arange(hp, device=valid.device) >= hp - sh  # the rows the shift brought in (none for sh = 0)
        cols = torch.arange(wp, device=valid.device) >= wp - sw
        region = (rows[:, None] * 2 + cols[None, :]).to(dtype).reshape(1, 1, hp * wp, 1)
        windows = window_partition(region, padded, self.window)[0][0, 0, :, :, 0]  # (nW, w*w)
        other = (windows[:, :, None] != windows[:, None, :]).to(dtype) * -100.0
        other = other.masked_fill(~valid[:, None, :], float("-inf"))
        return bias + other[None]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], rope: Optional[Rope], x: Tensor) -> Tensor:
        """Swin's order: the map padded at the bottom and right to whole windows, then rolled by the shift, then
        split into windows; after attention rolled back and cropped."""
        b, nh, n, d = q.shape
        (h, w), win = hw, self.window
        padded = (math.ceil(h / win) * win, math.ceil(w / win) * win)
        shifts = self._shifts(hw)

        def shifted(t: Tensor, sign: int = -1) -> Tensor:  # (..., Hp, Wp, D) rolled by sign * shifts
            return t.roll((sign * shifts[0], sign * shifts[1]), dims=(-3, -2)) if any(shifts) else t

        def windows(t: Tensor) -> Tensor:
            grid = F.pad(t.reshape(b, nh, h, w, d), (0, 0, 0, padded[1] - w, 0, padded[0] - h))
            return window_partition(shifted(grid).reshape(b, nh, padded[0] * padded[1], d), padded, win)[0]

        real = shifted(F.pad(torch.ones(h, w, 1, device=q.device), (0, 0, 0, padded[1] - w, 0, padded[0] - h)))
        valid = window_partition(real.reshape(1, 1, -1, 1), padded, win)[0][0, 0, :, :, 0] > 0
        qw, kw, vw = windows(q), windows(k), windows(v)
        count, area = qw.shape[2], qw.shape[3]
        # heads and windows on one axis: SDPA on 4D tensors (as ONNX's operator takes them), the bias per both
        mask = self._bias(padded, shifts, valid, q.dtype).reshape(1, nh * count, area, area)
        out = F.scaled_dot_product_attention(*(t.reshape(b, nh * count, area, d) for t in (qw, kw, vw)),
                                             attn_mask=mask)
        grid = window_merge(out.reshape(b, nh, count, area, d), padded, padded, win).reshape(b, nh, *padded, d)
        return shifted(grid, 1)[:, :, :h, :w].reshape(b, nh, n, d)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, shift={self.shift}"


def swin_stem(in_chans: int, dim: int) -> nn.Module:
    """Swin's patch embedding: a 4x4 conv of stride 4 and LayerNorm, channels-last out (timm's ``PatchEmbed``, as
    PVT's stage entry without a position embedding: an image smaller than 4x4 is padded to one patch)."""
    return PvtPatchEmbed(in_chans, dim, 4)


def swin_layout(*, lead: Optional[Sequence[Optional[Tuple[int, MixerSpec]]]] = None, **sizes: Any
                ) -> Tuple[StageSpec, ...]:
    """Swin's stages (:func:`~linvision.models.linhier.linhier_layout` of ``sizes``): windows of 7 for the mixers
    that take a window, the ``"swin_window"`` blocks at odd places in their stage shifted (Swin's alternation),
    and ``lead``: per stage None or (n, mixer), the first n blocks of that stage taking ``mixer`` (the
    published "mixed" stages: a few linear-attention blocks, then window attention)."""
    stages = linhier_layout(defaults=dict(window=7), lead=lead, **sizes)
    return tuple(replace(stage, blocks=tuple(
        replace(block, options={**block.options, "shift": j % 2 == 1}) if "shift" in mixer_options(block.mixer)
        else block for j, block in enumerate(stage.blocks))) for stage in stages)


class SwinHier(LinHier):
    """:class:`LinHier` with Swin's stages (:func:`swin_layout`; the layers: :func:`create_swin_like`). The
    window side of the softmax stages: ``mixer_kwargs=dict(window=...)`` (7)."""

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
                norm_layer=nn.LayerNorm, cpe=False, mlp_layer=Mlp, final_layer=nn.LayerNorm)
    return build_published(model_cls, variant, pretrained, filter_fn, **merge_options(sizes, args, **kwargs))
