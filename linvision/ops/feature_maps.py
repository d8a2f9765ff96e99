"""Feature maps phi(x) >= 0 for linear attention.

Every map is a callable ``phi(x, is_query) -> Tensor`` on tensors of shape (B, H, N, D); it returns
(B, H, N, D') with D' = D except for Performer random features (D' = number of features).
``is_query`` matters only for maps with a stabiliser: a per-token rescaling of phi(q_i) cancels between the
numerator and the denominator of o_i, a per-token rescaling of phi(k_j) does not (it reweights the keys), so
keys may only be rescaled by one constant per (batch, head).

Sources:
- ``elu``: elu(x) + 1, Katharopoulos et al. 2020, "Transformers are RNNs" (arXiv:2006.16236).
- ``relu``: relu(x), EfficientViT (Cai et al. 2023, arXiv:2205.14756) and Sana (Xie et al. 2024, arXiv:2410.10629).
- ``exp``: exp(x - c), the "softmax kernel" without the dot product coupling (see module notes above on c).
- ``performer``: positive orthogonal random features of FAVOR+, Choromanski et al. 2021, "Rethinking
  Attention with Performers" (arXiv:2009.14794).
- ``focused``: the focused map of FLatten Transformer, Han et al. 2023 (arXiv:2308.00442):
  ||x'|| * x'^p / ||x'^p|| with x' = relu(x) / softplus(s), power p = 3 and a learnable scale s.
- ``identity``: no map; for callers that apply phi themselves (the result must be non-negative for the
  denominator to be meaningful).
"""
from __future__ import annotations

import inspect
import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import FEATURE_MAP_ALIASES, FEATURE_MAPS, compute_dtype, feature_map_info, feature_map_name

__all__ = [
    "FeatureMap",
    "PerformerFeatureMap",
    "FocusedFeatureMap",
    "elu_plus_one",
    "relu_features",
    "exp_features",
    "focused_features",
    "performer_features",
    "orthogonal_random_projection",
    "get_feature_map",
    "FEATURE_MAP_NAMES",
    "FeatureMapArg",
    "causal_features",
    "check_causal_map",
    "featurize",
]

# name -> the PyTorch form of each map of the table FEATURE_MAPS: a function phi(x, is_query), or the FeatureMap
# class of a map that holds tensors; filled by @_form below, checked against the table at the end of the module.
_FORMS: dict = {}


def _form(name: str):
    """Register the decorated function or class as the PyTorch form of the table's map ``name``."""
    if name not in FEATURE_MAPS:
        raise KeyError(f"{name!r} is not a row of FEATURE_MAPS (linvision.kernels.common): add the row first")

    def register(form):
        _FORMS[name] = form
        return form
    return register


@_form("elu")
def elu_plus_one(x: Tensor, is_query: bool = True) -> Tensor:
    """elu(x) + 1 = exp(min(x, 0)) + max(x, 0): computed so, since a CPU's exp is vectorised and the expm1
    inside F.elu is not (8x the time on the same tensor); equal up to the rounding of exp against expm1."""
    return torch.exp(x.clamp(max=0)) + F.relu(x)


@_form("relu")
def relu_features(x: Tensor, is_query: bool = True) -> Tensor:
    return F.relu(x)


@_form("identity")
def identity_features(x: Tensor, is_query: bool = True) -> Tensor:
    return x


def _stabiliser(x: Tensor, is_query: bool) -> Tensor:
    """Constant subtracted before exp: per token for queries, one per (batch, head) for keys.

    Not detached: the output depends on it only through eps, and keeping it in the graph makes the gradient
    the exact gradient of what is computed."""
    if is_query:
        return x.amax(dim=-1, keepdim=True)
    return x.amax(dim=(-2, -1), keepdim=True)


@_form("exp")
def exp_features(x: Tensor, is_query: bool = True) -> Tensor:
    """exp(x - c) with c the stabiliser of ``_stabiliser``; the largest value is exactly 1, so no overflow."""
    return torch.exp(x - _stabiliser(x, is_query))


