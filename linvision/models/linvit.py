"""Isotropic (ViT/DeiT-shaped) backbones with linear attention.

Patch embedding (16x16), ``depth`` pre-norm blocks (:class:`linvision.layers.MixerBlock` without CPE)
``x + drop_path(mixer(norm1(x), (H, W)))``, ``x + drop_path(mlp(norm2(x)))``, a final norm, global average pooling over the patch tokens (no class
token) and a linear head. Shapes follow DeiT (Touvron et al. 2021, arXiv:2012.12877): tiny 192 wide with 3
heads, small 384 / 6, base 768 / 12, all 12 blocks deep.

Position information comes from either
- a learned absolute position embedding (``rope=None``): the model runs at the size it was built for (its
  pretrained_cfg says ``fixed_input_size=True``, as for timm's ViTs, so timm builds it at the size asked for);
  ``dynamic_img_size=True`` resamples the embedding to every input's grid instead, or
- 2D RoPE inside every attention mixer (``rope="axial"`` or ``"mixed"``, RoPE-ViT, Heo et al. 2024,
  arXiv:2403.13298), with no absolute embedding: the weights fit any grid and aspect ratio.

There are no linvit weights of its own (``pretrained=True`` without a tag fails and says so): the ``.deit_fb_in1k``
tags point at timm's DeiT softmax weights of the same shape, which ``checkpoint_filter_fn`` converts (:func:`convert_vit_state_dict`) into the start of
linearization (``linvision.engine.linearize``); a local copy loads with ``pretrained_cfg_overlay=dict(file=...)``.

The token mixer is one argument (``token_mixer="softmax"`` for the softmax twin of a model); the model hands
its ``rope`` to whatever mixer it builds, so the twin sees positions the same way.
"""
from __future__ import annotations

import math
import pickle
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from safetensors import SafetensorError
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import LayerNorm, PatchEmbed, resample_abs_pos_embed, resample_patch_embed, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from linvision.layers import MixerBlock, init_linear_weights, mixer_options, no_weight_decay_of
from linvision.layers.mixers import ROPE_TYPES

from .published import require_weights

__all__ = ["LinViT", "checkpoint_filter_fn", "convert_vit_state_dict"]


