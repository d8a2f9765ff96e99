"""Every command's --help answers: each flag's default where it has one worth saying, examples written as the
installed commands are typed, no markup, and no abbreviated flags (an unknown flag is an error, never taken for a
longer one). The examples of --help parse with their tool's parser: tests/test_examples.py."""
import argparse
import re

import pytest

from linvision.utils.cli import HelpFormatter, tool_parser
from support import SCRIPTS, command_parser


def _parser(command: str) -> argparse.ArgumentParser:
    return command_parser(command)


def _help(command: str, width: int = 100) -> str:
    parser = _parser(command)
    formatter_class = parser.formatter_class
    parser.formatter_class = lambda prog: formatter_class(prog, width=width)
    return parser.format_help()


def _entries(text: str) -> dict:
    """Each flag's entry of a --help text (its invocation and help, whitespace-normalised), by each of its option
    strings."""
    out = {}
    for block in re.split(r"\n(?=  -)", text.split("\n\n", 1)[1])[1:]:
        block = block.split("\n\n")[0]
        invocation = re.split(r"\s{2,}", block.strip())[0]
        for flag in re.findall(r"(?:^|, )(-{1,2}[\w-]+)", invocation):
            out[flag] = " ".join(block.split())
    return out


# One flag per command, with the default its --help must show: the parser's own default, typed as on the command line.
DEFAULTS = {
    "linvision-train": [("--epochs", "10"), ("--workers", "0"), ("--batch-size", "64"), ("--img-size", "224"),
                        ("--lr", "0.001"), ("--scale", "0.08 1.0"), ("--amp", "none"), ("--progress", "on")],
    "linvision-train-seg": [("--decoder", "unet"), ("--img-size", "512"), ("--batch-size", "8"),
                            ("--ignore-index", "255"), ("--scale", "0.25 1.0")],
    "linvision-validate": [("--batch-size", "64"), ("--workers", "0"), ("--device", "auto")],
    "linvision-benchmark": [("--models", "linhier_tiny_224 vit_small_patch16_224 mambaout_tiny"),
                            ("--img-size", "224 512 1024 2048"), ("--batch-size", "8"), ("--iters", "10"),
                            ("--warmup", "2"), ("--train", "on")],
    "linvision-ablate": [("--mixers", "none linear linear_rope softmax causal hybrid"), ("--bench-iters", "5"),
                         ("--epochs", "10")],
    "linvision-linearize": [("--steps", "200"), ("--dataset", "digits"), ("--params", "new")],
    "linvision-model-table": [("--style", "full")],
    "linvision-bench-kernels": [("--dim", "64"), ("--dtype", "bfloat16"), ("--sdpa-max-n", "65536")],
    "linvision-check-kernels": [("--d", "32 64 128"), ("--rope", "off on learn")],
    "linvision-bench-naflex": [("--budgets", "256 1024 4096 16384"), ("--batch", "4"), ("--iters", "3"),
                               ("--memory-limit-gib", "16.0")],
    "linvision-train-diffusion": [("--steps", "2000"), ("--model", "digits"), ("--cache-latents", "on"),
                                  ("--experiment", "diffusion_digits")],
    "linvision-sample-diffusion": [("--steps", "20"), ("--cfg-scale", "3.0"), ("--sampler", "euler")],
    "linvision-eval-diffusion-samples": [("--per-class", "50"), ("--steps", "20")],
    "linvision-bench-diffusion-block": [("--tokens", "1024 4096 16384 65536"), ("--attn", "linear softmax")],
    "linvision-bench-diffusion-parallel": [("--depth", "4"), ("--ranks", "1 2"), ("--modes", "ddp fsdp fsdp+ckpt")],
    "linvision-export": [("--tolerance", "0.0001"), ("--bench-iters", "3")],
    "linvision-gpu-report": [("--output", "output/gpu_report"), ("--budget", "540.0"),
                             ("--n", "2048 4096 8192 16384 32768 65536 131072"), ("--rec-n", "4096 16384 65536 262144"),
                             ("--img-size", "1024 512 2048"), ("--batch-sizes", "8 1"),
                             ("--model-modes", "eager reduce-overhead bf16-weights"),
                             ("--deciding", "linhier_tiny_224 swin_tiny_patch4_window7_224 convnext_tiny"),
                             ("--first-models", "vig_tiny linhier_delta_tiny_224"),
                             ("--amp", "bf16")],
}


