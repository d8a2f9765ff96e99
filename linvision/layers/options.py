"""How a model's options reach its parts: one merge of entry-point defaults with the caller's keywords, and the
options of each stage's token mixer, where the family's defaults may go unused but the caller's never vanish."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from .registry import MixerSpec, _mixer_name, mixer_options

__all__ = ["merge_options", "stage_mixer_options"]


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