class LinViT(nn.Module):
    """Isotropic backbone with a swappable token mixer.

    Args:
        img_size: training size; fixes the absolute position embedding grid (unused with RoPE).
        patch_size, in_chans, num_classes, embed_dim, depth, num_heads, mlp_ratio, drop_rate (before the
            head), proj_drop_rate, drop_path_rate (linear over blocks): as in timm's VisionTransformer.
        global_pool: 'avg' (mean over patch tokens) or '' (forward_head returns the tokens).
        token_mixer: a registered mixer name ("linear", "linear_rope", "softmax", "causal", "hybrid", "none", ...)
            or a mixer class (built as ``cls(dim, num_heads, **mixer_kwargs)``).
        mixer_kwargs: extra options for the mixer (e.g. feature_map="relu", lepe=True).
        rope: None (absolute position embedding), "axial" or "mixed" (2D RoPE in the mixer, no absolute
            embedding); passed to the mixer when it has a ``rope`` option.
        dynamic_img_size: resample the absolute position embedding to the input's grid at every call.
    Raises ValueError for an unknown rope or global_pool.
    """

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        token_mixer: Union[str, Type[nn.Module]] = "linear",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        rope: Optional[str] = None,
        dynamic_img_size: bool = False,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: Type[nn.Module] = LayerNorm,
        act_layer: Type[nn.Module] = nn.GELU,
    ):
        super().__init__()
        if rope not in ROPE_TYPES:
            raise ValueError(f"rope: unknown {rope!r}; allowed: {ROPE_TYPES}")
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool: {global_pool!r}; allowed: 'avg', ''")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 0
        self.dynamic_img_size = dynamic_img_size
        self.rope = rope
        self.token_mixer = token_mixer

        self.patch_embed = PatchEmbed(
            img_size, patch_size, in_chans, embed_dim, output_fmt="NHWC",
            strict_img_size=rope is None and not dynamic_img_size,
        )
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim)) if rope is None else None
        )
        options = dict(mixer_kwargs or {})
        if rope is not None and "rope" in mixer_options(token_mixer):
            options["rope"] = rope
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.Sequential(*[
            MixerBlock(embed_dim, num_heads, token_mixer, options, mlp_ratio, rates[i], proj_drop_rate,
                       norm_layer=norm_layer, act_layer=act_layer)
            for i in range(depth)
        ])
        reduction = self.patch_embed.patch_size[0]
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=reduction) for i in range(depth)]
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False

        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=0.02)
        self.apply(init_linear_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """The position embedding and what the mixers exclude (mixed-RoPE frequencies, hybrid gate logits)."""
        return no_weight_decay_of(self) | ({"pos_embed"} if self.pos_embed is not None else set())

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r"^pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in ("avg", ""):
                raise ValueError(f"global_pool: {global_pool!r}; allowed: 'avg', ''")
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def _embed(self, x: Tensor) -> Tensor:
        """(B, C_in, H, W) -> patch tokens (B, H/p, W/p, C) with the absolute position embedding added."""
        x = self.patch_embed(x)
        if self.pos_embed is None:
            return x
        b, h, w, c = x.shape
        pos = self.pos_embed
        if self.dynamic_img_size:
            # timm's resampler returns the embedding unchanged on the training grid; it is an FX leaf, so the grid
            # comparison stays out of the traced path.
            pos = resample_abs_pos_embed(pos, new_size=(h, w), old_size=self.patch_embed.grid_size,
                                         num_prefix_tokens=0)
        return x + pos.reshape(1, h, w, c)

    def _run_blocks(self, x: Tensor, blocks: nn.Sequential, take: Optional[List[int]] = None,
                    norm: bool = False) -> Tuple[Tensor, List[Tensor]]:
        intermediates = []
        for i, blk in enumerate(blocks):
            x = checkpoint(blk, x, use_reentrant=False) if self.grad_checkpointing else blk(x)
            if take is not None and i in take:
                intermediates.append(self.norm(x) if norm else x)
        return x, intermediates

    def forward_intermediates(
        self,
        x: Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """Block outputs. indices: last n blocks (int), all (None) or the listed ones; norm: apply the final
        norm to them; output_fmt: 'NCHW' (B, C, H/p, W/p) or 'NLC' (B, N, C).
        Returns intermediates, or (forward_features output, intermediates). Raises ValueError for another
        output_fmt."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt: {output_fmt!r}; allowed: 'NCHW', 'NLC'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        x, intermediates = self._run_blocks(self._embed(x), blocks, take_indices, norm)
        if output_fmt == "NCHW":
            intermediates = [y.permute(0, 3, 1, 2).contiguous() for y in intermediates]
        else:
            intermediates = [y.flatten(1, 2) for y in intermediates]
        if intermediates_only:
            return intermediates
        return self.norm(x).flatten(1, 2), intermediates

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True,
    ) -> List[int]:
        """Drop blocks after the last needed one; optionally the final norm and the head."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) -> normalised tokens (B, H/p * W/p, C) in raster order."""
        x, _ = self._run_blocks(self._embed(x), self.blocks)
        return self.norm(x).flatten(1, 2)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


# Silu(b) = b * sigmoid(b) = 1: an output gate with zero weights and this bias passes the attention output unchanged.
_IDENTITY_GATE_BIAS = 1.2784645427610738


def _is_softmax_vit(state_dict: Dict[str, Tensor]) -> bool:
    """A timm VisionTransformer state dict (DeiT, AugReg ViT, ...): attention weights under ``blocks.i.attn``."""
    return any(k.startswith("blocks.") and ".attn.qkv." in k for k in state_dict)


def _strip_prefix_rows(pos_embed: Tensor, num_prefix_tokens: int, name: str = "pos_embed") -> Tensor:
    """Drop the rows of a ViT position embedding (1, prefix + H*W, C) that belong to class / register tokens;
    embeddings without them (DeiT-III's ``no_embed_class``) are returned as they are."""
    n = pos_embed.shape[1]
    for prefix in (num_prefix_tokens, 0):
        side = math.isqrt(n - prefix)
        if side * side == n - prefix:
            return pos_embed[:, prefix:]
    raise ValueError(f"{name}: {n} rows are not a square grid with or without {num_prefix_tokens} prefix rows")


def convert_vit_state_dict(state_dict: Dict[str, Tensor], model: LinViT) -> Dict[str, Tensor]:
    """Map a timm softmax VisionTransformer state dict onto ``model`` (the start of linearization).

    - patch_embed, blocks.i.norm1 / norm2 / mlp, norm and head keep their names; blocks.i.attn.qkv and attn.proj
      become blocks.i.mixer.qkv and mixer.proj; layer-scale factors (blocks.i.ls1 / ls2.gamma) are folded into
      attn.proj and mlp.fc2 (exact).
    - cls_token and reg_token are dropped (linvit has no prefix tokens and pools the patch tokens by their
      mean; the head, trained on the class token, is kept as a starting point). The position embedding loses its
      prefix-token rows and is resampled to the model's grid; models with RoPE (no absolute embedding) drop it.
    - Parameters a softmax ViT does not have start where the block computes what the teacher's attention
      computes as nearly as it can: LePE at zero (it adds nothing), an output gate at weight 0 and
      bias b with silu(b) = 1 (it passes the attention through); feature-map and RoPE parameters keep the
      model's own initialisation.
    Raises ValueError for teacher weights this mapping cannot carry (q/k norms, a pre-norm, fc_norm, other
    depths or widths).
    """
    model_state = model.state_dict()
    num_prefix = sum(state_dict[k].shape[1] for k in ("cls_token", "reg_token") if k in state_dict)
    gammas = {k: v for k, v in state_dict.items() if k.endswith((".ls1.gamma", ".ls2.gamma"))}
    out: Dict[str, Tensor] = {}
    unsupported = []
    for name, value in state_dict.items():
        if name in ("cls_token", "reg_token") or name in gammas:
            continue
        if name == "pos_embed":
            if model.pos_embed is None:
                continue
            value = _strip_prefix_rows(value, num_prefix)
            if value.shape != model.pos_embed.shape:
                value = resample_abs_pos_embed(value, new_size=model.patch_embed.grid_size, num_prefix_tokens=0)
            out[name] = value
            continue
        target = name.replace(".attn.qkv.", ".mixer.qkv.").replace(".attn.proj.", ".mixer.proj.")
        if target not in model_state and not target.startswith("head."):
            unsupported.append(name)
            continue
        for layer_scale, module in ((".ls1.gamma", ".mixer.proj."), (".ls2.gamma", ".mlp.fc2.")):
            if module in target:
                gamma = gammas.get(target.split(module)[0] + layer_scale)
                if gamma is not None:
                    value = value * (gamma[:, None] if value.dim() == 2 else gamma)
        expected = model_state.get(target)
        if expected is not None and not target.startswith(("head.", "patch_embed.proj.weight")) \
                and value.shape != expected.shape:
            raise ValueError(f"state_dict: {name} has shape {tuple(value.shape)}, {target} of this model is "
                             f"{tuple(expected.shape)} (a softmax ViT of another width?)")
        out[target] = value
    if unsupported:
        raise ValueError(f"state_dict: softmax ViT weights linvit has no place for: {', '.join(unsupported[:8])}"
                         + (" ..." if len(unsupported) > 8 else ""))
    for name, value in model_state.items():
        if name in out or name.startswith("head."):
            continue
        if ".mixer.lepe." in name:
            value = torch.zeros_like(value)
        elif ".mixer.gate.weight" in name:
            value = torch.zeros_like(value)
        elif ".mixer.gate.bias" in name:
            value = torch.full_like(value, _IDENTITY_GATE_BIAS)
        elif ".mixer." not in name:
            raise ValueError(f"state_dict: the softmax ViT has no {name!r} (another depth or layout?)")
        out[name] = value
    return out


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: LinViT) -> Dict[str, Tensor]:
    """Unwrap training checkpoints, convert timm softmax ViT weights (:func:`convert_vit_state_dict`) and
    resample what depends on the resolution: the absolute position embedding (bicubic, to the model's patch grid)
    and the patch-embedding kernel (to the model's patch size)."""
    for key in ("state_dict_ema", "model_ema", "model", "state_dict"):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
            break
    if _is_softmax_vit(state_dict):
        state_dict = convert_vit_state_dict(state_dict, model)
    out = {}
    for name, value in state_dict.items():
        if name == "pos_embed" and model.pos_embed is not None and value.shape != model.pos_embed.shape:
            value = resample_abs_pos_embed(value, new_size=model.patch_embed.grid_size, num_prefix_tokens=0)
        elif name == "patch_embed.proj.weight" and value.shape[-2:] != model.patch_embed.proj.weight.shape[-2:]:
            value = resample_patch_embed(value, model.patch_embed.patch_size)
        out[name] = value
    return out


def _cfg(**kwargs) -> Dict[str, Any]:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "test_input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "mit",
        **kwargs,
    }


