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
second and peak memory: CUDA's max allocated bytes on a GPU, on CPU the process's peak resident set minus the
resident set before the first forward (so activations and workspace, not the weights or the library).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import time
from typing import Dict, List, Tuple

import torch

from linvision.diffusion.block import SanaBlock
from linvision.diffusion.model import DIT_CONFIGS
from linvision.utils.cli import tool_parser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def grid_for(tokens: int) -> Tuple[int, int]:
    """The most square H x W with H * W = tokens."""
    h = int(math.isqrt(tokens))
    while tokens % h:
        h -= 1
    return h, tokens // h


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_point(args: Dict, attn: str, tokens: int, queue: "mp.Queue") -> None:
    """Measure one point in this (child) process and put a result dict on ``queue``."""
    torch.set_num_threads(args["threads"] or torch.get_num_threads())
    torch.manual_seed(0)
    device = args["device"]
    dtype = DTYPES[args["dtype"]]
    cfg = DIT_CONFIGS[args["model"]]
    block = SanaBlock(cfg.dim, cfg.num_heads, head_dim=cfg.head_dim, mlp_ratio=cfg.mlp_ratio, self_attn=attn,
                      fp16_clamp=dtype == torch.float16).to(device=device, dtype=dtype).eval()
    hw = grid_for(tokens)
    x = torch.randn(args["batch"], tokens, cfg.dim, device=device, dtype=dtype)
    t_mod = torch.randn(args["batch"], 6 * cfg.dim, device=device, dtype=dtype) * 0.1
    context = torch.randn(args["batch"], args["context"], cfg.dim, device=device, dtype=dtype)
    mask = torch.ones(args["batch"], args["context"], dtype=torch.bool, device=device)
    repeats = 1 if tokens >= 16384 else args["repeats"]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        base = _rss_mib()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2 ** 20
        if repeats > 1:  # large points run once, cold: their own time dwarfs the first-call set-up
            block(x, hw, t_mod, context, mask)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            block(x, hw, t_mod, context, mask)
        sync()
        seconds = (time.perf_counter() - start) / repeats
        peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else _peak_rss_mib()
        parts = {}
        if args["parts"]:  # the self-attention and the Mix-FFN alone, on a layer-normed input
            h = block.norm1(x)
            for name, fn in (("self_attn_ms", lambda: block.attn(h, hw)), ("ffn_ms", lambda: block.ffn(h, hw))):
                sync()
                start = time.perf_counter()
                for _ in range(repeats):
                    fn()
                sync()
                parts[name] = 1e3 * (time.perf_counter() - start) / repeats
    queue.put({"attn": attn, "tokens": tokens, "grid": list(hw), "status": "ok", "ms": 1e3 * seconds,
               "tokens_per_s": args["batch"] * tokens / seconds, "peak_mib": peak - base, "repeats": repeats,
               **parts})


def measure(args: Dict, attn: str, tokens: int, timeout: float) -> Dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run_point, args=(args, attn, tokens, queue))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"attn": attn, "tokens": tokens, "status": f"timeout > {timeout:.0f}s"}
    if not queue.empty():
        return queue.get()
    # A process killed by the kernel's OOM killer exits with -9; a CUDA OOM raises inside the child.
    status = "out of memory (killed)" if proc.exitcode == -9 else f"failed (exit code {proc.exitcode})"
    return {"attn": attn, "tokens": tokens, "status": status}


