"""Token-mixer ablation: one macro-architecture, one recipe and seed, only the token mixer changes.

    python tools/ablate.py --config configs/ablate_digits.yaml      # offline demo, a few minutes on 2 cores

Writes ablation.md (the table), ablation.json, accuracy.png, throughput_memory.png and one training run
per mixer into <output>/<experiment>.
"""
import argparse

from linvision.engine.ablate import add_ablate_args, run_ablation
from linvision.engine.cli import run_cli
from linvision.engine.config import add_config_arg, parse_args


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-ablate: the training flags, the ablation's own and --config."""
    parser = argparse.ArgumentParser(prog="linvision-ablate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_config_arg(add_ablate_args(parser))


def main() -> int:
    args = parse_args(build_parser())
    result = run_ablation(args)
    print(result["table"])
    print(f"table and plots in {result['run_dir']}")
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
