"""What the tools share: the argument parser each is built on, turning expected failures into one clear line and
a non-zero exit status, and the flags every tool spells the same way."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Callable, Optional

__all__ = ["run_cli", "tool_parser", "HelpFormatter", "add_amp_arg", "amp_flag_options", "AMP_CHOICES", "AMP_HELP",
           "DEFAULT_AMP"]


def _default_text(action: argparse.Action) -> Optional[str]:
    """A flag's default as --help shows it, or None where showing it would say nothing: no default (None,
    False, empty), a switch without a value (store_true and the like), a required or hidden argument."""
    default = action.default
    if action.required or action.help is argparse.SUPPRESS or default is argparse.SUPPRESS:
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if default is True else None
    if action.nargs == 0 or default is None or default is False or (not action.option_strings and
                                                                    action.nargs not in ("?", "*")):
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default)) if default else None
    text = str(default)
    return text if text else None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The tools' --help: the description printed as written (its examples keep their lines and their
    continuation backslashes), and each flag's default after its help, as argparse's ArgumentDefaultsHelpFormatter
    adds it, but only where it tells something: not for switches, for flags without a default, or where the
    help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction):  # Python 3.10 appends its own, for False too
            text = text.removesuffix(" (default: %(default)s)")
        value = _default_text(action)
        if value is None or "%(default)" in text or re.search(r"\bdefault\b", text, re.I):
            return text
        return f"{text} (default: {value.replace('%', '%%')})".lstrip()


def tool_parser(prog: str, doc: Optional[str]) -> argparse.ArgumentParser:
    """The argument parser of the command ``prog``, described by ``doc`` (the tool's module docstring): the help
    of :class:`HelpFormatter`, and no abbreviated flags (``--pretrained`` is not taken for ``--pretrained-path``;
    an unknown flag is an error)."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter, allow_abbrev=False)


AMP_CHOICES = ("none", "bf16", "fp16")
# A bare --amp: bfloat16 needs no loss scaling and autocasts on CPUs and recent GPUs alike (timm's bare --amp
# is float16; --amp fp16 gives that).
DEFAULT_AMP = "bf16"
_AMP_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "false": "none", "off": "none"}


def _amp_value(value: str) -> str:
    return _AMP_ALIASES.get(str(value).lower(), str(value).lower())


AMP_HELP = f"mixed precision; a bare --amp means {DEFAULT_AMP} (also: bfloat16, float16)"


def amp_flag_options() -> dict:
    """The ``add_argument`` options of ``--amp`` besides its default and help: an optional value (a bare ``--amp``
    means DEFAULT_AMP), timm's dtype names accepted."""
    return dict(nargs="?", const=DEFAULT_AMP, type=_amp_value, choices=AMP_CHOICES)


def add_amp_arg(parser) -> None:
    """``--amp [none|bf16|fp16]``, default none (:func:`amp_flag_options`)."""
    parser.add_argument("--amp", default="none", help=AMP_HELP, **amp_flag_options())


def run_cli(main: Callable[[], int]) -> None:
    """Run ``main`` and exit with its status; bad input (ValueError, TypeError, FileNotFoundError) prints
    ``error: <message>`` on stderr and exits with status 2 instead of a traceback."""
    from .interrupt import TrainInterrupted

    try:
        status = main()
    except TrainInterrupted as e:
        print(str(e), file=sys.stderr, flush=True)
        status = 128 + e.signum
    except (ValueError, TypeError, FileNotFoundError) as e:
        # errors re-raised from DataLoader workers carry the worker's traceback; its last line is the message
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        status = 2
    sys.exit(status or 0)
