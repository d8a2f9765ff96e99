r"""Throughput and memory of one Sana-style block: ReLU linear self-attention against softmax self-attention;
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
from __future__ import annotations

import argparse
import json

import torch

from linvision.diffusion.block_speed import (DTYPES, OPTION_KEYS, TABLE_HEADER, comparison_text, compare_diffusers,
                                             describe, ratios, run_sweep)
from linvision.diffusion.model import DIT_CONFIGS
from linvision.utils.cli import add_threads_arg, tool_parser
from linvision.utils.threads import set_threads


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-diffusion-block."""
    p = tool_parser("linvision-bench-diffusion-block", __doc__)
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


def main() -> None:
    args = build_parser().parse_args()
    print(set_threads(args.threads), flush=True)
    args.threads = torch.get_num_threads()  # the points measured in processes of their own take the same
    if args.vs_diffusers:
        if args.model == "sana_600m":
            args.model = "sana_600m_t2i"
        result = compare_diffusers(args.model, args.latent, args.batch, args.context, args.dtype, args.device,
                                   args.repeats, args.threads)
        print(comparison_text(result, args.repeats))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    opts = {k: getattr(args, k) for k in OPTION_KEYS}
    print(describe(opts))
    print(TABLE_HEADER)
    results = run_sweep(opts, args.tokens, args.attn, args.timeout)
    for line in ratios(results, args.tokens):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": opts, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