def compare_diffusers(args: argparse.Namespace) -> Dict:
    """Time and agree linvision's Sana transformer with diffusers' on the same random weights and inputs."""
    import diffusers

    from linvision.diffusion.model import LinDiT
    from linvision.diffusion.sana import config_from_diffusers, config_to_diffusers, state_dict_from_diffusers

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, device = DTYPES[args.dtype], args.device
    config = config_to_diffusers(DIT_CONFIGS[args.model])
    torch.manual_seed(0)
    theirs = diffusers.SanaTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    theirs = theirs.to(device=device, dtype=dtype).eval()
    ours = {}
    for name, exact in (("exact eps", True), ("default eps", False)):
        cfg = config_from_diffusers(config, exact_eps=exact)
        model = LinDiT(cfg)
        model.load_state_dict(state_dict_from_diffusers(theirs.state_dict(), cfg))
        ours[name] = model.to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    h, w = args.latent
    x = torch.randn(args.batch, config["in_channels"], h, w, generator=g).to(device, dtype)
    t = torch.full((args.batch,), 0.5)
    context = torch.randn(args.batch, args.context, config["caption_channels"], generator=g).to(device, dtype)
    mask = torch.ones(args.batch, args.context, dtype=torch.bool)
    mask[:, args.context - args.context // 3:] = False
    mask = mask.to(device)
    runs = {
        "diffusers": lambda: theirs(x, context, (1000.0 * t).to(device), encoder_attention_mask=mask.long(),
                                    return_dict=False)[0],
        **{f"linvision ({n})": (lambda m=m: m(x, t.to(device), context=context, context_mask=mask))
           for n, m in ours.items()},
    }

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    result = {"model": args.model, "latent": [h, w], "batch": args.batch, "context": args.context,
              "dtype": args.dtype, "device": device, "threads": torch.get_num_threads(),
              "params_m": sum(p.numel() for p in theirs.parameters()) / 1e6, "ms": {}, "agreement": {}}
    outputs, times = {}, {name: [] for name in runs}
    with torch.no_grad():
        for name, fn in runs.items():
            outputs[name] = fn().float()  # warm-up
        for _ in range(args.repeats):  # interleaved, so that load from other processes hits all alike
            for name, fn in runs.items():
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(1e3 * (time.perf_counter() - start))
    result["ms"] = {name: sum(v) / len(v) for name, v in times.items()}
    result["min_ms"] = {name: min(v) for name, v in times.items()}
    ref = outputs["diffusers"]
    for name in ours:
        out = outputs[f"linvision ({name})"]
        result["agreement"][name] = {"max_abs": (out - ref).abs().max().item(),
                                     "rel_l2": ((out - ref).norm() / ref.norm()).item(),
                                     "ref_max_abs": ref.abs().max().item()}
    print(f"{args.model}: {result['params_m']:.0f}M parameters, latents {h}x{w}, batch {args.batch}, "
          f"{args.context} caption tokens ({args.context // 3} padded), {args.dtype}, {device}, "
          f"{result['threads']} threads, mean of {args.repeats} interleaved forwards after a warm-up")
    for name, ms in result["ms"].items():
        print(f"  {name:>24}: {ms:9.1f} ms (fastest {result['min_ms'][name]:.1f} ms)")
    for name, a in result["agreement"].items():
        print(f"  linvision ({name}) vs diffusers: max abs {a['max_abs']:.3g}, relative L2 {a['rel_l2']:.3g} "
              f"(outputs up to {a['ref_max_abs']:.3g})")
    return result


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
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
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
    if args.vs_diffusers:
        if args.model == "sana_600m":
            args.model = "sana_600m_t2i"
        result = compare_diffusers(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    cfg = DIT_CONFIGS[args.model]
    opts = {k: getattr(args, k) for k in ("model", "batch", "context", "dtype", "repeats", "threads", "device",
                                          "parts")}
    threads = args.threads or torch.get_num_threads()
    print(f"block C={cfg.dim}, linear heads {cfg.dim // cfg.head_dim} x {cfg.head_dim}, cross heads {cfg.num_heads}, "
          f"Mix-FFN hidden {int(cfg.dim * cfg.mlp_ratio)}; batch {args.batch}, {args.context} condition tokens, "
          f"{args.dtype}, device {args.device}, {threads} threads")
    print(f"{'attention':>9} {'tokens':>7} {'grid':>9} {'ms':>10} {'tokens/s':>10} {'peak MiB':>9}  status")
    results: List[Dict] = []
    for tokens in args.tokens:
        for attn in args.attn:
            r = measure(opts, attn, tokens, args.timeout)
            results.append(r)
            if r["status"] == "ok":
                grid = "x".join(map(str, r["grid"]))
                parts = "".join(f", {k[:-3]} {r[k]:.1f} ms" for k in ("self_attn_ms", "ffn_ms") if k in r)
                print(f"{attn:>9} {tokens:>7} {grid:>9} {r['ms']:>10.1f} {r['tokens_per_s']:>10.0f} "
                      f"{r['peak_mib']:>9.0f}  ok{parts}")
            else:
                print(f"{attn:>9} {tokens:>7} {'':>9} {'-':>10} {'-':>10} {'-':>9}  {r['status']}")
    for tokens in args.tokens:
        pair = {r["attn"]: r for r in results if r["tokens"] == tokens and r["status"] == "ok"}
        if "linear" in pair and "softmax" in pair:
            print(f"{tokens:>7} tokens: linear is {pair['softmax']['ms'] / pair['linear']['ms']:.2f}x the speed "
                  f"of softmax, {pair['linear']['peak_mib'] / max(pair['softmax']['peak_mib'], 1e-9):.2f}x its "
                  f"peak memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": opts, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
