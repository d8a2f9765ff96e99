"""Pola-Swin: Swin backbones with polarity-aware linear attention, loading the published ImageNet-1k weights.

Meng et al. 2025, "PolaFormer: Polarity-aware Linear Attention for Vision Transformers", ICLR 2025,
arXiv:2501.15061; reference code github.com/ZacharyMeng/PolaFormer (MIT licence; classification model
``PolaSwinTransformer``, configs ``cfgs/pola_swin_{t,s,b}.yaml``), weights on the Hugging Face hub repository
``ZachMeng/PolaFormer``.

The network is :class:`~linvision.models.linhier.LinHier` with Swin's layers: a 4x4 patch embedding of stride 4 with
LayerNorm, Swin's patch merging (2x2 neighbours concatenated, LayerNorm, a linear map to twice the channels)
between stages, pre-norm blocks without CPE or layer scale (LayerNorm eps 1e-5, timm's ``Mlp``), a final LayerNorm,
then mean pooling and a linear head. The stages are ``LLSS``:

- stages 1-2: ``"pola_swin"`` (registered here, :class:`PolaSwinAttention`): polarity-aware linear attention over
  the whole stage (at 224 px the authors' window of 56 holds the whole 56 x 56 and 28 x 28 maps), with a learned
  position encoding added to the keys, a 5x5 depthwise convolution of v shared by the heads, and the output
  modulation (attention + conv) * (W_g x) before the projection;
- stages 3-4: ``"swin_window"`` (:class:`SwinWindowAttention`): Swin's softmax attention in 7 x 7 windows with a
  learned relative position bias, the windows of every second block shifted by half a window.

At the training size every stage computes exactly the authors' model. At other sizes (any multiple of 32, square
or not) the linear stages still attend over the whole map, with the key position encoding resampled (bicubic,
antialiased) from its trained grid, and the window stages pad the map to whole windows, padded keys masked.
Evaluation as the authors' (Swin's): resize to 256/224 of the crop (bicubic), centre crop 224, ImageNet mean/std.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import Mlp, PatchEmbed, resample_abs_pos_embed, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models.swin_transformer import PatchMerging, get_relative_position_index
from torch import Tensor, nn

from linvision.layers import merge_options, register_mixer
from linvision.layers.mixers import AttentionMixer, window_merge, window_partition
from linvision.layers.variant_mixers import OutputModulation, PolaAttention
from linvision.ops import Rope

from .linhier import LinHier
from .published import build_published, load_published, published_cfg, require_weights, unwrap_state_dict

__all__ = ["PolaSwin", "PolaSwinAttention", "SwinWindowAttention", "HeadSharedConv", "checkpoint_filter_fn"]

HUB_ID = "ZachMeng/PolaFormer"
# The authors' main.py saves the weights under "model" (no EMA copy).
WEIGHT_KEYS = ("model", "state_dict")


class HeadSharedConv(nn.Module):
    """One depthwise k x k convolution of a head's D channels, applied to every head: (B, heads * D, H, W) ->
    the same shape (PolaFormer's ``dwc``; an ordinary per-channel LePE has heads times its weights)."""

    def __init__(self, head_dim: int, num_heads: int, kernel_size: int = 5):
        super().__init__()
        self.num_heads = num_heads
        self.conv = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        return self.conv(x.reshape(b * self.num_heads, c // self.num_heads, h, w)).reshape(b, c, h, w)


@register_mixer("pola_swin")
class PolaSwinAttention(OutputModulation, PolaAttention):
    """PolaFormer's block attention as Pola-Swin publishes it: ``"pola"`` (polarity-aware linear attention, power
    1 + alpha sigmoid(w) per head and channel, keys and queries divided by softplus(s) per channel, eps 1e-6), with

    - q, k, v and the modulation W_g x from one input (``qkv`` and ``gate``, the authors' ``qkvg`` split);
    - a learned position encoding added to the keys before the division (:meth:`set_key_position`; none until a
      model sets its grid), resampled to the input's grid when that differs;
    - a ``lepe_kernel`` x ``lepe_kernel`` (default 5) depthwise convolution of v whose weights every head shares
      (:class:`HeadSharedConv`), added to the attention output;
    - the output modulation (attention + conv) * (W_g x), no activation, then the projection.

    The ablation's ``"pola"`` has a per-channel 3x3 LePE, no modulation and no key position encoding. No prefix
    tokens (the key encoding is a grid's).
    """

    takes_prefix_tokens = False

    def __init__(self, dim: int, num_heads: int, *, lepe: bool = True, lepe_kernel: int = 5, gate: bool = True,
                 **kwargs):
        super().__init__(dim, num_heads, lepe=False, lepe_kernel=lepe_kernel, gate=gate, **kwargs)
        self.lepe = HeadSharedConv(self.head_dim, num_heads, lepe_kernel) if lepe else None
        self.key_pos: Optional[nn.Parameter] = None
        self.key_pos_grid: Optional[Tuple[int, int]] = None

    def set_key_position(self, grid: Tuple[int, int]) -> None:
        """Give the keys a learned position encoding of ``grid`` (H, W) (zeros, as the authors start it)."""
        self.key_pos_grid = (int(grid[0]), int(grid[1]))
        self.key_pos = nn.Parameter(torch.zeros(1, grid[0] * grid[1], self.dim))

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return super().no_weight_decay() | ({"key_pos"} if self.key_pos is not None else set())

    def key_position(self, hw: Tuple[int, int]) -> Tensor:
        """The key position encoding on grid ``hw``: (1, H * W, C), resampled when ``hw`` is not its own grid."""
        if tuple(hw) == self.key_pos_grid:
            return self.key_pos
        return resample_abs_pos_embed(self.key_pos, list(hw), list(self.key_pos_grid), num_prefix_tokens=0)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], rope: Optional[Rope], x: Tensor) -> Tensor:
        if self.key_pos is not None:
            b, nh, n, d = k.shape
            k = k + self.key_position(hw).to(k.dtype).reshape(1, n, nh, d).transpose(1, 2)
        return super().attend(q, k, v, hw, rope, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, key_pos_grid={self.key_pos_grid}"


@register_mixer("swin_window")
class SwinWindowAttention(AttentionMixer):
    """Swin's window attention: softmax attention (scale D^-1/2) inside ``window`` x ``window`` windows, with a
    learned bias per head and relative offset (``relative_position_bias_table``, (2 window - 1)^2 x heads).
    ``shift``: the windows are shifted by half a window (Swin's odd blocks; along an axis no longer than the
    window, nothing shifts), tokens brought together across the map's edge by the shift kept apart by a bias of
    -100, as Swin does. The map is padded at the bottom and right to whole windows; padded keys take no weight.
    No RoPE, no prefix tokens."""

    takes_prefix_tokens = False

    def __init__(self, dim: int, num_heads: int, *, window: int = 7, shift: bool = False, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
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

    def _bias(self, hw: Tuple[int, int], shifts: Tuple[int, int], device: torch.device, dtype: torch.dtype) -> Tensor:
        """(heads, windows, w*w, w*w): the relative position bias, -100 between tokens of different regions of
        the shifted map, -inf for padded keys."""
        area = self.window * self.window
        table = self.relative_position_bias_table.to(dtype)
        bias = table[self.relative_position_index].reshape(area, area, -1).permute(2, 0, 1)[:, None]
        (h, w), (sh, sw) = hw, shifts
        rows = (torch.arange(h, device=device) >= h - sh).long() if sh else torch.zeros(h, dtype=torch.long,
                                                                                         device=device)
        cols = (torch.arange(w, device=device) >= w - sw).long() if sw else torch.zeros(w, dtype=torch.long,
                                                                                         device=device)
        region = (rows[:, None] * 2 + cols[None, :]).to(dtype).reshape(1, 1, h * w, 1)
        windows, valid, _ = window_partition(region, hw, self.window)  # padded positions hold 0 and are invalid
        windows = windows[0, 0, :, :, 0]  # (nW, w*w)
        other = (windows[:, :, None] != windows[:, None, :]).to(dtype) * -100.0
        other = other.masked_fill(~valid[:, None, :], float("-inf"))
        return bias + other[None]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], rope: Optional[Rope], x: Tensor) -> Tensor:
        b, nh, n, d = q.shape
        h, w = hw
        shifts = self._shifts(hw)

        def roll(t: Tensor, sign: int) -> Tensor:
            if not any(shifts):
                return t
            grid = t.reshape(b, nh, h, w, d).roll((sign * shifts[0], sign * shifts[1]), dims=(2, 3))
            return grid.reshape(b, nh, n, d)

        qw, valid, padded = window_partition(roll(q, -1), hw, self.window)
        kw, _, _ = window_partition(roll(k, -1), hw, self.window)
        vw, _, _ = window_partition(roll(v, -1), hw, self.window)
        out = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=self._bias(hw, shifts, q.device, q.dtype))
        return roll(window_merge(out, hw, padded, self.window), 1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, shift={self.shift}"


def _stem(in_chans: int, dim: int) -> nn.Module:
    """Swin's patch embedding: a 4x4 conv of stride 4 and LayerNorm, channels-last out."""
    return PatchEmbed(None, 4, in_chans, dim, norm_layer=nn.LayerNorm, output_fmt="NHWC")


class PolaSwin(LinHier):
    """:class:`LinHier` with Swin's layers and PolaFormer's stages; loads the authors' files (timm's
    ``custom_load``). ``img_size``: the size whose stage grids the linear stages' key position encodings have
    (224: 56 x 56 and 28 x 28). The window side of the softmax stages: ``mixer_kwargs=dict(window=...)`` (7)."""

    mixer_defaults: Dict[str, Any] = dict(window=7)

    def __init__(self, *, img_size: Any = 224, **kwargs):
        super().__init__(img_size=img_size, **kwargs)
        size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        for i, stage in enumerate(self.stages):
            grid = (size[0] // (4 << i), size[1] // (4 << i))
            for j, block in enumerate(stage.blocks):
                if isinstance(block.mixer, PolaSwinAttention):
                    block.mixer.set_key_position(grid)
                if isinstance(block.mixer, SwinWindowAttention):
                    block.mixer.shift = j % 2 == 1

    def load_pretrained(self, path: str) -> None:
        load_published(self, path, checkpoint_filter_fn)


def _published_name(name: str) -> str:
    """linvision's name of a tensor of the authors' layout (``layers.i`` stages ending with their downsample)."""
    import re

    m = re.match(r"^layers\.(\d+)\.downsample\.(.*)$", name)
    if m:  # the merging at the end of stage i is the one at the start of stage i + 1 here
        return f"stages.{int(m.group(1)) + 1}.downsample.{m.group(2)}"
    for old, new in ((r"^patch_embed\.", "stem."), (r"^layers\.(\d+)\.blocks\.", r"stages.\1.blocks."),
                     (r"\.attn\.dwc\.", ".mixer.lepe.conv."),
                     (r"\.attn\.positional_encoding$", ".mixer.key_pos"), (r"\.attn\.", ".mixer."),
                     (r"^norm\.", "final."), (r"^head\.", "head.fc.")):
        name = re.sub(old, new, name)
    return name


def checkpoint_filter_fn(checkpoint: Dict[str, Any], model: LinHier) -> Dict[str, Tensor]:
    """The authors' checkpoint (weights under ``model``) in linvision's names: stage ``i``'s patch merging moves to
    the start of stage ``i + 1``; ``qkvg`` splits into the q/k/v projection and the modulation ``gate``; the per-
    channel scale and the power take the heads' shape; the key position encodings are resampled to the model's
    grids where it was built for another size; the relative position indices and the shift masks (buffers the
    model recomputes) are dropped. A state dict in linvision's own names passes unchanged."""
    state = unwrap_state_dict(checkpoint, WEIGHT_KEYS)
    if not any(k.startswith("layers.") for k in state):
        return state
    out = {}
    for name, value in state.items():
        if name.endswith((".relative_position_index", ".attn_mask")):
            continue
        new = _published_name(name)
        prefix, _, leaf = new.rpartition(".")
        if ".mixer." in new:
            try:
                mixer = model.get_submodule(new.split(".mixer.")[0] + ".mixer")
            except AttributeError:  # a block this model lacks: left as it is, reported as unexpected
                out[new] = value
                continue
            if ".mixer.qkvg." in new:
                c = mixer.dim
                out[new.replace(".qkvg.", ".qkv.")] = value[:3 * c]
                out[new.replace(".qkvg.", ".gate.")] = value[3 * c:]
                continue
            if leaf == "scale" and new.endswith(".mixer.scale"):
                out[prefix + ".qk_scale"] = value.reshape(mixer.num_heads, 1, mixer.head_dim)
                continue
            if leaf == "power":
                out[prefix + ".power_logit"] = value.reshape(mixer.num_heads, 1, mixer.head_dim)
                continue
            if leaf == "key_pos" and getattr(mixer, "key_pos_grid", None) is not None:
                n = value.shape[1]
                side = int(round(n ** 0.5))
                if (side, side) != mixer.key_pos_grid and side * side == n:
                    value = resample_abs_pos_embed(value, list(mixer.key_pos_grid), [side, side],
                                                   num_prefix_tokens=0)
        out[new] = value
    return out


def _cfg(top1: float) -> Dict[str, Any]:
    # The hub repository's file names are not recorded here: pretrained=True asks for a local copy
    # (pretrained_cfg_overlay=dict(file=...)); see the model cards.
    return published_cfg(
        top1, url="", first_conv="stem.proj", license="mit", paper_ids="arXiv:2501.15061",
        paper_name="PolaFormer: Polarity-aware Linear Attention for Vision Transformers",
        origin_url="https://github.com/ZacharyMeng/PolaFormer",
    )


default_cfgs = generate_default_cfgs({
    "pola_swin_tiny.in1k": _cfg(82.6),
    "pola_swin_small.in1k": _cfg(83.6),
    "pola_swin_base.in1k": _cfg(83.8),
})

SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(depths=(2, 2, 6, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)),
    "small": dict(depths=(2, 2, 18, 2), dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24)),
    "base": dict(depths=(2, 2, 18, 2), dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32)),
}


def _create_pola_swin(variant: str, size: str, pretrained: bool, **kwargs) -> LinHier:
    require_weights(variant, pretrained, kwargs,
                    hint=f"download the authors' file from https://huggingface.co/{HUB_ID} (its file names are "
                         f"not recorded here) and pass it")
    args = dict(token_mixers="pola_swin,pola_swin,swin_window,swin_window", stem_layer=_stem,
                downsample_layer=partial(PatchMerging, norm_layer=nn.LayerNorm), norm_layer=nn.LayerNorm,
                cpe=False, mlp_layer=Mlp, final_layer=nn.LayerNorm)
    return build_published(PolaSwin, variant, pretrained, checkpoint_filter_fn,
                           **merge_options(SIZES[size], args, **kwargs))


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
