"""Where the tokens of a batch of images of different sizes sit: :class:`TokenLayout`.

A batch of timm's NaFlex loader holds, per sample, the patches of one image at its own size and aspect ratio in
raster order, then padding: ``patch_coord`` (B, M, 2) gives each patch's (row, col) in its image's grid and
``patch_valid`` (B, M) which patches are real. A mixer given a layout (one whose class ``accepts`` ``"layout"``)
lets only each sample's valid tokens into its state (``valid=`` of the ops), turns each token by RoPE at its own
(row, col) (``rope_at``), and runs grid operations such as LePE's convolution on a zero canvas holding each
image at its place (:meth:`TokenLayout.to_canvas`, :meth:`TokenLayout.from_canvas`), which is the zero padding
the image alone is convolved with. Every sample then gets what it gets alone at its own size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["TokenLayout"]


@dataclass(eq=False)
class TokenLayout:
    """positions: (B, M, 2) int64 (row, col) of each grid token in its image's patch grid; valid: (B, M) bool,
    the real tokens; sizes: each sample's grid (h, w), the extent of its valid positions; lengths: (B,) the number
    of real tokens; packed: whether every sample's real tokens come first (timm's collator packs them so), which
    the scans along the token order need."""

    positions: Tensor
    valid: Tensor
    sizes: List[Tuple[int, int]] = field(default_factory=list)
    lengths: Optional[Tensor] = None
    packed: bool = False

    @classmethod
    def from_patches(cls, patch_coord: Tensor, patch_valid: Optional[Tensor] = None) -> "TokenLayout":
        """The layout of timm's NaFlex batch: ``patch_coord`` (B, M, 2) (y, x) and ``patch_valid`` (B, M) (all
        valid when None). Raises ValueError in one line for other shapes, or a sample without a valid patch."""
        if not isinstance(patch_coord, Tensor) or patch_coord.dim() != 3 or patch_coord.shape[-1] != 2:
            shape = tuple(patch_coord.shape) if isinstance(patch_coord, Tensor) else type(patch_coord).__name__
            raise ValueError(f"patch_coord: expected a (B, N, 2) tensor of (row, col), got {shape}")
        if patch_coord.is_floating_point():
            raise ValueError(f"patch_coord: expected integer (row, col), got {patch_coord.dtype}")
        b, m, _ = patch_coord.shape
        if patch_valid is None:
            patch_valid = torch.ones(b, m, dtype=torch.bool, device=patch_coord.device)
        if not isinstance(patch_valid, Tensor) or tuple(patch_valid.shape) != (b, m):
            shape = tuple(patch_valid.shape) if isinstance(patch_valid, Tensor) else type(patch_valid).__name__
            raise ValueError(f"patch_valid: expected shape (B, N) = {(b, m)}, got {shape}")
        valid = patch_valid.bool()
        positions = patch_coord.long().masked_fill(~valid[..., None], 0)
        if bool((positions < 0).any()):
            raise ValueError("patch_coord: negative (row, col) of a valid patch")
        counts = valid.sum(dim=1)
        if bool((counts == 0).any()):
            raise ValueError("patch_valid: a sample has no valid patch")
        extent = (positions.amax(dim=1) + 1).tolist()  # one transfer for the whole batch
        packed = bool((valid == (torch.arange(m, device=valid.device) < counts[:, None])).all())
        return cls(positions, valid, [(int(h), int(w)) for h, w in extent], counts, packed)

    @property
    def canvas(self) -> Tuple[int, int]:
        """(H, W) of a grid every sample's image fits in."""
        return max(h for h, _ in self.sizes), max(w for _, w in self.sizes)

    def token_mask(self, num_prefix_tokens: int = 0) -> Tensor:
        """(B, P + M) bool: the prefix tokens (always real), then the grid tokens' ``valid``."""
        if not num_prefix_tokens:
            return self.valid
        prefix = self.valid.new_ones(self.valid.shape[0], num_prefix_tokens)
        return torch.cat([prefix, self.valid], dim=1)

    def column_major(self) -> Tensor:
        """(B, M) indices that put each sample's real tokens in column-major order of its own grid, padding after
        them (as it was): ``tokens.gather`` along the token dim with them gives the column-major sequence."""
        m = self.valid.shape[1]
        heights = torch.tensor([h for h, _ in self.sizes], device=self.positions.device)
        key = self.positions[..., 1] * heights[:, None] + self.positions[..., 0]
        key = torch.where(self.valid, key, m * m + torch.arange(m, device=key.device))  # padding last, in order
        return key.argsort(dim=1)

    def _flat_index(self) -> Tensor:
        return self.positions[..., 0] * self.canvas[1] + self.positions[..., 1]  # (B, M)

    def to_canvas(self, x: Tensor) -> Tensor:
        """Grid tokens (B, M, C) -> (B, C, H, W) on :attr:`canvas`: each valid token at its (row, col), zeros
        elsewhere (around each image, as a convolution pads it alone)."""
        b, m, c = x.shape
        h, w = self.canvas
        flat = x.new_zeros(b, h * w, c)
        index = self._flat_index().masked_fill(~self.valid, h * w)  # padding goes to a slot that is cut off
        flat = torch.cat([flat, x.new_zeros(b, 1, c)], dim=1).scatter(1, index[..., None].expand(b, m, c), x)
        return flat[:, : h * w].transpose(1, 2).reshape(b, c, h, w)

    def from_canvas(self, grid: Tensor) -> Tensor:
        """(B, C, H, W) on :attr:`canvas` -> grid tokens (B, M, C) read at their positions (zeros for padding)."""
        b, c = grid.shape[:2]
        flat = grid.flatten(2).transpose(1, 2)  # (B, H*W, C)
        index = self._flat_index()[..., None].expand(-1, -1, c)
        return flat.gather(1, index).masked_fill(~self.valid[..., None], 0)
