"""What ``linvision.ops`` and the kernels both need, on tensors, ints and flags only.

Installed as ``linvision.kernels.common``. It imports neither Triton nor anything from linvision, so the ops import
it on every platform; the dependency runs one way: ops -> kernels (this module and, lazily, the Triton kernels).

- :func:`check_qkv`, :func:`check_eps`, :func:`check_int`, :func:`check_grid`: the one validation of attention
  inputs, eps, chunk and split sizes and (H, W) token grids; errors name the argument, the value and what is
  allowed.
- :class:`RopeSpec`: a 2D rotation as plain data (frequency tensors, grid, prefix, offset) and
  :func:`check_rope`; ``linvision.ops.rope.Rope`` extends it with the PyTorch tables, the kernels build per-column and
  per-row cos/sin tables from the same fields and combine them in-kernel.
- :func:`compute_dtype` and :func:`feature_map_name`: the dtype every accumulation runs in, and the canonical name
  of a feature map (aliases resolved), which is how the kernels are told which map to fuse.
- :data:`FEATURE_MAPS`: the one table of the named feature maps and where each may be used (fused in the kernels,
  causal and recurrent forms, normalised mixers); every other list of maps is derived from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_EPS",
    "EPILOGUE_GATES",
    "check_epilogue",
    "FLOAT_DTYPES",
    "FEATURE_MAP_ALIASES",
    "FEATURE_MAPS",
    "FUSED_FEATURE_MAPS",
    "FeatureMapInfo",
    "KERNEL_NAMES",
    "RopeSpec",
    "check_eps",
    "check_grid",
    "check_int",
    "check_qkv",
    "check_valid",
    "check_rope",
    "compute_dtype",
    "feature_map_name",
    "feature_map_info",
    "feature_maps_where",
]

DEFAULT_EPS = 1e-4
# The four Triton kernels of la_kernels.py, by function name (here so that tools can name them without Triton).
KERNEL_NAMES = ("_state_fwd_kernel", "_output_fwd_kernel", "_query_bwd_kernel", "_key_bwd_kernel")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FEATURE_MAP_ALIASES = {"elu+1": "elu", "elu1": "elu", "softmax_kernel": "exp"}


@dataclass(frozen=True)
class FeatureMapInfo:
    """A named feature map: where it may be used and what it holds. Every list of maps, the kernels' codes, the
    PyTorch forms (``linvision.ops.feature_maps``) and the tensors a mixer keeps for a map are derived from these
    rows; a new map is a row here and its PyTorch form there.

    fused: its in-kernel code in the Triton kernels (None: not fused, the PyTorch path runs it).
    causal: exact in causal, step and recurrent forms. ``exp`` and ``performer`` are not: their key stabiliser is
        one constant per (batch, head), the max over *all* tokens, so a late large key would shift the scale of
        every earlier prefix (whose own keys then underflow); they are non-causal only.
    nonnegative: phi >= 0, so a normalised attention's denominator is a sum of non-negative weights (``identity``
        is not: the normalised mixers refuse it, the delta rule, which L2-normalises instead, takes it).
    learnable: the map learns a tensor of its own (``focused``: a per-channel scale), a mixer's parameter
        ``focus_scale``; by name in an op it runs with that tensor at its initial value (a unit scale).
    random: the map draws random tensors (``performer``: a projection), a mixer's persistent buffer
        ``performer_projection``; by name in an op it is refused (it would draw anew on every call).
    recompute: the reference path's backward recomputes the features instead of keeping them (it knows every
        tensor the map learns).
    """

    fused: Optional[int]
    causal: bool
    nonnegative: bool
    learnable: bool = False
    random: bool = False
    recompute: bool = True

    @property
    def stateful(self) -> bool:
        """The map holds tensors of its own (learnt or drawn)."""
        return self.learnable or self.random


FEATURE_MAPS = {
    "identity": FeatureMapInfo(fused=0, causal=True, nonnegative=False),
    "relu": FeatureMapInfo(fused=1, causal=True, nonnegative=True),
    "elu": FeatureMapInfo(fused=2, causal=True, nonnegative=True),
    "exp": FeatureMapInfo(fused=None, causal=False, nonnegative=True),
    "focused": FeatureMapInfo(fused=None, causal=True, nonnegative=True, learnable=True),
    "performer": FeatureMapInfo(fused=None, causal=False, nonnegative=True, random=True, recompute=False),
}
# name -> in-kernel code of the maps the Triton kernels apply themselves
FUSED_FEATURE_MAPS = {name: info.fused for name, info in FEATURE_MAPS.items() if info.fused is not None}
# The activations of an output gate the forward's epilogue applies, (attention + residual) * act(gate), and their
# in-kernel codes (0: no gate).
EPILOGUE_GATES = {"identity": 1, "silu": 2}


def feature_maps_where(**properties: bool) -> Tuple[str, ...]:
    """The names of :data:`FEATURE_MAPS` with every given property (e.g. ``causal=True``), in table order."""
    return tuple(name for name, info in FEATURE_MAPS.items()
                 if all(bool(getattr(info, key)) == value for key, value in properties.items()))


def feature_map_info(name: str) -> Optional[FeatureMapInfo]:
    """The :class:`FeatureMapInfo` of a map's name (aliases allowed), None for a name not in the table."""
    return FEATURE_MAPS.get(feature_map_name(name))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32: the dtype of every accumulation, rotation and division."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def feature_map_name(name: str) -> str:
    """Lower-case canonical name of a feature map (``"elu+1"`` -> ``"elu"``)."""
    return FEATURE_MAP_ALIASES.get(name.lower(), name.lower())


