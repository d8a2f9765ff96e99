"""What the tools share: the argument parser each is built on, turning expected failures into one clear line and
a non-zero exit status, and the flags every tool spells the same way."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Callable, Optional

__all__ = ["run_cli", "tool_parser", "arg_type", "add_threads_arg", "THREADS_HELP", "HelpFormatter", "add_amp_arg", "amp_flag_options", "AMP_CHOICES", "AMP_HELP",
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


class ToolParser(argparse.ArgumentParser):
    """argparse's parser whose error for bad input is two lines, not the usage: the message with the nearest
    flag or value (``unrecognized arguments: --epoch (did you mean --epochs?)``), then where the flags are
    listed; exit status 2 as argparse's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}{_suggestion(self, message)}\n"
                     f"{self.prog} --help lists every flag\n")


def _nearest(word: str, candidates) -> Optional[str]:
    import difflib

    found = difflib.get_close_matches(word, [str(c) for c in candidates], n=1, cutoff=0.6)
    return found[0] if found else None


# Other tools' spellings of the tools' flags, too far apart for difflib (--learning-rate and --lr share 3 of 15
# letters): each is suggested where the parser has the flag it stands for.
FLAG_ALIASES = {
    "--learning-rate": "--lr", "--base-lr": "--lr", "--max-lr": "--lr", "--wd": "--weight-decay",
    "--bs": "--batch-size", "--batch": "--batch-size", "--num-epochs": "--epochs", "--n-epochs": "--epochs",
    "--max-epochs": "--epochs", "--image-size": "--img-size", "--resolution": "--img-size",
    "--data": "--data-dir", "--data-path": "--data-dir", "--dataset-dir": "--data-dir", "--output-dir": "--output",
    "--out": "--output", "--outdir": "--output", "--num-workers": "--workers", "--arch": "--model",
    "--gpu": "--device", "--cuda": "--device", "--num-threads": "--threads", "--nthreads": "--threads",
    "--optimizer": "--opt", "--scheduler": "--sched", "--mixed-precision": "--amp", "--fp16": "--amp",
    "--bf16": "--amp", "--checkpoint-dir": "--checkpoint",
}


def _nearest_flag(word: str, flags) -> Optional[str]:
    """The parser's flag nearest to the unknown ``word``: its own spelling with hyphens for underscores, a known
    alias (:data:`FLAG_ALIASES`), else the closest by difflib."""
    word = word.split("=")[0]
    for guess in (word.replace("_", "-"), FLAG_ALIASES.get(word.replace("_", "-").lower())):
        if guess in flags and guess != word:
            return guess
    return _nearest(word, flags)


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """`` (did you mean X?)`` for an unknown flag or a value outside a flag's choices in argparse's ``message``,
    or '' when nothing is near."""
    flags = [s for action in parser._actions for s in action.option_strings]
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        near = [(w, _nearest_flag(w, flags)) for w in unknown.group(1).split() if w.startswith("-")]
        near = [f"{n} for {w}" if len(near) > 1 else n for w, n in near if n]
        return f" (did you mean {', '.join(near)}?)" if near else ""
    choice = re.match(r"argument ([^:]+): invalid choice: '?([^' ]+)'?", message)
    if choice:
        action = next((a for a in parser._actions if "/".join(a.option_strings) == choice.group(1)
                       or a.dest == choice.group(1)), None)
        near = _nearest(choice.group(2), action.choices) if action is not None and action.choices else None
        return f" (did you mean {near}?)" if near else ""
    return ""


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse ``type=``: its ValueError's own message becomes argparse's error (``argument
    --check-sizes: img_size: '320by512' is neither a side nor HxW ...``), not ``invalid parse value``."""
    def convert(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def tool_parser(prog: str, doc: Optional[str]) -> argparse.ArgumentParser:
    """The argument parser of the command ``prog``, described by ``doc`` (the tool's module docstring): the help
    of :class:`HelpFormatter`, no abbreviated flags (``--pretrained`` is not taken for ``--pretrained-path``;
    an unknown flag is an error), and :class:`ToolParser`'s two-line errors that name the nearest flag or
    value."""
    return ToolParser(prog=prog, description=doc, formatter_class=HelpFormatter, allow_abbrev=False)


THREADS_HELP = ("torch CPU threads (default: OMP_NUM_THREADS when set, else the cores other processes leave free "
                "over half a second; the choice is printed)")


def add_threads_arg(parser, help: str = THREADS_HELP):
    """``--threads N``, default None: the rule of :func:`linvision.utils.threads.set_threads`, which the tool
    applies and prints before its work starts. It goes in the parser's group of run flags (``run``: --seed,
    --device, ...) where it has one. Returns ``parser``."""
    group = next((g for g in getattr(parser, "_action_groups", ()) if g.title == "run"), parser)
    group.add_argument("--threads", type=int, default=None, help=help)
    return parser


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


def add_run_mode_args(parser, compile_note: str = "") -> None:
    """``--compile`` and ``--weights`` (:mod:`linvision.utils.run_mode`); ``compile_note`` ends --compile's help."""
    from linvision.utils.run_mode import COMPILE_MODES, WEIGHT_DTYPES

    parser.add_argument("--compile", default="none", choices=COMPILE_MODES,
                        help=f"run the model under torch.compile: 'inductor' or 'reduce-overhead' (Inductor "
                             f"and CUDA graphs); the first call pays the compilation{compile_note}")
    parser.add_argument("--weights", default="fp32", choices=list(WEIGHT_DTYPES),
                        help="the weights' and input's dtype: bf16 or fp16 for inference without autocast "
                             "(with --amp none)")


