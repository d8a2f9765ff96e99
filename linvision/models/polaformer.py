"""Pola-Swin and Pola-PVT: Swin and PVT backbones with polarity-aware linear attention, loading the published
ImageNet-1k weights.

Meng et al. 2025, "PolaFormer: Polarity-aware Linear Attention for Vision Transformers", ICLR 2025,
arXiv:2501.15061; reference code github.com/ZacharyMeng/PolaFormer (MIT licence; classification model
``PolaSwinTransformer``, configs ``cfgs/pola_swin_{t,s,b}.yaml``; ``pola_pvt_tiny/small`` with
``cfgs/pola_pvt_{t,s}.yaml``), weights on the Hugging Face hub repository ``ZachMeng/PolaFormer``.

The network is :class:`~linvision.models.swinhier.SwinHier` (Swin's layers on LinHier) with the stages ``LLSS``:

- stages 1-2: ``"pola_swin"`` (:class:`~linvision.layers.pola.PolaSwinAttention`): polarity-aware linear
  attention over the whole stage (at 224 px the authors' window of 56 holds the whole 56 x 56 and 28 x 28 maps),
  with a learned position encoding added to the keys, a 5x5 depthwise convolution of v shared by the heads, and the
  output modulation (attention + conv) * (W_g x) before the projection;
- stages 3-4: ``"swin_window"`` (:class:`~linvision.layers.window.SwinWindowAttention`): Swin's softmax
  attention in 7 x 7 windows with a learned relative position bias, the windows of every second block shifted by
  half a window.

At the training size every stage computes exactly the authors' model. At other sizes (any multiple of 32, square
or not) the linear stages still attend over the whole map, with the key position encoding resampled (bicubic,
antialiased) from its trained grid, and the window stages pad the map to whole windows, padded keys masked.
Evaluation as the authors' (Swin's): resize to 256/224 of the crop (bicubic), centre crop 224, ImageNet mean/std.

Pola-PVT is :class:`~linvision.models.pvthier.PvtHier` (PVT v1's layers) with ``"pola_swin"`` in every block: the
authors' PVT attention is the same computation (their key map is not reduced, ``PVT_LA_SR_RATIOS`` 1111), with
q and the modulation from one projection (``qg``) and k, v from another (``kv``), which load as ``qkv`` and
``gate``. Their PVT builds a final norm that its forward never applies; the file's copy is not loaded. Only the
tiny and small sizes have published weights and figures (78.8 and 81.9); the medium and large sizes of the
authors' code are not registered.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from timm.layers import resample_abs_pos_embed
from timm.models import generate_default_cfgs, register_model, resolve_pretrained_cfg
from torch import Tensor, nn

from linvision.layers import merge_options

from .linhier import LinHier
from .published import load_published, published_cfg
from .pvthier import PvtHier, create_pvt_like, pvt_checkpoint_filter
from .swinhier import SwinHier, create_swin_like, swin_checkpoint_filter

__all__ = ["PolaSwin", "PolaPvt", "checkpoint_filter_fn", "pvt_filter_fn"]

HUB_ID = "ZachMeng/PolaFormer"
# The authors' main.py saves the weights under "model" (no EMA copy).
WEIGHT_KEYS = ("model", "state_dict")


class PolaSwin(SwinHier):
    """:class:`~linvision.models.swinhier.SwinHier` with PolaFormer's stages; loads the authors' files (timm's
    ``custom_load``). ``img_size``: the size whose stage grids the linear stages' key position encodings have
    (224: 56 x 56 and 28 x 28)."""

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, checkpoint_filter_fn)


class PolaPvt(PvtHier):
    """:class:`~linvision.models.pvthier.PvtHier` with ``"pola_swin"`` in every block; loads the authors' files
    (timm's ``custom_load``). ``img_size``: the size whose stage grids the position embeddings have."""

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, pvt_filter_fn)


def _mixer_tensor(name: str, value: Tensor, mixer: nn.Module) -> Dict[str, Tensor]:
    """PolaFormer's mixer tensors: ``qkvg`` splits into the q/k/v projection and the modulation ``gate``; the
    per-channel scale and the power take the heads' shape; ``dwc`` is the head-shared conv; the key position
    encoding is resampled to the model's grid where the file's differs (a model built for another size)."""
    prefix = name.rpartition(".")[0]
    if ".mixer.qkvg." in name:
        c = mixer.dim
        return {name.replace(".qkvg.", ".qkv."): value[:3 * c], name.replace(".qkvg.", ".gate."): value[3 * c:]}
    if name.endswith(".mixer.scale"):
        return {prefix + ".qk_scale": value.reshape(mixer.num_heads, 1, mixer.head_dim)}
    if name.endswith(".mixer.power"):
        return {prefix + ".power_logit": value.reshape(mixer.num_heads, 1, mixer.head_dim)}
    if ".mixer.dwc." in name:
        return {name.replace(".mixer.dwc.", ".mixer.lepe.conv."): value}
    if name.endswith(".mixer.positional_encoding"):
        grid = getattr(mixer, "key_pos_grid", None)
        side = int(round(value.shape[1] ** 0.5))
        if grid is not None and (side, side) != grid and side * side == value.shape[1]:
            value = resample_abs_pos_embed(value, list(grid), [side, side], num_prefix_tokens=0)
        return {prefix + ".key_pos": value}
    return {name: value}


