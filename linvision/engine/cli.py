"""What the tools share: turning expected failures into one clear line and a non-zero exit status."""
from __future__ import annotations

import sys
from typing import Callable

__all__ = ["run_cli"]


def run_cli(main: Callable[[], int]) -> None:
    """Run ``main`` and exit with its status; bad input (ValueError, TypeError, FileNotFoundError) prints
    ``error: <message>`` on stderr and exits with status 2 instead of a traceback."""
    from .train import TrainInterrupted

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
