"""Registry of token mixers, so that models and ablations pick a mixer by name, and the contract they keep.

A token mixer is a :class:`TokenMixer` built as ``cls(dim, num_heads, **kwargs)`` and called as ``mixer(x, ctx)``:
tokens x of shape (B, N, C) and one :class:`~linvision.layers.MixerContext` (or the grid (H, W) alone) to (B, N, C).

Every registered mixer is also registered with timm as a leaf of FX tracing (``register_notrace_module``): a
mixer builds its RoPE tables and checks the token count against the grid with Python ints, which symbolic
tracing cannot see. A traced model calls the mixer as one module (its parameters stay in the graph module), and
those checks still run on every call.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, FrozenSet, List, Sequence, Tuple, Type, Union

import torch
from timm.layers import register_notrace_module
from torch import nn
from torch.utils.checkpoint import checkpoint

from linvision.ops import is_exporting

from .context import CONTEXT_PARTS, MixerContext
from .weight_init import own_reset_parameters

__all__ = ["TokenMixer", "register_mixer", "create_mixer", "get_mixer_class", "list_mixers", "mixer_options",
           "mixer_option_default", "parse_mixer_list", "no_weight_decay_of", "mixer_accepts", "check_context",
           "check_prefix_tokens", "run_attend"]

_MIXERS: Dict[str, Type[nn.Module]] = {}
_ALIASES: Dict[str, str] = {}  # alias -> registered name


class TokenMixer(nn.Module):
    """What every registered token mixer is; :func:`register_mixer` refuses a class that does not derive from it.

    - Built as ``cls(dim, num_heads, **options)``; its options are the keyword arguments of its ``__init__`` (and
      of the bases it hands ``**kwargs`` to), as :meth:`options` lists them, all fixed at construction. Models
      give each mixer only the options it has (:func:`linvision.layers.stage_mixer_options`).
    - Called one way, ``mixer(x, ctx)``: tokens x (B, N, C) and a :class:`~linvision.layers.MixerContext` ctx
      (the grid (H, W) alone stands for ``MixerContext((H, W))``) -> (B, N, C). ``forward`` checks x (a
      (B, N, C) tensor, C the mixer's ``dim``) and that ctx holds no part the class does not take, each in one
      line, then calls :meth:`mix`, which a mixer implements.
    - ``accepts``: the parts of the context beyond the grid the class takes (of
      :data:`~linvision.layers.context.CONTEXT_PARTS`): ``"prefix_tokens"`` (x holds P class / register tokens
      before the H * W grid tokens) and ``"layout"`` (a batch of images of different sizes,
      :class:`~linvision.layers.layout.TokenLayout`, each image given what it gets alone). None here: a mixer on
      the grid itself (windows, convolutions, scans along the raster order). The block's input before its norm
      (``ctx.block_input``) is always offered; a mixer reads it or not.
    - ``init_weights()``: its own start (a gate's biases, ...), which models re-apply after their generic
      initialisation (:func:`linvision.layers.init_model_weights`); by default the mixer's own
      ``reset_parameters()`` when its class defines one, else nothing.
    - ``no_weight_decay()``: names (relative to the mixer) of parameters weight decay must leave alone.
    - ``recompute_attend``: the training-memory policy. True: the per-token tensors the mixer builds beyond its
      projections (features, augmented or windowed copies, gates, states) are not kept for the backward but
      recomputed there (its mixing runs twice in training; fewer bytes held for every layer); the mixer's
      :meth:`mix` honours it. False (the default here): the mixer keeps what autograd keeps, as a mixer that
      builds no such tensors, or whose op saves only its inputs, should. The attention mixers
      (:class:`linvision.layers.AttentionMixer`) start at True and recompute their ``attend`` under it; the
      linear and softmax ones, which keep nothing of their own, set False. An instance may override its class.

    A mixer handed to a model as a class (timm's layer arguments take classes too) only needs a ``forward(x,
    ctx)`` of this contract.
    """

    accepts: FrozenSet[str] = frozenset()
    recompute_attend = False

    def forward(self, x: torch.Tensor, ctx: Union[MixerContext, Tuple[int, int]]) -> torch.Tensor:
        """x (B, N, C) on the context ``ctx`` -> (B, N, C): the checks, then :meth:`mix`."""
        ctx = MixerContext.of(ctx)
        _check_tokens(self, x)
        check_context(self, ctx)
        return self.mix(x, ctx)

    def mix(self, x: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
        """The mixing itself, on checked tokens and context."""
        raise NotImplementedError(f"{type(self).__name__}: a TokenMixer implements mix(x, ctx)")

    def init_weights(self) -> None:
        """Re-apply the mixer's own initialisation: here its own ``reset_parameters()``, when its class defines
        one, else nothing."""
        reset = own_reset_parameters(self)
        if reset is not None:
            reset()

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set()

    @classmethod
    def options(cls) -> List[str]:
        """The keyword options this mixer takes besides dim and num_heads."""
        return mixer_options(cls)


def run_attend(mixer: nn.Module, attend: Callable[..., torch.Tensor], q: torch.Tensor, *args: Any,
               **kwargs: Any) -> torch.Tensor:
    """``attend(q, *args, **kwargs)`` under the mixer's ``recompute_attend`` policy: checkpointed (non-reentrant:
    its per-token tensors recomputed in the backward) when the policy is on and a gradient flows through q. The
    policy holds under torch.compile too, which traces the checkpoint as one region it recomputes; torch.export,
    whose graphs serve inference, runs ``attend`` plainly."""
    if getattr(mixer, "recompute_attend", False) and torch.is_grad_enabled() and q.requires_grad \
            and not is_exporting():
        return checkpoint(attend, q, *args, use_reentrant=False, **kwargs)
    return attend(q, *args, **kwargs)


def _check_tokens(mixer: nn.Module, x: torch.Tensor) -> None:
    """x a (B, N, C) tensor with C the mixer's ``dim`` (where it has one); TypeError / ValueError in one line
    naming x, its shape and what the mixer takes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor of tokens (B, N, C), got {type(x).__name__}")
    dim = getattr(mixer, "dim", None)
    if x.dim() != 3 or (isinstance(dim, int) and x.shape[-1] != dim):
        raise ValueError(f"x: the {_mixer_name(mixer)!r} mixer takes tokens (B, N, C) with C = "
                         f"{dim if isinstance(dim, int) else 'its dim'}, got shape {tuple(x.shape)}")


def register_mixer(name: str, *aliases: str) -> Callable[[Type[nn.Module]], Type[nn.Module]]:
    """Class decorator that registers a token mixer under ``name`` (and with timm as an FX leaf module); TypeError
    for a class that is not a :class:`TokenMixer`. ``aliases``: other names that build the same class (older
    spellings configs still use); :func:`list_mixers` lists ``name`` only."""

    def wrap(cls: Type[nn.Module]) -> Type[nn.Module]:
        if not (isinstance(cls, type) and issubclass(cls, TokenMixer)):
            raise TypeError(f"register_mixer: {getattr(cls, '__name__', cls)!r} is not a TokenMixer subclass "
                            f"(linvision.layers.TokenMixer: the contract every registered mixer keeps)")
        for key in (name, *aliases):
            known = _MIXERS.get(key) or _MIXERS.get(_ALIASES.get(key, ""))
            if known is not None and known is not cls:
                raise ValueError(f"name: token mixer {key!r} is already registered by {known.__name__}")
        _MIXERS[name] = cls
        _ALIASES.update({alias: name for alias in aliases})
        return register_notrace_module(cls)

    return wrap


def list_mixers() -> List[str]:
    return sorted(_MIXERS)


MixerSpec = Union[str, Type[nn.Module]]


def get_mixer_class(mixer: MixerSpec) -> Type[nn.Module]:
    """The class of a registered mixer name, or ``mixer`` itself when it is an ``nn.Module`` subclass (as timm's
    layer arguments take a name or a class). ValueError names the known mixers otherwise."""
    if isinstance(mixer, type) and issubclass(mixer, nn.Module):
        return mixer
    if isinstance(mixer, str) and mixer in _ALIASES:
        return _MIXERS[_ALIASES[mixer]]
    if not isinstance(mixer, str) or mixer not in _MIXERS:
        aliases = "".join(f", {a} (= {n})" for a, n in sorted(_ALIASES.items()))
        raise ValueError(f"token mixer: unknown {mixer!r}; allowed: {', '.join(list_mixers())}{aliases} "
                         "or an nn.Module class")
    return _MIXERS[mixer]


def create_mixer(mixer: MixerSpec, dim: int, num_heads: int, **kwargs) -> nn.Module:
    """Build the mixer registered as ``mixer`` (or the class ``mixer``) as ``cls(dim, num_heads, **kwargs)``."""
    return get_mixer_class(mixer)(dim, num_heads, **kwargs)


def mixer_accepts(mixer: Union[MixerSpec, nn.Module], part: str) -> bool:
    """Whether a mixer (a registered name, a class or a built mixer) takes the context part ``part`` (one of
    :data:`~linvision.layers.context.CONTEXT_PARTS`) beyond its grid; ValueError for another part."""
    if part not in CONTEXT_PARTS:
        raise ValueError(f"part: unknown {part!r}; allowed: {', '.join(CONTEXT_PARTS)}")
    cls = mixer if isinstance(mixer, nn.Module) else get_mixer_class(mixer)
    return part in getattr(cls, "accepts", ())


def check_prefix_tokens(mixer: Union[MixerSpec, nn.Module], num_prefix_tokens: int) -> int:
    """``num_prefix_tokens`` as an int; ValueError, naming the mixer, for a negative count or for prefix tokens
    given to a mixer that works on the grid itself (windows, convolutions, scans along the raster order)."""
    if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens: must be an int >= 0, got {num_prefix_tokens!r}")
    if num_prefix_tokens and not mixer_accepts(mixer, "prefix_tokens"):
        name = _mixer_name(mixer)
        raise ValueError(f"token mixer {name!r} cannot take prefix tokens (class / register tokens): it works on "
                         "the token grid itself; use a model without class_token / reg_tokens")
    return num_prefix_tokens


def check_context(mixer: Union[MixerSpec, nn.Module], ctx: MixerContext) -> None:
    """ValueError, naming the mixer, for a part of ``ctx`` the mixer does not take: prefix tokens
    (:func:`check_prefix_tokens`) or a layout (a batch of images of different sizes it cannot keep apart)."""
    check_prefix_tokens(mixer, ctx.num_prefix_tokens)
    if ctx.layout is not None and not mixer_accepts(mixer, "layout"):
        raise ValueError(f"token mixer {_mixer_name(mixer)!r} cannot take a batch of images of different sizes "
                         f"(patch_coord / patch_valid): it has no token mask; mixers that do: "
                         f"{', '.join(n for n in list_mixers() if mixer_accepts(n, 'layout'))}")


def _mixer_name(mixer: Union[MixerSpec, nn.Module]) -> str:
    """The registered name of a mixer (a name, a class or a built mixer), else its class name."""
    cls = type(mixer) if isinstance(mixer, nn.Module) else mixer
    if isinstance(cls, str):
        return cls
    return next((n for n, c in _MIXERS.items() if c is cls), cls.__name__)


def mixer_options(mixer: MixerSpec) -> List[str]:
    """Keyword options the mixer (a registered name or a class) accepts besides dim and num_heads, following
    ``**kwargs`` up the class hierarchy. Models use it to hand shared options (e.g. ``rope``) only to the mixers
    that have them."""
    options: List[str] = []
    for cls in get_mixer_class(mixer).__mro__:
        if "__init__" not in vars(cls):
            continue
        params = list(inspect.signature(vars(cls)["__init__"]).parameters.values())[3:]  # self, dim, num_heads
        options += [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return sorted(set(options))


def mixer_option_default(mixer: MixerSpec, option: str) -> Any:
    """The default of a mixer's keyword ``option`` (the first class up its hierarchy that declares it); None when
    the mixer does not take it."""
    for cls in get_mixer_class(mixer).__mro__:
        if "__init__" in vars(cls):
            param = inspect.signature(vars(cls)["__init__"]).parameters.get(option)
            if param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                return None if param.default is param.empty else param.default
    return None


def parse_mixer_list(token_mixers: Union[MixerSpec, Sequence[MixerSpec]], num_stages: int,
                     name: str = "token_mixers", unit: str = "stages") -> Tuple[MixerSpec, ...]:
    """"linear,linear,none,softmax", one mixer (name or class) or a sequence of them -> a tuple of
    ``num_stages`` mixers; one mixer is repeated for every stage. Raises ValueError (naming ``name``, and what
    the mixers are for as ``unit``) for a wrong count or an unknown mixer."""
    if isinstance(token_mixers, str):
        names = [n.strip() for n in token_mixers.split(",")]
    elif isinstance(token_mixers, type):
        names = [token_mixers]
    else:
        names = [n.strip() if isinstance(n, str) else n for n in token_mixers]
    if len(names) == 1:
        names = names * num_stages
    if len(names) != num_stages:
        raise ValueError(f"{name}: {len(names)} names {names} for {num_stages} {unit}; give 1 or {num_stages}")
    unknown = [n for n in names if not (isinstance(n, type) and issubclass(n, nn.Module)) and n not in _MIXERS
               and n not in _ALIASES]
    if unknown:
        aliases = "".join(f", {a} (= {n})" for a, n in sorted(_ALIASES.items()))
        raise ValueError(f"{name}: unknown {unknown}; allowed: {', '.join(list_mixers())}{aliases}")
    return tuple(names)


def no_weight_decay_of(model: nn.Module) -> set:
    """Full names of the parameters that the sub-modules of ``model`` exclude from weight decay through their
    own ``no_weight_decay()`` (timm's convention), so a model aggregates them instead of matching names."""
    names = set()
    for prefix, module in model.named_modules():
        if module is not model and hasattr(module, "no_weight_decay"):
            names |= {f"{prefix}.{n}" for n in module.no_weight_decay()}
    return names
