"""CSWin's macro-architecture on :class:`~linvision.models.linhier.LinHier`, for the published InLine-CSwin
backbones (:mod:`linvision.models.inline`).

Dong et al. 2022, "CSWin Transformer: A General Vision Transformer Backbone with Cross-Shaped Windows",
arXiv:2107.00652. The layers: a 7x7 conv of stride 4 (padding 2) and LayerNorm (:class:`CswinStem`); a 3x3 conv of
stride 2 and LayerNorm between stages (LinHier's :class:`~linvision.models.linhier.Downsample`); pre-norm blocks
without CPE or layer scale (LayerNorm eps 1e-5, timm's ``Mlp``); a final LayerNorm, the mean and a linear head.
Softmax stages use ``"cswin_stripes"`` (:class:`CswinStripeAttention`, registered here): half the heads attend
inside vertical stripes of the map, the other half inside horizontal ones, each with a LePE of v inside its
stripe. CSWin's last stage, whose map is a single stripe at 224 px, attends over the whole map: ``"softmax"``
with ``lepe=True``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import Tensor, nn

from linvision.layers import check_size, merge_options, pad_to_kernel, register_mixer
from linvision.layers.mixers import AttentionMixer
from linvision.ops import Rope, is_tracing

from .linhier import Downsample, LinHier
from .published import build_published, map_mixer_groups, unwrap_state_dict

__all__ = ["CswinStripeAttention", "CswinStem", "cswin_published_name", "cswin_checkpoint_filter",
           "create_cswin_like"]


@register_mixer("cswin_stripes")
class CswinStripeAttention(AttentionMixer):
    """CSWin's cross-shaped window attention: softmax attention (scale D^-1/2), the first half of the heads inside
    vertical stripes ``stripe`` tokens wide and the whole map high, the second half inside horizontal stripes
    ``stripe`` tokens high and the whole map wide; to each stripe's output a ``lepe_kernel`` x ``lepe_kernel``
    (3) depthwise convolution of its v (zero padding at the stripe's edges: LePE, ``stripe_lepe``, one kernel
    per channel; none with ``lepe=False``) is added. A map that is
    not a whole number of stripes is padded at the right / bottom, padded keys taking no weight. No RoPE, no
    prefix tokens (CSWin's whole-map last stage is ``"softmax"`` with ``lepe=True``)."""

    takes_prefix_tokens = False
    exports_fixed_grid = True  # the stripe count and padding follow the size: exported at one size

    def __init__(self, dim: int, num_heads: int, *, stripe: int = 7, lepe: bool = True, lepe_kernel: int = 3,
                 **kwargs):
        # its LePE is the stripes' own (stripe_lepe), not the mixer's of the whole map (lepe=False)
        super().__init__(dim, num_heads, lepe_kernel=lepe_kernel, **kwargs)
        if self.rope_type is not None:
            raise ValueError(f"rope: cswin_stripes places tokens by its LePE, not RoPE; got {self.rope_type!r}")
        check_size("stripe", stripe)
        if num_heads % 2:
            raise ValueError(f"num_heads: cswin_stripes splits the heads between vertical and horizontal stripes, "
                             f"so needs an even count, got {num_heads}")
        self.stripe = stripe
        self.stripe_lepe = nn.Conv2d(dim, dim, lepe_kernel, padding=lepe_kernel // 2, groups=dim) if lepe else None

    def _branch(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], vertical: bool,
                weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
        """Attention inside the stripes of one direction for q, k, v (B, h, N, D); the LePE with ``weight``
        (h * D, 1, k, k) and ``bias`` inside each stripe (none when ``weight`` is None)."""
        b, nh, n, d = q.shape
        h, w = hw
        s = self.stripe
        pad_h, pad_w = (0, -w % s) if vertical else (-h % s, 0)
        hp, wp = h + pad_h, w + pad_w

        count = wp // s if vertical else hp // s  # stripes per image

        def stripes(t: Tensor) -> Tensor:  # (B, h, N, D) -> (B * stripes, h, tokens of a stripe, D)
            th, td = t.shape[1], t.shape[3]
            t = F.pad(t.reshape(b, th, h, w, td), (0, 0, 0, pad_w, 0, pad_h))
            if vertical:  # (B, h, H, W / s, s, D) -> (B, W / s, h, H, s, D)
                t = t.reshape(b, th, hp, count, s, td).permute(0, 3, 1, 2, 4, 5)
            else:  # (B, h, H / s, s, W, D) -> (B, H / s, h, s, W, D)
                t = t.reshape(b, th, count, s, wp, td).permute(0, 2, 1, 3, 4, 5)
            return t.reshape(b * count, th, hp * wp // count, td)

        qs, ks, vs = stripes(q), stripes(k), stripes(v)
        mask = None
        # padded keys take no weight: (B * stripes, 1, 1, tokens); always built in a traced graph, which holds for
        # every size (whether a size pads is not asked of a symbolic size)
        if is_tracing(n) or pad_h or pad_w:
            real = stripes(torch.ones(b, 1, n, 1, dtype=q.dtype, device=q.device)) > 0
            mask = real[..., 0][:, :, None, :]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        if weight is not None:
            sh, sw = (hp, s) if vertical else (s, wp)
            grid = vs.transpose(2, 3).reshape(b * count, nh * d, sh, sw)  # channel head * D + i, per stripe
            lepe = F.conv2d(grid, weight, bias, padding=weight.shape[-1] // 2, groups=nh * d)
            out = out + lepe.reshape(b * count, nh, d, sh * sw).transpose(2, 3)
        # back to the map: (B * stripes, h, tokens, D) -> (B, h, N, D)
        if vertical:
            out = out.reshape(b, count, nh, hp, s, d).permute(0, 2, 3, 1, 4, 5).reshape(b, nh, hp, wp, d)
        else:
            out = out.reshape(b, count, nh, s, wp, d).permute(0, 2, 1, 3, 4, 5).reshape(b, nh, hp, wp, d)
        return out[:, :, :h, :w].reshape(b, nh, n, d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hw: Tuple[int, int], rope: Optional[Rope], x: Tensor) -> Tensor:
        half, c = self.num_heads // 2, self.dim // 2
        weight = bias = (None, None)
        if self.stripe_lepe is not None:
            w, b = self.stripe_lepe.weight.to(v.dtype), self.stripe_lepe.bias.to(v.dtype)
            weight, bias = (w[:c], w[c:]), (b[:c], b[c:])
        vertical = self._branch(q[:, :half], k[:, :half], v[:, :half], hw, True, weight[0], bias[0])
        horizontal = self._branch(q[:, half:], k[:, half:], v[:, half:], hw, False, weight[1], bias[1])
        return torch.cat([vertical, horizontal], dim=1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stripe={self.stripe}"


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
                norm_layer=nn.LayerNorm, cpe=False, mlp_layer=Mlp, final_layer=nn.LayerNorm)
    return build_published(model_cls, variant, pretrained, filter_fn, **merge_options(sizes, args, **kwargs))
