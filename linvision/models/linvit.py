"""Isotropic (ViT/DeiT-shaped) backbones with linear attention.

Patch embedding (16x16), optional prefix tokens (a class token, register tokens), ``depth`` pre-norm blocks
(:class:`linvision.layers.MixerBlock` without CPE) ``x + drop_path(mixer(norm1(x), (H, W)))``,
``x + drop_path(mlp(norm2(x)))``, a final norm, pooling and a linear head. Shapes follow DeiT (Touvron et al.
2021, arXiv:2012.12877): tiny 192 wide with 3 heads, small 384 / 6, base 768 / 12, all 12 blocks deep.

The head follows timm's VisionTransformer, with its option names and defaults: ``class_token`` (default True)
and ``reg_tokens`` put prefix tokens before the patch tokens (their position-embedding rows too, unless
``no_embed_class``); ``global_pool`` is "token" (the class token, the default), "avg" (the mean of the patch
tokens), "max", "avgmax" or "" (the tokens); ``fc_norm`` moves the final norm after the pooling (default None,
as timm's: after it for "avg", "max" and "avgmax", so ``global_pool="avg"`` normalises the mean of the tokens;
``fc_norm=False`` takes the mean of the normalised tokens instead). The prefix tokens go through every mixer as
tokens (RoPE leaves them unrotated), so only mixers that take prefix tokens
(:func:`linvision.layers.mixer_accepts` ``"prefix_tokens"``) build with them; a mixer that works on the grid (windows,
convolutions, scans) needs ``class_token=False, global_pool="avg"``. The class token is the default because it
measured better: pooling it instead of the mean of the normalised patch tokens took the softmax twin from 2.7
points below timm's ViT-Tiny/8 to level with it (photo crops, 3 seeds; docs/results.md, "The isotropic family
against timm's ViT").

Position information comes from either
- a learned absolute position embedding (``rope=None``): the model runs at the size it was built for (its
  pretrained_cfg says ``fixed_input_size=True``, as for timm's ViTs, so timm builds it at the size asked for);
  ``dynamic_img_size=True`` resamples the embedding to every input's grid instead, or
- 2D RoPE inside every attention mixer (``rope="axial"`` or ``"mixed"``, RoPE-ViT, Heo et al. 2024,
  arXiv:2403.13298), with no absolute embedding: the weights fit any grid and aspect ratio.

A model never goes without either. The ``*_rope_*`` entry points' RoPE is a default: with a mixer that has no
``rope`` option (the ``bidir_*`` scans, ``gated_cnn``) they build the learned absolute embedding instead,
resampled to every input's grid (``dynamic_img_size=True`` unless the caller sets it), so the model still takes
any grid, and say so in one UserWarning line (``rope="none"`` asks for it without one). A ``rope`` the caller gives
must fit the mixer: ValueError in one line, naming the option and the mixer, otherwise; ``rope="none"`` to a
``*_rope_*`` entry point whose mixer takes RoPE is refused too, naming the plain variant to use instead.

There are no linvit weights of its own (``pretrained=True`` without a tag fails and says so): the ``.deit_fb_in1k``
tags point at timm's DeiT softmax weights of the same shape, which ``checkpoint_filter_fn`` converts
(:func:`~linvision.models.vit_weights.convert_vit_state_dict`) into the start of linearization
(``linvision.experiments.linearize``); a local copy loads with ``pretrained_cfg_overlay=dict(file=...)``.

The ``*_pola_*`` entry points are the plain ones with PolaFormer's mixer (``token_mixer="pola"``, LePE on): in a
ViT-Tiny trained from scratch on fine-grained photos it came level with its softmax twin at the training size and
ahead at 1.5x and 2x, where plain linear attention trailed (3 seeds; docs/results.md, "ViT-Tiny on fine-grained
photographs").

The token mixer is one argument (``token_mixer="softmax"`` for the softmax twin of a model); the model hands
its ``rope`` to whatever mixer it builds, so the twin sees positions the same way.
"""
from __future__ import annotations

import pickle
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from safetensors import SafetensorError
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
import torch.nn.functional as F
from timm.layers import (Format, LayerNorm, PatchEmbed, global_pool_nlc, nchw_to, resample_abs_pos_embed,
                         trunc_normal_)
from timm.models.naflexvit import global_pool_naflex
from timm.models import build_model_with_cfg, generate_default_cfgs
from timm.models._features import feature_take_indices

