"""The pieces every chunked scan shares: chunking with padding, the read mask inside a chunk, the chain of states
from chunk to chunk (a loop, or torch's scan operator for symbolic sizes) and the unit-triangular solve by products."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import is_tracing

__all__ = ["Scan", "to_chunks", "chunk_length", "unit_lower_solve", "read_mask", "read_product", "chunk_states", "chain",
           "check_lengths", "Reversal"]


class Scan(NamedTuple):
    """An unnormalised scan's result: outputs (B, H, N, E) and the state after the last token (B, H, D, E)."""

    out: Tensor
    state: Tensor


def to_chunks(x: Tensor, c: int) -> Tensor:
    """(B, H, N, X) -> (B, H, ceil(N/c), c, X), zero-padded at the end (one chunk more while exported with dynamic
    sizes)."""
    b, h, n, _ = x.shape
    # With a symbolic n (torch.export with dynamic sizes) one more chunk of padding: a padding that is never empty
    # keeps the graph from assuming that every size is, like the traced one, a multiple of c.
    extra = c if isinstance(n, torch.SymInt) else 0
    pad = (-n) % c + extra
    if not is_tracing(n):  # eager: F.pad, one launch, none when nothing is padded (a chunk split is a view)
        padded = F.pad(x, (0, 0, 0, pad)) if pad else x
        return padded.view(b, h, padded.shape[2] // c, c, x.shape[-1])
    # Traced: written into a fresh buffer rather than F.pad; with a symbolic padding that turns out empty, F.pad
    # returns the input's strides (a transposed input stays transposed) where the compiled graph assumed contiguous ones.
    padded = x.new_empty(b, h, n + pad, x.shape[-1])
    padded[:, :, :n] = x
    padded[:, :, n:] = 0  # only the tail: one pass over the tokens, as F.pad's
    return padded.view(b, h, padded.shape[2] // c, c, x.shape[-1])  # no -1: an empty batch has a chunk count too


def chunk_length(chunk_size: int, n) -> int:
    """The chunk length of a scan over n tokens: chunk_size, or n when shorter. With a symbolic n (torch.export with
    dynamic sizes) always chunk_size, so that the graph holds for every n, shorter ones padded."""
    return chunk_size if isinstance(n, torch.SymInt) else min(chunk_size, n)


def unit_lower_solve(strict_lower: Tensor, rhs: Tensor) -> Tensor:
    """(I + L)^-1 rhs for L strictly lower triangular (..., c, c), by matrix products only: L^c = 0, so
    (I + L)^-1 = sum_{k<c} (-L)^k = prod_{j<m} (I + (-L)^(2^j)) with 2^m >= c, m = ceil(log2 c) factors."""
    power = -strict_lower
    out = rhs + power @ rhs
    for _ in range((strict_lower.shape[-1] - 1).bit_length() - 1):
        power = power @ power
        out = out + power @ out
    return out


def read_mask(c: int, strict: bool, device: torch.device) -> Tensor:
    """(c, c): which tokens j of its chunk token i reads: j <= i, or j < i with ``strict``."""
    return torch.ones(c, c, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def read_product(attn: Tensor, x: Tensor, strict: bool) -> Tensor:
    """attn @ x for a chunk's read weights ``attn`` (..., c, c), zero where :func:`read_mask` is False, and x
    (..., c, E), such that row i depends on rows j <= i of x alone (j < i with ``strict``), non-finite ones too.

    A plain product multiplies a later token's inf or NaN by the zero weight (0 * inf = NaN) and hands it to every
    earlier row of the chunk; here the product runs on x with its non-finite entries zeroed, and each output entry
    that a non-finite entry of x does reach (the same column, an earlier or equal row) is NaN."""
    bad = ~torch.isfinite(x)
    out = attn @ x.masked_fill(bad, 0)
    reached = bad.cumsum(dim=-2, dtype=torch.int32) > 0  # any non-finite entry at or before row i
    if strict:  # row i reads rows before it only
        reached = F.pad(reached, (0, 0, 1, 0))[..., :-1, :]
    return out.masked_fill(reached, float("nan"))


def chunk_states(kv: Tensor, decay: Optional[Tensor], s0: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """States entering each chunk of S_c = decay_c * S_{c-1} + kv_c, and the last state. kv (B, H, nc, D, E);
    decay (B, H, nc, G, 1) with G 1 or D, or None (no decay: an exclusive cumulative sum); s0 (B, H, D, E) or None.
    With decay the loop over chunks is one fused multiply-add each."""
    if decay is None:
        total = kv.cumsum(dim=2)
        if s0 is not None:
            total = total + s0.unsqueeze(2)
        first = s0.unsqueeze(2) if s0 is not None else torch.zeros_like(kv[:, :, :1])
        return torch.cat([first, total[:, :, :-1]], dim=2), total[:, :, -1]
    s = s0 if s0 is not None else kv.new_zeros(kv[:, :, 0].shape)
    return chain(lambda s, decay_c, kv_c: torch.addcmul(kv_c, decay_c, s), s, decay.movedim(2, 0), kv.movedim(2, 0),
                 stack_dim=2)


def chain(step, s: Tensor, *xs: Tensor, stack_dim: int = 0) -> Tuple[Tensor, Tensor]:
    """s <- step(s, x_0[t], x_1[t], ...) for t along the first dim of every x: returns the states entering each step,
    stacked along ``stack_dim`` (T at that position of s's shape), and the last state.

    A Python loop, except when the number of steps is symbolic (torch.export with dynamic sizes, where a loop would
    fix it to the traced size): then torch's scan operator, which keeps it symbolic in the graph."""
    if isinstance(xs[0].shape[0], torch.SymInt):
        from torch._higher_order_ops.scan import scan
        last, entering = scan(lambda c, x: (step(c, *x), c.clone()), s, list(xs))
        return entering.movedim(0, stack_dim), last
    entering = []
    for x in zip(*(t.unbind(0) for t in xs)):
        entering.append(s)
        s = step(s, *x)
    return torch.stack(entering, dim=stack_dim), s


def check_lengths(lengths: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """The per-sample token counts of a bidirectional scan, checked: None, or a (B,) integer tensor on q's device
    with 1 <= lengths <= N (each sample's tokens first, then padding). Raises TypeError / ValueError naming
    ``lengths``."""
    if lengths is None:
        return None
    if not isinstance(lengths, Tensor):
        raise TypeError(f"lengths: expected a torch.Tensor or None, got {type(lengths).__name__}")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected an integer tensor, got {lengths.dtype}")
    if tuple(lengths.shape) != (q.shape[0],):
        raise ValueError(f"lengths: expected shape (B,) = ({q.shape[0]},), got {tuple(lengths.shape)}")
    if lengths.device != q.device:
        raise ValueError(f"lengths: on {lengths.device}, the inputs on {q.device}")
    if lengths.numel() and not is_tracing(*q.shape):  # (read on the host: one synchronisation on a GPU)
        low, high = int(lengths.min()), int(lengths.max())
        if low < 1 or high > q.shape[2]:
            raise ValueError(f"lengths: every value must lie in 1..N = 1..{q.shape[2]}, got "
                             f"{low if low < 1 else high}")
    return lengths


class Reversal:
    """The backward direction of a bidirectional scan: the token order reversed (``flip(2)``), or with per-sample
    ``lengths`` each sample's first ``lengths[b]`` tokens reversed and its padding left after them, so that the
    padding, a scan's last tokens in both directions, never reaches a real token. Its own inverse. ``valid``:
    (B, 1, N, 1) bool of the real tokens, or None without lengths."""

    def __init__(self, lengths: Optional[Tensor], n: int):
        self.index = self.valid = None
        if lengths is not None:
            t = torch.arange(n, device=lengths.device)
            inside = t < lengths[:, None]  # (B, N)
            self.index = torch.where(inside, lengths[:, None] - 1 - t, t)
            self.valid = inside[:, None, :, None]

    def __call__(self, x: Tensor) -> Tensor:
        """x (B or 1, H, N, X) in the reversed order."""
        if self.index is None:
            return x.flip(2)
        index = self.index[:, None, :, None]
        return x.expand(index.shape[0], *x.shape[1:]).gather(2, index.expand(-1, x.shape[1], -1, x.shape[3]))

    def clean(self, *xs: Tensor) -> Tuple[Tensor, ...]:
        """``xs`` (B, H, N, X) with zeros at the padding (which may hold anything), so that no chunk computation
        mixes a non-finite value into a real token's."""
        if self.valid is None:
            return xs
        return tuple(x.masked_fill(~self.valid, 0) for x in xs)
