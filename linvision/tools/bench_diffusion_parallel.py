r"""Memory per rank of diffusion training, replicated (DDP) against sharded (FSDP2), at several world sizes.

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

The largest rank's figures make the table (printed, and written as <out>.md and <out>.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

MODES = ("ddp", "fsdp", "fsdp+ckpt")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    """One rank of one point: train ``args.steps`` steps and write every rank's figures to ``args.result``."""
    import torch.distributed as dist

    from linvision.utils.distributed import barrier, cleanup, init_distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    info = init_distributed("auto", group=True)
    try:
        mine = _measure(args, info)  # the model, optimizer and EMA are gone when it returns
        everyone = [None] * info.world_size
        dist.all_gather_object(everyone, mine)
        if info.is_main:
            with open(args.result, "w") as f:
                json.dump(everyone, f)
        barrier(info)
    finally:
        cleanup(info)


def _measure(args: argparse.Namespace, info) -> Dict[str, Any]:
    """Train ``args.steps`` steps of one rank; its figures."""
    from timm.optim import create_optimizer_v2

    from linvision.diffusion.flow import flow_matching_loss
    from linvision.diffusion.model import create_dit
    from linvision.diffusion.parallel import parallelize
    from linvision.diffusion.train import create_ema, optimizer_step

    cuda = info.device.type == "cuda"
    base = _rss_mib()
    torch.manual_seed(0)
    model = create_dit(args.model, depth=args.depth, img_size=args.latent)
    model.set_grad_checkpointing(args.mode == "fsdp+ckpt")
    ema = create_ema(model, 0.999)
    step_model = parallelize(model, ema.module, "ddp" if args.mode == "ddp" else "fsdp", info, args.param_dtype)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.0, betas=(0.9, 0.99))
    per_rank = args.batch // info.world_size
    g = torch.Generator(device=info.device).manual_seed(info.rank)
    shape = (per_rank, model.cfg.in_chans, args.latent, args.latent)
    times = []
    for k in range(args.steps):
        x0 = torch.randn(shape, generator=g, device=info.device)
        y = torch.randint(model.cfg.num_classes, (per_rank,), generator=g, device=info.device)
        start = time.perf_counter()
        loss = flow_matching_loss(step_model, x0, y, null_class=model.null_class, generator=g)
        optimizer_step(loss, model, opt, ema, k, 1.0)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    mib = 2 ** 20
    mine = {
        "rank": info.rank,
        "weights_mib": _local_bytes(model.parameters()) / mib,
        "ema_mib": _local_bytes(ema.module.parameters()) / mib,
        "grads_mib": _local_bytes(p.grad for p in model.parameters() if p.grad is not None) / mib,
        "optimizer_mib": _local_bytes(states) / mib,
        "peak_mib": (torch.cuda.max_memory_allocated(info.device) / mib if cuda
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base),
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
        "loss": loss.item(),
    }
    return mine


def run_point(args: argparse.Namespace, mode: str, ranks: int) -> Dict[str, Any]:
    """One torchrun job; the figures of its largest rank (or the error it ended with)."""
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           os.path.abspath(__file__), "--worker", "--mode", mode, "--result", result,
           "--model", args.model, "--depth", str(args.depth), "--latent", str(args.latent),
           "--batch", str(args.batch), "--steps", str(args.steps), "--param-dtype", args.param_dtype,
           "--threads", str(args.threads or 0)]
    point: Dict[str, Any] = {"mode": mode, "ranks": ranks}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)})
        if proc.returncode != 0:  # the rank's exception, not torchrun's summary around it
            lines = [s.strip() for s in proc.stderr.splitlines() if "ChildFailedError" not in s and s.strip()]
            lines = lines or [f"exit status {proc.returncode}"]
            signal = next((s for s in lines if s.startswith("exitcode") and "SIGTERM" not in s), lines[-1])
            point["error"] = next((s for s in reversed(lines) if "Error" in s or "error:" in s), signal)[:200]
            return point
        with open(result) as f:
            ranks_figures = json.load(f)
    except subprocess.TimeoutExpired:
        point["error"] = f"timed out after {args.timeout}s"
        return point
    finally:
        os.remove(result)
    worst = max(ranks_figures, key=lambda r: r["peak_mib"])
    point.update({k: v for k, v in worst.items() if k != "rank"})
    point["state_mib"] = sum(worst[k] for k in ("weights_mib", "ema_mib", "grads_mib", "optimizer_mib"))
    return point


def table(points: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.model} at depth {args.depth}, {args.latent} x {args.latent} latents, {args.batch} images per "
             f"step over all ranks, fsdp compute {args.param_dtype}; per rank (the largest):", "",
             "| mode | ranks | weights (MiB) | EMA | grads | optimizer | state total | peak (MiB) | step (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        if "error" in p:
            lines.append(f"| {p['mode']} | {p['ranks']} | {p['error']} |||||||")
            continue
        lines.append(f"| {p['mode']} | {p['ranks']} | {p['weights_mib']:.0f} | {p['ema_mib']:.0f} | "
                     f"{p['grads_mib']:.0f} | {p['optimizer_mib']:.0f} | {p['state_mib']:.0f} | "
                     f"{p['peak_mib']:.0f} | {p['step_s']:.2f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-bench-diffusion-parallel (and of its torchrun workers: the hidden flags)."""
    from linvision.utils.cli import tool_parser

    p = tool_parser("linvision-bench-diffusion-parallel", __doc__)
    p.add_argument("--model", default="sana_600m", help="a config of linvision.diffusion.DIT_CONFIGS")
    p.add_argument("--depth", type=int, default=4, help="blocks (sana_600m has 28)")
    p.add_argument("--latent", type=int, default=16, help="latent height and width")
    p.add_argument("--batch", type=int, default=2, help="images per step over all ranks")
    p.add_argument("--steps", type=int, default=3, help="training steps per point (the step time leaves out the first)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                   help="world sizes to measure (each must divide --batch)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="ddp: replicated; fsdp: FSDP2 shards; fsdp+ckpt: FSDP2 with activation checkpointing")
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="fsdp compute dtype")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ddp", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.worker:
        worker(args)
        return 0
    from linvision.diffusion.model import DIT_CONFIGS

    if args.model not in DIT_CONFIGS:
        raise ValueError(f"model: unknown {args.model!r}; allowed: {', '.join(DIT_CONFIGS)}")
    bad = next((r for r in args.ranks if r < 1 or args.batch % r), None)
    if bad is not None:
        raise ValueError(f"ranks: {bad} ranks cannot split a batch of {args.batch}")
    points = []
    for ranks in args.ranks:
        for mode in args.modes:
            points.append(run_point(args, mode, ranks))
            print(f"{mode} x {ranks}: " + (points[-1].get("error") or f"peak {points[-1]['peak_mib']:.0f} MiB, "
                                           f"state {points[-1]['state_mib']:.0f} MiB per rank"), flush=True)
    text = table(points, args)
    print(text)
    if args.out:
        from linvision.utils.files import atomic_write_text

        atomic_write_text(args.out + ".md", text + "\n")
        atomic_write_text(args.out + ".json", json.dumps({"args": {k: v for k, v in vars(args).items()
                                                                   if k not in ("worker", "mode", "result")},
                                                          "points": points}, indent=2))
    return 0


def cli() -> None:
    from linvision.utils.cli import run_cli

    run_cli(main)


if __name__ == "__main__":
    cli()
