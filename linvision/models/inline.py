"""InLine-DeiT, InLine-PVT, InLine-Swin and InLine-CSwin: backbones with injective linear attention, loading the
published ImageNet-1k weights.

Han et al. 2024, "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv:2412.06590;
reference code github.com/LeapLabTHU/InLine (classification models ``inline_deit_tiny/small/base``,
``inline_pvt_tiny/small/medium/large``, ``InLineSwin`` with ``cfgs/inline_swin_{t,s,b}.yaml`` and
``inline_cswin_tiny/small/base`` with ``cfgs/inline_cswin_{t,s,b}.yaml``), weights on TsinghuaCloud (links in
its README). The repository carries no licence file: the weights are loaded from their published location, never
redistributed.

The network is DeiT's (:class:`~linvision.models.linvit.LinViT` with a class token, a learned absolute position
embedding with a row for the class token, pre-norm blocks, LayerNorm eps 1e-6, the class token pooled after the
final norm, a linear head) with the ``"inline_deit"`` mixer
(:class:`~linvision.layers.inline.InLineDeitAttention`) in every block:

- injective linear attention over all tokens, the class token included (N = 1 + H * W):
  o_i = sum_j (s q_i.k_j - s q_i.kbar + 1) / N v_j with the identity map and s = D^-1/2
  (:func:`linvision.ops.attention_variants.injective_linear_attention`);
- the local residual on the patch tokens: a 3x3 depthwise convolution of v over the grid (zero padding) whose nine
  weights per image and channel are predicted from the mean of the block's input over all tokens by two grouped
  1x1 projections (one group per head) with a GELU between them; the class token gets none.

The sizes are the authors': tiny 192 wide with 6 heads, small 320 / 10, base 384 / 12, all 12 blocks deep, trained
at 224, 288 and 448 px. The absolute position embedding is resampled (bicubic) to each input's grid
(``dynamic_img_size=True``, the default: any multiple of 16), or once when the model is built for another size
with ``dynamic_img_size=False``; the mixer itself takes any grid.
Evaluation as the authors': a square resize to 256/224 of the crop (bicubic, the aspect ratio not kept: timm's
``crop_mode="squash"``), centre crop, ImageNet mean/std.

InLine-Swin is :class:`~linvision.models.swinhier.SwinHier` (Swin's layers) with ``"inline_deit"`` (no prefix
tokens there) in its linear blocks: the authors' window of 56 holds the whole 56 x 56, 28 x 28 and 14 x 14 maps of
224 px, so those blocks attend over the whole stage map, at every size here. Swin's shifted-window softmax
attention (``"swin_window"``, window 7) fills the rest: stage 4 of T (``IIIS``), stages 3-4 of S (``IISS``), and
stage 4 and all but the first two blocks of stage 3 of B (``IIMS2``). Evaluation as Swin's: resize to 256/224 of
the crop (bicubic), centre crop 224, ImageNet mean/std.

InLine-PVT is :class:`~linvision.models.pvthier.PvtHier` (PVT v1's layers) with ``"inline_deit"`` in every block
over the whole stage map (the authors' key map is not reduced, ``PVT_LA_SR_RATIOS`` 1111); their separate q and kv
projections load as one ``qkv``. Heads of 32 channels: 2, 4, 10, 16 per stage. Evaluation as Swin's.

InLine-CSwin is CSWin's layout (:mod:`linvision.models.cswinhier`) with the stages ``IISS``: ``"inline_cswin"``
(:class:`~linvision.layers.inline.InLineCswinAttention`) in stages 1-2 over the whole stage map (the authors'
split sizes 56 and 28 hold the whole maps of 224 px), CSWin's cross-shaped stripes (``"cswin_stripes"``, 7 wide)
in stage 3 and softmax attention with LePE over the whole 7 x 7 map in stage 4. ``"inline_cswin"`` is
``"inline_deit"`` with a 3x3 LePE of v and its kernels predicted from the mean of the block's input before the norm
(the block hands it on in the mixer's context: ``block_input``). The published files keep an EMA copy beside the raw weights; the
EMA copy is loaded, as timm loads a training checkpoint. Evaluation as Swin's.

The ablation's ``"inline"`` mixer (beside the published ones in :mod:`linvision.layers.inline`) has the same
attention but another local residual (nine weights per token and head from a 3x3 depthwise convolution of the
input) and no class token; it is kept as the form the results page measured.
"""
from __future__ import annotations

from typing import Any, Dict

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import Tensor, nn

from linvision.layers import merge_options

from .linhier import LinHier
from .linvit import LinViT
from .linvit import checkpoint_filter_fn as linvit_filter
from .published import (explain_failed_download, load_published, published_cfg, published_file_overlay,
                        unwrap_state_dict)
