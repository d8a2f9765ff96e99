"""Memory per rank of diffusion training, replicated (DDP) against sharded (FSDP2), at several world sizes
(``linvision-bench-diffusion-parallel``).

:func:`run_point` runs one (mode, ranks) point as its own torchrun job of this module (gloo on CPU, nccl with one
GPU per rank); each rank (:func:`measure_rank`) builds the model of a :data:`~.model.DIT_CONFIGS` config at the
asked depth, the EMA copy and AdamW as ``linvision-train-diffusion`` does, spreads them with
:func:`linvision.diffusion.parallel.parallelize` and takes training steps
(:func:`linvision.diffusion.train.optimizer_step`) on random latents. Modes (:data:`MODES`): ddp (every rank holds
the whole model; one rank is a plain process), fsdp (FSDP2, ``param_dtype`` compute), fsdp+ckpt (the same with
activation checkpointing). Every rank reports the bytes it holds of weights, EMA weights, gradients and optimizer
states (its shards under FSDP), the peak memory of building and training
(:class:`linvision.utils.measure.MemoryMeter`: the gathered blocks, activations and communication buffers
included) and the mean step time after the first step; a point keeps the figures of its largest rank.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, List, Sequence

import torch

from linvision.utils.measure import MemoryMeter

MODES = ("ddp", "fsdp", "fsdp+ckpt")


@dataclasses.dataclass
class ParallelMemoryConfig:
    """What every point of a sweep trains: ``model`` (a DIT_CONFIGS name) at ``depth`` blocks on ``latent`` x
    ``latent`` latents, ``batch`` images per step over all ranks, ``steps`` steps, FSDP's compute dtype, CPU
    threads per rank, and the seconds a point may take."""
    model: str = "sana_600m"
    depth: int = 4
    latent: int = 16
    batch: int = 2
    steps: int = 3
    param_dtype: str = "bf16"
    threads: int = 1
    timeout: float = 1800


def check_sweep(cfg: ParallelMemoryConfig, ranks: Sequence[int]) -> None:
    """ValueError in one line for a model that is not a config or a world size that cannot split the batch."""
    from .model import DIT_CONFIGS

    if cfg.model not in DIT_CONFIGS:
        raise ValueError(f"model: unknown {cfg.model!r}; allowed: {', '.join(DIT_CONFIGS)}")
    bad = next((r for r in ranks if r < 1 or cfg.batch % r), None)
    if bad is not None:
        raise ValueError(f"ranks: {bad} ranks cannot split a batch of {cfg.batch}")


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _train(cfg: ParallelMemoryConfig, mode: str, info):
    """Build and spread the model, its EMA and AdamW, and take ``cfg.steps`` steps: (model, ema, optimizer,
    seconds per step, the last loss)."""
    from timm.optim import create_optimizer_v2

    from .flow import flow_matching_loss
    from .model import create_dit
    from .parallel import parallelize
    from .train import create_ema, optimizer_step

    torch.manual_seed(0)
    model = create_dit(cfg.model, depth=cfg.depth, img_size=cfg.latent)
    model.set_grad_checkpointing(mode == "fsdp+ckpt")
    ema = create_ema(model, 0.999)
    step_model = parallelize(model, ema.module, "ddp" if mode == "ddp" else "fsdp", info, cfg.param_dtype)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.0, betas=(0.9, 0.99))
    per_rank = cfg.batch // info.world_size
    g = torch.Generator(device=info.device).manual_seed(info.rank)
    shape = (per_rank, model.cfg.in_chans, cfg.latent, cfg.latent)
    times = []
    for k in range(cfg.steps):
        x0 = torch.randn(shape, generator=g, device=info.device)
        y = torch.randint(model.cfg.num_classes, (per_rank,), generator=g, device=info.device)
        start = time.perf_counter()
        loss = flow_matching_loss(step_model, x0, y, null_class=model.null_class, generator=g)
        optimizer_step(loss, model, opt, ema, k, 1.0)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return model, ema, opt, times, loss.item()


def measure_rank(cfg: ParallelMemoryConfig, mode: str, info) -> Dict[str, Any]:
    """Train ``cfg.steps`` steps on this rank of ``info``; its figures (MiB, seconds). The model, optimizer and
    EMA are gone when it returns."""
    mib = 2 ** 20
    with MemoryMeter(info.device) as mem:
        model, ema, opt, times, loss = _train(cfg, mode, info)
        states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        held = {"weights_mib": local_bytes(model.parameters()) / mib,
                "ema_mib": local_bytes(ema.module.parameters()) / mib,
                "grads_mib": local_bytes(p.grad for p in model.parameters() if p.grad is not None) / mib,
                "optimizer_mib": local_bytes(states) / mib}
    return {"rank": info.rank, **held, "peak_mib": mem.peak_mb,
            "step_s": sum(times[1:]) / max(1, len(times) - 1), "loss": loss}


def worker(cfg: ParallelMemoryConfig, mode: str, result: str) -> None:
    """One rank of one point under torchrun: :func:`measure_rank`, every rank's figures written to ``result``."""
    import torch.distributed as dist

    from linvision.utils.distributed import barrier, cleanup, init_distributed

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    info = init_distributed("auto", group=True)
    try:
        mine = measure_rank(cfg, mode, info)
        everyone = [None] * info.world_size
        dist.all_gather_object(everyone, mine)
        if info.is_main:
            with open(result, "w") as f:
                json.dump(everyone, f)
        barrier(info)
    finally:
        cleanup(info)