def test_defaults_cover_every_command():
    assert set(DEFAULTS) == set(SCRIPTS)


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_help_shows_defaults(command):
    """The flags with a default show it, `(default: VALUE)` after their help; switches, flags without a default and
    flags whose help already says what happens by default show none (no entry names a default twice)."""
    text = _help(command)
    entries = _entries(text)
    for flag, value in DEFAULTS[command]:
        assert flag in entries, f"{command} --help lists no {flag}"
        assert entries[flag].endswith(f"(default: {value})"), f"{command} --help: {entries[flag]!r}"
    parser = _parser(command)
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        entry = entries[action.option_strings[0]]
        assert len(re.findall(r"\bdefault\b", entry, re.I)) <= 1, f"{command}: {entry!r}"
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            assert "(default:" not in entry, f"{command}: a switch shows a default: {entry!r}"
        if action.default is None:
            assert not entry.endswith("(default: None)"), f"{command}: {entry!r}"
    for shown in ("(default: None)", "(default: False)", "(default: [])", "(default: )", "(default: ==SUPPRESS=="):
        assert shown not in text, f"{command} --help shows {shown}"


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_help_is_plain_text_with_installed_commands(command):
    """What --help prints has no reST markup, no `python tools/...` (the commands are installed), and no pointer to
    a config file in place of the defaults."""
    text = _help(command)
    for bad in ("python tools/", "``", ":func:", ":class:", ":mod:", "see configs/", "defaults: see"):
        assert bad not in text, f"{command} --help prints {bad!r}"
    assert text.startswith(f"usage: {command} ")


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_help_keeps_the_description_lines(command):
    """The description is printed as written, whatever the terminal's width: examples keep their line breaks
    and continuation backslashes."""
    doc = _parser(command).description
    assert doc
    for width in (60, 200):
        assert doc in _help(command, width), f"{command} --help at {width} columns rewraps the description"


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_no_abbreviated_flags(command):
    """A flag typed short of its name is an error, not the longer flag it starts."""
    parser = _parser(command)
    assert parser.allow_abbrev is False and parser.formatter_class is HelpFormatter


def test_train_refuses_abbreviations(capsys):
    parser = _parser("linvision-train")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--epoch", "3"])
    assert e.value.code == 2 and "unrecognized arguments: --epoch 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--pretrained-pa", "weights.safetensors"])
    assert "unrecognized arguments: --pretrained-pa" in capsys.readouterr().err
    # timm's --pretrained is its own flag, never taken for --pretrained-path
    args = parser.parse_args(["--pretrained", "--epochs", "3"])
    assert args.pretrained is True and args.pretrained_path is None and args.epochs == 3
    args = parser.parse_args(["--initial-checkpoint", "w.safetensors"])  # an alias, not an abbreviation
    assert args.pretrained_path == "w.safetensors" and args.pretrained is False


def test_benchmark_refuses_abbreviations(capsys):
    parser = _parser("linvision-benchmark")
    with pytest.raises(SystemExit):
        parser.parse_args(["--gemm"])
    assert "unrecognized arguments: --gemm" in capsys.readouterr().err
    assert parser.parse_args(["--model", "resnet18"]).models == ["resnet18"]  # an alias of --models


def test_formatter_shows_only_defaults_that_say_something():
    parser = tool_parser("t", "Line one\n    t --x 1 \\\n        --y 2\n")
    parser.add_argument("--n", type=int, default=3, help="a count")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="sizes")
    parser.add_argument("--empty", nargs="*", default=[], help="a list")
    parser.add_argument("--none", default=None, help="nothing")
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("--on", action=argparse.BooleanOptionalAction, default=True, help="a feature")
    parser.add_argument("--off", action=argparse.BooleanOptionalAction, default=False, help="off")
    # what Python 3.10's BooleanOptionalAction makes of help="old"
    parser.add_argument("--old", action=argparse.BooleanOptionalAction, default=False,
                        help="old (default: %(default)s)")
    parser.add_argument("--said", type=int, default=5, help="said (default 5)")
    parser.add_argument("--pct", default="10%", help="a percentage")
    parser.add_argument("--hidden", default=1, help=argparse.SUPPRESS)
    parser.add_argument("--req", required=True, default="x", help="required")
    parser.add_argument("pos", help="a positional")
    entries = _entries(parser.format_help())
    assert entries["--n"] == "--n N a count (default: 3)"
    assert entries["--sizes"] == "--sizes SIZES [SIZES ...] sizes (default: 32 64)"
    assert entries["--empty"].endswith("a list") and entries["--none"].endswith("nothing")
    assert entries["--flag"].endswith("a switch") and entries["--off"].endswith("off")
    assert entries["--old"] == "--old, --no-old old"
    assert entries["--on"] == "--on, --no-on a feature (default: on)"
    assert entries["--said"].endswith("said (default 5)") and entries["--req"].endswith("required")
    assert entries["--pct"].endswith("a percentage (default: 10%)")
    assert "--hidden" not in parser.format_help()
    assert "Line one\n    t --x 1 \\\n        --y 2\n" in parser.format_help()
    assert parser.parse_args(["--req", "y", "p"]).n == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--siz", "1", "--req", "y", "p"])
