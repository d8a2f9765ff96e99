"""YAML configuration for the tools: a file's keys mirror the command-line flags, and the command line wins.

``--config run.yaml`` is read first; each key (``img_size`` or ``img-size``) must name a flag of the tool, and
its value becomes that flag's default, so that any flag given on the command line overrides the file.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Sequence

import yaml

__all__ = ["ConfigError", "parse_args", "load_yaml", "save_yaml", "parse_kwargs"]


class ConfigError(ValueError):
    """A configuration file or value the tools cannot use; the message names the key or file."""


def load_yaml(path: str) -> Dict[str, Any]:
    """Read a YAML mapping; ConfigError if the file is missing or does not hold a mapping."""
    if not os.path.isfile(path):
        raise ConfigError(f"config: file not found: {path}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of flag names to values, got {type(data).__name__}")
    return data


def save_yaml(path: str, data: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
               base_config: Optional[str] = None) -> argparse.Namespace:
    """Parse ``argv`` with ``parser``, taking defaults from the YAML file given by ``--config``.

    ``base_config`` (e.g. a resumed run's saved config.yaml) is applied first, then ``--config``, then the
    command line. The parser must not define ``--config`` itself. Raises ConfigError when a file has a key
    that is not one of the parser's flags (the message names the key and the allowed keys).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", "-c", default=None)
    known, _ = pre.parse_known_args(argv)
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", "-c", default=None, help="YAML file whose keys mirror these flags")
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
