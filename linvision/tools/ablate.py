r"""Token-mixer ablation: one macro-architecture, one recipe and seed, only the token mixer changes.

    linvision-ablate --config ablate_digits                  # the offline demo, a few minutes on 2 CPU cores
    linvision-ablate --config ablate_digits --seeds 0 1 2 --experiment ablate_digits_3seeds
    linvision-ablate --config ablate_seg_mosaics --mixers none linear_rope softmax --seeds 0 1   # segmentation
    linvision-ablate --task segment --dataset mosaic --model mlla_tiny --decoder upernet --img-size 256 \
        --mosaic-size 256 --mixers mlla softmax --epochs 20 --experiment mosaics_mixers
    linvision-ablate --dataset folder --data-dir /data/pets --model linhier_tiny_224 --img-size 224 \
        --mixers linear linear_rope softmax none --epochs 30 --amp --experiment pets_mixers

Each mixer (--mixers) is trained with the training flags of linvision-train, evaluated at --eval-sizes
without fine-tuning and benchmarked at --bench-sizes. Writes ablation.md (the table), ablation.json,
accuracy.png, throughput_memory.png and one training run per mixer (runs/) into <output>/<experiment>.
--task segment trains the encoder --model in the smp head --decoder on the offline mosaics (--dataset mosaic)
with the flags of linvision-train-seg, and reports mIoU and pixel accuracy of each run's best/ on the validation
mosaics rendered at each --eval-sizes (128 to 1024 px).

    linvision-ablate --merge runs/fine_s0 runs/fine_s1 runs/fine_s2 --output runs --experiment fine_3seeds

--merge trains nothing: it joins ablations run apart (a seed or a mixer each, so each can run and resume alone)
into one ablation.md, ablation.json and accuracy.png, each mixer's score the mean and spread over all its runs;
rows whose --model-kwargs differ stay apart, labelled with what differs. No throughput: runs timed apart are no
comparison.
"""
import argparse

from linvision.experiments.ablate import add_ablate_args, run_ablation
from linvision.experiments.merge_ablations import write_merged
from linvision.utils.cli import run_cli, tool_parser
from linvision.utils.config import add_config_arg, parse_args


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-ablate: the training flags, the ablation's own and --config."""
    parser = tool_parser("linvision-ablate", __doc__)
    return add_config_arg(add_ablate_args(parser))


def main() -> int:
    args = parse_args(build_parser())
    if args.merge:
        if args.resume:
            raise ValueError("merge: --merge trains nothing and --resume goes on training; give one of them")
        result = write_merged(args.merge, args.output, args.experiment or "merged", overwrite=args.overwrite)
        for note in result["notes"]:
            print(note)
        print(result["table"])
        print(f"table and plot in {result['run_dir']}")
        return 0
    result = run_ablation(args)
    if result.get("stopped"):  # --stop-after-steps: the line that says how to go on is printed
        return 0
    print(result["table"])
    print(f"table and plots in {result['run_dir']}")
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