def focused_features(x: Tensor, is_query: bool = True, power: float = 3.0, scale: Optional[Tensor] = None) -> Tensor:
    """FLatten's focused map. ``scale`` (broadcastable to (..., D)) is the raw learnable parameter s;
    the map divides by softplus(s). Without it the divisor is 1."""
    x = F.relu(x) + 1e-6
    if scale is not None:
        x = x / F.softplus(scale)
    norm = x.norm(dim=-1, keepdim=True)
    x_pow = x ** power
    return x_pow / x_pow.norm(dim=-1, keepdim=True) * norm


def orthogonal_random_projection(
    num_features: int, dim: int, generator: Optional[torch.Generator] = None, device=None
) -> Tensor:
    """(num_features, dim) Gaussian rows made orthogonal in blocks of ``dim``, each row rescaled to the norm of
    a Gaussian vector (the FAVOR+ estimator's unbiased orthogonal construction). fp32."""
    blocks = []
    remaining = num_features
    while remaining > 0:
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float32)
        qm, _ = torch.linalg.qr(g)
        rows = qm.T[: min(dim, remaining)]
        blocks.append(rows)
        remaining -= rows.shape[0]
    proj = torch.cat(blocks, dim=0)
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float32).norm(dim=1, keepdim=True)
    return (proj * norms).to(device)


def performer_features(x: Tensor, projection: Tensor, is_query: bool = True) -> Tensor:
    """Positive random features: phi(x) = exp(w.x' - |x'|^2 / 2 - c) / sqrt(m), x' = x / D^(1/4).

    With this scaling E[phi(q).phi(k)] is proportional to exp(q.k / sqrt(D)), the softmax attention kernel.
    ``projection`` has shape (m, D); c is the stabiliser described in the module docstring.
    """
    d = x.shape[-1]
    if projection.shape[-1] != d:
        raise ValueError(f"projection: last dim {projection.shape[-1]} does not match the head dim {d} of the input")
    x = x * d ** -0.25
    wx = torch.einsum("...d,md->...m", x, projection.to(dtype=x.dtype, device=x.device))
    wx = wx - 0.5 * (x * x).sum(dim=-1, keepdim=True)
    return torch.exp(wx - _stabiliser(wx, is_query)) / math.sqrt(projection.shape[0])


class FeatureMap:
    """A named feature map. ``name`` tells fused kernels which map to apply in-kernel."""

    def __init__(self, name: str, fn: Callable[[Tensor, bool], Tensor]):
        self.name = name
        self.fn = fn

    def __call__(self, x: Tensor, is_query: bool = True) -> Tensor:
        return self.fn(x, is_query)

    def output_dim(self, dim: int) -> int:
        return dim

    def __repr__(self) -> str:
        return f"FeatureMap({self.name!r})"


