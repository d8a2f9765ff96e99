r"""Params / GFLOPs of every registered linvision model, and what pretrained=True loads, as a Markdown table.

    linvision-model-table                                   # measure, print the full table (at 224 x 224)
    linvision-model-table --size 512 --filter "mlla*"
    linvision-model-table --json docs/models.json           # measure and store: the manual's table and cards
    linvision-model-table --from-json docs/models.json --style front   # README's table, nothing measured

GFLOPs are multiply-accumulates of one forward pass of one image (see linvision.benchmark.flops); the column without
attention leaves out the products of two activations (batched matmuls, SDPA), as papers that count convolutions
and projections only do. The input column is what timm.create_model(name) takes with no other argument: any
multiple of the model's stride (each row's input_multiple, found by running the model at two small non-square
sizes of it), or only the size it was built for (input_multiple null). Measuring builds every model on the meta
device (shapes without weights or arithmetic: the counts and the refusals are those of a CPU run, in a second or
so a model); --from-json renders stored rows. The front style (README's) is one row per family.
"""
import argparse
from typing import Optional, Sequence

import timm

from linvision.benchmark.model_table import DEFAULT_FILTER, front_table, full_table, measure, read_rows, write_rows
from linvision.utils.cli import tool_parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-model-table."""
    parser = tool_parser("linvision-model-table", __doc__)
    parser.add_argument("--size", type=int, default=224, help="square input side in pixels (default 224)")
    parser.add_argument("--filter", nargs="+", default=list(DEFAULT_FILTER),
                        help="timm name patterns (default: every linvision family)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the measured rows to FILE (JSON), as docs/models.json holds them")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="render the rows stored in FILE instead of measuring (--size and --filter ignored)")
    parser.add_argument("--style", default="full", choices=["full", "front"],
                        help="full: mixers, params, GFLOPs with and without attention, weights; front: README's "
                             "table (family, params, GFLOPs, weights, published top-1)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if args.from_json:
        rows = read_rows(args.from_json)
    else:
        rows = measure(timm.list_models(args.filter), args.size)
        if args.json:
            write_rows(args.json, rows)
    print((front_table if args.style == "front" else full_table)(rows))


if __name__ == "__main__":
    main()
