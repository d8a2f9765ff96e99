r"""Train a class-conditional linear-attention DiT (Sana-style blocks) with rectified flow.

    linvision-train-diffusion --config diffusion_digits                       # offline digits, a few minutes
    linvision-train-diffusion --config diffusion_digits --resume
    linvision-train-diffusion --dataset folder --data-dir /data/pets/train --model digits \
        --model-kwargs img_size=64 in_chans=3 patch_size=4 num_classes=37 --steps 20000
    torchrun --nproc_per_node 4 -m linvision.tools.train_diffusion --config diffusion_digits    # DDP
    torchrun --nproc_per_node 8 -m linvision.tools.train_diffusion --config diffusion_sana_600m \
        --parallel fsdp --grad-checkpointing                                                   # FSDP2

The recipe flags are the fields of linvision.diffusion.DiffusionTrainConfig (YAML keys too). The run folder
<output>/<experiment> receives config.yaml and the checkpoint last/ (model.safetensors, ema.safetensors,
model.json, train_state.pt; with --parallel fsdp the sharded dcp/ instead of the .safetensors files); sample
from it with linvision-sample-diffusion. Under torchrun --batch-size is still the images per step over all
ranks, so a run (and its resume, at any world size) takes the same steps; rank 0 owns the run folder and the
log.
"""
from __future__ import annotations

import argparse
import os
import typing
from dataclasses import fields

import torch

from linvision.diffusion.train import DiffusionTrainConfig, train_dit
from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.threads import set_threads
from linvision.utils.config import add_config_arg, parse_args, parse_kwargs, save_yaml
from linvision.utils.distributed import cleanup, init_distributed, on_main
from linvision.utils.files import atomic_write
from linvision.utils.run_folder import claim_run_folder


def _flag_type(annotation: typing.Any) -> type:
    """int, float or str for a field's annotation (Optional[X] -> X; a union with str or a dict -> str)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation in (int, float, str) or (len(args) == 1 and args[0] in (int, float, str)):
        return annotation if annotation in (int, float, str) else args[0]
    return str


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-train-diffusion: a flag per DiffusionTrainConfig field, the run's flags and
    --config."""
    p = tool_parser("linvision-train-diffusion", __doc__)
    recipe = p.add_argument_group("recipe (DiffusionTrainConfig)")
    hints = typing.get_type_hints(DiffusionTrainConfig)
    defaults = DiffusionTrainConfig()
    for f in fields(DiffusionTrainConfig):
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        help_ = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help strings
        if typing.get_origin(hint) is dict or hint is dict:
            recipe.add_argument(flag, nargs="*", default=None, help=help_)
        elif hint is bool:
            recipe.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, f.name),
                                help=help_)
        else:
            recipe.add_argument(flag, type=_flag_type(hint), default=getattr(defaults, f.name), help=help_)
    add_threads_arg(p)
    p.add_argument("--output", default="output", help="parent folder of run folders")
    p.add_argument("--experiment", default="diffusion_digits", help="run folder name under --output")
    p.add_argument("--resume", action="store_true", help="continue from <output>/<experiment>/last")
    p.add_argument("--overwrite", action="store_true",
                   help="delete an earlier run in the folder (without it a new run goes to <experiment>-<k>)")
    return add_config_arg(p)


def recipe_from_args(args: argparse.Namespace) -> DiffusionTrainConfig:
    """The DiffusionTrainConfig of the parsed flags (dict fields read by parse_kwargs); checked."""
    values = {f.name: getattr(args, f.name) for f in fields(DiffusionTrainConfig)}
    values["model_kwargs"] = parse_kwargs(values["model_kwargs"])
    cfg = DiffusionTrainConfig(**values)
    cfg.check()
    return cfg


def main() -> int:
    args = parse_args(build_parser())
    threads = set_threads(args.threads)
    cfg = recipe_from_args(args)
    info = init_distributed("auto", group=cfg.parallel == "fsdp")
    if info.is_main:
        print(threads, flush=True)
    held = []

    def claim() -> str:  # one process owns the folder; the others write only their checkpoint shards there
        folder = claim_run_folder(os.path.join(args.output, args.experiment), resume=args.resume,
                                  overwrite=args.overwrite)
        held.append(folder)
        for note in folder.notes:
            print(note, flush=True)
        recipe = {k: v for k, v in vars(args).items() if k not in ("config", "overwrite", "resume")}
        atomic_write(os.path.join(folder.path, "config.yaml"), lambda p: save_yaml(p, recipe))
        return folder.path

    try:
        run_dir = on_main(claim, info)
        result = train_dit(cfg, run_dir, resume=args.resume)
        if info.is_main:
            print(f"done: step {result['step']}, {result['elapsed_s']:.0f}s, checkpoint "
                  f"{os.path.join(run_dir, 'last')}")
    finally:
        for folder in held:
            folder.release()
        cleanup(info)
    return 0


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