def _rank_error(stderr: str, returncode: int) -> str:
    """The rank's exception in a failed job's stderr, not torchrun's summary around it."""
    lines = [s.strip() for s in stderr.splitlines() if "ChildFailedError" not in s and s.strip()]
    lines = lines or [f"exit status {returncode}"]
    signal = next((s for s in lines if s.startswith("exitcode") and "SIGTERM" not in s), lines[-1])
    return next((s for s in reversed(lines) if "Error" in s or "error:" in s), signal)[:200]


def run_point(cfg: ParallelMemoryConfig, mode: str, ranks: int) -> Dict[str, Any]:
    """One torchrun job of ``ranks`` processes; the figures of its largest rank (or the error it ended with)."""
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", __name__, json.dumps(dataclasses.asdict(cfg)), mode, result]
    point: Dict[str, Any] = {"mode": mode, "ranks": ranks}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout,
                              env={**os.environ, "OMP_NUM_THREADS": str(cfg.threads or 1)})
        if proc.returncode != 0:
            point["error"] = _rank_error(proc.stderr, proc.returncode)
            return point
        with open(result) as f:
            ranks_figures = json.load(f)
    except subprocess.TimeoutExpired:
        point["error"] = f"timed out after {cfg.timeout}s"
        return point
    finally:
        os.remove(result)
    worst = max(ranks_figures, key=lambda r: r["peak_mib"])
    point.update({k: v for k, v in worst.items() if k != "rank"})
    point["state_mib"] = sum(worst[k] for k in ("weights_mib", "ema_mib", "grads_mib", "optimizer_mib"))
    return point


def run_sweep(cfg: ParallelMemoryConfig, ranks: Sequence[int], modes: Sequence[str],
              log: Callable[[str], Any] = print) -> List[Dict[str, Any]]:
    """:func:`run_point` at every world size for every mode, a line per point logged as it finishes."""
    points = []
    for n in ranks:
        for mode in modes:
            p = run_point(cfg, mode, n)
            points.append(p)
            log(f"{mode} x {n}: " + (p.get("error") or f"peak {p['peak_mib']:.0f} MiB, state {p['state_mib']:.0f} "
                                                       f"MiB per rank"))
    return points


def table(points: List[Dict[str, Any]], cfg: ParallelMemoryConfig) -> str:
    """The points as a Markdown table under a line that says what was trained."""
    lines = [f"{cfg.model} at depth {cfg.depth}, {cfg.latent} x {cfg.latent} latents, {cfg.batch} images per "
             f"step over all ranks, fsdp compute {cfg.param_dtype}; per rank (the largest):", "",
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


if __name__ == "__main__":  # a rank of run_point's torchrun job: the config (JSON), the mode, the result file
    worker(ParallelMemoryConfig(**json.loads(sys.argv[1])), sys.argv[2], sys.argv[3])
