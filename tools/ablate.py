r"""Token-mixer ablation: one macro-architecture, one recipe and seed, only the token mixer changes.

    linvision-ablate --config ablate_digits                  # the offline demo, a few minutes on 2 CPU cores
    linvision-ablate --config ablate_digits --seeds 0 1 2 --experiment ablate_digits_3seeds
    linvision-ablate --dataset folder --data-dir /data/pets --model linhier_tiny_224 --img-size 224 \
        --mixers linear linear_rope softmax none --epochs 30 --amp --experiment pets_mixers

Each mixer (--mixers) is trained with the training flags of linvision-train, evaluated at --eval-sizes
without fine-tuning and benchmarked at --bench-sizes. Writes ablation.md (the table), ablation.json,
accuracy.png, throughput_memory.png and one training run per mixer (runs/) into <output>/<experiment>.
"""
import argparse

from linvision.engine.ablate import add_ablate_args, run_ablation
from linvision.engine.cli import run_cli, tool_parser
from linvision.engine.config import add_config_arg, parse_args


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-ablate: the training flags, the ablation's own and --config."""
    parser = tool_parser("linvision-ablate", __doc__)
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
