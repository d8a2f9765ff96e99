"""LinDiT checkpoints in the library's one checkpoint format (:mod:`linvision.engine.checkpoint`): a folder
(``<run>/last``) with model.safetensors (the trained weights), ema.safetensors (their exponential moving
average, what sampling uses by default), model.json ({"model": "lindit", "num_classes", "model_config": the
DiTConfig fields, "data", "step", ...}) and train_state.pt, written as one unit.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from linvision.engine.checkpoint import (
    load_checkpoint_weights,
    read_checkpoint_meta,
    resolve_checkpoint,
    save_checkpoint,
)

from .model import LinDiT, create_dit

__all__ = ["DIT_MODEL_NAME", "save_dit_checkpoint", "load_dit"]

DIT_MODEL_NAME = "lindit"


def save_dit_checkpoint(folder: str, model: LinDiT, ema: LinDiT, meta: Dict[str, Any],
                        train_state: Optional[Dict[str, Any]] = None) -> None:
    """:func:`linvision.engine.checkpoint.save_checkpoint` of a LinDiT, its EMA copy and ``meta``."""
    description = {"model": DIT_MODEL_NAME, "num_classes": model.cfg.num_classes,
                   "model_config": model.cfg.to_dict(), **meta}
    save_checkpoint(folder, model, description, train_state, ema=ema)


def load_dit(path: str, ema: bool = True, device: str = "cpu") -> Tuple[LinDiT, Dict[str, Any]]:
    """Rebuild a trained LinDiT (EMA weights unless ``ema=False``) from a checkpoint or run folder, in eval
    mode. Returns (model, meta) with meta the content of model.json."""
    folder = resolve_checkpoint(path)
    meta = read_checkpoint_meta(folder)
    if meta["model"] != DIT_MODEL_NAME or "model_config" not in meta:
        raise ValueError(f"checkpoint: {folder} holds a {meta['model']!r}, not a {DIT_MODEL_NAME} (tools/train.py "
                         f"checkpoints load with linvision.engine.load_model)")
    model = create_dit(meta["model_config"])
    load_checkpoint_weights(model, folder, DIT_MODEL_NAME, "ema.safetensors" if ema else "model.safetensors")
    return model.to(device).eval(), meta
