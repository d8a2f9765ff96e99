"""The diffusion commands: training, sampling and evaluating the linear-attention DiT, and measuring its block and
its memory per rank. Each command has a parser, a main and the entry point pyproject.toml names:

    linvision-train-diffusion           train_parser, train_main, train_cli
    linvision-sample-diffusion          sample_parser, sample_main, sample_cli
    linvision-eval-diffusion-samples    eval_samples_parser, eval_samples_main, eval_samples_cli
    linvision-bench-diffusion-block     bench_block_parser, bench_block_main
    linvision-bench-diffusion-parallel  bench_parallel_parser, bench_parallel_main, bench_parallel_cli

A command's --help opens with its *_HELP text; PARSERS maps each command to its parser.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing

import torch

from linvision import load_model
from linvision.diffusion import parallel_memory
from linvision.diffusion.block_speed import (DTYPES, OPTION_KEYS, TABLE_HEADER, comparison_text, compare_diffusers,
                                             describe, ratios, run_sweep)
from linvision.diffusion.checkpoint import load_dit
from linvision.diffusion.data import CaptionEmbeddings, load_images
from linvision.diffusion.flow import SAMPLERS
from linvision.diffusion.model import DIT_CONFIGS
from linvision.diffusion.sampling import classify_images, decoder_for, sample_captions, sample_classes, save_grid
from linvision.diffusion.train import DiffusionTrainConfig, train_dit
from linvision.utils.cli import add_threads_arg, run_cli, tool_parser
from linvision.utils.config import add_config_arg, parse_args, parse_kwargs, save_yaml
from linvision.utils.distributed import cleanup, init_distributed, on_main
from linvision.utils.files import atomic_write, atomic_write_text
from linvision.utils.run_folder import claim_run_folder
from linvision.utils.threads import set_threads


def _write_json(path: str, value) -> None:
    """``value`` as indented JSON in the file ``path``."""
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


# --- linvision-train-diffusion ----------------------------------------------------------------------------------

TRAIN_HELP = r"""Train a class-conditional linear-attention DiT (Sana-style blocks) with rectified flow.

    linvision-train-diffusion --config diffusion_digits                       # offline digits, a few minutes
    linvision-train-diffusion --config diffusion_digits --resume
    linvision-train-diffusion --dataset folder --data-dir /data/pets/train --model digits \
        --model-kwargs img_size=64 in_chans=3 patch_size=4 num_classes=37 --steps 20000
    torchrun --nproc_per_node 4 --no-python linvision-train-diffusion --config diffusion_digits    # DDP
    torchrun --nproc_per_node 8 --no-python linvision-train-diffusion --config diffusion_sana_600m \
        --parallel fsdp --grad-checkpointing                                                       # FSDP2

The recipe flags are the fields of linvision.diffusion.DiffusionTrainConfig (YAML keys too). The run folder
<output>/<experiment> receives config.yaml and the checkpoint last/ (model.safetensors, ema.safetensors,
model.json, train_state.pt; with --parallel fsdp the sharded dcp/ instead of the .safetensors files); sample
from it with linvision-sample-diffusion. Under torchrun --batch-size is still the images per step over all
ranks, so a run (and its resume, at any world size) takes the same steps; rank 0 owns the run folder and the
log.
"""


def _flag_type(annotation: typing.Any) -> type:
    """int, float or str for a field's annotation (Optional[X] -> X; a union with str or a dict -> str)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation in (int, float, str) or (len(args) == 1 and args[0] in (int, float, str)):
        return annotation if annotation in (int, float, str) else args[0]
    return str


def train_parser() -> argparse.ArgumentParser:
    """The parser of linvision-train-diffusion: a flag per DiffusionTrainConfig field, the run's flags and
    --config."""
    p = tool_parser("linvision-train-diffusion", TRAIN_HELP)
    recipe = p.add_argument_group("recipe (DiffusionTrainConfig)")
    hints = typing.get_type_hints(DiffusionTrainConfig)
    defaults = DiffusionTrainConfig()
    for f in dataclasses.fields(DiffusionTrainConfig):
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
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DiffusionTrainConfig)}
    values["model_kwargs"] = parse_kwargs(values["model_kwargs"])
    cfg = DiffusionTrainConfig(**values)
    cfg.check()
    return cfg


def train_main() -> int:
    args = parse_args(train_parser())
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


def train_cli() -> None:
    run_cli(train_main)


# --- linvision-sample-diffusion and linvision-eval-diffusion-samples --------------------------------------------

def _add_sampler_args(p: argparse.ArgumentParser, cfg_help: str) -> None:
    """The flags of the sampler that both sampling commands run: --steps, --cfg-scale (helped by ``cfg_help``) and
    --sampler."""
    p.add_argument("--steps", type=int, default=20, help="sampler steps from noise to image")
    p.add_argument("--cfg-scale", type=float, default=3.0, help=cfg_help)
    p.add_argument("--sampler", choices=SAMPLERS, default="euler",
                   help="ODE integrator: euler (one model call per step) or heun (two, but one in the last step)")


