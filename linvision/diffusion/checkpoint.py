"""LinDiT checkpoints: a folder (``<run>/last``)::

    model.safetensors   the trained weights
    ema.safetensors     their exponential moving average (what sampling uses by default)
    model.json          {"model_config": DiTConfig fields, "data": {...}, "step": int}
    train_state.pt      optimizer state, step, the data and noise generators' states

written as one unit (:func:`linvision.engine.files.write_checkpoint_folder`: a new folder, fsync'ed, swapped
in by renames), so a crash leaves either the previous or the new checkpoint, never files of both.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from linvision.engine.files import write_checkpoint_folder

from .model import LinDiT, create_dit

__all__ = ["save_dit_checkpoint", "resolve_dit_checkpoint", "load_dit"]


def _tensors(module: nn.Module) -> Dict[str, Tensor]:
    return {k: v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}


def save_dit_checkpoint(folder: str, model: LinDiT, ema: LinDiT, meta: Dict[str, Any],
                        train_state: Optional[Dict[str, Any]] = None) -> None:
    """Write the checkpoint folder described in the module docstring as one unit
    (:func:`linvision.engine.files.write_checkpoint_folder`)."""
    def write_json(p: str) -> None:
        with open(p, "w") as f:
            json.dump({"model_config": model.cfg.to_dict(), **meta}, f, indent=2)

    files = {"model.safetensors": lambda p: save_file(_tensors(model), p),
             "ema.safetensors": lambda p: save_file(_tensors(ema), p), "model.json": write_json}
    if train_state is not None:
        files["train_state.pt"] = lambda p: torch.save(train_state, p)
    write_checkpoint_folder(folder, files)


def resolve_dit_checkpoint(path: str) -> str:
    """The checkpoint folder of ``path``: itself if it holds model.json, else its ``last/``."""
    for folder in (path, os.path.join(path, "last")):
        if os.path.isfile(os.path.join(folder, "model.json")):
            return folder
    raise FileNotFoundError(f"checkpoint: no model.json in {path} nor in {os.path.join(path, 'last')}")


def load_dit(path: str, ema: bool = True, device: str = "cpu") -> Tuple[LinDiT, Dict[str, Any]]:
    """Rebuild a trained LinDiT (EMA weights unless ``ema=False``) from a checkpoint or run folder, in eval
    mode. Returns (model, meta) with meta the content of model.json."""
    folder = resolve_dit_checkpoint(path)
    with open(os.path.join(folder, "model.json")) as f:
        meta = json.load(f)
    model = create_dit(meta["model_config"])
    model.load_state_dict(load_file(os.path.join(folder, "ema.safetensors" if ema else "model.safetensors")))
    return model.to(device).eval(), meta
