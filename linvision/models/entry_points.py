"""The timm entry points of the families: a registered function per model name that builds the family's model from
its defaults and the caller's keywords. Written once here (:func:`entry_point`), so that an entry point is its name,
its defaults and its docstring."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

from timm.models import register_model
from torch import nn

from linvision.layers import merge_options

__all__ = ["entry_point"]


def entry_point(create: Callable[..., nn.Module], *defaults: Dict[str, Any],
                options: Optional[Callable[..., Dict[str, Any]]] = None) -> Callable[[Callable], Callable]:
    """Decorator of a timm entry point ``name(pretrained=False, **kwargs)`` whose body is its docstring: the
    registered function builds ``create(name, pretrained, **merge_options(*defaults, **kwargs))`` (the caller's
    keywords over the defaults, a later default over an earlier one), or with ``options(name, *defaults,
    **kwargs)`` in place of merge_options where the family's rule needs the name. Registered with timm under
    the function's name, module and docstring."""

    def wrap(fn: Callable) -> Callable:
        name = fn.__name__

        def entry(pretrained: bool = False, **kwargs: Any) -> nn.Module:
            args = options(name, *defaults, **kwargs) if options else merge_options(*defaults, **kwargs)
            return create(name, pretrained, **args)

        return register_model(functools.update_wrapper(entry, fn))
    return wrap