from .cswinhier import create_cswin_like, cswin_checkpoint_filter
from .pvthier import PvtHier, create_pvt_like, merge_q_kv, pvt_checkpoint_filter
from .swinhier import SwinHier, create_swin_like, swin_checkpoint_filter

__all__ = ["InLineDeiT", "InLinePvt", "InLineSwin", "InLineCswin", "checkpoint_filter_fn", "pvt_filter_fn",
           "swin_filter_fn", "cswin_filter_fn"]

WEIGHT_KEYS = ("model", "state_dict")  # the authors' main.py saves the weights under 'model' (no EMA copy)


class InLineDeiT(LinViT):
    """:class:`LinViT` with the ``"inline_deit"`` mixer; loads the authors' files (timm's ``custom_load``)."""

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, checkpoint_filter_fn)


class InLineSwin(SwinHier):
    """:class:`~linvision.models.swinhier.SwinHier` with InLine's stages; loads the authors' files (timm's
    ``custom_load``)."""

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, swin_filter_fn)


class InLinePvt(PvtHier):
    """:class:`~linvision.models.pvthier.PvtHier` with ``"inline_deit"`` in every block; loads the authors' files
    (timm's ``custom_load``)."""

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, pvt_filter_fn)


class InLineCswin(LinHier):
    """CSWin's layout (:func:`~linvision.models.cswinhier.create_cswin_like`) with InLine's stages; loads the
    authors' files (timm's ``custom_load``)."""

    MIXER_DEFAULTS = {"lepe": True}  # LePE in every block: the stripes' own, the InLine and whole-map softmax blocks'

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, cswin_filter_fn)


def checkpoint_filter_fn(checkpoint: Dict[str, Any], model: LinViT) -> Dict[str, Tensor]:
    """The authors' checkpoint (weights under ``model``) in linvision's names: ``blocks.i.attn.*`` becomes
    ``blocks.i.mixer.*`` and the kernel predictor ``attn.residual`` the mixer's ``local``; then linvit's filter
    resamples the position embedding to the model's grid. A state dict in linvision's names passes unchanged."""
    state = unwrap_state_dict(checkpoint, WEIGHT_KEYS)
    out = {}
    for name, value in state.items():
        if ".attn." in name:
            name = name.replace(".attn.residual.", ".mixer.local.").replace(".attn.", ".mixer.")
        out[name] = value
    return linvit_filter(out, model)


def _swin_mixer_tensor(name: str, value: Tensor, mixer: nn.Module) -> Dict[str, Tensor]:
    return {name.replace(".mixer.residual.", ".mixer.local."): value}