def check_qkv(q: Tensor, k: Tensor, v: Tensor, same_tokens: bool = True) -> None:
    """Validate attention inputs: q, k (B, H, N, D), v (B, H, Nk, Dv), one floating dtype, one device; with
    ``same_tokens`` also Nq == Nk (causal and RoPE attention).

    Raises TypeError for non-tensors and bad or mixed dtypes, ValueError for bad shapes or devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; allowed: float16, bfloat16, float32, float64")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: mixed dtypes {q.dtype}, {k.dtype}, {v.dtype}; all three must share one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: tensors on different devices {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v: batch and head dims must match, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k: head dim {k.shape[-1]} does not match q's head dim {q.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"v: {v.shape[2]} tokens, but k has {k.shape[2]}; keys and values must pair up")
    if same_tokens and q.shape[2] != k.shape[2]:
        raise ValueError(f"k: {k.shape[2]} tokens, but q has {q.shape[2]}; causal or RoPE attention needs equal counts")
    if k.shape[2] == 0:
        raise ValueError("k: zero tokens; attention needs at least one key")


def check_valid(valid: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The token mask of an attention call, checked: None, or a (B, Nk) bool tensor on the inputs' device that is
    True for the keys that count (with Nq == Nk also the queries whose outputs are kept; the others are zero; a
    sample without a valid key gets zeros). Raises TypeError / ValueError naming ``valid``."""
    if valid is None:
        return None
    if not isinstance(valid, Tensor):
        raise TypeError(f"valid: expected a torch.Tensor or None, got {type(valid).__name__}")
    if valid.dtype != torch.bool:
        raise TypeError(f"valid: expected a bool tensor, got {valid.dtype}")
    if tuple(valid.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"valid: expected shape (B, Nk) = {(k.shape[0], k.shape[2])}, got {tuple(valid.shape)}")
    if valid.device != k.device:
        raise ValueError(f"valid: on {valid.device}, the inputs on {k.device}")
    return valid


