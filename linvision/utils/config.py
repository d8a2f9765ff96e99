"""YAML configuration for the tools: a file's keys mirror the command-line flags, and the command line wins.

``--config run.yaml`` is read first (a path, or the name of a config shipped with linvision); each key (``img_size`` or ``img-size``) must name a flag of the tool, and
its value becomes that flag's default, so that any flag given on the command line overrides the file.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Sequence

import yaml

__all__ = ["ConfigError", "add_config_arg", "parse_args", "load_yaml", "save_yaml", "parse_kwargs",
           "packaged_config", "list_packaged_configs"]


class ConfigError(ValueError):
    """A configuration file or value the tools cannot use; the message names the key or file."""


def packaged_config(name: str) -> Optional[str]:
    """The path of a config shipped with linvision (``linvision.configs``) named ``name`` or ``name.yaml``
    (directories in ``name`` are ignored, so ``linvision/configs/digits_demo.yaml`` finds it too); None if none."""
    from importlib import resources

    base = os.path.basename(name)
    folder = resources.files("linvision.configs")
    for candidate in (base, base + ".yaml"):
        entry = folder.joinpath(candidate)
        if candidate.endswith(".yaml") and entry.is_file():
            return str(entry)
    return None


def load_yaml(path: str) -> Dict[str, Any]:
    """Read a YAML mapping from ``path``, or from the shipped config of that name when no such file exists
    (``--config digits_demo`` after ``pip install linvision``); ConfigError if neither exists, the YAML is
    malformed or does not hold a mapping."""
    if not os.path.isfile(path):
        shipped = packaged_config(path)
        if shipped is None:
            raise ConfigError(f"config: file not found: {path} (nor a shipped config of that name: "
                              f"{', '.join(list_packaged_configs())})")
        path = shipped
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"config: {path} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of flag names to values, got {type(data).__name__}")
    return data


def list_packaged_configs() -> List[str]:
    """Names (without .yaml) of the configs shipped with linvision."""
    from importlib import resources

    return sorted(e.name[:-5] for e in resources.files("linvision.configs").iterdir() if e.name.endswith(".yaml"))


def save_yaml(path: str, data: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)


def add_config_arg(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config``/``-c`` FILE, the YAML file :func:`parse_args` takes defaults from, so that the parser
    lists it with the other flags (:func:`parse_args` adds it to a parser that lacks it)."""
    parser.add_argument("--config", "-c", default=None, help="YAML file whose keys mirror these flags")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
               base_config: Optional[str] = None) -> argparse.Namespace:
    """Parse ``argv`` with ``parser``, taking defaults from the YAML file given by ``--config``.

    ``base_config`` (e.g. a resumed run's saved config.yaml) is applied first, then ``--config``, then the
    command line. ``--config`` is the flag of :func:`add_config_arg`, added here when the parser lacks it; the
    parser must not define another flag of that name. Raises ConfigError when a file has a key that is not one
    of the parser's flags (the message names the key and the allowed keys).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", "-c", default=None)
    known, _ = pre.parse_known_args(argv)
    if not any(a.dest == "config" for a in parser._actions):
        add_config_arg(parser)
    dests = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    for path in (base_config, known.config):
        if not path:
            continue
        defaults = {}
        for key, value in load_yaml(path).items():
            dest = str(key).replace("-", "_")
            if dest not in dests:
                raise ConfigError(f"config: unknown key {key!r} in {path}; allowed: {', '.join(sorted(dests))}")
            defaults[dest] = value
        parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def parse_kwargs(value: Any, name: str = "model_kwargs") -> Dict[str, Any]:
    """Keyword arguments from a mapping (YAML), a JSON object string, or ``key=value`` strings.

    ``key=value`` values are read as YAML scalars (``drop_path_rate=0.1``, ``token_mixers=none,linear``).
    Raises ConfigError naming ``name`` if the value cannot be read.
    """
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    items: List[str] = [value] if isinstance(value, str) else list(value)
    if len(items) == 1 and items[0].strip().startswith("{"):
        try:
            out = json.loads(items[0])
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}: not a JSON object: {items[0]!r} ({e})") from None
        return out
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{name}: expected key=value or a JSON object, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out
