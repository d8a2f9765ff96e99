"""The diffusion transformer built from :class:`SanaBlock`, class- or caption-conditioned.

Patchify (a strided conv), a sinusoidal timestep embedder (256 frequencies -> MLP; optionally a second one for
a guidance scale, added to it), adaLN-single (one Linear(SiLU(t_emb)) -> 6C vector shared by every block), the
condition tokens for the cross-attention: class labels (a learned table with a null class for classifier-free
guidance) or caption embeddings (Sana's Linear-GELU-Linear projection and RMSNorm), a final modulated layer and
unpatchify. The network predicts the rectified-flow velocity (noise - data) at time t in [0, 1].

With ``caption_channels`` set the model is Sana's transformer: its state dict converts to and from diffusers'
``SanaTransformer2DModel`` (:mod:`linvision.diffusion.sana`).

Configurations (``DIT_CONFIGS``): ``digits`` is a CPU demo size (8 x 8 grey images, 4 x 4 tokens, 1.2M
parameters); ``sana_600m`` has the shape of Sana-0.6B (depth 28, C 1152, 16 cross-attention heads, linear head
dim 32, Mix-FFN ratio 2.5; 592M parameters) on a 32-channel 32 x 32 input, the latent Sana's 32x autoencoder
gives at 1024 px, class-conditional; ``sana_600m_t2i`` and ``sana_1600m_t2i`` are the released text-to-image
shapes of Sana-0.6B and Sana-1.6B (caption embeddings of 2304 channels, Gemma-2's width).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, Dict, Optional, Set

import torch
from einops import rearrange
from timm.layers import Mlp
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from linvision.layers import init_model_weights, merge_options, no_weight_decay_of

from .block import SanaBlock, modulate

__all__ = ["DiTConfig", "DIT_CONFIGS", "TimestepEmbedder", "FinalLayer", "LinDiT", "create_dit"]


@dataclass
class DiTConfig:
    """Everything needed to rebuild a :class:`LinDiT` (stored with checkpoints).

    Conditioning: ``num_classes`` > 0 gives class labels as ``num_cond_tokens`` learned tokens each (label
    ``num_classes`` is the null class); ``caption_channels`` > 0 gives caption embeddings (B, L,
    caption_channels) projected to C (Sana). ``guidance_embeds`` adds an embedding of a guidance scale
    (guidance-distilled Sana). ``eps`` / ``eps_form``: the linear attention's denominator
    (:class:`linvision.layers.LinearAttention`; diffusers' Sana is 1e-15 in the "sum" form).
    """

    img_size: int = 8
    in_chans: int = 1
    patch_size: int = 2
    dim: int = 128
    depth: int = 4
    num_heads: int = 4
    head_dim: int = 32
    mlp_ratio: float = 2.5
    num_classes: int = 10
    num_cond_tokens: int = 4
    qk_norm: bool = False
    use_rope: bool = False
    self_attn: str = "linear"
    self_attn_options: Dict[str, Any] = field(default_factory=dict)
    fp16_clamp: bool = False
    caption_channels: int = 0
    guidance_embeds: bool = False
    out_chans: Optional[int] = None
    eps: float = 1e-4
    eps_form: str = "mean"
    qk_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DiTConfig":
        """Build from a dict; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model config: unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @property
    def out_channels(self) -> int:
        return self.in_chans if self.out_chans is None else self.out_chans


_SANA_T2I = dict(img_size=32, in_chans=32, patch_size=1, head_dim=32, mlp_ratio=2.5, num_classes=0,
                 caption_channels=2304)
DIT_CONFIGS: Dict[str, DiTConfig] = {
    "digits": DiTConfig(img_size=8, in_chans=1, patch_size=2, dim=128, depth=4, num_heads=4),
    "sana_600m": DiTConfig(img_size=32, in_chans=32, patch_size=1, dim=1152, depth=28, num_heads=16,
                           num_classes=1000),
    "sana_600m_t2i": DiTConfig(dim=1152, depth=28, num_heads=16, **_SANA_T2I),
    "sana_1600m_t2i": DiTConfig(dim=2240, depth=20, num_heads=20, **_SANA_T2I),
}


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> (B, C): sinusoids of ``scale`` * t (1000: diffusers' timestep) at ``freq_dim``
    frequencies, then Linear-SiLU-Linear."""

    def __init__(self, dim: int, freq_dim: int = 256, max_period: float = 10000.0, scale: float = 1000.0):
        super().__init__()
        self.freq_dim = freq_dim
        self.max_period = max_period
        self.scale = scale
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def sinusoids(self, t: Tensor) -> Tensor:
        """(B,) -> (B, freq_dim) fp32: [cos(s t f_k), sin(s t f_k)], f_k = max_period^(-k / half), s = scale."""
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = self.scale * t.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: Tensor) -> Tensor:
        emb = self.sinusoids(t)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    """LayerNorm (no affine), modulation by a learned (2, C) table + t_emb, Linear to patch pixels."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim ** 0.5)

    def forward(self, x: Tensor, t_emb: Tensor) -> Tensor:
        shift, scale = (self.scale_shift_table[None] + t_emb[:, None]).to(x.dtype).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


def _xavier_linear(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class LinDiT(nn.Module):
    """Linear-attention DiT. ``forward(x (B, in_chans, H, W), t (B,) in [0, 1], y (B,) int64)`` -> velocity
    (B, out_chans, H, W) for a class-conditional model (label ``num_classes`` is the null class);
    ``forward(x, t, context=(B, L, caption_channels), context_mask=(B, L) bool, guidance=(B,))`` for a caption
    model (Sana).

    H and W need only be multiples of the patch size (the blocks take the grid at call time).
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        if cfg.num_classes <= 0 and cfg.caption_channels <= 0:
            raise ValueError("model config: needs num_classes > 0 (class labels) or caption_channels > 0 (captions)")
        self.cfg = cfg
        c = cfg.dim
        self.null_class = cfg.num_classes
        self.patch_embed = nn.Conv2d(cfg.in_chans, c, cfg.patch_size, stride=cfg.patch_size)
        self.t_embedder = TimestepEmbedder(c)
        # diffusers embeds the guidance scale itself (no factor 1000) and adds it to the timestep embedding
        self.guidance_embedder = TimestepEmbedder(c, scale=1.0) if cfg.guidance_embeds else None
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(c, 6 * c))
        # One row per class plus the null class; each row holds num_cond_tokens condition tokens.
        self.class_tokens = (nn.Embedding(cfg.num_classes + 1, cfg.num_cond_tokens * c)
                             if cfg.num_classes > 0 else None)
        if cfg.caption_channels > 0:
            self.caption_proj = Mlp(cfg.caption_channels, c, c, act_layer=partial(nn.GELU, approximate="tanh"))
            self.caption_norm = nn.RMSNorm(c, eps=1e-5)
        else:
            self.caption_proj = self.caption_norm = None
        self.blocks = nn.ModuleList(
            SanaBlock(
                c, cfg.num_heads, head_dim=cfg.head_dim, mlp_ratio=cfg.mlp_ratio, self_attn=cfg.self_attn,
                qk_norm=cfg.qk_norm, use_rope=cfg.use_rope, fp16_clamp=cfg.fp16_clamp, eps=cfg.eps,
                eps_form=cfg.eps_form, qk_norm_eps=cfg.qk_norm_eps, self_attn_options=cfg.self_attn_options,
            )
            for _ in range(cfg.depth)
        )
        self.final_layer = FinalLayer(c, cfg.patch_size ** 2 * cfg.out_channels)
        self.grad_checkpointing = False
        self._init_weights()

    def _init_weights(self) -> None:
        # Xavier for every Linear, then each module's own start (init_weights), then the DiT's own choices below
        init_model_weights(self, _xavier_linear)
        w = self.patch_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        if self.class_tokens is not None:
            nn.init.normal_(self.class_tokens.weight, std=0.02)
        embedders = [self.t_embedder] + ([self.guidance_embedder] if self.guidance_embedder is not None else [])
        for lin in [e.mlp[i] for e in embedders for i in (0, 2)] + [self.t_block[1]]:
            nn.init.normal_(lin.weight, std=0.02)
        # Zero cross-attention outputs and the final projection: the network starts from a zero prediction
        # and from blocks whose condition path adds nothing.
        for blk in self.blocks:
            nn.init.zeros_(blk.cross_attn.proj.weight)
            nn.init.zeros_(blk.cross_attn.proj.bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward instead of keeping them (timm's name)."""
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """The modulation tables (2-D, but offsets rather than weights) and what the mixers exclude."""
        tables = {n for n, _ in self.named_parameters() if n.endswith("scale_shift_table")}
        return tables | no_weight_decay_of(self)

    def condition(self, y: Tensor) -> Tensor:
        """Class labels (B,) -> condition tokens (B, num_cond_tokens, C)."""
        if self.class_tokens is None:
            raise ValueError("y: this model is conditioned on captions (context), not class labels")
        if y.dtype not in (torch.int64, torch.int32) or y.dim() != 1:
            raise ValueError(f"y: expected integer labels of shape (B,), got {y.dtype} {tuple(y.shape)}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) > self.null_class):
            raise ValueError(f"y: labels must lie in [0, {self.null_class}] ({self.null_class} = null class)")
        return self.class_tokens(y).reshape(y.shape[0], self.cfg.num_cond_tokens, self.cfg.dim)

    def caption(self, context: Tensor) -> Tensor:
        """Caption embeddings (B, L, caption_channels) -> condition tokens (B, L, C)."""
        if self.caption_proj is None:
            raise ValueError("context: this model is conditioned on class labels (y), not captions")
        if context.dim() != 3 or context.shape[-1] != self.cfg.caption_channels:
            raise ValueError(f"context: expected (B, L, {self.cfg.caption_channels}), got {tuple(context.shape)}")
        return self.caption_norm(self.caption_proj(context.to(self.caption_proj.fc1.weight.dtype)))

    def forward(self, x: Tensor, t: Tensor, y: Optional[Tensor] = None, *, context: Optional[Tensor] = None,
                context_mask: Optional[Tensor] = None, guidance: Optional[Tensor] = None) -> Tensor:
        p = self.cfg.patch_size
        if x.dim() != 4 or x.shape[1] != self.cfg.in_chans or x.shape[2] % p or x.shape[3] % p:
            raise ValueError(
                f"x: expected (B, {self.cfg.in_chans}, H, W) with H, W multiples of {p}, got {tuple(x.shape)}"
            )
        if t.shape != (x.shape[0],):
            raise ValueError(f"t: expected shape ({x.shape[0]},), got {tuple(t.shape)}")
        if (y is None) == (context is None):
            raise ValueError("y / context: give exactly one (class labels or caption embeddings)")
        if (guidance is not None) != (self.guidance_embedder is not None):
            raise ValueError("guidance: required by a model with guidance_embeds, refused by one without")
        hw = (x.shape[2] // p, x.shape[3] // p)
        # inputs in the weights' dtype (a sharded run may hold them in bf16); t stays fp32 for the sinusoids
        tokens = rearrange(self.patch_embed(x.to(self.patch_embed.weight.dtype)), "b c h w -> b (h w) c")
        t_emb = self.t_embedder(t)
        if guidance is not None:
            t_emb = t_emb + self.guidance_embedder(guidance)
        t_mod = self.t_block(t_emb)
        cond = (self.condition(y) if y is not None else self.caption(context)).to(tokens.dtype)
        for blk in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(blk, tokens, hw, t_mod, cond, context_mask, use_reentrant=False)
            else:
                tokens = blk(tokens, hw, t_mod, cond, context_mask)
        out = self.final_layer(tokens, t_emb)  # (B, N, p*p*out_chans)
        return rearrange(out, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=hw[0], w=hw[1], p1=p, p2=p)


def create_dit(config: "str | DiTConfig | Dict[str, Any]", **overrides: Any) -> LinDiT:
    """Build a :class:`LinDiT` from a name in ``DIT_CONFIGS``, a :class:`DiTConfig` or a dict, with overrides."""
    if isinstance(config, str):
        if config not in DIT_CONFIGS:
            raise ValueError(f"config: unknown {config!r}; allowed: {', '.join(DIT_CONFIGS)}")
        cfg = asdict(DIT_CONFIGS[config])
    elif isinstance(config, DiTConfig):
        cfg = asdict(config)
    elif isinstance(config, dict):
        cfg = dict(config)
    else:
        raise TypeError(f"config: expected a name, a DiTConfig or a dict, got {type(config).__name__}")
    return LinDiT(DiTConfig.from_dict(merge_options(cfg, **overrides)))