def check_eps(eps: float) -> float:
    """eps as a float; ValueError unless it is a positive number (bools are not numbers here)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: must be a positive number, got {eps!r}")
    return float(eps)


def check_int(name: str, value: int, minimum: int) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else ValueError naming ``name`` (chunk and split
    sizes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")
    return value


def check_grid(grid, num_tokens: Optional[int] = None, name: str = "grid") -> Tuple[int, int]:
    """(H, W) as ints; ValueError unless ``grid`` is two positive ints and, when ``num_tokens`` is given, has
    exactly that many cells. Symbolic ints (``torch.SymInt``, traced sizes) are accepted and returned as they are."""
    if (
        not isinstance(grid, (tuple, list))
        or len(grid) != 2
        or not all(isinstance(g, (int, torch.SymInt)) and not isinstance(g, bool) and g > 0 for g in grid)
    ):
        raise ValueError(f"{name}: expected (H, W) with two positive ints, got {grid!r}")
    # symbolic sizes (torch.export with dynamic H, W) stay symbolic: int() would fix them to the traced size
    h, w = (g if isinstance(g, torch.SymInt) else int(g) for g in grid)
    if num_tokens is not None and h * w != num_tokens:
        raise ValueError(f"{name}: grid {(h, w)} has {h * w} cells, but the input has N={num_tokens} tokens")
    return h, w


@dataclass(eq=False)
class RopeSpec:
    """Rotation of a (num_prefix_tokens + H*W)-token sequence, as data: channel pair t (channels t and t + P) of
    head h at grid position (row, col) turns by ``freqs_x[h, t] * (col + offset[1]) + freqs_y[h, t] * (row +
    offset[0])``; prefix tokens are not rotated.

    freqs_x, freqs_y: fp32 tensors of shape (P,) or (heads, P); P = D / 2 channel pairs. grid: (H, W).
    positions: instead of the grid's raster order, each sample's own (row, col) per token, a (B, M, 2) tensor
    (variable-size images in one batch: M tokens after the prefix, each sample's grid wherever its tokens say);
    ``grid`` is then (1, M).
    Raises ValueError for a bad grid, mismatched frequency shapes, a negative prefix or bad positions.
    """

    freqs_x: Tensor
    freqs_y: Tensor
    grid: Tuple[int, int]
    num_prefix_tokens: int = 0
    offset: Tuple[float, float] = (0.0, 0.0)
    positions: Optional[Tensor] = None

    def __post_init__(self):
        self.grid = check_grid(self.grid)
        if self.freqs_x.shape != self.freqs_y.shape or self.freqs_x.dim() not in (1, 2):
            raise ValueError(
                f"freqs_x, freqs_y: expected equal shapes (P,) or (heads, P), got {tuple(self.freqs_x.shape)} "
                f"and {tuple(self.freqs_y.shape)}"
            )
        if self.num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens: must be >= 0, got {self.num_prefix_tokens}")
        if self.positions is not None:
            p = self.positions
            if not isinstance(p, Tensor) or p.dim() != 3 or p.shape[-1] != 2:
                raise ValueError(f"positions: expected a (B, M, 2) tensor of (row, col), got "
                                 f"{tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__}")
            if self.grid != (1, p.shape[1]):
                raise ValueError(f"grid: with positions for {p.shape[1]} tokens the grid is (1, {p.shape[1]}), "
                                 f"got {self.grid}")

    @property
    def dim(self) -> int:
        """Head dim D the rotation applies to (2 * pairs)."""
        return 2 * self.freqs_x.shape[-1]

    @property
    def num_heads(self) -> int:
        """1 when every head shares the frequencies."""
        return 1 if self.freqs_x.dim() == 1 else self.freqs_x.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid[0] * self.grid[1]


def check_rope(rope: RopeSpec, dim: int, num_tokens: int, num_heads: int, batch: Optional[int] = None) -> None:
    """Raise ValueError unless ``rope`` fits inputs of head dim ``dim``, ``num_tokens`` tokens and ``num_heads``
    (and, for per-sample positions, ``batch`` samples when given)."""
    if rope.positions is not None and batch is not None and rope.positions.shape[0] not in (1, batch):
        raise ValueError(f"rope: positions for {rope.positions.shape[0]} samples, the input has {batch}")
    if dim != rope.dim:
        raise ValueError(f"rope: table is for head dim {rope.dim}, the (feature-mapped) input has D={dim}")
    if num_tokens != rope.num_tokens:
        raise ValueError(
            f"rope: table is for {rope.num_tokens} tokens (prefix {rope.num_prefix_tokens} + grid {rope.grid}), "
            f"input has N={num_tokens}"
        )
    if rope.num_heads not in (1, num_heads):
        raise ValueError(f"rope: frequencies for {rope.num_heads} heads, input has {num_heads} heads")


def check_epilogue(q: Tensor, v: Tensor, residual: Optional[Tensor], gate: Optional[Tensor],
                   gate_activation: str) -> None:
    """ValueError / TypeError in one line for an epilogue that does not fit the call: ``residual`` and ``gate``
    floating tensors of the output's shape (B, H, Nq, Dv) on q's device, ``gate_activation`` one of
    ``EPILOGUE_GATES``."""
    if gate_activation not in EPILOGUE_GATES:
        raise ValueError(f"gate_activation: unknown {gate_activation!r}; allowed: {', '.join(EPILOGUE_GATES)}")
    shape = (*q.shape[:3], v.shape[-1])
    for name, t in (("residual", residual), ("gate", gate)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating tensor, got "
                            f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
        if tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(f"{name}: expected shape {shape} (B, H, Nq, Dv) on {q.device}, got "
                             f"{tuple(t.shape)} on {t.device}")

