"""Token mixers: linear attention (with optional 2D RoPE, LePE and output gate), softmax attention, causal
linear attention, local-window softmax + global linear attention, and the Gated CNN of MambaOut; RAVLT's
softmax stages (``"ravlt_softmax"``) and the two mixins several mechanisms share (:class:`OutputModulation`,
:class:`RavltRope`).

Every mixer is built as ``cls(dim, num_heads, **options)`` and called as ``mixer(x, ctx)``: tokens x (B, N, C)
on the grid ``ctx.hw`` = (H, W), N = H * W in raster order, to (B, N, C) (:class:`~linvision.layers.MixerContext`).
The grid is given at call time, so a mixer runs at any resolution and aspect ratio with the same weights. A mixer
whose class ``accepts`` ``"prefix_tokens"`` also takes a context with ``num_prefix_tokens=P``: x then holds P
prefix tokens (class and register tokens, as in timm's ViT) before the
H * W grid tokens. They are mixed as tokens like any other; RoPE leaves them unrotated and LePE, a convolution on
the grid, adds nothing to them. Mixers that work on the grid itself (windows, convolutions, scans along the
raster order) do not take them and say so.

The attention mixers share one skeleton (:class:`AttentionMixer`): a qkv projection, optional 2D RoPE
(axial: fixed frequencies; mixed: learnable frequencies per head), optional LePE (3x3 depthwise conv on V
added to the output, Ren et al. 2023 / CSWin), optional output gate (SiLU of a linear projection of the
input, as in MLLA's Mamba-like block) and an output projection. Subclasses differ only in how q, k, v are
combined, so swapping "linear" for "softmax" in a model changes nothing but the mixing itself.

Sources: MLLA (Han et al. 2024, "Demystify Mamba in Vision: A Linear Attention Perspective",
arXiv:2405.16605); RoPE-ViT (Heo et al. 2024, arXiv:2403.13298); Infini-attention (Munkhdalai et al. 2024,
arXiv:2404.07143) for the gated local + global mix; MambaOut (Yu & Wang 2024, arXiv:2405.07992).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linvision.ops import (
    GATE_ACTIVATIONS,
    FeatureMap,
    FocusedFeatureMap,
    PerformerFeatureMap,
    Rope,
    apply_rope,
    axial_rope,
    axial_rope_freqs,
    check_grid,
    get_feature_map,
    interpolate_positions,
    interpolation_scale,
    linear_attention,
    mixed_rope_freqs,
    rope_at,
    softmax_attention,
)
from linvision.ops.common import FEATURE_MAPS, feature_map_name, feature_maps_where
from linvision.ops.feature_maps import orthogonal_random_projection

from .derived import derived
from .context import MixerContext
from .layout import TokenLayout
from .options import check_number, check_size, check_square_grid, lepe_size
from .recompute import gated_linear
from .registry import TokenMixer, register_mixer, run_attend

__all__ = [
    "check_feature_map",
    "ROPE_TYPES",
    "ROPE_ORIGINS",
    "EPS_FORMS",
    "LAYER_FEATURE_MAPS",
    "AttentionMixer",
    "LinearAttention",
    "LinearRopeAttention",
    "SoftmaxAttention",
    "OutputModulation",
    "RavltRope",
    "RavltSoftmax",
    "CausalLinearAttention",
    "HybridAttention",
    "GatedConvMixer",
]

ROPE_TYPES = (None, "axial", "mixed")
ROPE_ORIGINS = ("corner", "centre")
# The maps of the normalised attention mixers (linear, hybrid, rala, mala): the non-negative ones of the table
# linvision.ops.common.FEATURE_MAPS. Causal and recurrent mixers take those of them that are also causal.
LAYER_FEATURE_MAPS = feature_maps_where(nonnegative=True)
EPS_FORMS = ("mean", "sum")


def check_feature_map(feature_map: str, **needs: bool) -> str:
    """The canonical name of ``feature_map`` (lower case, an alias such as "elu+1" as "elu") if it names a map of
    :data:`linvision.ops.common.FEATURE_MAPS` with every property in ``needs`` (e.g. ``nonnegative=True`` for a
    normalised attention, ``causal=True`` for a scan), else ValueError naming the allowed maps, at construction
    rather than in the first forward."""
    name = feature_map_name(feature_map) if isinstance(feature_map, str) else None
    allowed = feature_maps_where(**needs)
    if name in FEATURE_MAPS and name not in allowed:
        missing = [key for key, value in needs.items() if bool(getattr(FEATURE_MAPS[name], key)) != value]
        raise ValueError(f"feature_map: {name!r} does not fit this mixer (it needs a map that is "
                         f"{' and '.join(missing)}); allowed: {', '.join(allowed)}")
    if name not in allowed:
        raise ValueError(f"feature_map: unknown {feature_map!r}; allowed: {', '.join(allowed)}")
    return name


class AttentionMixer(TokenMixer):
    """Skeleton of the attention mixers; subclasses implement :meth:`attend`.

    Args:
        dim: channels C (divisible by ``num_heads``).
        num_heads: heads; head dim D = C / num_heads.
        rope: None, "axial" (fixed frequencies) or "mixed" (learnable per-head frequencies); needs D % 4 == 0.
        rope_theta: base of the axial frequencies (default 100, RoPE-ViT; MLLA and RAVLT use 10000).
        rope_row_first: the first half of the axial channel pairs follows the row (MLLA, RAVLT), not the column.
        rope_fraction: the fraction of the axial channel pairs that turn (default 1, all; the rest carry no
            position, :func:`~linvision.ops.axial_rope_freqs`' ``rotate``); axial RoPE only.
        rope_origin: where the grid's position (0, 0) lies, and so where the unrotated prefix tokens (class
            token) sit as RoPE sees them: "corner" (the first patch, RoPE-ViT's convention) or "centre" (the
            middle of each image's grid). Tokens of the grid see each other the same either way: without prefix
            tokens the outputs are equal.
        rope_ref_grid: position interpolation, an int or (rows, cols), usually the grid the model is trained
            on: on another H x W grid a token at (row, col) turns as at (row * rows / H, col * cols / W), so every
            grid spans the reference grid's extent, as a learned absolute embedding resampled to the grid does
            (:func:`~linvision.ops.interpolation_scale`; timm's ``ref_feat_shape``). On the reference grid
            itself the mixer computes exactly what it computes without the option. Default None: positions as
            they are (a larger grid reaches angles the model never saw).
        lepe: add a depthwise conv of V (on the grid) to the attention output; lepe_kernel its size (default 3;
            refused without lepe).
        gate: multiply the attention output (with LePE) by act(W_g x) before the output projection; act is the
            class's :meth:`gate_activation` (SiLU here, MLLA's gate; RALA's output modulation has none).
        qkv_bias: bias of the qkv projection.
        proj_drop: dropout after the output projection.
    Raises ValueError for a bad dim/num_heads pair, an unknown ``rope``, an even lepe_kernel or one without lepe.

    What a subclass may change besides :meth:`attend`: :meth:`build_qkv` / :meth:`project` (how q, k, v come
    from x), :meth:`build_proj` (the output projection), :meth:`make_rope` (the rotation of a grid) and
    :meth:`gate_activation`. Each mechanism's module of :mod:`linvision.layers` holds its ablation form and its
    published form together (pola, inline, rala, mala, agent, mlla, window, cswin; Sana's beside its block in
    :mod:`linvision.diffusion.block`).

    Training memory: the :class:`~linvision.layers.TokenMixer` contract's ``recompute_attend``, True here (the
    attention mixers' default): a subclass whose ``attend`` builds per-token tensors beyond q, k, v (features,
    augmented copies, gates, states) has :meth:`attend` run under activation checkpointing, so those tensors
    are recomputed in the backward and not kept for every layer; the linear and softmax mixers keep nothing of
    their own already and set it False. ``split_value_proj``: v is projected apart from q and k (the same
    weights), for an attention that keeps its own copies of q and k (softmax with RoPE).
    """

    recompute_attend = True  # the TokenMixer policy (False there); forward() checkpoints attend() under it
    split_value_proj = False
    gate_act = "silu"  # the output gate's activation, a name of linvision.ops.GATE_ACTIVATIONS
    rope_endpoint = False  # axial frequencies theta^(-i / (D/4)); True: theta^-linspace(0, 1, D/4) (RAVLT's)
    accepts = frozenset({"prefix_tokens"})  # subclasses whose mixing depends on the grid take none

    def __init__(
        self, dim: int, num_heads: int, *, rope: Optional[str] = None, rope_theta: float = 100.0,
        rope_row_first: bool = False, rope_fraction: float = 1.0, rope_origin: str = "corner",
        rope_ref_grid: Optional[Union[int, Tuple[int, int]]] = None, lepe: bool = False,
        lepe_kernel: Optional[int] = None, gate: bool = False, qkv_bias: bool = True, proj_drop: float = 0.0,
    ):
        super().__init__()
        check_size("dim", dim)
        if check_size("num_heads", num_heads) and dim % num_heads != 0:
            raise ValueError(f"num_heads: {num_heads} must be >= 1 and divide dim={dim}")
        check_number("proj_drop", proj_drop, 0.0, 1.0, closed_low=True)
        if rope not in ROPE_TYPES:
            raise ValueError(f"rope: unknown {rope!r}; allowed: {ROPE_TYPES}")
        if not 0.0 < rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction: the fraction of channel pairs that turn must be in (0, 1], got "
                             f"{rope_fraction}")
        if rope_fraction != 1.0 and rope != "axial":
            raise ValueError(f"rope_fraction: only axial RoPE turns a fraction of its channels; rope is {rope!r}")
        if rope_origin not in ROPE_ORIGINS:
            raise ValueError(f"rope_origin: unknown {rope_origin!r}; allowed: {', '.join(ROPE_ORIGINS)}")
        if rope_ref_grid is not None:
            if rope is None:
                raise ValueError("rope_ref_grid: position interpolation needs RoPE; rope is None")
            rope_ref_grid = check_square_grid("rope_ref_grid", rope_ref_grid)
        lepe_kernel = lepe_size(lepe, lepe_kernel, 3)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.rope_type = rope
        self.rope_axial = dict(theta=rope_theta, row_first=rope_row_first, rotate=rope_fraction,  # axial_rope's
                               **({"endpoint": True} if self.rope_endpoint else {}))
        self.rope_origin = rope_origin
        self.rope_ref_grid = rope_ref_grid
        if rope is not None and self.rope_dim % 4 != 0:
            raise ValueError(f"rope: 2D RoPE needs a (feature) head dim divisible by 4, got {self.rope_dim}")
        self.qkv = self.build_qkv(dim, qkv_bias)
        if rope == "mixed":
            fx, fy = mixed_rope_freqs(self.rope_dim, num_heads)
            self.rope_freqs_x = nn.Parameter(fx)  # (heads, D/2)
            self.rope_freqs_y = nn.Parameter(fy)
        self.lepe = nn.Conv2d(dim, dim, lepe_kernel, padding=lepe_kernel // 2, groups=dim) if lepe else None
        self.gate = nn.Linear(dim, dim) if gate else None
        self.proj = self.build_proj(dim)
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def rope_dim(self) -> int:
        """Head dim that RoPE rotates (the head dim; linear attention rotates phi(q), phi(k) of that size)."""
        return self.head_dim

    def build_qkv(self, dim: int, bias: bool) -> nn.Module:
        """The input projection ``qkv`` (q, k, v side by side, 3C channels); :meth:`project` reads it."""
        return nn.Linear(dim, 3 * dim, bias=bias)

    def build_proj(self, dim: int) -> nn.Module:
        """The output projection ``proj``."""
        return nn.Linear(dim, dim)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Names (relative to this mixer) of parameters weight decay must leave alone: learnable RoPE
        frequencies; subclasses add their own. Models collect these with :func:`no_weight_decay_of`."""
        return {"rope_freqs_x", "rope_freqs_y"} if self.rope_type == "mixed" else set()

    def make_rope(self, hw: Tuple[int, int], device: torch.device, num_prefix_tokens: int = 0) -> Optional[Rope]:
        """The rotation for grid ``hw`` after ``num_prefix_tokens`` unrotated tokens (None without RoPE): one
        axial table per head dim, shared by every head, or the learnable frequencies of each head (kept in the
        autograd graph)."""
        if self.rope_type is None:
            return None
        offset = self._rope_offset(hw, num_prefix_tokens)
        if self.rope_type == "axial":
            return axial_rope(self.rope_dim, hw, num_prefix_tokens=num_prefix_tokens, device=device, num_heads=1,
                              offset=offset, ref_grid=self.rope_ref_grid, **self.rope_axial)
        scale = interpolation_scale(hw, self.rope_ref_grid)  # None on the reference grid: the parameters as they are
        if scale is None:
            return Rope(self.rope_freqs_x, self.rope_freqs_y, hw, num_prefix_tokens, offset)
        return Rope(self.rope_freqs_x * scale[1], self.rope_freqs_y * scale[0], hw, num_prefix_tokens, offset)

    def _rope_offset(self, hw: Tuple[int, int], num_prefix_tokens: int) -> Tuple[float, float]:
        """The shift of the grid positions that puts (0, 0) where ``rope_origin`` says (only prefix tokens see it)."""
        if self.rope_origin == "corner" or not num_prefix_tokens:
            return (0.0, 0.0)
        return (-(hw[0] - 1) / 2, -(hw[1] - 1) / 2)

    def make_rope_at(self, positions: Tensor, num_prefix_tokens: int = 0) -> Optional[Rope]:
        """The rotation of tokens at their own (row, col) (``positions`` (B, M, 2), images of different sizes in
        one batch), with the frequencies :meth:`make_rope` uses; None without RoPE."""
        if self.rope_type is None:
            return None
        positions = interpolate_positions(positions, self.rope_ref_grid)  # unchanged without the option
        if self.rope_origin == "centre" and num_prefix_tokens:  # each image's own centre (padding sits at 0)
            positions = positions - positions.amax(dim=1, keepdim=True).to(torch.float32) / 2
        if self.rope_type == "axial":
            fx, fy = axial_rope_freqs(self.rope_dim, num_heads=1, **self.rope_axial)
            return rope_at(fx.to(positions.device), fy.to(positions.device), positions, num_prefix_tokens)
        return rope_at(self.rope_freqs_x, self.rope_freqs_y, positions, num_prefix_tokens)

    def project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """x (B, N, C) -> q, k, v, each (B, N, C) with the heads' D channels side by side."""
        if self.split_value_proj and self.rope_type is not None:
            # v on its own: the attention keeps v and the rotated q, k for the backward; q, k are then free
            c = x.shape[-1]
            weight, bias = self.qkv.weight, self.qkv.bias
            q, k = F.linear(x, weight[:2 * c], None if bias is None else bias[:2 * c]).chunk(2, dim=-1)
            return q, k, F.linear(x, weight[2 * c:], None if bias is None else bias[2 * c:])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return q, k, v

    def gate_activation(self, g: Tensor) -> Tensor:
        """The activation of the output gate, named by the class's ``gate_act`` (of
        :data:`linvision.ops.GATE_ACTIVATIONS`): SiLU here."""
        return GATE_ACTIVATIONS[self.gate_act](g)

    def use_feature_map(self, feature_map: str, **needs: bool) -> None:
        """Set ``self.feature_map`` to the canonical name of ``feature_map``, checked by :func:`check_feature_map`
        against ``needs``, and keep what the table says the map holds: a random map's draw (Performer's projection)
        as the persistent buffer ``performer_projection`` (saved with the weights, the same on every call, redrawn
        only by :meth:`redraw_feature_map`), a learnable map's tensor (the focused map's per-channel scale) as the
        parameter ``focus_scale``. A map that holds nothing is resolved here, once."""
        self.feature_map = check_feature_map(feature_map, **needs)
        info = FEATURE_MAPS[self.feature_map]
        projection = orthogonal_random_projection(self.head_dim, self.head_dim) if info.random else None
        self.register_buffer("performer_projection", projection, persistent=info.random)
        self.focus_scale = nn.Parameter(torch.zeros(self.head_dim)) if info.learnable else None
        self._named_phi = None if info.stateful else get_feature_map(self.feature_map)

    def phi(self) -> FeatureMap:
        """The feature map named by ``feature_map``, reading this mixer's tensors (Performer's projection, the
        focused map's scale)."""
        if self.performer_projection is not None:
            return PerformerFeatureMap(self.head_dim, projection=self.performer_projection)
        if self.focus_scale is not None:
            return FocusedFeatureMap(scale=self.focus_scale)
        return self._named_phi

    @torch.no_grad()
    def redraw_feature_map(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new Performer projection in place (as Performer redraws during training); ValueError for a
        mixer whose feature map has no random draw."""
        if getattr(self, "performer_projection", None) is None:
            raise ValueError(f"redraw_feature_map: the feature map {getattr(self, 'feature_map', None)!r} of "
                             f"{type(self).__name__} draws nothing; only 'performer' has a projection to redraw")
        self.phi().redraw(generator)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        """q, k, v: (B, heads, N, D) -> (B, heads, N, D). x: the mixer's input tokens (B, N, C), for mixers whose
        mixing depends on the data beyond q, k, v (e.g. forget gates). ctx: the call's context with ``hw`` the
        grid the tokens lie on (with a layout, the canvas every image fits in)."""
        raise NotImplementedError

    def mix(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """x: (B, N, C) tokens, ``ctx.num_prefix_tokens`` prefix tokens then the grid ``ctx.hw`` -> (B, N, C); or,
        with ``ctx.layout``, the prefix tokens then each sample's tokens where the layout puts them. Raises
        ValueError for a token count that does not fit."""
        p, layout = ctx.num_prefix_tokens, ctx.layout
        b, n, c = x.shape
        if layout is None:
            h, w = check_grid(ctx.hw, n - p, name="hw")
            rope = self.make_rope((h, w), x.device, p)
        else:
            if layout.valid.shape != (b, n - p):
                raise ValueError(f"layout: for {tuple(layout.valid.shape)} grid tokens, x has {b} x {n - p}")
            h, w = layout.canvas
            rope = self.make_rope_at(layout.positions, p)
        ctx = ctx._replace(hw=(h, w))
        q, k, v, g = self._project_and_gate(x)
        q, k, v = (t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        lepe = None
        if self.lepe is not None:
            v_tokens = v[:, :, p:].transpose(1, 2).reshape(b, n - p, c)
            if layout is None:
                lepe = self.lepe(v_tokens.reshape(b, h, w, c).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
            else:  # each image on a zero canvas: the zero padding it is convolved with alone
                lepe = layout.from_canvas(self.lepe(layout.to_canvas(v_tokens)))
        inference = not torch.is_grad_enabled()
        if inference and (lepe is not None or g is not None):  # inference: one epilogue
            out = self.attend_epilogue(q, k, v, rope, x, ctx, lepe, g)
            if out is not None:
                return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))
        out = run_attend(self, self.attend, q, k, v, rope, x, ctx)
        out = out.transpose(1, 2).reshape(b, n, c)
        if lepe is not None:
            if p and inference:  # onto the grid tokens of the mixing's own fresh output, in place: no padded copy
                out[:, p:].add_(lepe)
            else:
                out = out + _with_prefix_rows(lepe, p)
        if g is not None:  # proj(out * act(g)), keeping out and g for the backward, not act(g) nor the product
            return self.proj_drop(gated_linear(out, g, self.gate_activation, self.proj))
        return self.proj_drop(self.proj(out))

    def attend_epilogue(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext,
                        lepe: Optional[Tensor], gate: Optional[Tensor]) -> Optional[Tensor]:
        """For inference: (attend(...) + LePE) * act(gate) (B, heads, N, D) computed by the mixing's own op in one
        pass (``lepe``: LePE's output on the grid tokens (B, N - P, C), nothing for the prefix tokens; ``gate``:
        the gate's pre-activation (B, N, C); act the class's ``gate_act``), or None where the mixing has no such
        op (here: none has; :class:`LinearAttention` fuses them into its kernels' epilogue)."""
        return None

    def _heads(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """Tokens (B, N, C) as the heads' view (B, heads, N, D), no copy; None stays None."""
        return None if t is None else t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _project_and_gate(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """q, k, v (:meth:`project`) and the gate's pre-activation (None without a gate). For inference the gate's
        projection rides in the qkv projection's matrix product: one (C, 4C) weight formed once (derived), where
        the mixer projects as this class does."""
        gate = self.gate
        if gate is None:
            return (*self.project(x), None)
        merged = None
        if type(self).project is AttentionMixer.project and isinstance(self.qkv, nn.Linear) \
                and self.qkv.out_features == 3 * gate.out_features \
                and not (self.split_value_proj and self.rope_type is not None):
            qkv = self.qkv
            merged = derived(self, "qkv-gate", (qkv.weight, qkv.bias, gate.weight, gate.bias),
                             lambda: _stacked_linear(qkv, gate))
        if merged is None:
            return (*self.project(x), gate(x))
        q, k, v, g = F.linear(x, *merged).chunk(4, dim=-1)
        return q, k, v, g

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, rope={self.rope_type}"


def _with_prefix_rows(lepe: Tensor, p: int) -> Tensor:
    """LePE's grid tokens (B, M, C) with ``p`` zero rows before them for the prefix tokens (no copy without)."""
    return F.pad(lepe, (0, 0, p, 0)) if p else lepe


def _stacked_linear(*layers: nn.Linear) -> Tuple[Tensor, Optional[Tensor]]:
    """(weight, bias) of one linear layer that computes ``layers`` side by side (zeros for a missing bias)."""
    weight = torch.cat([layer.weight for layer in layers])
    if all(layer.bias is None for layer in layers):
        return weight, None
    return weight, torch.cat([layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
                              for layer in layers])


class OutputModulation:
    """RALA's element-wise output modulation, mixed into an :class:`AttentionMixer`: its output gate with no
    activation, so the output is proj((attention + LePE) * (W_o x)); ``gate`` (the W_o projection) is on by default
    in the mixers that take this. Used by ``"rala"``, ``"pola_swin"``, ``"mavit_mala"`` and RAVLT's softmax stages
    (``"ravlt_softmax"``)."""

    gate_act = "identity"


class RavltRope:
    """RAVLT's RoPE frequencies, mixed into an :class:`AttentionMixer`: axial frequencies theta^-linspace(0, 1, D/4)
    (the last one theta^-1) instead of theta^(-i / (D/4)). Used by RAVLT's and MAViT's mixers (``"ravlt_rala"``,
    ``"ravlt_softmax"``, ``"mavit_mala"``)."""

    rope_endpoint = True  # AttentionMixer's axial frequencies end at theta^-1


def _token_mask(layout: Optional[TokenLayout], q: Tensor) -> Optional[Tensor]:
    """The (B, N) mask of q's tokens (the prefix tokens, then the layout's), or None without a layout."""
    return None if layout is None else layout.token_mask(q.shape[2] - layout.valid.shape[1])


@register_mixer("linear")
class LinearAttention(AttentionMixer):
    """Non-causal linear attention (mean-normalised, fp32 state; RoPE on the numerator only).

    feature_map: one of :data:`LAYER_FEATURE_MAPS`: "elu" (elu+1), "relu", "exp", "focused" (FLatten, with a
        learnable per-channel scale) or "performer" (a fixed random projection, the buffer
        ``performer_projection``; :meth:`redraw_feature_map` draws a new one). The causal mixer takes those of
        them that are exact per prefix (not "exp" or "performer").
    eps: denominator epsilon. eps_form "mean" (default): the eps of :func:`linvision.ops.linear_attention`,
        o = (sum_j ... / N) / (sum_j phi(q).phi(k_j) / N + eps), the same relative weight at any token count.
        "sum": o = (sum_j ...) / (sum_j phi(q).phi(k_j) + eps), the form of Sana and diffusers (eps 1e-15
        there), computed as the mean form with eps / N, so it stays in the fp32 mean-form accumulation and is
        finite in half precision; non-causal only (a causal row i would need eps / i).
    Other options: :class:`AttentionMixer`.
    """

    causal = False
    recompute_attend = False  # linear_attention keeps only q, k, v itself
    accepts = frozenset({"prefix_tokens", "layout"})  # linear_attention(valid=) keeps the images apart

    def __init__(self, dim: int, num_heads: int, *, feature_map: str = "elu", eps: float = 1e-4,
                 eps_form: str = "mean", **kwargs):
        if eps_form not in EPS_FORMS:
            raise ValueError(f"eps_form: unknown {eps_form!r}; allowed: {', '.join(EPS_FORMS)}")
        if eps_form == "sum" and self.causal:
            raise ValueError("eps_form: 'sum' is for non-causal attention only")
        super().__init__(dim, num_heads, **kwargs)
        self.use_feature_map(feature_map, nonnegative=True, **({"causal": True} if self.causal else {}))
        self.eps = eps
        self.eps_form = eps_form

    def op_eps(self, num_keys: int) -> float:
        """The eps handed to :func:`linvision.ops.linear_attention` (mean form) for ``num_keys`` keys."""
        return self.eps / num_keys if self.eps_form == "sum" else self.eps

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        layout = ctx.layout
        if layout is not None and self.eps_form == "sum":
            raise ValueError("eps_form: 'sum' (eps / N) has no single N in a batch of images of different sizes; "
                             "use eps_form='mean'")
        return linear_attention(q, k, v, self.phi(), rope=rope, causal=self.causal,
                                eps=self.op_eps(k.shape[2]), valid=_token_mask(layout, q))

    def attend_epilogue(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext,
                        lepe: Optional[Tensor], gate: Optional[Tensor]) -> Optional[Tensor]:
        """:func:`linvision.ops.linear_attention` with the epilogue, which its fused kernels apply in their output
        pass; None for a subclass whose ``attend`` mixes otherwise, and for a batch of images of different sizes."""
        if type(self).attend is not LinearAttention.attend or ctx.layout is not None:
            return None
        residual = None if lepe is None else _with_prefix_rows(lepe, ctx.num_prefix_tokens)
        return linear_attention(q, k, v, self.phi(), rope=rope, causal=self.causal, eps=self.op_eps(k.shape[2]),
                                residual=self._heads(residual), gate=self._heads(gate),
                                gate_activation=self.gate_act)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map}, causal={self.causal}"


@register_mixer("linear_rope")
class LinearRopeAttention(LinearAttention):
    """:class:`LinearAttention` whose defaults are 2D axial RoPE and LePE (the MLLA attention)."""

    def __init__(self, dim: int, num_heads: int, *, rope: Optional[str] = "axial", lepe: bool = True, **kwargs):
        super().__init__(dim, num_heads, rope=rope, lepe=lepe, **kwargs)


@register_mixer("causal")
class CausalLinearAttention(LinearAttention):
    """Causal linear attention over the raster order of the grid (token i sees tokens j <= i). No prefix
    tokens: a class token first in the order would see no other token."""

    causal = True
    accepts = frozenset()


@register_mixer("softmax")
class SoftmaxAttention(AttentionMixer):
    """Softmax attention through SDPA; with RoPE both q and k are rotated (the usual softmax form)."""

    recompute_attend = False  # SDPA keeps q, k, v and its output, nothing else
    # with RoPE, SDPA keeps rotated copies of q and k: v computed apart lets the projection's q, k go
    split_value_proj = True
    accepts = frozenset({"prefix_tokens", "layout"})  # softmax_attention(valid=) keeps the images apart

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        return softmax_attention(q, k, v, rope=rope, valid=_token_mask(ctx.layout, q))


@register_mixer("ravlt_softmax")
class RavltSoftmax(RavltRope, OutputModulation, SoftmaxAttention):
    """RAVLT's softmax stages (Fan et al. 2025, arXiv:2411.07635; :mod:`linvision.models.ravlt`): softmax attention
    with RAVLT's RoPE frequencies and RALA's output modulation (:class:`OutputModulation`, the same as
    ``"rala"``'s)."""


def window_partition(x: Tensor, hw: Tuple[int, int], window: int) -> Tuple[Tensor, Tensor, Tuple[int, int]]:
    """Split (B, heads, H*W, D) tokens into windows of window x window tokens, padding the grid at the bottom
    and right. Returns (windows (B, heads, nW, window*window, D), valid (nW, window*window) bool, (Hp, Wp))."""
    b, nh, _, d = x.shape
    h, w = hw
    hp, wp = math.ceil(h / window) * window, math.ceil(w / window) * window
    grid = F.pad(x.reshape(b, nh, h, w, d), (0, 0, 0, wp - w, 0, hp - h))
    grid = grid.reshape(b, nh, hp // window, window, wp // window, window, d).transpose(3, 4)
    valid = torch.zeros(hp, wp, dtype=torch.bool, device=x.device)
    valid[:h, :w] = True
    valid = valid.reshape(hp // window, window, wp // window, window).transpose(1, 2).reshape(-1, window * window)
    return grid.reshape(b, nh, valid.shape[0], window * window, d), valid, (hp, wp)


def window_merge(x: Tensor, hw: Tuple[int, int], padded: Tuple[int, int], window: int) -> Tensor:
    """Inverse of :func:`window_partition`: (B, heads, nW, window*window, D) -> (B, heads, H*W, D)."""
    b, nh, _, _, d = x.shape
    (h, w), (hp, wp) = hw, padded
    grid = x.reshape(b, nh, hp // window, wp // window, window, window, d).transpose(3, 4)
    return grid.reshape(b, nh, hp, wp, d)[:, :, :h, :w].reshape(b, nh, h * w, d)


@register_mixer("hybrid")
class HybridAttention(LinearAttention):
    """Local-window softmax attention and global linear attention on the same q, k, v, mixed per head by a
    learned sigmoid gate g_h: out = g_h * local + (1 - g_h) * global (Infini-attention's local attention +
    compressive memory, with the memory replaced by the non-causal linear-attention state of the image).

    window: side of the square windows (the grid is padded to a multiple; padded keys are masked).
    RoPE, when set, rotates q and k of the local softmax branch and the numerator of the global branch. No prefix
    tokens (they have no window).
    """

    accepts = frozenset()  # windows of the raster grid
    # attend builds rotated q, k, padded window copies of q, k, v, the local output and the global one: recomputed
    # in the backward (the policy of AttentionMixer), where LinearAttention keeps nothing of its own
    recompute_attend = True

    def __init__(self, dim: int, num_heads: int, *, window: int = 7, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.window = check_size("window", window)
        self.mix_logit = nn.Parameter(torch.zeros(num_heads))  # sigmoid(0) = 0.5: equal start

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """The per-head mixing logits are not decayed (decay would pull the mix towards 0.5)."""
        return super().no_weight_decay() | {"mix_logit"}

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        hw = ctx.hw
        global_out = linear_attention(q, k, v, self.phi(), rope=rope, eps=self.op_eps(k.shape[2]))
        if rope is not None:
            q_l, k_l = apply_rope(q, rope).to(v.dtype), apply_rope(k, rope).to(v.dtype)
        else:
            q_l, k_l = q, k
        qw, valid, padded = window_partition(q_l, hw, self.window)
        kw, _, _ = window_partition(k_l, hw, self.window)
        vw, _, _ = window_partition(v, hw, self.window)
        mask = valid[:, None, :]  # (nW, 1, w*w): padded keys take no weight
        local = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask)
        local = window_merge(local, hw, padded, self.window)
        g = torch.sigmoid(self.mix_logit).to(v.dtype)[None, :, None, None]
        return g * local + (1 - g) * global_out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


@register_mixer("gated_cnn", "none")
class GatedConvMixer(TokenMixer):
    """MambaOut's Gated CNN as a token mixer (no attention), registered as "gated_cnn" ("none", the name the
    ablation configs use, is an alias): fc1 expands C to 2 * hidden channels split into
    a gate g (hidden), an identity part i (hidden - conv) and a conv part c (conv = conv_ratio * C channels);
    out = fc2(act(g) * concat(i, dwconv_k(c))). ``num_heads`` is accepted for the common interface only.

    Args: expansion_ratio (hidden = expansion_ratio * C, default 8/3), kernel_size of the depthwise conv
    (default 7), conv_ratio (default 1.0), act_layer (default GELU), proj_drop.
    """

    def __init__(
        self, dim: int, num_heads: int = 1, *, expansion_ratio: float = 8 / 3, kernel_size: int = 7,
        conv_ratio: float = 1.0, act_layer: Type[nn.Module] = nn.GELU, proj_drop: float = 0.0,
    ):
        super().__init__()
        self.dim = check_size("dim", dim)
        hidden = int(check_number("expansion_ratio", expansion_ratio) * dim)
        if hidden < 1:
            raise ValueError(f"expansion_ratio: {expansion_ratio} gives {hidden} hidden channels at dim={dim}; "
                             "need at least 1")
        conv_channels = int(check_number("conv_ratio", conv_ratio) * dim)
        if not 0 < conv_channels <= hidden:
            raise ValueError(f"conv_ratio: {conv_ratio} gives {conv_channels} conv channels; need 1..{hidden}")
        check_size("kernel_size", kernel_size, odd=True)
        check_number("proj_drop", proj_drop, 0.0, 1.0, closed_low=True)
        self.split = (hidden, hidden - conv_channels, conv_channels)
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.act = act_layer()
        self.conv = nn.Conv2d(conv_channels, conv_channels, kernel_size, padding=kernel_size // 2, groups=conv_channels)
        self.fc2 = nn.Linear(hidden, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def mix(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """x: (B, N, C) tokens on the grid ``ctx.hw`` -> (B, N, C)."""
        h, w = check_grid(ctx.hw, x.shape[1], name="hw")
        g, i, c = torch.split(self.fc1(x), self.split, dim=-1)
        b = x.shape[0]
        c = self.conv(c.transpose(1, 2).reshape(b, c.shape[-1], h, w)).flatten(2).transpose(1, 2)  # (B, N, conv)
        return self.proj_drop(self.fc2(self.act(g) * torch.cat((i, c), dim=-1)))
