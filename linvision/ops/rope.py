"""Rotary position embeddings (RoPE) in 1D and 2D for token grids.

A :class:`Rope` describes the rotation of every token of a (prefix + H*W)-token sequence: channel pair t of
head h at grid position (row, col) is rotated by the angle ``freqs_x[h, t] * col + freqs_y[h, t] * row``.
- 1D RoPE (Su et al. 2021, "RoFormer", arXiv:2104.09864) is the grid (1, N) with ``freqs_y = 0``.
- 2D axial RoPE (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer", arXiv:2403.13298):
  half of the pairs rotate with the column, half with the row, theta = 100.
- 2D mixed RoPE (same paper): every pair of every head has its own learnable (fx, fy); axial is the special
  case where one of the two is zero for each pair.
- Position interpolation (a ``ref_grid``): on an H x W grid a token at (row, col) turns as at (row * Hr / H,
  col * Wr / W), so every grid spans the extent of the reference grid Hr x Wr (the grid a model was trained on)
  instead of reaching angles it never saw; timm's ``ref_feat_shape``. It scales the frequencies (fx by Wr / W,
  fy by Hr / H), which is the same rotation, so the kernels need nothing of it.

Channel pairs are split in halves: pair t is (x[..., t], x[..., t + D/2]) (the interleaved pairs of published
models map onto these by a reordering of channels, :func:`halves_from_interleaved`). Prefix tokens (e.g. a class
token) are not rotated. Angles and tables are fp32 whatever the input dtype, and are computed for the grid
given at call time (any H x W, never a fixed square).

Linear attention applies the rotation to the numerator only (see ``linear_attention``).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .common import RopeSpec, check_grid, check_rope, compute_dtype, is_tracing

__all__ = [
    "Rope",
    "grid_positions",
    "rope_1d",
    "axial_rope",
    "rope_at",
    "interpolation_scale",
    "interpolate_positions",
    "axial_rope_freqs",
    "mixed_rope_freqs",
    "apply_rope",
    "rotate_pairs",
    "halves_from_interleaved",
]

class _RecentCache(OrderedDict):
    """A dict that keeps only its ``size`` most recently used entries: a model run at many input sizes keeps the
    tables of its last few grids (each stage of a hierarchical model has its own), not of every grid it saw."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def lookup(self, key):
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def store(self, key, value):
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value


# Tensors on the device they are used on: bounded, so varied input sizes do not hold memory without end. Every key
# holds whether inference mode is on: tensors made under torch.inference_mode() are inference tensors, which autograd
# refuses to save for a backward, so a table made there is never handed to a call outside it (a forward under
# inference_mode, then a training step, would fail), and the other way round costs nothing but a second entry.
CACHE_SIZE = 32
_POSITION_CACHE: _RecentCache = _RecentCache(CACHE_SIZE)  # (H, W, device) -> (rows, cols)
_AXIAL_CACHE: _RecentCache = _RecentCache(CACHE_SIZE)  # axial_rope's arguments -> Rope (with its tables)


def grid_positions(height: int, width: int, device=None) -> Tuple[Tensor, Tensor]:
    """(rows, cols) of the H*W grid in raster order, fp32, each of shape (H*W,). Cached per (H, W, device, inference
    mode) for the last ``CACHE_SIZE`` grids, except while a graph is traced (the positions are then computed in the
    graph)."""
    device = torch.device(device or "cpu")
    tracing = is_tracing(height, width)
    key = None if tracing else (height, width, str(device), torch.is_inference_mode_enabled())
    cached = None if tracing else _POSITION_CACHE.lookup(key)
    if cached is not None:
        return cached
    # expand + reshape rather than repeat/repeat_interleave: the same values, and an ONNX export of symbolic
    # sizes gets a plain broadcast
    rows = torch.arange(height, dtype=torch.float32, device=device)[:, None].expand(height, width).reshape(-1)
    cols = torch.arange(width, dtype=torch.float32, device=device)[None, :].expand(height, width).reshape(-1)
    if not tracing:
        _POSITION_CACHE.store(key, (rows, cols))
    return rows, cols