def add_amp_arg(parser) -> None:
    """``--amp [none|bf16|fp16]``, default none (:func:`amp_flag_options`)."""
    parser.add_argument("--amp", default="none", help=AMP_HELP, **amp_flag_options())


def run_cli(main: Callable[[], int]) -> None:
    """Run ``main`` and exit with its status; bad input (ValueError, TypeError, FileNotFoundError) prints
    ``error: <message>`` on stderr and exits with status 2 instead of a traceback. A run stopped by a signal
    (after saving, :class:`~linvision.utils.interrupt.TrainInterrupted`) or by Ctrl-C anywhere else (building,
    evaluating, timing) says so on stderr, flushed, and exits with 128 + the signal (130 for Ctrl-C), as a shell
    expects of a program a signal ended; a standard output whose reader is gone (``| tee`` or ``| head`` ended
    by the same Ctrl-C) neither hides that line nor changes the status."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ReaderSafe(sys.stdout), _ReaderSafe(sys.stderr)
    try:
        status = _run(main)
    finally:
        sys.stdout, sys.stderr = streams
    sys.exit(status or 0)


def _run(main: Callable[[], int]) -> int:
    """``main``'s status, or the status of what stopped it (see :func:`run_cli`), said on stderr."""
    import signal

    from .interrupt import TrainInterrupted

    try:
        status = main()
    except TrainInterrupted as e:
        status = _say(str(e), 128 + e.signum)
    except KeyboardInterrupt:
        status = _say("interrupted by SIGINT (Ctrl-C)", 128 + signal.SIGINT)
    except BrokenPipeError:  # whoever read the output has stopped reading: nothing left to tell them
        status = _say("", 128 + signal.SIGPIPE)
    except (ValueError, TypeError, FileNotFoundError) as e:
        # errors re-raised from DataLoader workers carry the worker's traceback; its last line is the message
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        status = _say(f"error: {message}", 2)
    return status


class _ReaderSafe:
    """A text stream whose reader may be gone (``| tee`` or ``| head`` ended by Ctrl-C): a write or flush that
    finds the pipe broken sends the stream to /dev/null from then on instead of raising, so that a run stopped
    by Ctrl-C goes on to its next step, saves and says so on the other stream."""

    def __init__(self, stream):
        self._stream = stream

    def _drop(self) -> None:
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _say(message: str, status: int) -> int:
    """``message`` on stderr, flushed, and standard output made safe to flush at exit (pointed at /dev/null when
    its reader is gone, so that Python's last flush does not turn the exit status into 120); returns
    ``status``."""
    import os

    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError, ValueError):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
    if message:
        try:
            print(message, file=sys.stderr, flush=True)
        except (BrokenPipeError, OSError, ValueError):
            pass
    return status