def checkpoint_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' checkpoint (weights under ``model``) in linvision's names
    (:func:`~linvision.models.swinhier.swin_checkpoint_filter`; the mixer tensors as :func:`_mixer_tensor` says).
    A state dict in linvision's own names passes unchanged."""
    return swin_checkpoint_filter(checkpoint, model, WEIGHT_KEYS, _mixer_tensor)


def _pvt_mixer_tensors(prefix: str, tensors: Dict[str, Tensor], mixer: nn.Module) -> Dict[str, Tensor]:
    """Pola-PVT's mixer tensors: ``qg`` splits into q and the modulation ``gate``, q joins ``kv`` as ``qkv``; the
    rest as Pola-Swin's (:func:`_mixer_tensor`)."""
    out: Dict[str, Tensor] = {}
    c = mixer.dim
    for part in ("weight", "bias"):
        qg, kv = tensors.pop(f"{prefix}.qg.{part}", None), tensors.pop(f"{prefix}.kv.{part}", None)
        if qg is not None and kv is not None:
            out[f"{prefix}.qkv.{part}"] = torch.cat([qg[:c], kv])
            out[f"{prefix}.gate.{part}"] = qg[c:]
    for name, value in tensors.items():
        out.update(_mixer_tensor(name, value, mixer))
    return out


def pvt_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' Pola-PVT checkpoint (weights under ``model``) in linvision's names
    (:func:`~linvision.models.pvthier.pvt_checkpoint_filter`, the mixers' tensors as :func:`_pvt_mixer_tensors`
    says). A state dict in linvision's own names passes unchanged."""
    return pvt_checkpoint_filter(checkpoint, model, WEIGHT_KEYS, _pvt_mixer_tensors)


def _cfg(top1: float) -> Dict[str, Any]:
    # The hub repository's file names are not recorded here: the weights load from a local copy
    # (pretrained_cfg_overlay=dict(file=...)); pretrained=True alone says so (_create_pola_swin).
    return published_cfg(
        top1, url="", first_conv="stem.proj", license="mit", paper_ids="arXiv:2501.15061",
        paper_name="PolaFormer: Polarity-aware Linear Attention for Vision Transformers",
        origin_url="https://github.com/ZacharyMeng/PolaFormer",
        description=f"the authors' ImageNet-1k weights, from a local copy of the hub file (top-1 {top1}% as published)",
    )


default_cfgs = generate_default_cfgs({
    "pola_swin_tiny.in1k": _cfg(82.6),
    "pola_swin_small.in1k": _cfg(83.6),
    "pola_swin_base.in1k": _cfg(83.8),
    "pola_pvt_tiny.in1k": _cfg(78.8),
    "pola_pvt_small.in1k": _cfg(81.9),
})

SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 2, 6, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)),
    "small": dict(depths=(2, 2, 18, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)),
    "base": dict(depths=(2, 2, 18, 2), dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32)),
}


PVT_SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 2, 2, 2), dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8)),
    "small": dict(depths=(3, 4, 6, 3), dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8)),
}


def _require_local_file(variant: str, pretrained: bool, kwargs: Dict[str, Any]) -> None:
    """pretrained=True without a local file: one line saying where the file is and how to pass it."""
    if pretrained:
        cfg = resolve_pretrained_cfg(variant, kwargs.get("pretrained_cfg"), kwargs.get("pretrained_cfg_overlay"))
        if not cfg.has_weights:
            raise ValueError(f"pretrained: {variant}.{cfg.tag} loads the authors' file from a local copy: download it "
                             f"from https://huggingface.co/{HUB_ID} (the file names there are not recorded here) "
                             f"and pass pretrained_cfg_overlay=dict(file=PATH) (--pretrained-path PATH to the tools)")


def _create_pola_swin(variant: str, size: str, pretrained: bool, **kwargs) -> LinHier:
    _require_local_file(variant, pretrained, kwargs)
    return create_swin_like(PolaSwin, variant, pretrained, checkpoint_filter_fn, SIZES[size],
                            **merge_options(dict(token_mixers="pola_swin,pola_swin,swin_window,swin_window"), **kwargs))


# Published training used stochastic depth 0.2 / 0.3 / 0.5 (T / S / B); the models default to none, as timm's do.
@register_model
def pola_swin_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_pola_swin("pola_swin_tiny", "tiny", pretrained, **kwargs)


@register_model
def pola_swin_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_pola_swin("pola_swin_small", "small", pretrained, **kwargs)


@register_model
def pola_swin_base(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_pola_swin("pola_swin_base", "base", pretrained, **kwargs)


def _create_pola_pvt(variant: str, size: str, pretrained: bool, **kwargs) -> LinHier:
    _require_local_file(variant, pretrained, kwargs)
    return create_pvt_like(PolaPvt, variant, pretrained, pvt_filter_fn, PVT_SIZES[size],
                           **merge_options(dict(token_mixers="pola_swin"), **kwargs))


# Published training used stochastic depth 0.1 (T and S); the models default to none, as timm's do.
@register_model
def pola_pvt_tiny(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_pola_pvt("pola_pvt_tiny", "tiny", pretrained, **kwargs)


@register_model
def pola_pvt_small(pretrained: bool = False, **kwargs) -> LinHier:
    return _create_pola_pvt("pola_pvt_small", "small", pretrained, **kwargs)