@dataclass(eq=False)
class Rope(RopeSpec):
    """Rotation of a (num_prefix_tokens + H*W)-token sequence: a :class:`~linvision.kernels.common.RopeSpec` (what
    the kernels read) with its PyTorch tables.

    freqs_x, freqs_y: fp32 tensors of shape (P,) or (heads, P); P = D / 2 channel pairs.
    grid: (H, W). offset: (row, col) added to every grid position (a shift; outputs of RoPE attention do not
    depend on it). Tables are computed on first use and kept on the object when the frequencies need no grad, one
    pair made under ``torch.inference_mode()`` and one made outside it (an inference tensor cannot be saved for a
    backward).
    """

    _tables: Optional[Dict[bool, Tuple[Tensor, Tensor]]] = field(default=None, repr=False)

    def angles(self) -> Tensor:
        """(heads or 1, N, P) fp32 rotation angles, or (B, heads or 1, N, P) with per-sample ``positions``; rows of
        prefix tokens are zero."""
        fx = self.freqs_x.float().reshape(-1, self.freqs_x.shape[-1])  # (Hh, P)
        fy = self.freqs_y.float().reshape(-1, self.freqs_y.shape[-1])
        if self.positions is not None:
            pos = self.positions.to(device=fx.device, dtype=torch.float32)
            rows, cols = pos[..., 0:1] + self.offset[0], pos[..., 1:2] + self.offset[1]  # (B, M, 1)
            ang = cols[:, None] * fx[None, :, None, :] + rows[:, None] * fy[None, :, None, :]  # (B, Hh, M, P)
        else:
            rows, cols = grid_positions(*self.grid, device=fx.device)
            rows = rows + self.offset[0]
            cols = cols + self.offset[1]
            ang = cols[None, :, None] * fx[:, None, :] + rows[None, :, None] * fy[:, None, :]  # (Hh, HW, P)
        if self.num_prefix_tokens:
            pad = ang.new_zeros(*ang.shape[:-2], self.num_prefix_tokens, ang.shape[-1])
            ang = torch.cat([pad, ang], dim=-2)
        return ang

    def tables(self) -> Tuple[Tensor, Tensor]:
        """(cos, sin), each of the shape of :meth:`angles`, fp32."""
        if (self.freqs_x.requires_grad or self.freqs_y.requires_grad or is_tracing(*self.grid)
                or self.positions is not None):  # per-sample positions: a table of one batch, never kept
            # part of the graph: computed every call and never kept. The inference mode is not asked for here:
            # traced, that query made inductor fail on the dynamic-shape recompile of a linhier (batch 2 -> 1).
            ang = self.angles()
            return ang.cos(), ang.sin()
        inference = torch.is_inference_mode_enabled()
        if self._tables is not None and inference in self._tables:
            return self._tables[inference]
        ang = self.angles()
        tables = (ang.cos(), ang.sin())
        self._tables = {**(self._tables or {}), inference: tables}
        return tables


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotation itself: channel pair t, (x[..., t], x[..., t + P]), turned by the angle whose cos and sin are
    ``cos[..., t]``, ``sin[..., t]`` (broadcast against x's leading dims)."""
    p = x.shape[-1] // 2
    x1, x2 = x[..., :p], x[..., p:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def halves_from_interleaved(head_dim: int, num_heads: int = 1) -> Tensor:
    """Channel order that turns interleaved pairs (2t, 2t + 1) into this module's pairs (t, t + D/2), per head:
    ``x[..., order]`` of a (..., num_heads * head_dim) tensor whose heads are consecutive. Features of q and k
    reordered this way (the same for both, so every dot product is unchanged) are rotated here as the published
    interleaved convention rotates the originals; checkpoints of such models are converted by reordering the rows
    of the q and k projections."""
    if head_dim % 2:
        raise ValueError(f"head_dim: pairs need an even head dim, got {head_dim}")
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return (torch.arange(num_heads)[:, None] * head_dim + within).flatten()


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate x of shape (B, heads, N, D) by ``rope``; computed in fp32, returned in fp32 (or float64)."""
    check_rope(rope, x.shape[-1], x.shape[-2], x.shape[1], x.shape[0])
    cdt = compute_dtype(x.dtype)
    cos, sin = (t.to(device=x.device, dtype=cdt) for t in rope.tables())
    return rotate_pairs(x.to(cdt), cos, sin)


def _rope_magnitudes(dim: int, theta: float, endpoint: bool = False) -> Tensor:
    """The dim/4 frequencies of one axis: theta^(-i / (dim/4)), i < dim/4 (RoPE-ViT, MLLA), or with ``endpoint``
    theta^(-linspace(0, 1, dim/4)) (RAVLT: the last one is exactly 1/theta)."""
    if dim % 4 != 0:
        raise ValueError(f"dim: 2D RoPE needs a head dim divisible by 4, got {dim}")
    if endpoint:
        return 1.0 / theta ** torch.linspace(0, 1, dim // 4, dtype=torch.float32)
    return 1.0 / theta ** (torch.arange(0, dim, 4, dtype=torch.float32) / dim)  # (dim/4,)


def axial_rope_freqs(dim: int, theta: float = 100.0, *, row_first: bool = False, endpoint: bool = False,
                     num_heads: int = 1, rotate: float = 1.0) -> Tuple[Tensor, Tensor]:
    """Axial frequencies (fx, fy): half of the dim/2 channel pairs follow the column, the other half the row, each
    half with the frequencies of :func:`_rope_magnitudes`.

    row_first: the first half of the pairs follows the row (MLLA, RAVLT) instead of the column (RoPE-ViT).
    rotate: the fraction of each half's pairs that turn (rounded to whole pairs, at least one); they take the
        frequencies of a head dim that size, from 1 down to 1/theta, and the remaining pairs frequency 0 (they
        carry no position: partial rotation, as GPT-NeoX's rotary_pct).
    num_heads: 1 gives one table of shape (dim/2,) for every head. More than one makes ``dim`` the channels of
        all heads together (MLLA's table over the whole channel dimension) and splits the pairs into per-head
        tables of shape (num_heads, dim/2/num_heads), heads taking consecutive pairs.
    """
    if num_heads < 1 or dim % (2 * num_heads) != 0:
        raise ValueError(f"num_heads: {num_heads} must be >= 1 and divide the {dim // 2} channel pairs of dim={dim}")
    if not 0.0 < rotate <= 1.0:
        raise ValueError(f"rotate: the fraction of channel pairs that turn must be in (0, 1], got {rotate}")
    mag = _rope_magnitudes(dim, theta, endpoint)
    turning = max(1, round(mag.numel() * rotate))
    if turning < mag.numel():
        mag = torch.cat([_rope_magnitudes(4 * turning, theta, endpoint), mag.new_zeros(mag.numel() - turning)])
    zeros = torch.zeros_like(mag)
    fx, fy = torch.cat([mag, zeros]), torch.cat([zeros, mag])
    if row_first:
        fx, fy = fy, fx
    if num_heads > 1:
        fx, fy = fx.reshape(num_heads, -1), fy.reshape(num_heads, -1)
    return fx, fy


def mixed_rope_freqs(
    dim: int, num_heads: int, theta: float = 10.0, generator: Optional[torch.Generator] = None
) -> Tuple[Tensor, Tensor]:
    """Initial mixed frequencies (fx, fy), each (num_heads, dim/2): per head a random direction, the two halves
    of the pairs at right angles (RoPE-ViT's initialisation). Make them ``nn.Parameter`` to learn them."""
    mag = _rope_magnitudes(dim, theta)
    angle = torch.rand(num_heads, 1, generator=generator) * 2 * math.pi
    fx = torch.cat([mag * torch.cos(angle), mag * torch.cos(angle + math.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angle), mag * torch.sin(angle + math.pi / 2)], dim=-1)
    return fx, fy


def rope_at(freqs_x: Tensor, freqs_y: Tensor, positions: Tensor, num_prefix_tokens: int = 0) -> Rope:
    """The rotation of tokens at their own (row, col): ``positions`` (B, M, 2), each sample's grid positions
    (e.g. the ``patch_coord`` of a batch of images of different sizes), after ``num_prefix_tokens`` unrotated
    prefix tokens. A token at (row, col) is turned exactly as at that place of its image's own grid."""
    return Rope(freqs_x, freqs_y, (1, positions.shape[1]), num_prefix_tokens, positions=positions)


def rope_1d(dim: int, num_tokens: int, theta: float = 10000.0, num_prefix_tokens: int = 0, device=None) -> Rope:
    """1D RoPE over ``num_tokens`` positions (the grid (1, num_tokens))."""
    if dim % 2 != 0:
        raise ValueError(f"dim: RoPE needs an even head dim, got {dim}")
    fx = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    return Rope(fx, torch.zeros_like(fx), (1, num_tokens), num_prefix_tokens)


def axial_rope(dim: int, grid: Tuple[int, int], theta: float = 100.0, num_prefix_tokens: int = 0, device=None, *,
               row_first: bool = False, endpoint: bool = False, num_heads: int = 1, rotate: float = 1.0,
               offset: Tuple[float, float] = (0.0, 0.0), ref_grid: Optional[Tuple[int, int]] = None) -> Rope:
    """2D axial RoPE for an H x W grid (frequencies: :func:`axial_rope_freqs`; ``offset`` as :class:`Rope`'s;
    ``ref_grid``: the positions interpolated to that grid's extent, :func:`interpolation_scale`); the object and
    its fp32 tables are cached per (dim, H, W, theta, prefix, device, row_first, endpoint, num_heads, rotate,
    offset, ref_grid, inference mode) for the last ``CACHE_SIZE`` such keys, except while a graph is traced."""
    grid = check_grid(grid)
    scale = interpolation_scale(grid, ref_grid)
    if is_tracing(*grid):  # a traced graph computes the tables itself: nothing cached, nothing taken from the cache
        fx, fy = _scaled(*axial_rope_freqs(dim, theta, row_first=row_first, endpoint=endpoint, num_heads=num_heads,
                                           rotate=rotate), scale)
        return Rope(fx.to(device), fy.to(device), grid, num_prefix_tokens, offset)
    key = (dim, grid, float(theta), num_prefix_tokens, str(torch.device(device or "cpu")), row_first, endpoint,
           num_heads, float(rotate), tuple(map(float, offset)), scale, torch.is_inference_mode_enabled())
    cached = _AXIAL_CACHE.lookup(key)
    if cached is None:
        fx, fy = _scaled(*axial_rope_freqs(dim, theta, row_first=row_first, endpoint=endpoint, num_heads=num_heads,
                                           rotate=rotate), scale)
        cached = _AXIAL_CACHE.store(key, Rope(fx.to(device), fy.to(device), grid, num_prefix_tokens, offset))
    return cached


def interpolation_scale(grid: Tuple[int, int], ref_grid: Optional[Tuple[int, int]]) -> Optional[Tuple[float, float]]:
    """(Hr / H, Wr / W): the factors by which position interpolation scales an H x W grid's rows and columns so
    that it spans the reference grid Hr x Wr; None (nothing to scale) without ``ref_grid`` or on that grid itself,
    so a model evaluated at the grid it was trained on is computed exactly as without the option."""
    if ref_grid is None:
        return None
    h, w = grid
    if (h, w) == tuple(ref_grid):
        return None
    return (ref_grid[0] / h, ref_grid[1] / w)


def _scaled(freqs_x: Tensor, freqs_y: Tensor, scale: Optional[Tuple[float, float]]) -> Tuple[Tensor, Tensor]:
    """The frequencies that turn a position (row, col) as the unscaled ones turn (row * sy, col * sx)."""
    if scale is None:
        return freqs_x, freqs_y
    return freqs_x * scale[1], freqs_y * scale[0]


def interpolate_positions(positions: Tensor, ref_grid: Optional[Tuple[int, int]]) -> Tensor:
    """Per-sample (row, col) positions (B, M, 2) interpolated to ``ref_grid`` as :func:`axial_rope` does a grid's:
    each sample's grid is taken as rows 0..max row and columns 0..max col of its own positions (padding tokens
    sit at (0, 0)), and scaled by Hr / H, Wr / W; fp32. Without ``ref_grid``, the positions unchanged."""
    if ref_grid is None:
        return positions
    extent = positions.amax(dim=1, keepdim=True).to(torch.float32) + 1  # (B, 1, 2): each sample's H, W
    ref = torch.tensor([float(ref_grid[0]), float(ref_grid[1])], device=positions.device)
    return positions.to(torch.float32) * (ref / extent)
