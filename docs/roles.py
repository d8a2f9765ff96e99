"""A Griffe extension for the API reference: reST cross-reference roles in docstrings become links.

The docstrings are Google style but name other objects with reST roles (``:func:`linear_attention```,
``:class:`~.common.RopeSpec```, ``:meth:`~LinSanaTransformer2DModel.from_pretrained```, ``:mod:`...```,
``:attr:``, ``:data:``, ``:exc:``, ``:obj:``), which Markdown would print as written. When the package is loaded,
every such role is rewritten: a name that resolves, as Python would resolve it from the docstring's object (its
scope and its parents', imports included, a leading dot relative to the module's package), becomes an optional
cross-reference to the object's canonical path, a link wherever the reference renders that object and plain code
elsewhere; a name that does not resolve becomes plain code. ``~`` shows only the last part of the name, as in
Sphinx. mkdocs.yml loads this file through mkdocstrings' ``extensions`` option.
"""
from __future__ import annotations

import html
import re
from typing import Optional

import griffe

ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|attr|data|exc|obj):`([^`]+)`")


def _package_of(obj: griffe.Object) -> griffe.Object:
    module = obj.module
    return module if module.is_package else module.parent


def _lookup(obj: griffe.Object, path: str) -> Optional[griffe.Object]:
    try:
        return obj.modules_collection.get_member(path)
    except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _canonical(found: griffe.Object | griffe.Alias) -> Optional[str]:
    try:
        return found.final_target.path if found.is_alias else found.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def resolve(obj: griffe.Object, name: str, role: str) -> Optional[str]:
    """The canonical path ``name`` names in the docstring of ``obj``, or None."""
    if name.startswith("."):
        base = _package_of(obj)
        rest = name[1:]
        while rest.startswith(".") and base is not None:
            base, rest = base.parent, rest[1:]
        path = f"{base.path}.{rest}" if base is not None else None
    else:
        first, _, rest = name.partition(".")
        path = None
        if first in obj.modules_collection:
            path = name
        else:
            scope = obj if obj.is_module or obj.is_class else obj.parent
            try:
                path = scope.resolve(first) + (f".{rest}" if rest else "")
            except (griffe.NameResolutionError, AttributeError):
                # a method named from its class's docstring, e.g. :meth:`forward` inside the class
                if obj.is_class and first in obj.all_members:
                    path = f"{obj.path}.{name}"
    if path is None:
        return None
    found = _lookup(obj, path)
    if found is None:
        return None
    target = _canonical(found)
    if target is None:
        return None
    # ``linvision.ops.linear_attention`` is both a module and the function it re-exports: a function role means
    # the function
    if role in ("func", "meth", "class") and found.is_module:
        inner = _lookup(obj, f"{target}.{target.rsplit('.', 1)[-1]}")
        if inner is not None and (inner_target := _canonical(inner)):
            target = inner_target
    return target


def rewrite(obj: griffe.Object, text: str) -> str:
    def replace(m: re.Match) -> str:
        role, name = m.group(1), m.group(2).strip()
        short = name.startswith("~")
        name = name.lstrip("~")
        display = name.rsplit(".", 1)[-1] if short else name.lstrip(".")
        if role in ("func", "meth") and not display.endswith(")"):
            display += "()"
        target = resolve(obj, name, role)
        if target is None:
            return f"`{display}`"
        return f'<autoref identifier="{html.escape(target)}" optional><code>{html.escape(display)}</code></autoref>'
    return ROLE.sub(replace, text)


def _walk(obj: griffe.Object, seen: set):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member, seen)


class CrossReferenceRoles(griffe.Extension):
    """Rewrites the reST roles of every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _walk(pkg, set()):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite(obj, obj.docstring.value)
