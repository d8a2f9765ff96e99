"""Hierarchical linear-attention backbones (MLLA-like) and their Gated-CNN (MambaOut-like) counterparts.

One macro-architecture: a conv stem (stride 4), four stages (stride 4, 8, 16, 32; a 3x3 stride-2 conv between
stages), blocks (:class:`linvision.layers.MixerBlock` with CPE) of

    x = x + cpe1(x)                              3x3 depthwise conv: conditional position encoding
    x = x + drop_path(mixer(norm1(x), (H, W)))   token mixer chosen per stage
    x = x + cpe2(x)
    x = x + drop_path(mlp(norm2(x)))

and a norm -> global pool -> linear head. The default mixer is "linear_rope" with an output gate: linear
attention (elu+1) with 2D RoPE on the numerator and LePE, gated by SiLU of a projection of the input — the
MLLA block (Han et al. 2024, "Demystify Mamba in Vision: A Linear Attention Perspective", arXiv:2405.16605).
With the mixer "gated_cnn" (alias "none") in every stage the block's mixer is MambaOut's Gated CNN (Yu & Wang 2024,
arXiv:2405.07992), so linear attention and its absence are compared in the same network.

Activations are kept channels-last (B, H, W, C) between blocks; mixers see (B, H*W, C) and the grid (H, W).
No parameter depends on the input resolution: the models run at any size that is a multiple of 32.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor, nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, ClNormMlpClassifierHead, LayerNorm
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs
from timm.models._features import feature_take_indices

from linvision.layers import (MixerBlock, RecomputeMlp, init_model_weights, no_weight_decay_of, parse_mixer_list,
                              routed_options, stage_mixer_options)
from linvision.layers.options import check_images, check_size
from linvision.layers.registry import MixerSpec, mixer_option_default, mixer_options

from .entry_points import entry_point
from .published import require_weights, unwrap_state_dict

__all__ = ["LinHier", "StageSpec", "BlockSpec", "linhier_layout", "with_family_defaults", "with_mixer_options",
           "with_stage_rope_grids", "stage_grids"]

def _to_nchw(x: Tensor) -> Tensor:
    return x.permute(0, 3, 1, 2)


def _to_nhwc(x: Tensor) -> Tensor:
    return x.permute(0, 2, 3, 1)


class Stem(nn.Module):
    """Two 3x3 stride-2 convs (stride 4): (B, C_in, H, W) -> (B, H/4, W/4, C) channels-last."""

    def __init__(self, in_chans: int, dim: int, norm_layer: Type[nn.Module] = LayerNorm,
                 act_layer: Type[nn.Module] = nn.GELU):
        super().__init__()
        self.conv1 = nn.Conv2d(in_chans, dim // 2, 3, stride=2, padding=1)
        self.norm1 = norm_layer(dim // 2)
        self.act = act_layer()
        self.conv2 = nn.Conv2d(dim // 2, dim, 3, stride=2, padding=1)
        self.norm2 = norm_layer(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.norm1(_to_nhwc(self.conv1(x))))
        return self.norm2(_to_nhwc(self.conv2(_to_nchw(x))))


class Downsample(nn.Module):
    """3x3 stride-2 conv and a norm: (B, H, W, C_in) -> (B, H/2, W/2, C_out)."""

    def __init__(self, in_dim: int, out_dim: int, norm_layer: Type[nn.Module] = LayerNorm):
        super().__init__()
        self.conv = nn.Conv2d(in_dim, out_dim, 3, stride=2, padding=1)
        self.norm = norm_layer(out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(_to_nhwc(self.conv(_to_nchw(x))))


@dataclass(frozen=True)
class BlockSpec:
    """One block of a stage: its token mixer (a registered name or a mixer class) and that mixer's options."""

    mixer: MixerSpec
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageSpec:
    """One stage: its width, heads, blocks, the blocks' MLP ratio and layer scale (None: none), its grid (H, W)
    at the model's ``img_size`` (what a position table of the stage is drawn for), and ``entry``: the layer that
    starts it, built as ``entry(in_dim, dim)`` (None: the model's stem for the first stage, its downsampling
    layer for the others)."""

    dim: int
    num_heads: int
    blocks: Tuple[BlockSpec, ...]
    grid: Tuple[int, int]
    mlp_ratio: float = 4.0
    layer_scale_init: Optional[float] = None
    entry: Optional[Callable[[int, int], nn.Module]] = None