def swin_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' InLine-Swin checkpoint (weights under ``model``) in linvision's names
    (:func:`~linvision.models.swinhier.swin_checkpoint_filter`; the kernel predictor ``attn.residual`` becomes the
    mixer's ``local``, no tensor changed). A state dict in linvision's own names passes unchanged."""
    return swin_checkpoint_filter(checkpoint, model, WEIGHT_KEYS, _swin_mixer_tensor)


def _pvt_mixer_tensors(prefix: str, tensors: Dict[str, Tensor], mixer: nn.Module) -> Dict[str, Tensor]:
    tensors = {k.replace(".mixer.residual.", ".mixer.local."): v for k, v in tensors.items()}
    return merge_q_kv(tensors, prefix)


def pvt_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' InLine-PVT checkpoint (weights under ``model``) in linvision's names
    (:func:`~linvision.models.pvthier.pvt_checkpoint_filter`; q and kv joined as ``qkv``, the kernel predictor
    ``attn.residual`` the mixer's ``local``). A state dict in linvision's own names passes unchanged."""
    return pvt_checkpoint_filter(checkpoint, model, WEIGHT_KEYS, _pvt_mixer_tensors)


# InLine-CSwin's training (main_ema.py) saves the EMA copy under 'state_dict_ema' beside the raw weights: the EMA
# copy first, as timm loads a training checkpoint.
CSWIN_WEIGHT_KEYS = ("state_dict_ema", "model", "state_dict")


def _cswin_mixer_tensors(prefix: str, tensors: Dict[str, Tensor], mixer: nn.Module) -> Dict[str, Tensor]:
    return {k.replace(".attns.0.residual.", ".local."): v for k, v in tensors.items()}


def cswin_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' InLine-CSwin checkpoint (the EMA copy under ``state_dict_ema`` when there is one, else
    ``model``) in linvision's names (:func:`~linvision.models.cswinhier.cswin_checkpoint_filter`; the kernel
    predictor ``attns.0.residual`` becomes the mixer's ``local``). A state dict in linvision's names passes
    unchanged."""
    return cswin_checkpoint_filter(checkpoint, model, CSWIN_WEIGHT_KEYS, _cswin_mixer_tensors)


def _cfg(url: str, filename: str, size: int, top1: float) -> Dict[str, Any]:
    # (url, file name): the links end in "/?dl=1", from which timm's download cache cannot name a file. The
    # top-1 is the README's, each model evaluated at its training size.
    return published_cfg(
        top1, url=(url, filename), input_size=(3, size, size), test_input_size=(3, size, size),
        notes=(f"published ImageNet-1k top-1 {top1} ({size} px)",),
        fixed_input_size=True, pool_size=None, crop_mode="squash", first_conv="patch_embed.proj",
        classifier="head", license="unknown (no licence file: load, do not redistribute)",
        paper_ids="arXiv:2412.06590", paper_name="Bridging the Divide: Reconsidering Softmax and Linear Attention",
        origin_url="https://github.com/LeapLabTHU/InLine",
    )


_CLOUD = "https://cloud.tsinghua.edu.cn/f/{}/?dl=1"


def _hier_cfg(layout: str, size: str, key: str, top1: float) -> Dict[str, Any]:
    return published_cfg(
        top1, url=(_CLOUD.format(key), f"inline_{layout}_{size}_in1k.pth"), first_conv="stem.proj",
        license="unknown (no licence file: load, do not redistribute)", paper_ids="arXiv:2412.06590",
        paper_name="Bridging the Divide: Reconsidering Softmax and Linear Attention",
        origin_url="https://github.com/LeapLabTHU/InLine",
    )


# Every family's cfgs, complete before any entry point registers (timm reads them at registration).
default_cfgs = generate_default_cfgs({
    "inline_deit_tiny.in1k": _cfg(_CLOUD.format("1d6b8191ad6d4114b291"), "inline_deit_tiny_in1k.pth", 224, 74.5),
    "inline_deit_small.in1k": _cfg(_CLOUD.format("2f3898b07e9247f3beb3"), "inline_deit_small_in1k.pth", 288, 80.2),
    "inline_deit_base.in1k": _cfg(_CLOUD.format("10bdd726d4b0435eb34e"), "inline_deit_base_in1k.pth", 448, 82.3),
    "inline_swin_tiny.in1k": _hier_cfg("swin", "tiny", "32810869fcc34410966b", 82.4),
    "inline_swin_small.in1k": _hier_cfg("swin", "small", "e9657fd247c04c7cb1a1", 83.6),
    "inline_swin_base.in1k": _hier_cfg("swin", "base", "bf23564bb64c420aafe1", 84.1),
    "inline_pvt_tiny.in1k": _hier_cfg("pvt", "tiny", "90ac52b1555b401eb5e6", 78.2),
    "inline_pvt_small.in1k": _hier_cfg("pvt", "small", "1ab953b2479d433080a3", 82.0),
    "inline_pvt_medium.in1k": _hier_cfg("pvt", "medium", "a72aec31e6084bc0a280", 83.2),
    "inline_pvt_large.in1k": _hier_cfg("pvt", "large", "efd91318ba964f01b288", 83.6),
    "inline_cswin_tiny.in1k": _hier_cfg("cswin", "tiny", "49fa2ecc543647c4b970", 83.2),
    "inline_cswin_small.in1k": _hier_cfg("cswin", "small", "59f4e65f776f4052b93c", 83.8),
    "inline_cswin_base.in1k": _hier_cfg("cswin", "base", "91e17121df284ae38521", 84.5),
})

SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(embed_dim=192, num_heads=6),
    "small": dict(embed_dim=320, num_heads=10),
    "base": dict(embed_dim=384, num_heads=12),
}
TRAINING_SIZES = {"tiny": 224, "small": 288, "base": 448}
_ARCH = dict(patch_size=16, depth=12, mlp_ratio=4.0, token_mixer="inline_deit", class_token=True, global_pool="token")


def _create_inline_deit(variant: str, size: str, pretrained: bool, **kwargs) -> LinViT:
    out_indices = kwargs.pop("out_indices", 3)
    kwargs.setdefault("dynamic_img_size", True)  # any multiple of 16 by default, as its mixer takes any grid
    if kwargs.get("dynamic_img_size"):  # the embedding is resampled per call: the cfg must not fix the size,
        # and the embedding keeps its training grid (resampled once per input, not twice)
        kwargs["pretrained_cfg_overlay"] = dict(kwargs.get("pretrained_cfg_overlay") or {}, fixed_input_size=False)
        kwargs.setdefault("img_size", TRAINING_SIZES[size])
    kwargs = published_file_overlay(merge_options(_ARCH, SIZES[size], **kwargs))
    with explain_failed_download(variant, pretrained, kwargs, "docs/models/published.md"):
        return build_model_with_cfg(InLineDeiT, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                    feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **kwargs)


# Published training used stochastic depth 0.1 (the authors' config default); the models default to none, as
# timm's do.
@register_model
def inline_deit_tiny(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_inline_deit("inline_deit_tiny", "tiny", pretrained, **kwargs)


@register_model
def inline_deit_small(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_inline_deit("inline_deit_small", "small", pretrained, **kwargs)


@register_model
def inline_deit_base(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_inline_deit("inline_deit_base", "base", pretrained, **kwargs)


_SWIN_SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 2, 6, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24),
                 token_mixers="inline_deit,inline_deit,inline_deit,swin_window"),
    "small": dict(depths=(2, 2, 18, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24),
                  token_mixers="inline_deit,inline_deit,swin_window,swin_window"),
    "base": dict(depths=(2, 2, 18, 2), dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32),
                 token_mixers="inline_deit,inline_deit,swin_window,swin_window"),
}
# Swin-B's stage 3 is mixed: two InLine blocks, then window attention.
_SWIN_LEAD = {"base": (None, None, (2, "inline_deit"), None)}


def _create_inline_swin(variant: str, size: str, pretrained: bool, **kwargs) -> LinHier:
    return create_swin_like(InLineSwin, variant, pretrained, swin_filter_fn, _SWIN_SIZES[size],
                            lead=_SWIN_LEAD.get(size), **kwargs)


# Published training used stochastic depth 0.2 / 0.3 / 0.5 (T / S / B); the models default to none, as timm's do.
@register_model
def inline_swin_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_swin("inline_swin_tiny", "tiny", pretrained, **kwargs)


@register_model
def inline_swin_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_swin("inline_swin_small", "small", pretrained, **kwargs)


@register_model
def inline_swin_base(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_swin("inline_swin_base", "base", pretrained, **kwargs)


_PVT_SIZES: Dict[str, Dict[str, Any]] = {
    size: dict(depths=depths, dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), token_mixers="inline_deit")
    for size, depths in (("tiny", (2, 2, 2, 2)), ("small", (3, 4, 6, 3)), ("medium", (3, 4, 18, 3)),
                         ("large", (3, 8, 27, 3)))
}


def _create_inline_pvt(variant: str, size: str, pretrained: bool, **kwargs) -> LinHier:
    return create_pvt_like(InLinePvt, variant, pretrained, pvt_filter_fn, _PVT_SIZES[size], **kwargs)


# Published training used stochastic depth 0.1 / 0.1 / 0.3 / 0.3 (T / S / M / L); the models default to none.
@register_model
def inline_pvt_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_pvt("inline_pvt_tiny", "tiny", pretrained, **kwargs)


@register_model
def inline_pvt_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_pvt("inline_pvt_small", "small", pretrained, **kwargs)


@register_model
def inline_pvt_medium(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_pvt("inline_pvt_medium", "medium", pretrained, **kwargs)


@register_model
def inline_pvt_large(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_pvt("inline_pvt_large", "large", pretrained, **kwargs)


# LePE in every block: the stripes' own, the InLine and whole-map softmax blocks' over their map
_CSWIN_MIXERS = dict(token_mixers="inline_cswin,inline_cswin,cswin_stripes,softmax")
_CSWIN_SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 4, 18, 1), dims=(64, 128, 256, 512), num_heads=(2, 4, 8, 16)),
    "small": dict(depths=(3, 6, 29, 2), dims=(64, 128, 256, 512), num_heads=(2, 4, 8, 16)),
    "base": dict(depths=(3, 6, 29, 2), dims=(96, 192, 384, 768), num_heads=(4, 8, 16, 32)),
}


def _create_inline_cswin(variant: str, size: str, pretrained: bool, **kwargs) -> LinHier:
    return create_cswin_like(InLineCswin, variant, pretrained, cswin_filter_fn, _CSWIN_SIZES[size],
                             **merge_options(_CSWIN_MIXERS, **kwargs))


# Published training used stochastic depth 0.2 / 0.4 / 0.5 (T / S / B); the models default to none.
@register_model
def inline_cswin_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_cswin("inline_cswin_tiny", "tiny", pretrained, **kwargs)


@register_model
def inline_cswin_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_cswin("inline_cswin_small", "small", pretrained, **kwargs)


@register_model
def inline_cswin_base(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_inline_cswin("inline_cswin_base", "base", pretrained, **kwargs)