from linvision.layers import (MixerBlock, RecomputeMlp, TokenLayout, check_prefix_tokens, init_model_weights,
                              merge_options, mixer_options, no_weight_decay_of, parse_mixer_list, stage_mixer_options)
from linvision.layers.mixers import ROPE_TYPES
from linvision.layers.options import check_images

from .entry_points import entry_point
from .published import explain_failed_download, require_weights
from .vit_weights import checkpoint_filter_fn

__all__ = ["LinViT"]


def _patchify(embed: PatchEmbed, x: Tensor) -> Tensor:
    """timm's ``PatchEmbed.forward`` after its size assertions, which :func:`check_images` has made: the assertions'
    messages format the height and width, which under torch.compile(dynamic=True) fixes them in the graph (each
    new resolution recompiled)."""
    x = embed.proj(x)
    if embed.flatten:
        x = x.flatten(2).transpose(1, 2)
    elif embed.output_fmt != Format.NCHW:
        x = nchw_to(x, embed.output_fmt)
    return embed.norm(x)


class LinViT(nn.Module):
    """Isotropic backbone with a swappable token mixer.

    Args:
        img_size: training size; fixes the absolute position embedding grid (unused with RoPE).
        patch_size: side of the square patches (as in timm's VisionTransformer, as are the next nine).
        in_chans: input channels.
        num_classes: classes of the head (0: no head).
        embed_dim: width C.
        depth: number of blocks.
        num_heads: heads of every mixer.
        mlp_ratio: MLP hidden size / embed_dim.
        drop_rate: dropout before the head.
        proj_drop_rate: dropout inside the blocks.
        drop_path_rate: stochastic depth of the last block (linear over blocks).
        global_pool: 'token' (the class token; default), 'avg' (mean over patch tokens), 'max', 'avgmax' or ''
            (forward_head returns the tokens), as timm's VisionTransformer.
        class_token: a learned class token before the patch tokens (default, as timm's ViT; needed by
            global_pool='token').
        reg_tokens: number of learned register tokens after the class token (Darcet et al. 2024).
        no_embed_class: the position embedding covers the patch tokens only (DeiT-III); otherwise it has rows for
            the prefix tokens too (timm's and DeiT's ViT).
        fc_norm: the final norm after the pooling instead of before it; None (default, as timm's
            VisionTransformer): after the pooling for 'avg', 'max' and 'avgmax', before it for 'token' and ''.
        token_mixer: a registered mixer name ("linear", "linear_rope", "softmax", "causal", "hybrid", "gated_cnn", ...)
            or a mixer class (built as ``cls(dim, num_heads, **mixer_kwargs)``); or one per block, ``depth``
            comma-separated names or a sequence (e.g. linear attention with softmax in the last quarter).
        mixer_kwargs: extra options for the mixer (e.g. feature_map="relu", lepe=True).
        rope: None or "none" (absolute position embedding), "axial" or "mixed" (2D RoPE in the mixer); the mixer
            must have a ``rope`` option for the last two.
        pos_embed: the learned absolute position embedding, as timm's VisionTransformer names it: "learn" (one),
            "none" (none), or None (default): "learn" without RoPE, "none" with it. "learn" beside RoPE is EVA-02's
            pairing; the embedding is then resampled to every input's grid, so the model still takes any size.
        dynamic_img_size: resample the absolute position embedding to the input's grid at every call.
        norm_layer: the blocks' norm (also the final one).
        act_layer: the MLP's activation.
        mlp_layer: the MLP class, as :class:`~linvision.layers.MixerBlock` builds it.
        embed_layer: the patch embedding, built as timm's ``PatchEmbed`` (img_size, patch_size, in_chans,
            embed_dim, output_fmt="NHWC", strict_img_size=...), with its ``patch_size`` and ``grid_size``.
    Raises ValueError for an unknown rope or global_pool, a rope the mixer has no option for, global_pool='token'
    without a class token, prefix tokens with a mixer that cannot take them, or an img_size that is not a
    multiple of the patch size (whatever the position information: the grid would leave pixels out).
    """

    pos_embed_antialias = True  # how the absolute position embedding is resampled (timm's default: antialiased)

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        class_token: bool = True,
        reg_tokens: int = 0,
        no_embed_class: bool = False,
        fc_norm: Optional[bool] = None,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        token_mixer: Union[str, Type[nn.Module]] = "linear",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        rope: Optional[str] = None,
        pos_embed: Optional[str] = None,
        dynamic_img_size: bool = False,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: Type[nn.Module] = LayerNorm,
        act_layer: Type[nn.Module] = nn.GELU,
        embed_layer: Callable[..., nn.Module] = PatchEmbed,
        mlp_layer: Type[nn.Module] = RecomputeMlp,
    ):
        super().__init__()
        mixers = parse_mixer_list(token_mixer, depth, "token_mixer", "blocks")
        rope, learned = _position_options(rope, pos_embed, token_mixer)
        _check_pool(global_pool, class_token)
        if isinstance(reg_tokens, bool) or not isinstance(reg_tokens, int) or reg_tokens < 0:
            raise ValueError(f"reg_tokens: must be an int >= 0, got {reg_tokens!r}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = int(class_token) + reg_tokens
        self.no_embed_class = no_embed_class
        for mixer in dict.fromkeys(mixers):
            check_prefix_tokens(mixer, self.num_prefix_tokens)
        self.dynamic_img_size = dynamic_img_size
        self.rope = rope
        self.token_mixer = token_mixer

        self.patch_embed = embed_layer(
            img_size, patch_size, in_chans, embed_dim, output_fmt="NHWC",
            strict_img_size=learned and rope is None and not dynamic_img_size,
        )
        _check_grid(self.patch_embed)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        embed_len = self.patch_embed.num_patches + (0 if no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim)) if learned else None
        # the RoPE variant reaches the mixer (checked above to take it); the caller's options must all fit the mixer
        options = stage_mixer_options(mixers, mixer_kwargs, dict(rope=rope) if rope is not None else None)
        rates = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()
        self.blocks = nn.Sequential(*[
            MixerBlock(embed_dim, num_heads, mixers[i], options[i], mlp_ratio, rates[i], proj_drop_rate,
                       norm_layer=norm_layer, act_layer=act_layer, mlp_layer=mlp_layer)
            for i in range(depth)
        ])
        reduction = self.patch_embed.patch_size[0]
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=reduction) for i in range(depth)]
        use_fc_norm = global_pool in ("avg", "max", "avgmax") if fc_norm is None else fc_norm
        self.norm = nn.Identity() if use_fc_norm else norm_layer(embed_dim)
        self.fc_norm = norm_layer(embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False

        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        init_model_weights(self)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """The position embedding, the prefix tokens and what the mixers exclude (mixed-RoPE frequencies, hybrid
        gate logits)."""
        own = {n for n in ("pos_embed", "cls_token", "reg_token") if getattr(self, n) is not None}
        return no_weight_decay_of(self) | own

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r"^cls_token|^reg_token|^pos_embed|^patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            _check_pool(global_pool, self.cls_token is not None)
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def _embed(self, x: Tensor) -> Tuple[Tensor, Tuple[int, int]]:
        """(B, C_in, H, W) -> (tokens (B, prefix + H/p * W/p, C) with the absolute position embedding added, the
        patch grid (H/p, W/p)); timm's ViT order: class token, register tokens, patch tokens in raster order."""
        embed = self.patch_embed  # the sizes timm's PatchEmbed asserts, checked in one line (ViG's stem takes any)
        strict, padded = getattr(embed, "strict_img_size", False), getattr(embed, "dynamic_img_pad", True)
        check_images(x, self.in_chans, size=embed.img_size if strict else None,
                     multiple=None if strict or padded else embed.patch_size)
        x = _patchify(embed, x) if type(embed) is PatchEmbed and not (strict or padded) else embed(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        prefix = [t.expand(b, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.pos_embed is None:
            return (torch.cat(prefix + [x], dim=1) if prefix else x), (h, w)
        pos = self.pos_embed
        if self.dynamic_img_size or self.rope is not None:
            # timm's resampler returns the embedding unchanged on the training grid; it is an FX leaf, so the grid
            # comparison stays out of the traced path. A RoPE model takes any size, its embedding too.
            pos = resample_abs_pos_embed(pos, new_size=(h, w), old_size=self.patch_embed.grid_size,
                                         num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens,
                                         antialias=self.pos_embed_antialias)
        if self.no_embed_class or not prefix:
            x = x + pos
            return (torch.cat(prefix + [x], dim=1) if prefix else x), (h, w)
        return torch.cat(prefix + [x], dim=1) + pos, (h, w)

    @torch.jit.ignore
    def get_patch_size(self) -> Tuple[int, int]:
        """(patch height, patch width), as timm's NaFlex loader asks a model."""
        return tuple(self.patch_embed.patch_size)

    def _embed_patches(self, patches: Tensor, patch_coord: Tensor,
                       patch_valid: Optional[Tensor]) -> Tuple[Tensor, TokenLayout]:
        """timm's NaFlex batch -> (tokens (B, prefix + N, C), their layout): the patches (B, N, P*P*C_in), each
        flattened as (row in patch, column in patch, channel) like timm's patchify, through the patch
        embedding's weights as a linear map (the same map its convolution applies to an image), the prefix tokens
        before them, and the absolute position embedding resampled to each image's own grid (as
        ``dynamic_img_size`` resamples it for one image) and read at each patch's (row, col)."""
        layout = TokenLayout.from_patches(patch_coord, patch_valid)
        proj = self.patch_embed.proj
        ph, pw = self.patch_embed.patch_size
        if patches.dim() == 5:  # (B, N, ph, pw, C): timm's unflattened channels-last patches
            patches = patches.flatten(2)
        width = ph * pw * self.in_chans
        if patches.dim() != 3 or patches.shape[-1] != width or patches.shape[:2] != patch_coord.shape[:2]:
            raise ValueError(f"patches: expected (B, N, {ph}*{pw}*{self.in_chans}) = (B, N, {width}) beside "
                             f"patch_coord {tuple(patch_coord.shape)}, got {tuple(patches.shape)}")
        weight = proj.weight.permute(0, 2, 3, 1).reshape(proj.out_channels, width)  # the (ph, pw, c) order
        x = self.patch_embed.norm(F.linear(patches, weight, proj.bias))
        b = x.shape[0]
        prefix = [t.expand(b, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.pos_embed is not None:
            x, prefix_pos = x + self._naflex_pos_embed(layout), None
            if prefix and not self.no_embed_class:
                prefix_pos = self.pos_embed[:, : self.num_prefix_tokens]
            if prefix_pos is not None:
                prefix = [torch.cat(prefix, dim=1) + prefix_pos]
        return (torch.cat(prefix + [x], dim=1) if prefix else x), layout

    def _naflex_pos_embed(self, layout: TokenLayout) -> Tensor:
        """(B, N, C): the grid rows of the absolute position embedding resampled to each sample's grid, at each
        patch's (row, col); zeros at padding."""
        p = 0 if self.no_embed_class else self.num_prefix_tokens
        grid_rows = self.pos_embed[:, p:]
        out = grid_rows.new_zeros(*layout.valid.shape, self.embed_dim)
        for size in sorted(set(layout.sizes)):
            table = resample_abs_pos_embed(grid_rows, new_size=size, old_size=self.patch_embed.grid_size,
                                           num_prefix_tokens=0)[0]  # (h * w, C)
            for i in (i for i, s in enumerate(layout.sizes) if s == size):
                index = layout.positions[i, :, 0] * size[1] + layout.positions[i, :, 1]
                out[i] = table[index].masked_fill(~layout.valid[i, :, None], 0)
        return out

    def _run_blocks(self, x: Tensor, hw: Tuple[int, int], blocks: nn.Sequential, take: Optional[List[int]] = None,
                    norm: bool = False, layout: Optional[TokenLayout] = None) -> Tuple[Tensor, List[Tensor]]:
        intermediates = []
        p = self.num_prefix_tokens
        args = (hw, p) if layout is None else (hw, p, layout)
        for i, blk in enumerate(blocks):
            x = checkpoint(blk, x, *args, use_reentrant=False) if self.grad_checkpointing else blk(x, *args)
            if take is not None and i in take:
                intermediates.append(self.norm(x) if norm else x)
        return x, intermediates

    def forward_intermediates(
        self,
        x: Union[Tensor, Dict[str, Tensor]],
        indices: Optional[Union[int, List[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        patch_coord: Optional[Tensor] = None,
        patch_valid: Optional[Tensor] = None,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """Block outputs of the patch tokens, as timm's VisionTransformer. indices: last n blocks (int), all (None)
        or the listed ones; return_prefix_tokens: each intermediate is (patch tokens, prefix tokens (B, P, C));
        norm: apply the final norm to them; output_fmt: 'NCHW' (B, C, H/p, W/p) or 'NLC' (B, N, C).
        A NaFlex batch (a dict, or patches with ``patch_coord``) gives 'NLC' intermediates in its patch order
        (the images' grids differ: place them with patch_coord).
        Returns intermediates, or (forward_features output, intermediates). Raises ValueError for another
        output_fmt, or 'NCHW' with a NaFlex batch."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt: {output_fmt!r}; allowed: 'NCHW', 'NLC'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        naflex = _naflex_inputs(x, patch_coord, patch_valid)
        if naflex is not None and output_fmt == "NCHW":
            raise ValueError("output_fmt: 'NCHW' needs one grid for the batch; a NaFlex batch (images of different "
                             "sizes) gives output_fmt='NLC', placed by patch_coord")
        if naflex is not None:
            x, layout = self._embed_patches(*naflex)
            (h, w) = layout.canvas
        else:
            (x, (h, w)), layout = self._embed(x), None
        x, intermediates = self._run_blocks(x, (h, w), blocks, take_indices, norm, layout)
        p = self.num_prefix_tokens
        prefix_tokens = [y[:, :p] for y in intermediates]
        intermediates = [y[:, p:] for y in intermediates] if p else intermediates
        if output_fmt == "NCHW":
            intermediates = [y.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens and p:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True,
    ) -> List[int]:
        """Drop blocks after the last needed one; optionally the final norm and the head."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: Union[Tensor, Dict[str, Tensor]], patch_coord: Optional[Tensor] = None,
                         patch_valid: Optional[Tensor] = None) -> Union[Tensor, Dict[str, Tensor]]:
        """(B, in_chans, H, W) -> tokens (B, prefix + H/p * W/p, C): the prefix tokens, then the patch tokens in
        raster order, through the final norm (unless ``fc_norm`` moved it after the pooling). A NaFlex batch (timm's
        dict of ``patches``, ``patch_coord``, ``patch_valid``, or those as arguments) -> {"patches": tokens (B,
        prefix + N, C), "patch_valid": (B, N)}, as timm's NaFlexVit returns it: each image's tokens are those
        it gets alone at its own size."""
        naflex = _naflex_inputs(x, patch_coord, patch_valid)
        if naflex is not None:
            x, layout = self._embed_patches(*naflex)
            x, _ = self._run_blocks(x, layout.canvas, self.blocks, layout=layout)
            return {"patches": self.norm(x), "patch_valid": layout.valid}
        x, hw = self._embed(x)
        x, _ = self._run_blocks(x, hw, self.blocks)
        return self.norm(x)

    def forward_head(self, x: Union[Tensor, Dict[str, Tensor]], pre_logits: bool = False,
                     patch_valid: Optional[Tensor] = None) -> Tensor:
        """Pooling (over the valid patches only, given ``patch_valid`` or forward_features' NaFlex dict), the
        norm after it, dropout and the classifier."""
        if isinstance(x, dict):
            x, patch_valid = x["patches"], x.get("patch_valid", patch_valid)
        if patch_valid is None:
            x = global_pool_nlc(x, pool_type=self.global_pool, num_prefix_tokens=self.num_prefix_tokens)
        else:
            x = global_pool_naflex(x, patch_valid.bool(), pool_type=self.global_pool,
                                   num_prefix_tokens=self.num_prefix_tokens)
        x = self.fc_norm(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Union[Tensor, Dict[str, Tensor]], patch_coord: Optional[Tensor] = None,
                patch_valid: Optional[Tensor] = None) -> Tensor:
        """Images (B, in_chans, H, W), or a NaFlex batch of images of different sizes (timm's dict, or
        ``patches`` with ``patch_coord`` and ``patch_valid``) -> logits (B, num_classes)."""
        return self.forward_head(self.forward_features(x, patch_coord, patch_valid))


_POOLS = ("", "avg", "max", "avgmax", "token")


def _naflex_inputs(x, patch_coord: Optional[Tensor], patch_valid: Optional[Tensor]):
    """(patches, patch_coord, patch_valid) of a NaFlex call (timm's dict, or patches with patch_coord), None for
    images. ValueError for a dict without patches or patch_coord."""
    if isinstance(x, dict):
        missing = [key for key in ("patches", "patch_coord") if key not in x]
        if missing:
            raise ValueError(f"x: a NaFlex batch holds 'patches', 'patch_coord' and 'patch_valid'; missing "
                             f"{', '.join(map(repr, missing))}")
        return x["patches"], x["patch_coord"], x.get("patch_valid", patch_valid)
    if patch_coord is None or isinstance(patch_coord, torch.fx.Proxy):  # FX traces the image path
        if patch_valid is not None and not isinstance(patch_valid, torch.fx.Proxy):
            raise ValueError("patch_valid: given without patch_coord")
        return None
    return x, patch_coord, patch_valid


def _has_rope(token_mixer: Union[str, Type[nn.Module]]) -> bool:
    """Whether the mixer, or every one of several comma-separated names, has a ``rope`` option."""
    names = [n.strip() for n in token_mixer.split(",")] if isinstance(token_mixer, str) else (
        [token_mixer] if isinstance(token_mixer, type) else list(token_mixer))
    return all("rope" in mixer_options(n) for n in names)


def _mixer_name(token_mixer: Union[str, Type[nn.Module]]) -> str:
    return token_mixer if isinstance(token_mixer, str) else getattr(token_mixer, "__name__", repr(token_mixer))


def _check_grid(embed: nn.Module) -> None:
    """ValueError in one line unless the patch grid covers the built size exactly: an ``img_size`` that is not a
    multiple of the patch size would build a grid that drops the last rows and columns of every image (a patch
    embedding that pads, ``dynamic_img_pad``, or has no such option, as ViG's convolutional stem, covers any
    size); the same rule as the check of every input in ``LinViT._embed``."""
    if getattr(embed, "dynamic_img_pad", True):
        return
    (h, w), (ph, pw) = embed.img_size, embed.patch_size
    if h % ph or w % pw:
        lower = f"{max(ph, h // ph * ph)}x{max(pw, w // pw * pw)}"
        upper = f"{-(-h // ph) * ph}x{-(-w // pw) * pw}"
        raise ValueError(f"img_size: height and width must be multiples of the patch size {ph}x{pw}, got {h}x{w} "
                         f"(the patch grid would leave out {h % ph} rows and {w % pw} columns of pixels); use "
                         f"{lower} or {upper}")


def _check_pool(global_pool: str, class_token: bool) -> None:
    if global_pool not in _POOLS:
        raise ValueError(f"global_pool: {global_pool!r}; allowed: {', '.join(repr(p) for p in _POOLS)}")
    if global_pool == "token" and not class_token:
        raise ValueError("global_pool: 'token' pools the class token; build the model with class_token=True")


def _position_options(rope: Optional[str], pos_embed: Optional[str], token_mixer) -> Tuple[Optional[str], bool]:
    """(the RoPE variant or None, whether the model has a learned absolute embedding) from LinViT's ``rope`` and
    ``pos_embed``; ValueError in one line for an unknown value or a RoPE the mixer has no option for."""
    rope = None if rope == "none" else rope  # the spelling that survives timm.create_model, which drops None
    if rope not in ROPE_TYPES:
        raise ValueError(f"rope: unknown {rope!r}; allowed: {ROPE_TYPES}")
    if rope is not None and not _has_rope(token_mixer):
        raise ValueError(f"rope: {rope!r} is not an option of the {_mixer_name(token_mixer)} mixer (it has no "
                         "RoPE); build it with rope=None, a learned absolute position embedding")
    if pos_embed not in (None, "learn", "none"):
        raise ValueError(f"pos_embed: unknown {pos_embed!r}; allowed: 'learn', 'none' or None (learn without "
                         "RoPE, none with it)")
    return rope, (rope is None) if pos_embed is None else pos_embed == "learn"


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
            fixed_input_size=variant != "_rope", description=_DEIT,
        )
        for size in ("tiny", "small", "base") for variant in ("", "_rope", "_pola")
    },
    "linvit_small_patch16_rope_mixed_224.deit_fb_in1k": _cfg(
        hf_hub_id="timm/deit_small_patch16_224.fb_in1k", license="apache-2.0", description=_DEIT),
    "linvit_tiny_patch16_224.*": _cfg(fixed_input_size=True),
    "linvit_small_patch16_224.*": _cfg(fixed_input_size=True),
    "linvit_base_patch16_224.*": _cfg(fixed_input_size=True),
    "linvit_tiny_patch16_pola_224.*": _cfg(fixed_input_size=True),
    "linvit_small_patch16_pola_224.*": _cfg(fixed_input_size=True),
    "linvit_base_patch16_pola_224.*": _cfg(fixed_input_size=True),
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
        with explain_failed_download(variant, pretrained, kwargs, "docs/models/linvit.md"):  # offline: one line
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
_POLA = dict(token_mixer="pola")  # the design of the ViT-Tiny ablation on fine-grained photos (docs/results.md)


def _rope_options(variant: str, *defaults: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]:
    """merge_options for the RoPE entry points, whose ``rope`` is a default. The rule, one of three cases:

    - the mixer takes RoPE (a ``rope`` option): the model has RoPE; ``rope="none"`` (or None, which
      timm.create_model drops) contradicts the entry point and fails in one line naming the plain variant;
    - the mixer takes no RoPE (the ``bidir_*`` scans, ``gated_cnn``): the model gets the learned absolute position
      embedding in place of RoPE, resampled to every input's grid unless the caller sets ``dynamic_img_size``, as
      the RoPE variants take any grid; it says so in one UserWarning line unless the caller asked ``rope="none"``;
    - another ``rope`` the caller gives stays, and LinViT refuses it for a mixer without RoPE.
    A ``rope`` in the caller's mixer_kwargs is left to the mixer."""
    args = merge_options(*defaults, **kwargs)
    if "rope" in (args.get("mixer_kwargs") or {}):
        return args
    mixer, given = args.get("token_mixer", "linear"), "rope" in kwargs
    no_rope = given and kwargs["rope"] in (None, "none")  # timm.create_model drops a None: "none" says it there
    if _has_rope(mixer):
        if no_rope:
            plain = variant.replace("_rope_mixed", "").replace("_rope", "")
            raise ValueError(f"rope: {kwargs['rope']!r} asks {variant} for no RoPE, but its {_mixer_name(mixer)} "
                             f"mixer takes RoPE; use {plain} for a learned absolute position embedding")
        return args
    if given and not no_rope:
        return args  # LinViT refuses it in one line, naming the option and the mixer
    if not given:
        warnings.warn(f"{variant}: the {_mixer_name(mixer)} mixer takes no RoPE, so the model has a learned absolute "
                      "position embedding instead (rope='none' asks for it without this warning)",
                      UserWarning, stacklevel=3)
    args["rope"] = None
    args.setdefault("dynamic_img_size", True)
    if not args["dynamic_img_size"]:  # a fixed absolute embedding: the cfg says so, as for the plain variants
        args["pretrained_cfg_overlay"] = dict(args.get("pretrained_cfg_overlay") or {}, fixed_input_size=True)
    return args


@entry_point(_create_linvit, _TINY)
def linvit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Tiny/16 (DeiT's sizes) with linear attention and a learned absolute position embedding."""


@entry_point(_create_linvit, _SMALL)
def linvit_small_patch16_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Small/16 with linear attention and a learned absolute position embedding."""


@entry_point(_create_linvit, _BASE)
def linvit_base_patch16_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Base/16 with linear attention and a learned absolute position embedding."""


@entry_point(_create_linvit, _TINY, _POLA)
def linvit_tiny_patch16_pola_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Tiny/16 with PolaFormer's attention (LePE on)."""


@entry_point(_create_linvit, _SMALL, _POLA)
def linvit_small_patch16_pola_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Small/16 with PolaFormer's attention (LePE on)."""


@entry_point(_create_linvit, _BASE, _POLA)
def linvit_base_patch16_pola_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Base/16 with PolaFormer's attention (LePE on)."""


@entry_point(_create_linvit, _TINY, _ROPE, options=_rope_options)
def linvit_tiny_patch16_rope_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Tiny/16 with linear attention, 2D axial RoPE and LePE, no absolute embedding."""


@entry_point(_create_linvit, _SMALL, _ROPE, options=_rope_options)
def linvit_small_patch16_rope_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Small/16 with linear attention, 2D axial RoPE and LePE, no absolute embedding."""


@entry_point(_create_linvit, _BASE, _ROPE, options=_rope_options)
def linvit_base_patch16_rope_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Base/16 with linear attention, 2D axial RoPE and LePE, no absolute embedding."""


@entry_point(_create_linvit, _SMALL, _ROPE, dict(rope="mixed"), options=_rope_options)
def linvit_small_patch16_rope_mixed_224(pretrained: bool = False, **kwargs) -> LinViT:
    """ViT-Small/16 with linear attention and 2D RoPE of learnable per-head frequencies (RoPE-ViT mixed)."""
