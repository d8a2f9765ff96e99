"""How a model's options reach its parts: one merge of entry-point defaults with the caller's keywords, and the
options of each stage's token mixer, where the family's defaults may go unused but the caller's never vanish; and
the checks of options at construction (sizes, ratios, grids) and of the images a model takes (:func:`check_images`),
each refusal one line naming the argument, the value and what is allowed; :func:`pad_to_kernel`, the zero padding
that lets a strided convolution take an image smaller than its kernel."""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import Tensor, nn

from linvision.ops.common import check_grid, check_int

from .registry import MixerSpec, _mixer_name, mixer_option_default, mixer_options

__all__ = ["merge_options", "stage_mixer_options", "routed_options", "lepe_size", "check_size", "check_number",
           "check_square_grid", "check_images", "pad_to_kernel"]


def check_size(name: str, value: Any, minimum: int = 1, odd: bool = False) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum`` (and odd with ``odd``: a kernel that keeps the grid's
    size); ValueError naming ``name``, the value and what is allowed otherwise."""
    if odd and not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum and value % 2):
        raise ValueError(f"{name}: must be an odd int >= {minimum}, got {value!r}")
    return check_int(name, value, minimum)


def check_number(name: str, value: Any, low: float = 0.0, high: Optional[float] = None,
                 closed_low: bool = False) -> float:
    """``value`` as a float if it is a real number (not a bool) in (low, high] ([low, high] with ``closed_low``;
    no upper bound without ``high``); TypeError for anything but a number, ValueError out of range, naming
    ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    above = value >= low if closed_low else value > low
    if not (above and (high is None or value <= high)):
        interval = f"{'[' if closed_low else '('}{low}, {'inf)' if high is None else f'{high}]'}"
        raise ValueError(f"{name}: must lie in {interval}, got {value!r}")
    return float(value)


def check_square_grid(name: str, value: Any) -> Tuple[int, int]:
    """(rows, cols) from one positive int (a square grid) or a pair of them; ValueError naming ``name``."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    try:
        return check_grid(value, name=name)
    except ValueError:
        raise ValueError(f"{name}: expected a positive int or (rows, cols) of positive ints, got {value!r}") from None


def merge_options(*defaults: Optional[Mapping[str, Any]], **kwargs: Any) -> Dict[str, Any]:
    """The keywords a model entry point builds with: ``defaults`` merged left to right (a later one wins), then
    the caller's ``kwargs``, which override any default (``token_mixers=``, sizes, any key)."""
    out: Dict[str, Any] = {}
    for d in defaults:
        out.update(d or {})
    out.update(kwargs)
    return out


# An option that sizes what another one turns on: it goes only to the mixers where that one is on.
COMPANIONS = {"lepe_kernel": "lepe"}


def stage_mixer_options(mixers: Sequence[MixerSpec], options: Optional[Mapping[str, Any]] = None,
                        defaults: Optional[Mapping[str, Any]] = None, name: str = "mixer_kwargs",
                        current: Optional[Sequence[Mapping[str, Any]]] = None) -> List[Dict[str, Any]]:
    """The options of each stage's mixer: ``defaults`` (the family's, e.g. ``gate=True``) where that mixer takes
    them, overridden by ``options`` (the caller's). Every one of ``options`` must be an option of at least one of
    ``mixers``; ValueError in one line, naming the option and the mixers with their options, otherwise (a
    misspelt option would otherwise be dropped without a word). An option of :data:`COMPANIONS` goes only to the
    mixers whose switch is on (in these options, else in ``current``, each mixer's options so far, else by the
    mixer's default); ValueError in one line when the caller's reaches none."""
    options, defaults = dict(options or {}), dict(defaults or {})
    accepted = [set(mixer_options(m)) for m in mixers]
    unknown = [k for k in options if not any(k in a for a in accepted)]
    if unknown:
        names = list(dict.fromkeys(_mixer_name(m) for m in mixers))
        known = sorted(set().union(*accepted))
        raise ValueError(f"{name}: {', '.join(repr(k) for k in unknown)} is not an option of the "
                         f"{' or '.join(names)} mixer{'s' if len(names) > 1 else ''} (options: "
                         f"{', '.join(known) or 'none'})")
    merged = {**defaults, **options}
    chosen = [{k: v for k, v in merged.items() if k in a} for a in accepted]
    for i, own in enumerate(chosen):
        kept = routed_options(mixers[i], {**(current[i] if current else {}), **own})
        chosen[i] = {k: v for k, v in own.items() if k in kept}
    for option, switch in COMPANIONS.items():
        if option in options and not any(option in own for own in chosen):
            raise ValueError(f"{name}: {option!r} sizes what {switch!r} turns on, and no block it is given to has "
                             f"{switch}=True (set {switch}=True with it)")
    return chosen


