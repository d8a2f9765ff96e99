"""Bidirectional recurrent token mixers: decay (RetNet), gated (GLA) and delta-rule (DeltaNet) linear attention.

An image has no natural token order, so each mixer scans the raster order forward and backward (the backward scan
strictly anti-causal, so a token's own term counts once) and, with ``column_major=True``, also the column-major
order, averaging the two orders. The recurrences and their chunked forms are in :mod:`linvision.ops.recurrent`.

Registered as "bidir_decay", "bidir_gated" and "bidir_delta"; built as ``cls(dim, num_heads, **options)`` and
called as ``forward(x (B, N, C), hw)`` with N = H * W tokens in raster order, like the other mixers. Beside
"bidir_gated", its published form: ViG's "vig_gla" (:class:`VigGatedAttention`; Liao et al. 2024,
arXiv:2405.18425, the models in :mod:`linvision.models.vig`).
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import RmsNorm
from torch import Tensor, nn

from linvision.ops import (
    BACKENDS,
    DEFAULT_EPS,
    check_grid,
    check_int,
    bidirectional_delta_rule_attention,
    bidirectional_gated_linear_attention,
    compute_dtype,
    gated_linear_attention,
)
from linvision.ops.rope import Rope

from .context import MixerContext
from .mixers import AttentionMixer
from .registry import register_mixer, run_attend

__all__ = ["BidirectionalRecurrentMixer", "BidirDecayAttention", "BidirGatedAttention", "VigGatedAttention",
           "BidirDeltaAttention"]


def retnet_log_decays(num_heads: int, decay_range: Tuple[float, float]) -> Tensor:
    """log(gamma_h) for gamma_h = 1 - 2^-e_h with e_h evenly spaced over ``decay_range`` (RetNet's multi-scale
    decays; about 2^e_h tokens of memory per head), in fp32, computed with log1p to keep gamma near 1 exact."""
    lo, hi = decay_range
    if not 0 < lo <= hi:
        raise ValueError(f"decay_range: need 0 < low <= high, got {tuple(decay_range)}")
    exponents = torch.linspace(lo, hi, num_heads, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -exponents)).float()


class BidirectionalRecurrentMixer(AttentionMixer):
    """Skeleton of the bidirectional recurrent mixers; subclasses implement :meth:`scan`. The qkv projection,
    LePE, output gate and output projection are those of :class:`AttentionMixer` (without RoPE).

    Args:
        dim: channels C (divisible by ``num_heads``); head dim D = C / num_heads.
        num_heads: heads.
        feature_map: the map applied to q and k: a name of ``linvision.ops.common.FEATURE_MAPS`` that is exact in
            a scan (``causal``; not "exp" or "performer") and, for the normalised forms, non-negative.
        column_major: also scan the column-major order and average with the raster-order result.
        chunk_size: chunk length of the chunked scans (32 was 10-20% faster than 64 on CPU at head dim 32).
        lepe: a 3x3 depthwise conv of v added to the output, as :class:`AttentionMixer`.
        gate: a SiLU output gate, as :class:`AttentionMixer`.
        qkv_bias: bias of the q, k, v projection.
        proj_drop: dropout after the output projection.
        backend: the scans' backend, "auto" (fla-core's Triton kernels for CUDA tensors, see
            ``linvision.ops.recurrent.kernels``), "triton" or "torch" (the PyTorch chunk loop).
    Raises ValueError for a bad dim/num_heads pair, chunk_size, backend or an unknown feature map.
    """

    # no prefix tokens: the scans run along the raster order of the grid; a layout: each image's tokens scanned
    # as alone (packed: real tokens first, padding after)
    accepts = frozenset({"layout"})
    # the scans are causal in each direction (no max-over-all-tokens stabiliser) and normalised (phi >= 0)
    feature_map_needs = dict(causal=True, nonnegative=True)

    def __init__(
        self, dim: int, num_heads: int, *, feature_map: str = "elu", column_major: bool = False,
        chunk_size: int = 32, lepe: bool = False, gate: bool = False, qkv_bias: bool = True, proj_drop: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__(dim, num_heads, lepe=lepe, gate=gate, qkv_bias=qkv_bias, proj_drop=proj_drop)
        check_int("chunk_size", chunk_size, 1)
        if backend not in BACKENDS:
            raise ValueError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
        self.backend = backend
        self.use_feature_map(feature_map, **self.feature_map_needs)
        self.column_major = column_major
        self.chunk_size = chunk_size

    def scan(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, lengths: Optional[Tensor] = None) -> Tensor:
        """Bidirectional scan over the given token order. q, k, v: (B, heads, N, D); x: (B, N, C) input tokens
        in the same order (for data-dependent gates); lengths: (B,) real tokens of each sample, first (padding
        after them). Returns (B, heads, N, D)."""
        raise NotImplementedError

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: Optional[Rope], x: Tensor, ctx: MixerContext) -> Tensor:
        layout = ctx.layout
        if layout is not None and not layout.packed:
            raise ValueError("layout: the scans need each image's patches first and its padding after them (as "
                             "timm's NaFlex collator packs them)")
        lengths = None if layout is None else layout.lengths
        out = self.scan(q, k, v, x, lengths)
        if self.column_major:
            if layout is None:
                h, w = ctx.hw
                n = h * w
                to_cols = torch.arange(n, device=x.device).reshape(h, w).t().reshape(-1)  # column-major -> raster
                to_rows = torch.arange(n, device=x.device).reshape(w, h).t().reshape(-1)  # its inverse
                out_cols = self.scan(q[:, :, to_cols], k[:, :, to_cols], v[:, :, to_cols], x[:, to_cols])
                return 0.5 * (out + out_cols[:, :, to_rows])
            order = layout.column_major()  # (B, N): each image's own column-major order, padding after
            heads = order[:, None, :, None]

            def by(t: Tensor, index: Tensor) -> Tensor:
                return t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3]))

            out_cols = self.scan(by(q, heads), by(k, heads), by(v, heads),
                                 x.gather(1, order[..., None].expand(-1, -1, x.shape[-1])), lengths)
            out = 0.5 * (out + by(out_cols, order.argsort(dim=1)[:, None, :, None]))
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map}, column_major={self.column_major}"


@register_mixer("bidir_decay")
class BidirDecayAttention(BidirectionalRecurrentMixer):
    """Bidirectional linear attention with a fixed decay per head (RetNet): token i weighs token j by
    gamma_h^|i - j| along the scan order, in the normalised (decayed-mean) form.

    decay_range: gamma_h = 1 - 2^-e, e evenly spaced over this range across heads (see :func:`retnet_log_decays`).
    eps: denominator epsilon. Other options: :class:`BidirectionalRecurrentMixer`.
    """

    def __init__(
        self, dim: int, num_heads: int, *, decay_range: Tuple[float, float] = (3.0, 10.0), eps: float = DEFAULT_EPS,
        feature_map: str = "elu", column_major: bool = False, chunk_size: int = 32, lepe: bool = False,
        gate: bool = False, qkv_bias: bool = True, proj_drop: float = 0.0, backend: str = "auto",
    ):
        super().__init__(
            dim, num_heads, feature_map=feature_map, column_major=column_major, chunk_size=chunk_size, lepe=lepe,
            gate=gate, qkv_bias=qkv_bias, proj_drop=proj_drop, backend=backend,
        )
        self.eps = eps
        self.register_buffer("log_decay", retnet_log_decays(num_heads, decay_range), persistent=False)

    def scan(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, lengths: Optional[Tensor] = None) -> Tensor:
        log_gate = self.log_decay.reshape(1, -1, 1)  # (1, heads, 1)
        return bidirectional_gated_linear_attention(
            q, k, v, log_gate, self.phi(), eps=self.eps, chunk_size=self.chunk_size, backend=self.backend,
            lengths=lengths,
        )


@register_mixer("bidir_gated")
class BidirGatedAttention(BidirectionalRecurrentMixer):
    """Bidirectional gated linear attention (GLA): a forget gate gamma_t = sigmoid(W x_t + b)^(1/forget_temperature)
    per head, or per key channel with ``forget_per_channel``. W starts at zero and b at RetNet's decays, so training
    starts from :class:`BidirDecayAttention` and learns which tokens to forget across.

    forget_temperature: divides log sigmoid (GLA's 16 keeps gates near 1). eps, decay_range: as BidirDecayAttention.
    chunk_size: default 32 per head, 16 per channel (per-channel gates form a (chunk, chunk, D) decay tensor).
    Other options: :class:`BidirectionalRecurrentMixer`.
    """

    def __init__(
        self, dim: int, num_heads: int, *, forget_per_channel: bool = False, forget_temperature: float = 16.0,
        decay_range: Tuple[float, float] = (3.0, 10.0), eps: float = DEFAULT_EPS, feature_map: str = "elu",
        column_major: bool = False, chunk_size: Optional[int] = None, lepe: bool = False, gate: bool = False,
        qkv_bias: bool = True, proj_drop: float = 0.0, backend: str = "auto",
    ):
        if chunk_size is None:
            chunk_size = 16 if forget_per_channel else 32
        super().__init__(
            dim, num_heads, feature_map=feature_map, column_major=column_major, chunk_size=chunk_size, lepe=lepe,
            gate=gate, qkv_bias=qkv_bias, proj_drop=proj_drop, backend=backend,
        )
        if not forget_temperature > 0:
            raise ValueError(f"forget_temperature: must be positive, got {forget_temperature!r}")
        self.eps = eps
        self.forget_per_channel = forget_per_channel
        self.forget_temperature = float(forget_temperature)
        width = self.head_dim if forget_per_channel else 1
        self.decay_range = decay_range
        self.forget_gate = nn.Linear(dim, num_heads * width)
        self.init_weights()

    def init_weights(self) -> None:
        """The forget gate's start: W zero and b at RetNet's per-head decays (a model's generic init runs before
        this, see :func:`~linvision.layers.init_model_weights`)."""
        width = self.forget_gate.out_features // self.num_heads
        nn.init.zeros_(self.forget_gate.weight)
        # sigmoid(b)^(1/T) = gamma_h  <=>  b = logit(gamma_h^T)
        p = (retnet_log_decays(self.num_heads, self.decay_range) * self.forget_temperature).exp()
        with torch.no_grad():
            self.forget_gate.bias.copy_(torch.logit(p).repeat_interleave(width).to(self.forget_gate.bias))

    def scan(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, lengths: Optional[Tensor] = None) -> Tensor:
        b, n, _ = x.shape
        # (B, N, heads * G) log-gates in fp32 whatever the autocast dtype (float64 for float64): they are summed
        log_gate = F.logsigmoid(self.forget_gate(x).to(compute_dtype(x.dtype))) / self.forget_temperature
        heads = (self.num_heads, log_gate.shape[-1] // self.num_heads)
        log_gate = log_gate.unflatten(-1, heads).transpose(1, 2)  # (B, heads, N, G)
        return bidirectional_gated_linear_attention(
            q, k, v, log_gate, self.phi(), eps=self.eps, chunk_size=self.chunk_size, backend=self.backend,
            lengths=lengths,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, forget_per_channel={self.forget_per_channel}"


@register_mixer("vig_gla")
class VigGatedAttention(BidirGatedAttention):
    """ViG's token mixer: bidirectional gated linear attention with direction-wise gates and the 2D gating
    locality injection. On tokens x (B, N, C) of the grid (H, W), with heads of Dk = expand_k C / heads key
    channels and D = C / heads value channels:

    - l = act(dwconv3x3(x)) (``local_act``: SiLU, ViG-T; none for S and B): the local branch, from which every
      projection below is taken;
    - q, k, v = W_qkv l (no bias; q scaled by Dk^-1/2);
    - per-channel forget gates, one set per direction: log gamma = logsigmoid(W_2 W_1 l + b) / 16 with a rank-16
      W_1 (``gate_rank``), its first Dk channels per head for the forward scan, the next for the backward one;
    - o_i = s (q_i S_i + q_i S'_i), S the forward scan S_i = diag(gamma_i) S_{i-1} + k_i^T v_i and S' the
      backward scan with the backward gates; both scans include token i (its own term counts twice), and the
      output is unnormalised. s = ``output_scale``: 1/4 in ViG's evaluation (a mean of the two directions,
      halved again), 1/2 in ViG-H's (the mean), which the RMSNorm after it sees only through its eps;
    - out = W_o act(g * RMSNorm(o) + (1 - g) * RMSNorm(l)) per head, g = sigmoid(W_g l + b_g) (the locality
      injection; ``out_act``: SiLU on the mix, ViG-T).

    The scans are :func:`linvision.ops.gated_linear_attention` (identity features, ``normalize=False``), the
    backward one on the reversed sequence: fla-core's ``chunk_gla`` kernel for CUDA tensors, the PyTorch chunked
    scan otherwise (``backend``, ``chunk_size``, as :class:`BidirGatedAttention`). It differs from the
    ``"bidir_gated"`` mixer it derives from in everything but the per-channel gate's logsigmoid / 16 (see
    docs/models/published.md): there, one gate serves both directions, features are elu+1, the output is
    normalised and the backward scan leaves token i out.
    Raises ValueError for a width that the heads or expand_k do not divide.
    """

    accepts = frozenset()  # each image's scan runs over its own grid; no NaFlex batches
    feature_map_needs = dict(causal=True)  # unnormalised: the identity map (signed q, k)

    def __init__(
        self, dim: int, num_heads: int, *, expand_k: float = 0.5, gate_rank: int = 16, local_act: bool = False,
        out_act: bool = False, forget_temperature: float = 16.0, norm_eps: float = 1e-6,
        chunk_size: Optional[int] = None, proj_drop: float = 0.0, backend: str = "auto", output_scale: float = 0.25,
    ):
        super().__init__(dim, num_heads, forget_per_channel=True, forget_temperature=forget_temperature,
                         feature_map="identity", chunk_size=chunk_size, qkv_bias=False, proj_drop=proj_drop,
                         backend=backend)
        key_dim = int(dim * expand_k)
        if key_dim < num_heads or key_dim % num_heads:
            raise ValueError(f"expand_k: {expand_k} x dim={dim} = {key_dim} key channels, not a multiple of "
                             f"num_heads={num_heads}")
        self.key_dim, self.key_head_dim = key_dim, key_dim // num_heads
        self.local = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False)
        self.local_act = nn.SiLU() if local_act else nn.Identity()
        self.qkv = nn.Linear(dim, 2 * key_dim + dim, bias=False)
        self.forget_gate = nn.Sequential(nn.Linear(dim, gate_rank, bias=False), nn.Linear(gate_rank, 2 * key_dim))
        self.mix_gate = nn.Linear(dim, dim)
        self.norm_global = RmsNorm(self.head_dim, eps=norm_eps)
        self.norm_local = RmsNorm(self.head_dim, eps=norm_eps)
        self.out_act = nn.SiLU() if out_act else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.output_scale = output_scale

    def init_weights(self) -> None:
        """No start of its own: the model's generic initialisation (the forget gates' bias at 0, gamma about 0.96,
        as the authors start)."""

    def scan(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, lengths: Optional[Tensor] = None) -> Tensor:
        """s (q S + q S') for the forward and backward scans (s: ``output_scale``), each with its own gates from
        ``x`` (the local branch); q, k (B, heads, N, Dk), v (B, heads, N, D)."""
        b, n, _ = x.shape
        log_gates = F.logsigmoid(self.forget_gate(x).to(compute_dtype(x.dtype))) / self.forget_temperature
        forward, backward = (g.unflatten(-1, (self.num_heads, g.shape[-1] // self.num_heads)).transpose(1, 2)
                             for g in log_gates.chunk(2, -1))
        run = partial(gated_linear_attention, feature_map="identity", normalize=False, chunk_size=self.chunk_size,
                      backend=self.backend)
        q = q * self.key_head_dim ** -0.5
        out = run(q, k, v, forward)
        out_back = run(q.flip(2), k.flip(2), v.flip(2), backward.flip(2)).flip(2)
        return (out + out_back) * self.output_scale

    def mix(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """x: (B, N, C) tokens of the grid ``ctx.hw`` in raster order -> (B, N, C). ValueError for a grid that does
        not hold N tokens."""
        b, n, c = x.shape
        h, w = check_grid(ctx.hw, n, name="hw")
        local = self.local_act(self.local(x.transpose(1, 2).reshape(b, c, h, w))).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(local).split([self.key_dim, self.key_dim, c], dim=-1)
        q, k, v = (t.unflatten(-1, (self.num_heads, t.shape[-1] // self.num_heads)).transpose(1, 2) for t in (q, k, v))
        out = run_attend(self, self.attend, q, k, v, None, local, ctx)
        out = self.norm_global(out.transpose(1, 2))  # (B, N, heads, D)
        gate = torch.sigmoid(self.mix_gate(local)).unflatten(-1, (self.num_heads, -1))
        out = out * gate + self.norm_local(local.unflatten(-1, (self.num_heads, -1))) * (1 - gate)
        return self.proj_drop(self.proj(self.out_act(out.reshape(b, n, c))))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, key_dim={self.key_dim}, output_scale={self.output_scale}"


@register_mixer("bidir_delta")
class BidirDeltaAttention(BidirectionalRecurrentMixer):
    """Bidirectional delta-rule linear attention (DeltaNet): the state corrects what it stores for k_t towards v_t
    with strength beta_t = sigmoid(w_h . x_t + b_h) per head; q and k are L2-normalised after the feature map
    (default identity), and the output is unnormalised. Options: :class:`BidirectionalRecurrentMixer`.
    """

    feature_map_needs = dict(causal=True)  # unnormalised, keys L2-normalised: "identity" (signed) is its default

    def __init__(
        self, dim: int, num_heads: int, *, feature_map: str = "identity", column_major: bool = False,
        chunk_size: int = 32, lepe: bool = False, gate: bool = False, qkv_bias: bool = True, proj_drop: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__(
            dim, num_heads, feature_map=feature_map, column_major=column_major, chunk_size=chunk_size, lepe=lepe,
            gate=gate, qkv_bias=qkv_bias, proj_drop=proj_drop, backend=backend,
        )
        self.beta = nn.Linear(dim, num_heads)

    def scan(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, lengths: Optional[Tensor] = None) -> Tensor:
        beta = torch.sigmoid(self.beta(x).to(compute_dtype(x.dtype))).transpose(1, 2)  # (B, heads, N), in (0, 1)
        return bidirectional_delta_rule_attention(q, k, v, beta, self.phi(), chunk_size=self.chunk_size,
                                                  backend=self.backend, lengths=lengths)