SAMPLE_HELP = r"""Sample a trained linear-attention DiT with classifier-free guidance and write a PNG grid.

    linvision-sample-diffusion output/diffusion_digits --per-class 8 --steps 20 --cfg-scale 3 \
        --out output/diffusion_digits/samples.png

One row per class (--classes picks them), --per-class columns; Euler or Heun over --steps. A caption model
samples one row per caption (--captions, default: its training captions). A model trained on latents is
decoded with the autoencoder its checkpoint names.
"""


def sample_parser() -> argparse.ArgumentParser:
    """The parser of linvision-sample-diffusion."""
    p = tool_parser("linvision-sample-diffusion", SAMPLE_HELP)
    p.add_argument("checkpoint", help="run folder (uses its last/) or checkpoint folder")
    p.add_argument("--classes", type=int, nargs="*", default=None,
                   help="class indices to sample, a row each (default: every class)")
    p.add_argument("--captions", default=None, help="caption model: a safetensors file of 'context' (K, L, C') and "
                   "'mask' (K, L) (default: the training captions)")
    p.add_argument("--num-captions", type=int, default=8, help="caption model: sample the first this many captions")
    p.add_argument("--per-class", type=int, default=8, help="samples per class or caption (the grid's columns)")
    _add_sampler_args(p, cfg_help="1 = no guidance")
    p.add_argument("--shift", type=float, default=1.0, help="time shift (> 1: more steps at high noise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    p.add_argument("--no-ema", action="store_true", help="sample the raw weights instead of the EMA")
    p.add_argument("--out", default=None, help="PNG path (default: <checkpoint>/samples.png)")
    add_threads_arg(p)
    return p


def sample_main() -> int:
    args = sample_parser().parse_args()
    print(set_threads(args.threads), flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, meta = load_dit(args.checkpoint, ema=not args.no_ema, device=device)
    options = dict(steps=args.steps, cfg_scale=args.cfg_scale, sampler=args.sampler, shift=args.shift, seed=args.seed,
                   decode=decoder_for(meta, device))
    out = args.out or os.path.join(args.checkpoint, "samples.png")
    if model.cfg.caption_channels > 0:
        path = args.captions or meta["data"].get("captions")
        if not path:
            raise ValueError("captions: a caption model needs --captions (a safetensors file of 'context', 'mask')")
        captions = CaptionEmbeddings(path, channels=model.cfg.caption_channels)
        context, mask = captions.rows(range(min(args.num_captions, len(captions))))
        context, mask = context.repeat_interleave(args.per_class, 0), mask.repeat_interleave(args.per_class, 0)
        images = sample_captions(model, context, mask, **options)
        what = f"{len(images) // args.per_class} captions of {path}"
    else:
        classes = args.classes if args.classes is not None else list(range(model.cfg.num_classes))
        images, _ = sample_classes(model, classes, args.per_class, **options)
        what = f"{len(classes)} classes"
    save_grid(images, out, ncol=args.per_class)
    print(f"wrote {len(images)} samples ({what} x {args.per_class}) to {out}")

    return 0


def sample_cli() -> None:
    run_cli(sample_main)


EVAL_SAMPLES_HELP = r"""How often does a classifier recognise the class a DiT sample was conditioned on?

    linvision-eval-diffusion-samples output/diffusion_digits output/digits_linvit_cls --per-class 50

Samples --per-class images of every class from the DiT (EMA weights, fixed seed), classifies them with a
checkpoint of linvision-train (grey samples repeated to RGB, resized to the classifier's size if needed,
normalised as it was trained) and prints the fraction assigned to the conditioning class, overall and per
class. As a yardstick it also prints the classifier's accuracy on the real digits validation split, read
with the same preprocessing path.
"""


def eval_samples_parser() -> argparse.ArgumentParser:
    """The parser of linvision-eval-diffusion-samples."""
    p = tool_parser("linvision-eval-diffusion-samples", EVAL_SAMPLES_HELP)
    p.add_argument("dit", help="DiT run or checkpoint folder (of linvision-train-diffusion)")
    p.add_argument("classifier", help="classifier run or checkpoint folder (of linvision-train)")
    p.add_argument("--per-class", type=int, default=50, help="samples drawn and classified per class")
    _add_sampler_args(p, cfg_help="classifier-free guidance scale (1 = no guidance)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    add_threads_arg(p)
    p.add_argument("--grid", default=None, help="also write the first 10 samples of each class as a PNG grid")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    return p


def eval_samples_main() -> int:
    args = eval_samples_parser().parse_args()
    print(set_threads(args.threads), flush=True)
    dit, dit_meta = load_dit(args.dit)
    if dit.cfg.num_classes <= 0:
        raise ValueError(f"dit: {args.dit} is a caption model; this tool evaluates class-conditional ones")
    classifier, cls_meta = load_model(args.classifier)
    classes = list(range(dit.cfg.num_classes))
    images, labels = sample_classes(dit, classes, args.per_class, steps=args.steps, cfg_scale=args.cfg_scale,
                                    sampler=args.sampler, seed=args.seed, decode=decoder_for(dit_meta))
    preds = classify_images(classifier, images, cls_meta)
    hit = (preds == labels).float()
    per_class = {c: hit[labels == c].mean().item() for c in classes}
    result = {"samples": len(labels), "steps": args.steps, "cfg_scale": args.cfg_scale, "sampler": args.sampler,
              "dit_step": dit_meta.get("step"), "agreement": hit.mean().item(), "per_class": per_class}
    if dit_meta.get("data", {}).get("dataset") == "digits" and not dit_meta["data"].get("autoencoder"):
        real, real_labels, _ = load_images("digits", dit.cfg.img_size, dit.cfg.in_chans, split="val")
        result["classifier_val_accuracy"] = (classify_images(classifier, real, cls_meta) == real_labels).float() \
            .mean().item()
    print(f"DiT step {result['dit_step']}, {args.steps} {args.sampler} steps, cfg {args.cfg_scale}: "
          f"{100 * result['agreement']:.1f}% of {len(labels)} samples classified as their conditioning class")
    print("per class: " + "  ".join(f"{c}:{100 * v:.0f}%" for c, v in per_class.items()))
    if "classifier_val_accuracy" in result:
        print(f"classifier on real validation digits: {100 * result['classifier_val_accuracy']:.1f}%")
    if args.grid:
        keep = torch.cat([torch.nonzero(labels == c).flatten()[:10] for c in classes])
        save_grid(images[keep], args.grid, ncol=min(10, args.per_class))
    if args.json:
        _write_json(args.json, result)
    return 0


def eval_samples_cli() -> None:
    run_cli(eval_samples_main)


# --- linvision-bench-diffusion-block ----------------------------------------------------------------------------

BENCH_BLOCK_HELP = """\
Throughput and memory of one Sana-style block: ReLU linear self-attention against softmax self-attention;
with --vs-diffusers, the whole Sana transformer in linvision against diffusers' SanaTransformer2DModel.

    linvision-bench-diffusion-block                      # C 1152 (Sana-0.6B), 1k/4k/16k/64k tokens
    linvision-bench-diffusion-block --tokens 1024 4096 --dtype bf16 --repeats 5
    linvision-bench-diffusion-block --vs-diffusers --model sana_600m_t2i --latent 32 32 --repeats 3

--vs-diffusers builds diffusers' model with random weights for the config, converts them into linvision's
(linvision.diffusion.sana), and times forwards of each (after a warm-up; interleaved) on the same latents,
timestep and a caption of --context tokens whose last third is padding; it reports the agreement of the
outputs, with the exact (diffusers) eps and with linvision's default eps. Needs diffusers.

Each (attention, token count) point runs in its own process, so an out-of-memory or a time-out (--timeout
seconds) is recorded for that point and the others still run. A point builds one block (cross-attention to
--context condition tokens, Mix-FFN) on a square-ish grid and times --repeats forwards under no_grad after one
warm-up forward (from 16k tokens on: one cold forward, no warm-up), and reports the mean time, tokens per
second and peak memory: CUDA's max allocated bytes on a GPU, on CPU the process's peak resident set (reset
before the first forward) minus the resident set then (so activations and workspace, not the weights or the
library). The measurements are linvision.diffusion.block_speed's.
"""


def bench_block_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-diffusion-block."""
    p = tool_parser("linvision-bench-diffusion-block", BENCH_BLOCK_HELP)
    p.add_argument("--model", default="sana_600m", choices=list(DIT_CONFIGS), help="block shape to take")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536],
                   help="token counts to measure, each on the most square H x W grid")
    p.add_argument("--attn", nargs="+", default=["linear", "softmax"], choices=["linear", "softmax"],
                   help="self-attentions to measure at each token count")
    p.add_argument("--batch", type=int, default=1, help="images per forward")
    p.add_argument("--context", type=int, default=300, help="condition tokens (Sana: 300 text tokens)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="dtype of the weights and inputs")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed forwards per point (one from 16k tokens on); with --vs-diffusers, per model")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per point")
    add_threads_arg(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to run on (default: cuda when available, else cpu)")
    p.add_argument("--parts", action="store_true", help="also time the self-attention and the Mix-FFN alone")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--vs-diffusers", action="store_true",
                   help="time and agree the whole Sana transformer against diffusers' (a caption model config)")
    p.add_argument("--latent", type=int, nargs=2, default=[32, 32], help="latent H W of --vs-diffusers")
    return p


def bench_block_main() -> None:
    args = bench_block_parser().parse_args()
    print(set_threads(args.threads), flush=True)
    args.threads = torch.get_num_threads()  # the points measured in processes of their own take the same
    if args.vs_diffusers:
        if args.model == "sana_600m":
            args.model = "sana_600m_t2i"
        result = compare_diffusers(args.model, args.latent, args.batch, args.context, args.dtype, args.device,
                                   args.repeats, args.threads)
        print(comparison_text(result, args.repeats))
        if args.json:
            _write_json(args.json, result)
        return
    opts = {k: getattr(args, k) for k in OPTION_KEYS}
    print(describe(opts))
    print(TABLE_HEADER)
    results = run_sweep(opts, args.tokens, args.attn, args.timeout)
    for line in ratios(results, args.tokens):
        print(line)
    if args.json:
        _write_json(args.json, {"options": opts, "results": results})


# --- linvision-bench-diffusion-parallel -------------------------------------------------------------------------

BENCH_PARALLEL_HELP = """\
Memory per rank of diffusion training, replicated (DDP) against sharded (FSDP2), at several world sizes.

    linvision-bench-diffusion-parallel                   # sana_600m's blocks, depth 4, 16 x 16 latents
    linvision-bench-diffusion-parallel --depth 8 --ranks 1 2 4 --latent 32 --batch 8 --out results/fsdp_mem

Each (mode, ranks) point is its own torchrun job (gloo on CPU, nccl with one GPU per rank) that builds the
model of --model at --depth, the EMA copy and AdamW as linvision-train-diffusion does, spreads them with
linvision.diffusion.parallel and takes --steps training steps (linvision.diffusion.train.optimizer_step) of
--batch images over all ranks on random latents. Modes: ddp (every rank holds the whole model; one rank is a
plain process), fsdp (FSDP2, --param-dtype compute), fsdp+ckpt (the same with activation checkpointing).
Every rank reports:

  - state: the bytes it holds of weights, EMA weights, gradients and optimizer states (its shards under FSDP);
  - peak: CUDA's max allocated bytes on a GPU; on CPU the process's peak resident set minus the resident set
    before the model was built (so it includes the gathered blocks, activations and communication buffers);
  - step time (the mean of the steps after the first).

The largest rank's figures make the table (printed, and written as <out>.md and <out>.json). The measurements
are linvision.diffusion.parallel_memory's.
"""


def bench_parallel_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-diffusion-parallel."""
    p = tool_parser("linvision-bench-diffusion-parallel", BENCH_PARALLEL_HELP)
    p.add_argument("--model", default="sana_600m", help="a config of linvision.diffusion.DIT_CONFIGS")
    p.add_argument("--depth", type=int, default=4, help="blocks (sana_600m has 28)")
    p.add_argument("--latent", type=int, default=16, help="latent height and width")
    p.add_argument("--batch", type=int, default=2, help="images per step over all ranks")
    p.add_argument("--steps", type=int, default=3, help="training steps per point (the step time leaves out the first)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                   help="world sizes to measure (each must divide --batch)")
    p.add_argument("--modes", nargs="+", default=list(parallel_memory.MODES), choices=parallel_memory.MODES,
                   help="ddp: replicated; fsdp: FSDP2 shards; fsdp+ckpt: FSDP2 with activation checkpointing")
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="fsdp compute dtype")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    return p


def bench_parallel_main() -> int:
    args = bench_parallel_parser().parse_args()
    cfg = parallel_memory.ParallelMemoryConfig(**{f.name: getattr(args, f.name)
                                                  for f in dataclasses.fields(parallel_memory.ParallelMemoryConfig)})
    parallel_memory.check_sweep(cfg, args.ranks)
    points = parallel_memory.run_sweep(cfg, args.ranks, args.modes, log=lambda line: print(line, flush=True))
    text = parallel_memory.table(points, cfg)
    print(text)
    if args.out:
        atomic_write_text(args.out + ".md", text + "\n")
        atomic_write_text(args.out + ".json", json.dumps({"args": vars(args), "points": points}, indent=2))
    return 0


def bench_parallel_cli() -> None:
    run_cli(bench_parallel_main)


PARSERS = {
    "linvision-train-diffusion": train_parser,
    "linvision-sample-diffusion": sample_parser,
    "linvision-eval-diffusion-samples": eval_samples_parser,
    "linvision-bench-diffusion-block": bench_block_parser,
    "linvision-bench-diffusion-parallel": bench_parallel_parser,
}

if __name__ == "__main__":
    sys.exit(f"linvision/tools/diffusion.py holds the commands {', '.join(PARSERS)}: run one of them")
