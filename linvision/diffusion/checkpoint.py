"""LinDiT checkpoints in the library's one checkpoint format (:mod:`linvision.utils.checkpoint`): a folder
(``<run>/last``) with model.safetensors (the trained weights), ema.safetensors (their exponential moving
average, what sampling uses by default), model.json ({"model": "lindit", "num_classes", "model_config": the
DiTConfig fields, "data", "step", ...}) and train_state.pt, written as one unit.

A sharded (FSDP) run writes the weights, the EMA and the optimizer with ``torch.distributed.checkpoint``
instead: every rank writes its shards into ``dcp/`` of the same folder (model.json and train_state.pt beside
it), still swapped in as one unit. Such a checkpoint loads at any world size, a single process included
(:func:`load_dit`, :func:`load_train_state`).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from linvision.utils.checkpoint import (
    load_checkpoint_weights,
    read_checkpoint_meta,
    resolve_checkpoint,
    save_checkpoint,
)
from linvision.utils.distributed import DistInfo, barrier, on_main
from linvision.utils.files import begin_checkpoint_folder, commit_checkpoint_folder

from .model import LinDiT, create_dit

__all__ = ["DIT_MODEL_NAME", "SHARDED_FOLDER", "save_dit_checkpoint", "save_sharded_dit_checkpoint",
           "optimizer_state", "is_sharded_checkpoint", "load_train_state", "load_dit"]

DIT_MODEL_NAME = "lindit"
SHARDED_FOLDER = "dcp"


def _description(model: LinDiT, meta: Dict[str, Any]) -> Dict[str, Any]:
    return {"model": DIT_MODEL_NAME, "num_classes": model.cfg.num_classes, "model_config": model.cfg.to_dict(),
            **meta}


def save_dit_checkpoint(folder: str, model: LinDiT, ema: LinDiT, meta: Dict[str, Any],
                        train_state: Optional[Dict[str, Any]] = None) -> None:
    """:func:`linvision.utils.checkpoint.save_checkpoint` of a LinDiT, its EMA copy and ``meta``."""
    save_checkpoint(folder, model, _description(model, meta), train_state, ema=ema)


def is_sharded_checkpoint(folder: str) -> bool:
    """Whether ``folder`` holds its weights as torch.distributed.checkpoint shards."""
    return os.path.isdir(os.path.join(folder, SHARDED_FOLDER))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer state keyed by parameter names (torch.distributed.checkpoint's form): what a checkpoint
    stores, so that a run of another layout (FSDP from a single-process checkpoint) can take it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)[1]


def save_sharded_dit_checkpoint(folder: str, model: LinDiT, ema: LinDiT, optimizer: torch.optim.Optimizer,
                                meta: Dict[str, Any], train_state: Dict[str, Any], info: DistInfo) -> None:
    """Collective (every rank calls it): the weights, EMA weights and optimizer state of a sharded ``model``
    through ``torch.distributed.checkpoint`` into ``folder/dcp``, model.json and ``train_state`` (scheduler,
    generators, step: no tensors of the model) from rank 0, the whole folder swapped in as one unit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    new = on_main(lambda: begin_checkpoint_folder(folder), info)
    weights, optim = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "ema": get_model_state_dict(ema), "optim": optim},
             checkpoint_id=os.path.join(new, SHARDED_FOLDER))
    barrier(info)
    if info.is_main:
        with open(os.path.join(new, "model.json"), "w") as f:
            json.dump(_description(model, meta), f, indent=2)
        torch.save(train_state, os.path.join(new, "train_state.pt"))
        commit_checkpoint_folder(folder)
    barrier(info)


def _load_sharded(folder: str, state: Dict[str, Any], collective: bool = False) -> None:
    """Fill ``state`` from ``folder/dcp``: in this process alone, or (``collective``) with every rank of the
    process group, each reading the shards of its part."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.join(folder, SHARDED_FOLDER)
    try:
        with warnings.catch_warnings():  # one process reading shards is what no_dist asks for, not a surprise
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=not (collective and dist.is_initialized()))
    except Exception as e:  # torch raises several types for missing, truncated or mismatched shards
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint: cannot read the sharded weights in {path} ({reason})") from None


def _read_weights(folder: str, file: str) -> Dict[str, Tensor]:
    path = os.path.join(folder, file)
    try:
        return load_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint: no {file} in {folder}") from None
    except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
        raise ValueError(f"checkpoint: cannot read {path} ({str(e).strip()[:200]})") from None


def load_train_state(folder: str, model: nn.Module, ema: LinDiT, optimizer: torch.optim.Optimizer,
                     train_state: Dict[str, Any]) -> None:
    """Load a checkpoint's weights, EMA weights and optimizer state into a run of any layout (a single
    process, DDP or FSDP at any world size; every rank calls it): from ``dcp/`` (resharded to this run) or
    from model.safetensors, ema.safetensors and ``train_state`` (train_state.pt's content)'s optimizer.
    ValueError in one line naming the folder when they do not fit."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    if is_sharded_checkpoint(folder):
        weights, optim = get_state_dict(model, optimizer)
        state = {"model": weights, "ema": get_model_state_dict(ema), "optim": optim}
        _load_sharded(folder, state, collective=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        set_model_state_dict(ema, state["ema"])
        return
    inner = model.module if hasattr(model, "module") else model
    saved = train_state["optimizer"]
    by_name = all(isinstance(k, str) for k in saved.get("state", {}))
    if not any(type(p).__name__ == "DTensor" for p in inner.parameters()):
        load_checkpoint_weights(inner, folder, DIT_MODEL_NAME)
        load_checkpoint_weights(ema, folder, DIT_MODEL_NAME, "ema.safetensors")
        if by_name:
            set_optimizer_state_dict(inner, optimizer, saved)
        else:  # written before optimizer states were keyed by name
            optimizer.load_state_dict(saved)
        return
    if not by_name:
        raise ValueError(f"resume: {folder} keeps its optimizer state in the older positional form, which a sharded "
                         f"(fsdp) run cannot take; resume it with parallel 'ddp'")
    full = StateDictOptions(full_state_dict=True)
    set_state_dict(model, optimizer, model_state_dict=_read_weights(folder, "model.safetensors"),
                   optim_state_dict=saved, options=full)
    set_model_state_dict(ema, _read_weights(folder, "ema.safetensors"), options=full)


def load_dit(path: str, ema: bool = True, device: str = "cpu") -> Tuple[LinDiT, Dict[str, Any]]:
    """Rebuild a trained LinDiT (EMA weights unless ``ema=False``) from a checkpoint or run folder, sharded or
    not, in eval mode. Returns (model, meta) with meta the content of model.json."""
    folder = resolve_checkpoint(path)
    meta = read_checkpoint_meta(folder)
    if meta["model"] != DIT_MODEL_NAME or "model_config" not in meta:
        raise ValueError(f"checkpoint: {folder} holds a {meta['model']!r}, not a {DIT_MODEL_NAME} (linvision/tools/train.py "
                         f"checkpoints load with linvision.load_model)")
    model = create_dit(meta["model_config"])
    if is_sharded_checkpoint(folder):
        key = "ema" if ema else "model"
        state = {key: model.state_dict()}
        _load_sharded(folder, state)
        model.load_state_dict(state[key])
    else:
        load_checkpoint_weights(model, folder, DIT_MODEL_NAME, "ema.safetensors" if ema else "model.safetensors")
    return model.to(device).eval(), meta
