"""PVT's macro-architecture on :class:`~linvision.models.linhier.LinHier`, shared by the published PVT-shaped
backbones (Pola-PVT in :mod:`linvision.models.polaformer`, InLine-PVT in :mod:`linvision.models.inline`).

Wang et al. 2021, "Pyramid Vision Transformer: A Versatile Backbone for Dense Prediction without Convolutions",
arXiv:2102.12122 (PVT v1). The layers: every stage starts with a patch embedding (:class:`PvtPatchEmbed`: a
conv with kernel = stride, 4 for the first stage and 2 after, then LayerNorm eps 1e-5) and adds a learned absolute
position embedding of its grid; pre-norm blocks without CPE or layer scale (LayerNorm eps 1e-6, timm's ``Mlp``
with a hidden size of 8, 8, 4, 4 times the width); no final norm; mean pooling and a linear head.

The published linear-attention PVTs attend over the whole stage map in every block (no spatial reduction of the
keys); PVT's own softmax stages with a spatially reduced key map are not built here.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from timm.layers import PatchEmbed, register_notrace_module, resample_abs_pos_embed, trunc_normal_
from torch import Tensor, nn

from linvision.layers import RecomputeMlp, merge_options
from linvision.layers.options import pad_to_kernel

from .linhier import LinHier, StageSpec, linhier_layout, stage_grids
from .published import build_published, map_mixer_groups, unwrap_state_dict

__all__ = ["PvtHier", "PvtPatchEmbed", "pvt_layout", "stage_grids", "pvt_published_name", "pvt_checkpoint_filter",
           "merge_q_kv", "create_pvt_like"]


@register_notrace_module  # resamples its embedding by the input's grid: one leaf of timm's FX tracing
class PvtPatchEmbed(PatchEmbed):
    """PVT's stage entry: timm's ``PatchEmbed`` (a ``patch`` x ``patch`` conv of stride ``patch``, LayerNorm),
    channels-last out, then a learned absolute position embedding of the stage's ``grid`` (H, W) (none when
    None), drawn as PVT draws it and resampled bilinearly (PVT's rule) to an input whose grid differs.
    ``channels_last``: the input is (B, H, W, C), as between stages; else an image (B, C, H, W)."""

    def __init__(self, in_chans: int, dim: int, patch: int, channels_last: bool = False,
                 grid: Optional[Tuple[int, int]] = None):
        super().__init__(None, patch, in_chans, dim, norm_layer=nn.LayerNorm, output_fmt="NHWC")
        self.channels_last = channels_last
        self.pos_embed: Optional[nn.Parameter] = None
        self.pos_grid: Optional[Tuple[int, int]] = None
        if grid is not None:
            self.pos_grid = (int(grid[0]), int(grid[1]))
            self.pos_embed = nn.Parameter(torch.zeros(1, grid[0] * grid[1], dim))
            trunc_normal_(self.pos_embed, std=0.02)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {"pos_embed"} if self.pos_embed is not None else set()

    def position(self, hw: Tuple[int, int]) -> Tensor:
        """The position embedding on grid ``hw``: (1, H * W, C), resampled when ``hw`` is not its own grid."""
        if tuple(hw) == self.pos_grid:
            return self.pos_embed
        return resample_abs_pos_embed(self.pos_embed, list(hw), list(self.pos_grid), num_prefix_tokens=0,
                                      interpolation="bilinear", antialias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = super().forward(pad_to_kernel(x.permute(0, 3, 1, 2) if self.channels_last else x, self.proj))
        if self.pos_embed is None:
            return x
        b, h, w, c = x.shape
        return x + self.position((h, w)).to(x.dtype).reshape(1, h, w, c)

    def extra_repr(self) -> str:
        return f"pos_grid={self.pos_grid}"


def pvt_layout(**sizes: Any) -> Tuple[StageSpec, ...]:
    """PVT's stages (:func:`~linvision.models.linhier.linhier_layout` of ``sizes``), each started by its patch
    embedding (:class:`PvtPatchEmbed`: 4 x 4 on the image, 2 x 2 between stages) with the position embedding of
    its grid."""
    return tuple(replace(stage, entry=partial(PvtPatchEmbed, patch=2 if i else 4, channels_last=i > 0,
                                              grid=stage.grid))
                 for i, stage in enumerate(linhier_layout(**sizes)))


class PvtHier(LinHier):
    """:class:`LinHier` with PVT's stages (:func:`pvt_layout`; the layers: :func:`create_pvt_like`)."""

    MIXER_DEFAULTS = {}  # PVT's blocks: the mixers as they come

    def __init__(self, *, layout: Optional[Callable[..., Sequence[StageSpec]]] = None, **kwargs):
        super().__init__(layout=layout or pvt_layout, **kwargs)


def pvt_published_name(name: str) -> Optional[str]:
    """linvision's name of a tensor of the authors' PVT layout (``patch_embed{i}``, ``pos_embed{i}`` and
    ``block{i}`` per stage from 1, ``attn`` for the mixer); None for PVT's final norm, which the published
    linear-attention PVTs build and never apply."""
    m = re.match(r"^(patch_embed|pos_embed)(\d)(.*)$", name)
    if m:
        stage = int(m.group(2)) - 1
        where = "stem" if stage == 0 else f"stages.{stage}.downsample"
        return f"{where}.{'pos_embed' if m.group(1) == 'pos_embed' else m.group(3)[1:]}"
    if name.startswith("norm."):
        return None
    m = re.match(r"^block(\d)\.(\d+)\.(.*)$", name)
    if m:
        name = f"stages.{int(m.group(1)) - 1}.blocks.{m.group(2)}.{m.group(3)}"
    return re.sub(r"^head\.", "head.fc.", name.replace(".attn.", ".mixer."))


def merge_q_kv(tensors: Dict[str, Tensor], prefix: str) -> Dict[str, Tensor]:
    """The separate projections ``{prefix}.q`` (C outputs) and ``{prefix}.kv`` (2C: k, then v) of a mixer as one
    ``{prefix}.qkv`` (q, k, v), weights and biases; the other tensors unchanged."""
    out = {k: v for k, v in tensors.items() if not k.startswith((f"{prefix}.q.", f"{prefix}.kv."))}
    for part in ("weight", "bias"):
        if f"{prefix}.q.{part}" in tensors:
            out[f"{prefix}.qkv.{part}"] = torch.cat([tensors[f"{prefix}.q.{part}"], tensors[f"{prefix}.kv.{part}"]])
    return out


def pvt_checkpoint_filter(checkpoint: Dict[str, Any], model: LinHier, weight_keys: Sequence[str],
                          mixer_tensors: Callable[[str, Dict[str, Tensor], nn.Module], Dict[str, Tensor]],
                          ) -> Dict[str, Tensor]:
    """An authors' PVT-layout checkpoint in linvision's names (:func:`pvt_published_name`), the stages' position
    embeddings resampled (bilinear) to the model's grids where the file's differ (a model built for another size).
    ``mixer_tensors(prefix, tensors, mixer)``: a family's mapping of one mixer's tensors (their linvision names,
    all under ``prefix``), returning the tensors they become. A state dict in linvision's own names passes
    unchanged."""
    state = unwrap_state_dict(checkpoint, weight_keys)
    if not any(k.startswith("block1.") for k in state):
        return state
    out: Dict[str, Tensor] = {}
    mixers: Dict[str, Dict[str, Tensor]] = {}
    for name, value in state.items():
        new = pvt_published_name(name)
        if new is None:
            continue
        if ".mixer." in new:
            mixers.setdefault(new.split(".mixer.")[0] + ".mixer", {})[new] = value
            continue
        if new.endswith("pos_embed"):
            embed = model.get_submodule(new.rpartition(".")[0])
            side = int(round(value.shape[1] ** 0.5))
            if embed.pos_grid is not None and side * side == value.shape[1] and (side, side) != embed.pos_grid:
                value = resample_abs_pos_embed(value, list(embed.pos_grid), [side, side], num_prefix_tokens=0,
                                               interpolation="bilinear", antialias=False)
        out[new] = value
    out.update(map_mixer_groups(mixers, model, mixer_tensors))
    return out


def _no_final_norm(dim: int) -> nn.Module:
    return nn.Identity()


def create_pvt_like(model_cls: type, variant: str, pretrained: bool, filter_fn: Callable, sizes: Dict[str, Any],
                    **kwargs) -> LinHier:
    """A model of PVT's layout as ``model_cls`` (a :class:`PvtHier`), built through :func:`build_published`;
    ``sizes`` (depths, dims, heads) and ``kwargs`` (``token_mixers``, options) over the layers."""
    args = dict(layout=pvt_layout, norm_layer=partial(nn.LayerNorm, eps=1e-6), cpe=False, mlp_layer=RecomputeMlp,
                mlp_ratio=(8, 8, 4, 4), final_layer=_no_final_norm)
    return build_published(model_cls, variant, pretrained, filter_fn, **merge_options(sizes, args, **kwargs))