# The absolute-position variants run at the size they were built for (timm reads fixed_input_size to build them at
# the size asked for, as for its own ViTs); the RoPE variants run at any multiple of the patch size.
# Linearization starts: DeiT's softmax ViT weights of the same shape, converted by checkpoint_filter_fn. Their
# attention was trained as softmax attention, so they are not trained classifiers of these models: each model's
# default is its untagged cfg, which names no weights (pretrained=True without a tag fails and says so). timm makes
# the first tag with weights the default unless a tag ending in "*" comes after it, hence this order.
_DEIT = "DeiT's softmax weights, converted: a start for linearization, not a trained linear-attention model"
default_cfgs = generate_default_cfgs({
    **{
        f"linvit_{size}_patch16{variant}_224.deit_fb_in1k": _cfg(
            hf_hub_id=f"timm/deit_{size}_patch16_224.fb_in1k", license="apache-2.0",
            fixed_input_size=not variant, description=_DEIT,
        )
        for size in ("tiny", "small", "base") for variant in ("", "_rope")
    },
    "linvit_small_patch16_rope_mixed_224.deit_fb_in1k": _cfg(
        hf_hub_id="timm/deit_small_patch16_224.fb_in1k", license="apache-2.0", description=_DEIT),
    "linvit_tiny_patch16_224.*": _cfg(fixed_input_size=True),
    "linvit_small_patch16_224.*": _cfg(fixed_input_size=True),
    "linvit_base_patch16_224.*": _cfg(fixed_input_size=True),
    "linvit_tiny_patch16_rope_224.*": _cfg(),
    "linvit_small_patch16_rope_224.*": _cfg(),
    "linvit_base_patch16_rope_224.*": _cfg(),
    "linvit_small_patch16_rope_mixed_224.*": _cfg(),
})


