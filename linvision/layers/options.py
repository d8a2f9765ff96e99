"""How a model's options reach its parts: one merge of entry-point defaults with the caller's keywords, and the
options of each stage's token mixer, where the family's defaults may go unused but the caller's never vanish; and
the checks of options at construction (sizes, ratios, grids), each refusal one line naming the option, the value
and what is allowed."""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from linvision.ops.common import check_grid, check_int

from .registry import MixerSpec, _mixer_name, mixer_options

__all__ = ["merge_options", "stage_mixer_options", "check_size", "check_number", "check_square_grid"]


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


def stage_mixer_options(mixers: Sequence[MixerSpec], options: Optional[Mapping[str, Any]] = None,
                        defaults: Optional[Mapping[str, Any]] = None, name: str = "mixer_kwargs"
                        ) -> List[Dict[str, Any]]:
    """The options of each stage's mixer: ``defaults`` (the family's, e.g. ``gate=True``) where that mixer takes
    them, overridden by ``options`` (the caller's). Every one of ``options`` must be an option of at least one of
    ``mixers``; ValueError in one line, naming the option and the mixers with their options, otherwise (a
    misspelt option would otherwise be dropped without a word)."""
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
    return [{k: v for k, v in merged.items() if k in a} for a in accepted]