def stage_grids(img_size: Any, stages: int) -> Tuple[Tuple[int, int], ...]:
    """The grid of every stage at ``img_size`` (an int or (H, W)): a quarter of the image, then halved by each
    downsampling, rounding down as the convolutions do."""
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    grids = [(h // 4, w // 4)]
    for _ in range(stages - 1):
        grids.append((grids[-1][0] // 2, grids[-1][1] // 2))
    return tuple(grids)


def _per_stage(value: Any, count: int, name: str) -> Tuple[Any, ...]:
    """One value for every stage, or a sequence of ``count``; ValueError naming ``name`` otherwise."""
    values = (value,) * count if value is None or isinstance(value, (int, float)) else tuple(value)
    if len(values) != count:
        raise ValueError(f"{name}: {len(values)} values for {count} stages")
    return values


def block_spec(mixer: MixerSpec, grid: Tuple[int, int]) -> BlockSpec:
    """A block of ``mixer`` with its stage's ``grid`` when the mixer takes a ``grid`` option (a learned position
    table of the stage's map)."""
    return BlockSpec(mixer, {"grid": grid} if "grid" in mixer_options(mixer) else {})


def with_family_defaults(stages: Sequence[StageSpec], defaults: Optional[Mapping[str, Any]]
                         ) -> Tuple[StageSpec, ...]:
    """``stages`` with a family's mixer options ``defaults`` in every block whose mixer takes them and whose layout
    did not set them (the others go unused): what makes a family's block (MLLA's output gate, InLine-CSwin's
    LePE) whatever layout builds its stages."""
    if not defaults:
        return tuple(stages)

    def block(b: BlockSpec) -> BlockSpec:
        takes = mixer_options(b.mixer)
        extra = {k: v for k, v in defaults.items() if k in takes and k not in b.options}
        return replace(b, options=routed_options(b.mixer, {**extra, **b.options})) if extra else b
    return tuple(replace(stage, blocks=tuple(block(b) for b in stage.blocks)) for stage in stages)


def with_stage_rope_grids(stages: Sequence[StageSpec]) -> Tuple[StageSpec, ...]:
    """``stages`` with each block that turns its positions with RoPE (a ``rope`` option, given or by its mixer's
    default, that is not None) interpolating them to its stage's grid (``rope_ref_grid``: :attr:`StageSpec.grid`,
    the grid at the model's img_size), unless the block sets its own: at img_size the model computes what it
    computes without it, at other sizes each stage's positions span the range they were trained on."""
    def block(b: BlockSpec, grid: Tuple[int, int]) -> BlockSpec:
        if "rope_ref_grid" not in mixer_options(b.mixer) or b.options.get("rope_ref_grid") is not None:
            return b
        if b.options.get("rope", mixer_option_default(b.mixer, "rope")) is None:
            return b
        return replace(b, options={**b.options, "rope_ref_grid": grid})
    return tuple(replace(stage, blocks=tuple(block(b, stage.grid) for b in stage.blocks)) for stage in stages)


def linhier_layout(
    depths: Sequence[int] = (3, 5, 9, 4), dims: Sequence[int] = (64, 128, 256, 512),
    num_heads: Sequence[int] = (2, 4, 8, 16), token_mixers: Union[MixerSpec, Sequence[MixerSpec]] = "linear_rope",
    mlp_ratio: Union[float, Sequence[float]] = 4.0, layer_scale_init: Union[None, float, Sequence] = None,
    img_size: Any = 224, *, lead: Optional[Sequence[Optional[Tuple[int, MixerSpec]]]] = None,
) -> Tuple[StageSpec, ...]:
    """The stages of a hierarchical model: stage i has ``depths[i]`` blocks of ``token_mixers[i]`` (one name, 4
    comma-separated names or a sequence; :func:`block_spec`); a family's mixer options are its model class's
    ``MIXER_DEFAULTS``, not the layout's. ``lead``: per stage None or (n, mixer): the first n blocks of that
    stage take ``mixer`` instead (a mixed stage). ``mlp_ratio`` and ``layer_scale_init``: one value or one per
    stage. Raises ValueError for lists of other lengths or unknown mixers."""
    depths, dims, num_heads = tuple(depths), tuple(dims), tuple(num_heads)
    if not len(depths) == len(dims) == len(num_heads):
        raise ValueError(f"depths, dims, num_heads: lengths differ ({len(depths)}, {len(dims)}, {len(num_heads)})")
    n = len(depths)
    mixers = parse_mixer_list(token_mixers, n)
    ratios, scales = _per_stage(mlp_ratio, n, "mlp_ratio"), _per_stage(layer_scale_init, n, "layer_scale_init")
    leads = tuple(lead) if lead is not None else (None,) * n
    if len(leads) != n:
        raise ValueError(f"lead: {len(leads)} values for {n} stages")
    grids = stage_grids(img_size, n)
    stages = []
    for i in range(n):
        count, first = leads[i] or (0, None)
        blocks = tuple(block_spec(first if j < count else mixers[i], grids[i]) for j in range(depths[i]))
        stages.append(StageSpec(dims[i], num_heads[i], blocks, grids[i], ratios[i], scales[i]))
    return tuple(stages)


def with_mixer_options(stages: Sequence[StageSpec], mixer_kwargs: Optional[Mapping[str, Any]] = None,
                       stage_mixer_kwargs: Optional[Mapping[Any, Mapping[str, Any]]] = None) -> Tuple[StageSpec, ...]:
    """``stages`` with the caller's mixer options over the layout's: ``mixer_kwargs`` reach every block whose
    mixer takes them, then ``stage_mixer_kwargs`` ({stage index: options} or {(stage, block): options}) those
    of one stage or one block (a block's over its stage's). Every option must be taken by a block it is given
    to: ValueError in one line naming it and the mixers otherwise, as for a key naming no stage or block. A grid
    option (``rope_ref_grid``) in ``mixer_kwargs`` is refused when the stages' grids differ: one grid would be
    wrong for all stages but one, so each stage takes its own (the model's ``rope_ref_grid=True``, or
    ``stage_mixer_kwargs``)."""
    stages = list(stages)
    if "rope_ref_grid" in (mixer_kwargs or {}) and len({s.grid for s in stages}) > 1:
        raise ValueError(f"mixer_kwargs: 'rope_ref_grid' is one grid, and the stages of this model run on "
                         f"{', '.join(f'{h}x{w}' for h, w in (s.grid for s in stages))} at its img_size; give each "
                         f"stage its own grid with rope_ref_grid=True (the model's option), or one by one with "
                         f"stage_mixer_kwargs={{0: {{'rope_ref_grid': {stages[0].grid}}}, ...}}")
    specific = sorted((stage_mixer_kwargs or {}).items(), key=lambda t: isinstance(t[0], (tuple, list)))
    targets = [(None, mixer_kwargs)] + specific
    for where, options in targets:
        places = [(i, j) for i, s in enumerate(stages) for j in range(len(s.blocks)) if _names(where, i, j)]
        if not places:
            raise ValueError(f"stage_mixer_kwargs: {where!r} names no stage or (stage, block) of this model "
                             f"(blocks per stage: {[len(s.blocks) for s in stages]})")
        name = "mixer_kwargs" if where is None else f"stage_mixer_kwargs[{where!r}]"
        mixers = [stages[i].blocks[j].mixer for i, j in places]
        chosen = stage_mixer_options(mixers, options, name=name,
                                     current=[stages[i].blocks[j].options for i, j in places])
        for (i, j), own in zip(places, chosen):
            blocks = list(stages[i].blocks)
            blocks[j] = replace(blocks[j], options=routed_options(blocks[j].mixer, {**blocks[j].options, **own}))
            stages[i] = replace(stages[i], blocks=tuple(blocks))
    return tuple(stages)


def _names(where: Any, stage: int, block: int) -> bool:
    """Whether ``where`` (None: every block; an int: a stage; (stage, block)) names block ``block`` of
    ``stage``."""
    if isinstance(where, (tuple, list)):
        return tuple(where) == (stage, block)
    return where is None or where == stage


def stage_mixer_text(stage: StageSpec) -> str:
    """What a stage holds, by its blocks' mixers: ``"swin_window"``, or runs ``"inline_deit x2+swin_window"``
    (each run but the last with its count)."""
    runs: List[List[Any]] = []
    for block in stage.blocks:
        name = block.mixer if isinstance(block.mixer, str) else block.mixer.__name__
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return "+".join(f"{n} x{c}" if k < len(runs) - 1 else n for k, (n, c) in enumerate(runs))


class HierStage(nn.Module):
    """Optional downsample (``downsample``: a module or None), then the :class:`MixerBlock` s ``spec`` describes
    (``cpe`` and ``mlp_layer``: the blocks' options of those names)."""

    def __init__(
        self, spec: StageSpec, downsample: Optional[nn.Module], drop_path: Sequence[float],
        norm_layer: Type[nn.Module], act_layer: Type[nn.Module], cpe: Union[bool, str] = True,
        mlp_layer: Type[nn.Module] = RecomputeMlp,
    ):
        super().__init__()
        self.downsample = downsample if downsample is not None else nn.Identity()
        self.blocks = nn.Sequential(*[
            MixerBlock(spec.dim, spec.num_heads, block.mixer, dict(block.options), spec.mlp_ratio, drop_path[i],
                       norm_layer=norm_layer, act_layer=act_layer, cpe=cpe, layer_scale_init=spec.layer_scale_init,
                       mlp_layer=mlp_layer)
            for i, block in enumerate(spec.blocks)
        ])
        self.grad_checkpointing = False

    def forward(self, x: Tensor) -> Tensor:
        x = self.downsample(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


class LinHier(nn.Module):
    """Four-stage backbone, built from a description of its stages and blocks (:class:`StageSpec`,
    :class:`BlockSpec`) that ``layout`` returns for the sizes and mixers given; nothing is changed after the
    modules are built. The description is kept as :attr:`spec`.

    Args:
        in_chans: input channels.
        num_classes: classes of the head (0: no head).
        global_pool: 'avg', 'max', 'avgmax' or '' (none), as in timm.
        drop_rate: dropout before the classifier.
        drop_path_rate: stochastic depth of the last block (linear over blocks).
        depths: blocks per stage (4 values).
        dims: channels per stage (4 values).
        num_heads: heads per stage (4 values).
        token_mixers: one mixer (a registered name or a mixer class), 4 comma-separated names, or a sequence of 4.
        mixer_kwargs: the caller's options for the mixers, over the layout's: every block whose mixer takes one
            receives it, and each must be an option of at least one block's mixer (ValueError naming it otherwise).
        stage_mixer_kwargs: options for one stage ({stage index: options}) or one block ({(stage, block):
            options}), over ``mixer_kwargs``; refused in the same way.
        layout: returns the stages (a tuple of :class:`StageSpec`), called with ``depths``, ``dims``,
            ``num_heads``, ``token_mixers``, ``mlp_ratio``, ``layer_scale_init`` and ``img_size`` as keywords; a
            family binds its block pattern (default: :func:`linhier_layout`).
        rope_ref_grid: True: every block with RoPE interpolates its positions to its stage's grid at ``img_size``
            (:attr:`StageSpec.grid`; a block's own ``rope_ref_grid`` in ``stage_mixer_kwargs`` wins), so a model
            run at another size turns each stage's positions within the range it was trained on.
        mlp_ratio: MLP hidden size / dim, one value or one per stage.
        img_size: nominal input size: the grid of a stage's position tables, where a layout has some (no
            parameter of the default layout depends on it).
        stem_layer: built as ``stem_layer(in_chans, dims[0])`` (default: :class:`Stem` with ``norm_layer`` and
            ``act_layer``) unless the first stage names its ``entry``; maps an NCHW image to channels-last features.
        downsample_layer: built as ``downsample_layer(in_dim, dim)`` between stages (default: :class:`Downsample`
            with ``norm_layer``) unless the stage names its ``entry``; maps channels-last to channels-last features.
        cpe: the blocks' 3x3 depthwise-conv position encoding: before the mixer and the MLP (True), before the
            mixer only ("first"), or none (False).
        mlp_layer: the blocks' MLP class (:class:`~linvision.layers.RecomputeMlp`, timm's ``Mlp`` keeping less for
            the backward; RAVLT: :class:`~linvision.layers.DwConvMlp`).
        layer_scale_init: initial layer scale of the blocks, one value or one per stage (None: no layer scale).
        final_layer: built as ``final_layer(dims[-1])`` after the last stage, on channels-last features (a norm
            before pooling), or as ``final_layer(dims[-1], head_chs)`` with ``head_chs`` (a conv head whose
            ``head_chs`` channels are ``num_features``); the head is then pooling and a linear classifier. None
            (default): the head normalises after pooling.
        head_chs: the output channels of a final conv head (with ``final_layer`` only).
    Raises ValueError for inconsistent stage lists, unknown mixers or options no block takes.
    """

    # The family's mixer options, under the layout's and the caller's: every block whose mixer takes one and whose
    # layout did not set it receives it, whatever the layout (:func:`with_family_defaults`). A family's class sets
    # its own; LinHier's is the output gate where the mixer takes one: the MLLA block.
    MIXER_DEFAULTS: Mapping[str, Any] = {"gate": True}

    def __init__(
        self,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        depths: Sequence[int] = (3, 5, 9, 4),
        dims: Sequence[int] = (64, 128, 256, 512),
        num_heads: Sequence[int] = (2, 4, 8, 16),
        token_mixers: Union[MixerSpec, Sequence[MixerSpec]] = "linear_rope",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        stage_mixer_kwargs: Optional[Dict[Any, Dict[str, Any]]] = None,
        layout: Optional[Callable[..., Sequence[StageSpec]]] = None,
        rope_ref_grid: bool = False,
        mlp_ratio: Union[float, Sequence[float]] = 4.0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        img_size: Union[int, Tuple[int, int]] = 224,
        norm_layer: Type[nn.Module] = LayerNorm,
        act_layer: Type[nn.Module] = nn.GELU,
        stem_layer: Optional[Callable[[int, int], nn.Module]] = None,
        downsample_layer: Optional[Callable[[int, int], nn.Module]] = None,
        cpe: Union[bool, str] = True,
        mlp_layer: Type[nn.Module] = RecomputeMlp,
        layer_scale_init: Union[None, float, Sequence[Optional[float]]] = None,
        final_layer: Optional[Callable[..., nn.Module]] = None,
        head_chs: Optional[int] = None,
    ):
        super().__init__()
        if not isinstance(rope_ref_grid, bool):
            raise TypeError(f"rope_ref_grid: True (each stage's grid at img_size) or False, got {rope_ref_grid!r}; "
                            "one grid for every block goes in mixer_kwargs of an isotropic model")
        spec = (layout or linhier_layout)(depths=depths, dims=dims, num_heads=num_heads, token_mixers=token_mixers,
                                          mlp_ratio=mlp_ratio, layer_scale_init=layer_scale_init, img_size=img_size)
        spec = with_family_defaults(spec, self.MIXER_DEFAULTS)
        spec = with_mixer_options(spec, mixer_kwargs, stage_mixer_kwargs)
        self.spec = with_stage_rope_grids(spec) if rope_ref_grid else spec
        self.token_mixers = tuple(stage_mixer_text(stage) for stage in self.spec)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.img_size = img_size
        self.drop_rate = drop_rate
        self.output_fmt = "NHWC"
        self._build_stages(stem_layer or partial(Stem, norm_layer=norm_layer, act_layer=act_layer),
                           downsample_layer or partial(Downsample, norm_layer=norm_layer), drop_path_rate,
                           norm_layer, act_layer, cpe, mlp_layer)
        last = self.spec[-1].dim
        if head_chs is not None:
            if final_layer is None:
                raise ValueError("head_chs: the channels of a final conv head need final_layer")
            check_size("head_chs", head_chs)
        self.head_chs = head_chs
        if final_layer is None:
            self.final = nn.Identity()
            self.num_features = last
            self.head = ClNormMlpClassifierHead(
                self.num_features, num_classes, pool_type=global_pool, drop_rate=drop_rate, norm_layer=norm_layer,
                input_fmt="NHWC",
            )
        else:
            self.final = final_layer(last) if head_chs is None else final_layer(last, head_chs)
            self.num_features = last if head_chs is None else head_chs
            self.head = ClassifierHead(self.num_features, num_classes, pool_type=global_pool, drop_rate=drop_rate,
                                       input_fmt="NHWC")
        self.head_hidden_size = self.head.num_features
        init_model_weights(self)

    def _build_stages(self, stem_layer: Callable, downsample_layer: Callable, drop_path_rate: float,
                      norm_layer: Type[nn.Module], act_layer: Type[nn.Module], cpe: Union[bool, str],
                      mlp_layer: Type[nn.Module]) -> None:
        """The stem and the stages of :attr:`spec`, each stage started by its ``entry`` or the model's layer."""
        first = self.spec[0]
        self.stem = (first.entry or stem_layer)(self.in_chans, first.dim)
        rates = torch.linspace(0, drop_path_rate, sum(len(s.blocks) for s in self.spec), device="cpu").tolist()
        self.stages = nn.Sequential()
        self.feature_info = []
        in_dim, stride, start = first.dim, 4, 0
        for i, stage in enumerate(self.spec):
            stride *= 2 if i > 0 else 1
            depth = len(stage.blocks)
            downsample = (stage.entry or downsample_layer)(in_dim, stage.dim) if i > 0 else None
            self.stages.append(HierStage(stage, downsample, rates[start:start + depth], norm_layer, act_layer, cpe,
                                         mlp_layer))
            self.feature_info.append(dict(num_chs=stage.dim, reduction=stride, module=f"stages.{i}"))
            in_dim, start = stage.dim, start + depth

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r"^stem",
            blocks=r"^stages\.(\d+)" if coarse else [
                (r"^stages\.(\d+)\.downsample", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
            ],
        )

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """What the mixers exclude (mixed-RoPE frequencies, the hybrid mixer's gate logits); norms and biases
        are excluded by timm's optimizer factory through their dimension."""
        return no_weight_decay_of(self)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None, reset_other: bool = False):
        self.num_classes = num_classes
        self.head.reset(num_classes, global_pool, reset_other=reset_other, in_features=self.num_features)
        self.head_hidden_size = self.head.num_features

    def forward_intermediates(
        self,
        x: Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """Stage outputs. indices: last n stages (int), all (None) or the listed ones; norm: the last stage's
        output (when taken) passes through the model's final norm, as timm's hierarchical models apply theirs:
        the final layer when it is a norm (MLLA's, before the pooling), else the head's norm (applied to every
        position of the map; the classifier applies it after the pooling); output_fmt: 'NCHW' or 'NHWC'.
        Returns intermediates, or (final features, intermediates), the final features through the final layer as
        :meth:`forward_features`'s. Raises ValueError for another output_fmt, or for norm=True on a model without
        a final norm (RAVLT's final conv head, a head pruned of its norm)."""
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"output_fmt: {output_fmt!r}; allowed: 'NCHW', 'NHWC'")
        final_norm = self._final_norm() if norm else None
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        stages = self.stages[: max_index + 1] if stop_early else self.stages
        last = len(self.stages) - 1
        intermediates = []
        check_images(x, self.in_chans)
        x = self.stem(x)
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                y = final_norm(x) if final_norm is not None and i == last else x
                intermediates.append(_to_nchw(y).contiguous() if output_fmt == "NCHW" else y)
        if intermediates_only:
            return intermediates
        return self.final(x), intermediates

    def _final_norm(self) -> nn.Module:
        """The norm that ends the network, for a channels-last map (B, H, W, C): the final layer when it is a norm
        (before the pooling, as MLLA's), else the head's norm (which the classifier applies after the pooling).
        Raises ValueError when there is none: a final conv head (RAVLT's) or a head without a norm (pruned)."""
        if not isinstance(self.final, nn.Identity):
            if self.head_chs is not None:
                raise ValueError(f"norm: the final layer of {type(self).__name__} is a conv head "
                                 f"({type(self.final).__name__}), not a norm; use norm=False")
            return self.final
        head_norm = getattr(self.head, "norm", None)
        if head_norm is None or isinstance(head_norm, nn.Identity):
            raise ValueError(f"norm: {type(self).__name__} has no final norm (its head has none); use norm=False")
        return head_norm

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages after the last needed one, the final layer with them or when ``prune_norm`` asks (timm's
        feature extraction without the final norm: nothing may be left that no output uses, or DDP refuses the
        model), and the head when asked or when either goes."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[: max_index + 1]
        if prune_end or prune_norm:
            self.final = nn.Identity()
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_head or prune_end or prune_norm:
            self.reset_classifier(0, "", reset_other=True)
        return take_indices

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) -> (B, H/32, W/32, num_features) channels-last."""
        check_images(x, self.in_chans)
        return self.final(self.stages(self.stem(x)))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: LinHier) -> Dict[str, Tensor]:
    """Unwrap training checkpoints (:func:`linvision.models.published.unwrap_state_dict`: the EMA copy first, as
    timm). No weight of this family depends on the resolution (RoPE tables are built per input; CPE/LePE are
    convolutions), so nothing is resampled."""
    return unwrap_state_dict(state_dict)


def _cfg(**kwargs) -> Dict[str, Any]:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "test_input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.conv1",
        "classifier": "head.fc",
        "license": "mit",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "linhier_tiny_224": _cfg(),
    "linhier_small_224": _cfg(),
    "linhier_base_224": _cfg(),
    "linhier_gcnn_femto_224": _cfg(crop_pct=1.0),
    "linhier_gcnn_tiny_224": _cfg(crop_pct=1.0),
    "linhier_delta_femto_224": _cfg(),
    "linhier_delta_tiny_224": _cfg(),
    "linhier_delta_small_224": _cfg(),
})


def _create_linhier(variant: str, pretrained: bool = False, **kwargs) -> LinHier:
    require_weights(variant, pretrained, kwargs)
    return build_model_with_cfg(
        LinHier, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=(0, 1, 2, 3), feature_cls="getter"),
        **kwargs,
    )


# Sizes shared by the families that differ only in their token mixer.
_FEMTO = dict(depths=(2, 2, 5, 2), dims=(48, 96, 192, 288), num_heads=(2, 3, 6, 9))
_TINY = dict(depths=(3, 5, 9, 4), dims=(64, 128, 256, 512), num_heads=(2, 4, 8, 16))
_SMALL = dict(depths=(3, 6, 21, 6), dims=(64, 128, 256, 512), num_heads=(2, 4, 8, 16))


@entry_point(_create_linhier, _TINY)
def linhier_tiny_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, tiny: the MLLA block (linear attention with 2D RoPE, LePE and an output gate) in every stage."""


@entry_point(_create_linhier, _SMALL)
def linhier_small_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, small: as tiny, deeper (3, 6, 21 and 6 blocks)."""


@entry_point(_create_linhier, dict(depths=(3, 6, 21, 6), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)))
def linhier_base_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, base: as small, wider (96 to 768 channels)."""


@entry_point(_create_linhier, _FEMTO, dict(token_mixers="gated_cnn"))
def linhier_gcnn_femto_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, femto, with MambaOut's Gated CNN in every stage (no attention)."""


@entry_point(_create_linhier, dict(depths=(2, 2, 7, 2), dims=(80, 160, 320, 576), num_heads=(2, 4, 8, 16),
                                   token_mixers="gated_cnn"))
def linhier_gcnn_tiny_224(pretrained: bool = False, **kwargs) -> LinHier:
    """MambaOut's Gated CNN in every stage (no attention): 2, 2, 7 and 2 blocks, 80 to 576 channels."""


# The bidirectional delta rule in every stage: the best hierarchical mixer of the project's comparisons (docs/results.md).
_DELTA = dict(token_mixers="bidir_delta")


@entry_point(_create_linhier, _FEMTO, _DELTA)
def linhier_delta_femto_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, femto, with the bidirectional delta rule in every stage."""


@entry_point(_create_linhier, _TINY, _DELTA)
def linhier_delta_tiny_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, tiny, with the bidirectional delta rule in every stage."""


@entry_point(_create_linhier, _SMALL, _DELTA)
def linhier_delta_small_224(pretrained: bool = False, **kwargs) -> LinHier:
    """linhier, small, with the bidirectional delta rule in every stage."""
