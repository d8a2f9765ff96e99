"""A LinDiT spread over the ranks of a torchrun job, on PyTorch's own engine.

``ddp``: every rank holds the whole model; ``DistributedDataParallel`` averages the gradients (a single
process trains the model as it is). ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every
transformer block, then the rest of the model, over the ranks: each rank keeps 1/N of the fp32 weights,
gradients and AdamW states and gathers a block's weights, in ``param_dtype`` (bf16 by default), only while that
block runs; gradients are reduced in fp32. The EMA copy is sharded the same way (it never runs while training).
"""
from __future__ import annotations

import torch
from torch import nn

from linvision.utils.distributed import DistInfo

from .model import LinDiT

__all__ = ["PARALLEL_MODES", "PARAM_DTYPES", "parallelize"]

PARALLEL_MODES = ("ddp", "fsdp")
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _shard(model: nn.Module, mesh, param_dtype=None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    # The root's forward keeps its inputs as given: t must reach the timestep sinusoids in fp32 (the model casts
    # the image and the captions to its weights' dtype itself).
    root = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root)


def parallelize(model: LinDiT, ema: LinDiT, mode: str, info: DistInfo, param_dtype: str = "bf16") -> nn.Module:
    """Move ``model`` and its EMA copy ``ema`` to ``info.device`` and spread them over the ranks; returns the
    module a training step calls. ``mode`` "ddp": DistributedDataParallel around ``model`` when there are
    several ranks, else ``model``; "fsdp": both sharded in place (FSDP2 over all ranks, ``model``'s weights
    gathered in ``param_dtype``: "bf16", "fp16" or "fp32"; needs a process group, one rank included), and
    ``model`` itself is returned. ValueError in one line for an unknown mode or dtype, or FSDP without a group."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel: unknown {mode!r}; allowed: {', '.join(PARALLEL_MODES)}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"fsdp_param_dtype: unknown {param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}")
    model.to(info.device)
    ema.to(info.device)
    if mode == "ddp":
        if not info.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("parallel: 'fsdp' needs a process group (launch with torchrun, or init_distributed("
                         "group=True))")
    mesh = init_device_mesh(info.device.type, (dist.get_world_size(),))
    _shard(model, mesh, PARAM_DTYPES[param_dtype])
    _shard(ema, mesh)
    return model