def routed_options(mixer: MixerSpec, options: Mapping[str, Any]) -> Dict[str, Any]:
    """A mixer's full ``options`` without the options of :data:`COMPANIONS` whose switch is off there (given, or
    by the mixer's default): a family's ``lepe_kernel`` stays out of a block whose LePE the caller turned off."""
    out = dict(options)
    for option, switch in COMPANIONS.items():
        if option in out and not out.get(switch, mixer_option_default(mixer, switch)):
            del out[option]
    return out


def lepe_size(lepe: bool, lepe_kernel: Optional[int], default: int) -> int:
    """The kernel size of a mixer's LePE convolution: ``lepe_kernel`` (odd), or ``default`` when None. ValueError
    naming lepe_kernel when it is given with ``lepe`` off (it would size a convolution there is none of)."""
    if lepe_kernel is None:
        return default
    check_size("lepe_kernel", lepe_kernel, odd=True)
    if not lepe:
        raise ValueError(f"lepe_kernel: {lepe_kernel} sizes the LePE convolution, which is off (lepe=False); set "
                         "lepe=True with it")
    return lepe_kernel


@register_notrace_function  # a node of timm's FX graphs: the check runs on every traced call
def check_images(x: Any, in_chans: int, size: Optional[Tuple[int, int]] = None,
                 multiple: Optional[Tuple[int, int]] = None) -> None:
    """The check at a model's entry, before any work: ``x`` a floating-point (B, in_chans, H, W) tensor, B >= 0 and
    H, W >= 1; with ``size`` exactly (H, W) = size (a fixed position embedding), with ``multiple`` H and W
    multiples of it (a patch grid). TypeError / ValueError in one line naming x, its shape and what is allowed."""
    if isinstance(x, torch.fx.Proxy):  # traced by torch.fx itself: checked when the graph runs instead
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor of images (B, {in_chans}, H, W), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected floating-point images, got dtype {x.dtype} (convert, e.g. x.float() / 255)")
    if x.dim() != 4 or x.shape[1] != in_chans or x.shape[2] < 1 or x.shape[3] < 1:
        raise ValueError(f"x: expected images (B, {in_chans}, H, W) with H, W >= 1 (in_chans={in_chans}), got shape "
                         f"{tuple(x.shape)}")
    h, w = x.shape[2], x.shape[3]
    if size is not None and (h, w) != tuple(size):
        raise ValueError(f"x: this model takes {size[0]}x{size[1]} images (a fixed position embedding; "
                         f"dynamic_img_size=True resamples it), got {h}x{w}")
    if multiple is not None and (h % multiple[0] or w % multiple[1]):
        raise ValueError(f"x: height and width must be multiples of the patch size {multiple[0]}x{multiple[1]}, "
                         f"got {h}x{w}")


@register_notrace_function  # reads the input's size: one leaf of timm's FX graphs
def pad_to_kernel(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """x (B, C, H, W) zero-padded at the bottom and right so that ``conv`` (its own padding included) has at least
    one window: an image smaller than the kernel gives one output row or column, as a larger one does; x itself
    when it is large enough."""
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    extra_h, extra_w = max(0, kh - 2 * ph - x.shape[2]), max(0, kw - 2 * pw - x.shape[3])
    return F.pad(x, (0, extra_w, 0, extra_h)) if extra_h or extra_w else x