@_form("performer")
class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive random features with a projection held by this object.

    ``redraw(generator)`` draws a new projection (Performer redraws it periodically during training).
    ``to(device)`` moves the projection.
    """

    def __init__(self, dim: int, num_features: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 projection: Optional[Tensor] = None):
        """A new projection of ``num_features`` (default ``dim``) rows drawn with ``generator``, or ``projection``
        (num_features, dim) as it is (a module's buffer: the map then reads it, and a redraw fills it in place)."""
        self.dim = dim
        if projection is not None:
            if projection.dim() != 2 or projection.shape[1] != dim:
                raise ValueError(f"projection: expected (num_features, {dim}), got {tuple(projection.shape)}")
            self.num_features = projection.shape[0]
            self.projection = projection
        else:
            self.num_features = num_features or dim
            self.projection = orthogonal_random_projection(self.num_features, dim, generator)
        super().__init__("performer", self._apply)

    def _apply(self, x: Tensor, is_query: bool = True) -> Tensor:
        return performer_features(x, self.projection, is_query)

    def redraw(self, generator: Optional[torch.Generator] = None) -> None:
        """A new projection, written into the held tensor (so a module's buffer holding it is redrawn too)."""
        with torch.no_grad():
            fresh = orthogonal_random_projection(self.num_features, self.dim, generator)
            self.projection.copy_(fresh.to(self.projection))

    def to(self, device) -> "PerformerFeatureMap":
        self.projection = self.projection.to(device)
        return self

    def output_dim(self, dim: int) -> int:
        return self.num_features


@_form("focused")
class FocusedFeatureMap(FeatureMap):
    """FLatten's focused map with power ``power`` and an optional raw scale tensor."""

    def __init__(self, power: float = 3.0, scale: Optional[Tensor] = None):
        self.power = power
        self.scale = scale
        super().__init__("focused", self._apply)

    def _apply(self, x: Tensor, is_query: bool = True) -> Tensor:
        return focused_features(x, is_query, self.power, self.scale)


if set(_FORMS) != set(FEATURE_MAPS):  # a row of the table without its PyTorch form (or the reverse)
    raise ImportError(f"feature maps without a PyTorch form: {sorted(set(FEATURE_MAPS) ^ set(_FORMS))}")
# the named maps that hold nothing, resolved once: get_feature_map(name) hands out these objects
_STATELESS = {name: FeatureMap(name, form) for name, form in _FORMS.items() if not FEATURE_MAPS[name].stateful}
# every name get_feature_map takes: the table of linvision.kernels.common.FEATURE_MAPS and its aliases
FEATURE_MAP_NAMES = tuple(sorted(set(FEATURE_MAPS) | set(FEATURE_MAP_ALIASES)))


FeatureMapArg = Union[str, Callable, FeatureMap]


def get_feature_map(feature_map: FeatureMapArg, dim: Optional[int] = None) -> FeatureMap:
    """Resolve a name or callable to a :class:`FeatureMap`.

    Names (:data:`FEATURE_MAP_NAMES`): ``elu`` (alias ``elu+1``), ``relu``, ``exp``, ``identity``, ``focused``
    (p=3, unit scale). ``performer`` is refused by name: it would draw a new random projection on every call, so
    two identical calls would differ; hold a :class:`PerformerFeatureMap` (or use a mixer, which keeps its
    projection as a buffer). A callable may take ``(x)`` or ``(x, is_query)``. Raises ValueError for an unknown
    name and TypeError for anything else. ``dim`` is accepted for callers that pass the head dim; no map needs it.
    """
    if isinstance(feature_map, FeatureMap):
        return feature_map
    if isinstance(feature_map, str):
        name = feature_map_name(feature_map)
        info = FEATURE_MAPS.get(name)
        if info is None:
            raise ValueError(f"feature_map: unknown name {feature_map!r}; allowed: {', '.join(FEATURE_MAP_NAMES)} "
                             "or a callable")
        if info.random:
            raise ValueError(f"feature_map: {name!r} by name would draw a new random projection on every call; "
                             f"pass a {_FORMS[name].__name__}, which holds one")
        return _STATELESS[name] if name in _STATELESS else _FORMS[name]()
    if callable(feature_map):
        try:
            n_params = len(inspect.signature(feature_map).parameters)
        except (TypeError, ValueError):
            n_params = 2
        # "custom:" keeps a user function named e.g. "relu" from being mistaken for a kernel-fusable map.
        name = "custom:" + getattr(feature_map, "__name__", type(feature_map).__name__)
        if n_params == 1:
            return FeatureMap(name, lambda x, is_query: feature_map(x))
        return FeatureMap(name, feature_map)
    raise TypeError(f"feature_map: expected a name or a callable, got {type(feature_map).__name__}")


def check_causal_map(phi: FeatureMap, op: str) -> FeatureMap:
    """``phi`` if it is exact in causal, step and recurrent forms, else ValueError naming ``op`` and the reason
    (``exp``, ``performer``: their key stabiliser is a max over all tokens, future ones included)."""
    info = feature_map_info(phi.name)
    if info is not None and not info.causal:
        allowed = ", ".join(n for n, i in FEATURE_MAPS.items() if i.causal)
        raise ValueError(
            f"feature_map: {phi.name!r} is for non-causal attention only ({op} refuses it): its key stabiliser is "
            f"a max over all tokens, so a later key would change earlier outputs; allowed here: {allowed}"
        )
    return phi


def featurize(phi: FeatureMap, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(phi(q), phi(k), v), all three in the compute dtype (fp32, float64 for float64 inputs)."""
    cdt = compute_dtype(q.dtype)
    return phi(q.to(cdt), True), phi(k.to(cdt), False), v.to(cdt)


def causal_features(feature_map: FeatureMapArg, q: Tensor, k: Tensor, v: Tensor, op: str
                    ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`featurize` for a causal, step or recurrent op ``op``: the map resolved and checked by
    :func:`check_causal_map` first."""
    return featurize(check_causal_map(get_feature_map(feature_map), op), q, k, v)
