"""Where a classification run starts from when it does not start fresh: its own checkpoint (every rank's RNG
states with the rest, and the records written after it dropped) or a checkpoint of timm's train.py."""
from __future__ import annotations

import json
import os
import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from timm.utils import unwrap_model

from linvision.models.published import unwrap_state_dict
from linvision.utils.checkpoint import load_torch_file
from linvision.utils.distributed import DistInfo
from linvision.utils.files import atomic_write_text

__all__ = ["resume_config", "is_external_checkpoint", "resume_folder", "read_timm_checkpoint",
           "load_timm_checkpoint", "rng_state", "set_rng_state", "gather_rng", "truncate_metrics"]


def rng_state() -> Dict[str, Any]:
    """Every RNG's state as tensors, ints and tuples, so train_state.pt loads with ``weights_only=True``."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                   "cached_gaussian": float(cached)}
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng(info: DistInfo) -> List[Dict[str, Any]]:
    if not info.distributed:
        return [rng_state()]
    states = [None] * info.world_size
    dist.all_gather_object(states, rng_state())
    return states


_CHECKPOINT_FILES = ("train_state.pt", "model.safetensors", "model.json", "config.json")


def is_external_checkpoint(path: str) -> bool:
    """A file that is not part of a linvision checkpoint folder: a timm train.py checkpoint (.pth.tar)."""
    return os.path.isfile(path) and os.path.basename(path) not in _CHECKPOINT_FILES


def resume_folder(path: str) -> str:
    folder = os.path.abspath(path)
    if os.path.isfile(folder):  # a file of a checkpoint folder (last/train_state.pt, ...)
        folder = os.path.dirname(folder)
    return os.path.dirname(folder) if os.path.basename(folder) in ("last", "best") else folder


def resume_config(path: str) -> Optional[str]:
    """The saved config.yaml of the run that ``path`` (a run folder, its last/, or a file in it) belongs to;
    None for a timm checkpoint file, whose recipe comes from the command line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"resume: not found: {path}")
    if is_external_checkpoint(path):
        return None
    config = os.path.join(resume_folder(path), "config.yaml")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"resume: no config.yaml in the run folder of {path}")
    return config


def read_timm_checkpoint(path: str) -> Dict[str, Any]:
    """Weights, optimizer, EMA, scaler and the epoch to start from, out of a checkpoint written by timm's
    train.py (``{"epoch", "arch", "state_dict", "optimizer", "version", "args", ...}``). Nothing is unpickled
    beyond tensors, containers and the argparse.Namespace timm stores its arguments in."""
    ckpt = load_torch_file(path, "resume")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ValueError(f"resume: {path} holds no 'state_dict' (not a timm training checkpoint); give weights "
                         f"alone with --initial-checkpoint, or a linvision run folder")
    epoch = int(ckpt.get("epoch", -1))
    # timm's checkpoints from version 2 on store the epoch just finished
    start = epoch + 1 if int(ckpt.get("version", 1)) > 1 else max(epoch, 0)
    ema = ckpt.get("state_dict_ema")
    # both copies, each a state dict already (no key to pick: keys=()), with DDP's "module." prefixes removed
    return {"model": unwrap_state_dict(ckpt["state_dict"], keys=()), "optimizer": ckpt.get("optimizer"),
            "ema": unwrap_state_dict(ema, keys=()) if isinstance(ema, dict) and ema else None,
            "scaler": ckpt.get("amp_scaler"), "start_epoch": start}


def load_timm_checkpoint(external: Dict[str, Any], cfg, model, optimizer, ema, scaler) -> int:
    """Load what a timm checkpoint holds into the new run's objects (``cfg``: the run's TrainConfig, for its
    resume, model and epochs); returns the epoch to start at."""
    def load(target, sd, what):
        try:
            target.load_state_dict(sd)
        except (RuntimeError, ValueError, KeyError) as e:
            reason = str(e).strip().splitlines()[0][:300]
            raise ValueError(f"resume: the {what} in {cfg.resume} does not fit {cfg.model} ({reason})") from None

    load(unwrap_model(model), external["model"], "weights")
    if external["optimizer"]:
        load(optimizer, external["optimizer"], "optimizer state")
    if ema is not None and external["ema"]:
        load(ema.module, external["ema"], "EMA weights")
    if scaler is not None and external["scaler"]:
        load(scaler, external["scaler"], "loss-scaler state")
    start = external["start_epoch"]
    if start >= cfg.epochs:
        raise ValueError(f"epochs: {cfg.resume} has finished {start} epochs; give --epochs above {start}")
    return start


def truncate_metrics(path: str, global_step: int, start_epoch: int) -> int:
    """Drop the records an interrupted run wrote after its checkpoint (steps after ``global_step``, epochs from
    ``start_epoch`` on), so a resumed run does not log them twice; returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if (record.get("kind") == "step" and record.get("step", 0) <= global_step) or \
                (record.get("kind") == "epoch" and record.get("epoch", 0) < start_epoch):
            keep.append(json.dumps(record) + "\n")
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(keep))
    return len(lines) - len(keep)
