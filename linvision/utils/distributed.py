"""Process-group helpers for runs launched with ``torchrun`` (gloo on CPU, nccl on CUDA)."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "all_reduce_sum", "all_reduce_max", "broadcast_object", "on_main",
           "barrier", "cleanup"]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", group: bool = False) -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE > 1), else a single process.

    ``device`` is "auto" (CUDA when available), "cpu" or "cuda". Each rank uses cuda:LOCAL_RANK. ``group``: a
    single process gets a process group of its own too (for code that needs one, such as FSDP), in memory when
    torchrun did not describe one. A group made here is ``DistInfo.owns_group``: :func:`cleanup` ends it.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda', got {device!r}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but CUDA is not available")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    backend = "nccl" if use_cuda else "gloo"
    owns = False
    if (world_size > 1 or group) and not dist.is_initialized():
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        owns = True
    return DistInfo(rank, world_size, local_rank, dev, owns)


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of ``values`` (a float64 tensor on any device) over ranks."""
    if not info.distributed:
        return values
    # gloo reduces CPU tensors, nccl CUDA tensors
    t = values.to(info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def all_reduce_max(value: int, info: DistInfo) -> int:
    """The largest of the ranks' integers."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn, info: DistInfo):
    """``fn()`` on rank 0, its result on every rank. When it raises ValueError, FileNotFoundError or TypeError,
    every rank raises the same one-line error (instead of the others waiting in their next collective until
    torchrun tears the job down)."""
    if not info.distributed:
        return fn()
    outcome = None
    if info.is_main:
        try:
            outcome = ("ok", fn())
        except (ValueError, FileNotFoundError, TypeError) as e:
            broadcast_object(("error", type(e).__name__, str(e)), info)
            raise
    outcome = broadcast_object(outcome, info)
    if outcome[0] == "error":
        raise {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError}[
            outcome[1]](outcome[2])
    return outcome[1]


def barrier(info: DistInfo) -> None:
    """Wait for every rank. Call it at the end of a run's normal path, before :func:`cleanup`: under gloo a rank
    that ends its group while another is still sending can abort at exit."""
    if info.distributed:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    """End the process group of a multi-process run, or the one :func:`init_distributed` made for a single one.
    Modules that only reference cycles keep alive (FSDP's hooks) are collected first: under gloo, freeing them
    after the group has ended aborted the process at exit."""
    if (info.distributed or info.owns_group) and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
