"""Model construction and checkpoints.

A checkpoint is a folder::

    model.safetensors   the weights (of the EMA copy when training kept one and it scored better; see model.json)
    model.json          what rebuilds the model: {"model", "num_classes", "in_chans", "model_kwargs",
                        "img_size", "mean", "std", "crop_pct", "classes", ...}
    train_state.pt      (``last`` only) optimizer, scheduler, scaler, EMA weights, RNG states, epoch and step

A training run writes ``<run>/last`` (every epoch, and on interruption) and ``<run>/best``. Every file is
written to a temporary name and renamed, so a crash never leaves a half-written file under the final name.

Load a trained model with :func:`load_model`::

    from linvision.engine import load_model
    model, meta = load_model("output/digits_demo")        # the run's best checkpoint, in eval mode
    logits = model(images)                                # images normalised with meta["mean"], meta["std"]
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = ["create_model", "load_pretrained", "save_checkpoint", "load_model", "resolve_checkpoint",
           "atomic_write", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DistributedDataParallel and torch.compile wrappers."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def create_model(name: str, num_classes: Optional[int] = None, in_chans: int = 3,
                 model_kwargs: Optional[Dict[str, Any]] = None, pretrained_path: Optional[str] = None) -> nn.Module:
    """A timm model by name (linvision's models are registered by importing linvision.models).

    ``pretrained_path`` loads local weights (safetensors, .pth, or a checkpoint folder); tensors whose shape
    differs from the new model (the classifier, when ``num_classes`` changed) are left at their fresh
    initialisation. Raises ValueError for an unknown ``name`` (with close names), TypeError for a keyword
    the model does not take.
    """
    import timm

    import linvision.models  # noqa: F401  (registers linvision's models with timm)

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:12]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise ValueError(f"model: unknown {name!r}{hint}")
    kwargs = dict(model_kwargs or {})
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    model = timm.create_model(name, pretrained=False, in_chans=in_chans, **kwargs)
    if pretrained_path:
        load_pretrained(model, pretrained_path)
    return model


def _read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    if os.path.isdir(path):
        path = os.path.join(resolve_checkpoint(path), "model.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained_path: file not found: {path}")
    if path.endswith(".safetensors"):
        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict_ema", "model_ema", "state_dict", "model"):  # common wrappers of saved weights
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_pretrained(model: nn.Module, path: str) -> Dict[str, list]:
    """Load weights from ``path`` into ``model``, skipping tensors whose shape differs (a new head).

    Returns {"skipped": [...], "missing": [...], "unexpected": [...]} key lists.
    """
    state = _read_state_dict(path)
    own = model.state_dict()
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    for k in skipped:
        del state[k]
    result = model.load_state_dict(state, strict=False)
    return {"skipped": skipped, "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


def atomic_write(path: str, write_fn) -> None:
    """Call ``write_fn(tmp_path)``, then rename tmp_path to ``path`` (same folder, so the rename is atomic)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    # safetensors refuses shared storage; clone so tied weights are stored twice and reload fine
    return {k: v.detach().cpu().contiguous().clone() for k, v in unwrap_model(module).state_dict().items()}


def save_checkpoint(folder: str, model: nn.Module, meta: Dict[str, Any],
                    train_state: Optional[Dict[str, Any]] = None) -> None:
    """Write model.safetensors, model.json and (if given) train_state.pt into ``folder``, each atomically.

    The train state is written last, so a train_state.pt always comes with weights at least as new.
    """
    os.makedirs(folder, exist_ok=True)
    atomic_write(os.path.join(folder, "model.safetensors"), lambda p: save_file(_tensors(model), p))

    def write_json(p):
        with open(p, "w") as f:
            json.dump(meta, f, indent=2)

    atomic_write(os.path.join(folder, "model.json"), write_json)
    if train_state is not None:
        atomic_write(os.path.join(folder, "train_state.pt"), lambda p: torch.save(train_state, p))


def resolve_checkpoint(path: str) -> str:
    """The checkpoint folder for ``path``: itself if it holds model.json, else its ``best`` then ``last``."""
    for folder in (path, os.path.join(path, "best"), os.path.join(path, "last")):
        if os.path.isfile(os.path.join(folder, "model.json")):
            return folder
    raise FileNotFoundError(f"checkpoint: no model.json in {path} nor in its best/ or last/ sub-folders")


def load_model(path: str, device: str = "cpu", **model_kwargs) -> Tuple[nn.Module, Dict[str, Any]]:
    """Rebuild the model of a checkpoint folder (or a run folder: its best, else last) in eval mode.

    ``model_kwargs`` override the stored ones (e.g. ``img_size`` for a model with a fixed input size).
    Returns (model, meta) where meta is model.json's content (name, classes, normalisation, image size).
    """
    folder = resolve_checkpoint(path)
    with open(os.path.join(folder, "model.json")) as f:
        meta = json.load(f)
    kwargs = {**meta.get("model_kwargs", {}), **model_kwargs}
    model = create_model(meta["model"], num_classes=meta["num_classes"], in_chans=meta.get("in_chans", 3),
                         model_kwargs=kwargs)
    state = load_file(os.path.join(folder, "model.safetensors"))
    model.load_state_dict(state)
    return model.to(device).eval(), meta