def _create_linvit(variant: str, pretrained: bool = False, **kwargs) -> LinViT:
    out_indices = kwargs.pop("out_indices", 3)
    if kwargs.get("dynamic_img_size"):  # the embedding is resampled per call: the cfg must not fix the size
        kwargs["pretrained_cfg_overlay"] = dict(kwargs.get("pretrained_cfg_overlay") or {}, fixed_input_size=False)
    source = kwargs.get("pretrained_cfg")  # a dict from timm.create_model; a PretrainedCfg or a tag when called directly
    file = (kwargs.get("pretrained_cfg_overlay") or {}).get("file") or (
        source.get("file") if isinstance(source, dict) else getattr(source, "file", None))
    require_weights(variant, pretrained, kwargs, hint=f"'{variant}.deit_fb_in1k' loads DeiT's softmax weights "
                    "converted as the start of linearization (not a trained linear-attention classifier)")
    try:
        return build_model_with_cfg(
            LinViT, variant, pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
            **kwargs,
        )
    except (ValueError, RuntimeError, EOFError, OSError, pickle.UnpicklingError, SafetensorError) as e:
        if not (pretrained and file):
            raise
        raise ValueError(f"pretrained_cfg file {file!r}: cannot load it into {variant} "
                         f"(truncated, not a checkpoint, or weights of another shape): {e}") from e


_TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
_SMALL = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
_BASE = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
_ROPE = dict(token_mixer="linear_rope", rope="axial")


@register_model
def linvit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_linvit("linvit_tiny_patch16_224", pretrained, **dict(_TINY, **kwargs))


@register_model
def linvit_small_patch16_224(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_linvit("linvit_small_patch16_224", pretrained, **dict(_SMALL, **kwargs))


@register_model
def linvit_base_patch16_224(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_linvit("linvit_base_patch16_224", pretrained, **dict(_BASE, **kwargs))


@register_model
def linvit_tiny_patch16_rope_224(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_linvit("linvit_tiny_patch16_rope_224", pretrained, **dict(_TINY, **_ROPE) | kwargs)


@register_model
def linvit_small_patch16_rope_224(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_linvit("linvit_small_patch16_rope_224", pretrained, **dict(_SMALL, **_ROPE) | kwargs)


@register_model
def linvit_base_patch16_rope_224(pretrained: bool = False, **kwargs) -> LinViT:
    return _create_linvit("linvit_base_patch16_rope_224", pretrained, **dict(_BASE, **_ROPE) | kwargs)


@register_model
def linvit_small_patch16_rope_mixed_224(pretrained: bool = False, **kwargs) -> LinViT:
    args = dict(_SMALL, **_ROPE) | dict(rope="mixed")
    return _create_linvit("linvit_small_patch16_rope_mixed_224", pretrained, **args | kwargs)
