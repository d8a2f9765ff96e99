"""What the tools share: turning expected failures into one clear line and a non-zero exit status, and the
flags every tool spells the same way."""
from __future__ import annotations

import sys
from typing import Callable

__all__ = ["run_cli", "add_amp_arg", "AMP_CHOICES", "DEFAULT_AMP"]

AMP_CHOICES = ("none", "bf16", "fp16")
# A bare --amp: bfloat16 needs no loss scaling and autocasts on CPUs and recent GPUs alike (timm's bare --amp
# is float16; --amp fp16 gives that).
DEFAULT_AMP = "bf16"
_AMP_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "false": "none", "off": "none"}


def _amp_value(value: str) -> str:
    return _AMP_ALIASES.get(str(value).lower(), str(value).lower())


def add_amp_arg(parser) -> None:
    """``--amp [none|bf16|fp16]``: a bare ``--amp`` means DEFAULT_AMP; timm's dtype names are accepted."""
    parser.add_argument("--amp", nargs="?", const=DEFAULT_AMP, default="none", type=_amp_value,
                        choices=AMP_CHOICES,
                        help=f"mixed precision; a bare --amp means {DEFAULT_AMP} (also: bfloat16, float16)")


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
