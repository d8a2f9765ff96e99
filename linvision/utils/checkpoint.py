"""Checkpoints: writing a checkpoint folder, finding and reading one, and loading weights into a model.

A checkpoint is a folder::

    model.safetensors   the weights (of the EMA copy when training kept one and it scored better; see model.json)
    ema.safetensors     (diffusion models) the EMA copy's weights, which sampling uses by default
    model.json          what rebuilds the model: {"model", "num_classes", "in_chans", "model_kwargs",
                        "img_size", "mean", "std", "crop_pct", "interpolation", "crop_mode", "classes", ...}
                        (the image size and the settings of the transforms the run resolved, which
                        validation uses again: :func:`recorded_data_config`)
    config.json         (classifiers) the same model in timm's hub layout, written by timm's own
                        ``save_config_for_hf`` from the model and model.json: {"architecture", "num_classes",
                        "num_features", "label_names", "model_args", "pretrained_cfg"} (the run's transform in
                        the pretrained cfg), so that ``timm.create_model("local-dir:FOLDER", pretrained=True)``
                        after ``import linvision`` rebuilds it with these weights (:func:`write_timm_config`);
                        derived from model.json, which linvision reads
    train_state.pt      (``last`` only) optimizer, scheduler, scaler, EMA weights, RNG states, epoch and step

A training run writes ``<run>/last`` (every epoch, and on interruption) and ``<run>/best``. A checkpoint
folder is written as one unit: into a hidden new folder, every file fsync'ed, then swapped in by renames, so
a crash leaves the previous checkpoint or the new one, never a mix of files from two steps.

Load a trained model with :func:`load_model`::

    from linvision import load_model
    model, meta = load_model("output/digits_demo")        # the run's best checkpoint, in eval mode
    logits = model(images)                                # images normalised with meta["mean"], meta["std"]

or a classifier's checkpoint folder with timm alone (``import linvision`` registers linvision's models)::

    model = timm.create_model("local-dir:output/digits_demo/best", pretrained=True).eval()
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file
from timm.utils import unwrap_model
from torch import nn

from linvision.models.published import DEFAULT_WEIGHT_KEYS, unwrap_state_dict
from linvision.safe_pickle import read_checkpoint

from .factory import create_model
from .files import write_checkpoint_folder

__all__ = ["load_torch_file", "load_pretrained", "save_checkpoint", "load_model",
           "resolve_checkpoint", "read_checkpoint_meta", "checkpoint_task", "load_checkpoint_weights",
           "recorded_data_config", "write_timm_config"]


def load_torch_file(path: str, what: str) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and containers only, nothing that runs code), also
    allowing the argparse.Namespace that timm's train.py stores its arguments in; ValueError in one line,
    naming ``what`` and the file, when it cannot be read."""
    import argparse

    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for unreadable, truncated or unsafe files
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what}: cannot read {path} ({reason})") from None


# Where weights sit in a training checkpoint, most preferred first: linvision.models.published's one order (the
# EMA copy first, as timm); a model module's WEIGHT_KEYS overrides it (the published families name the weights
# their authors report).
__all__ += ["DEFAULT_WEIGHT_KEYS"]


def _read_state_dict(path: str, keys=DEFAULT_WEIGHT_KEYS) -> Dict[str, torch.Tensor]:
    """The weights in ``path``: a checkpoint folder, a .safetensors file or a torch file, read with no code run
    (:func:`linvision.safe_pickle.read_checkpoint`: other objects in the pickle stay inert), picked out by
    :func:`linvision.models.published.unwrap_state_dict` (the first of ``keys`` it has)."""
    if os.path.isdir(path):
        path = os.path.join(resolve_checkpoint(path), "model.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained_path: file not found: {path}")
    checkpoint = load_file(path) if path.endswith(".safetensors") else read_checkpoint(path, "pretrained_path")
    return unwrap_state_dict(checkpoint, keys)


def _model_module(model: nn.Module):
    import sys

    return sys.modules.get(type(unwrap_model(model)).__module__)


def _filter_state_dict(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The model module's ``checkpoint_filter_fn`` (timm's convention: resample position embeddings and patch
    kernels to this model, map a published layout onto this one) applied to ``state``, where the module defines
    one."""
    filter_fn = getattr(_model_module(model), "checkpoint_filter_fn", None)
    return filter_fn(state, unwrap_model(model)) if filter_fn is not None else state


def load_pretrained(model: nn.Module, path: str) -> Dict[str, list]:
    """Load weights from ``path`` into ``model``, skipping tensors whose shape differs (a new head).

    Returns {"skipped": [...], "missing": [...], "unexpected": [...]} key lists, each tensor in at most one of
    them (a tensor skipped for its shape is not also missing). Raises ValueError when a
    tensor is an integer where the model has a float, or when fewer than half of the model's tensors fit (not
    weights of this model).
    """
    keys = getattr(_model_module(model), "WEIGHT_KEYS", DEFAULT_WEIGHT_KEYS)
    state = _filter_state_dict(model, _read_state_dict(path, keys))
    own = model.state_dict()
    for k, v in state.items():
        if k in own and own[k].is_floating_point() and not v.is_floating_point():
            raise ValueError(f"pretrained_path: tensor {k!r} in {path} is {v.dtype}, the model's is "
                             f"{own[k].dtype}: not weights of this model")
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    shapes = {k: (tuple(state[k].shape), tuple(own[k].shape)) for k in skipped}
    for k in skipped:
        del state[k]
    result = model.load_state_dict(state, strict=False)
    # a tensor left out for its shape is counted once, as skipped, not again as missing
    missing = [k for k in result.missing_keys if k not in skipped]
    unexpected = list(result.unexpected_keys)
    loaded = len(own) - len(missing) - len(skipped)
    if loaded < len(own) / 2:
        raise ValueError(f"pretrained_path: {path} fits {loaded} of the model's {len(own)} tensors "
                         f"({_misfits(shapes, missing, unexpected)}); is it a checkpoint of this model (and its "
                         f"options)?")
    return {"skipped": skipped, "missing": missing, "unexpected": unexpected}


def _misfits(shapes: Dict[str, tuple], missing: list, unexpected: list) -> str:
    """What kept a checkpoint's tensors out: those of another shape (file's against the model's), those the file
    lacks and those the model lacks, each with a few names; the kinds with none left out."""
    def dims(shape: tuple) -> str:
        return "x".join(map(str, shape)) or "scalar"

    parts = []
    if shapes:
        shown = "; ".join(f"{k}: {dims(a)} in the file, {dims(b)} in the model"
                          for k, (a, b) in list(shapes.items())[:3])
        parts.append(f"{len(shapes)} of another shape, e.g. {shown}")
    if missing:
        parts.append(f"{len(missing)} missing from the file, e.g. {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} not in the model, e.g. {', '.join(unexpected[:3])}")
    return "; ".join(parts)


def _tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    # safetensors refuses shared storage; clone so tied weights are stored twice and reload fine
    return {k: v.detach().cpu().contiguous().clone() for k, v in unwrap_model(module).state_dict().items()}


def save_checkpoint(folder: str, model: nn.Module, meta: Dict[str, Any],
                    train_state: Optional[Dict[str, Any]] = None, ema: Optional[nn.Module] = None,
                    timm_config: bool = False) -> None:
    """Write model.safetensors, model.json, (if given) train_state.pt and ema.safetensors (the weights of an EMA
    copy kept beside the model, for models sampled from their EMA) into ``folder`` as one unit
    (:func:`write_checkpoint_folder`): weights, description and train state always come from the same step.
    ``timm_config`` (a timm classifier, ``meta`` a classification run's) adds timm's config.json
    (:func:`write_timm_config`) where the installed timm can write it."""
    def write_json(p):
        with open(p, "w") as f:
            json.dump(meta, f, indent=2)

    files = {"model.safetensors": lambda p: save_file(_tensors(model), p), "model.json": write_json}
    if timm_config and _timm_save_config() is not None:
        files["config.json"] = lambda p: write_timm_config(p, model, meta)
    if ema is not None:
        files["ema.safetensors"] = lambda p: save_file(_tensors(ema), p)
    if train_state is not None:
        files["train_state.pt"] = lambda p: torch.save(train_state, p)
    write_checkpoint_folder(folder, files)


def _timm_save_config() -> Optional[Callable]:
    """timm's ``save_config_for_hf`` where it records what rebuilds the model and the transform given to it
    (its ``data_config``: timm 1.0.31 and later), else None: an older timm would describe the weights with the
    model's default pretrained cfg (ImageNet's transform) and without its keyword arguments."""
    import inspect

    from timm.models import _hub

    save = getattr(_hub, "save_config_for_hf", None)
    return save if save is not None and "data_config" in inspect.signature(save).parameters else None


def write_timm_config(path: str, model: nn.Module, meta: Dict[str, Any]) -> None:
    """Write ``path``, the config.json of a classifier's checkpoint folder in timm's hub layout, with timm's own
    ``save_config_for_hf`` (what ``timm.models.push_to_hf_hub`` uploads beside the weights): the architecture,
    ``model_args`` (what timm's factory was given to build ``model``: its keyword arguments, input channels,
    classes and image size; drop rates left out, as timm does), and the pretrained cfg with the transform the
    run resolved (model.json's, ``meta``: :func:`recorded_data_config`) and, where model.json names one class per
    output, the classes as ``label_names``. The description of the source weights that the model's default cfg
    carries (tag, notes) is replaced: these are the run's weights. ValueError (from timm) for a model argument
    that JSON cannot hold; RuntimeError where the installed timm cannot write it (before 1.0.31)."""
    save = _timm_save_config()
    if save is None:
        raise RuntimeError("config.json: the installed timm's save_config_for_hf takes no data_config "
                           "(timm 1.0.31 or later writes the run's transform)")
    classes = meta.get("classes")
    labels = {"label_names": list(classes)} if classes and len(classes) == meta["num_classes"] else {}
    what = {"tag": None, "notes": None,
            "description": f"{meta['model']} trained with linvision ({meta['num_classes']} classes)"}
    save(unwrap_model(model), path, model_config={**labels, "pretrained_cfg": what},
         data_config=recorded_data_config(meta))


def resolve_checkpoint(path: str) -> str:
    """The checkpoint folder for ``path``: itself if it holds model.json, else its ``best`` then ``last``."""
    for folder in (path, os.path.join(path, "best"), os.path.join(path, "last")):
        if os.path.isfile(os.path.join(folder, "model.json")):
            return folder
    raise FileNotFoundError(f"checkpoint: no model.json in {path} nor in its best/ or last/ sub-folders")


_META_KEYS = ("model", "num_classes")


def read_checkpoint_meta(folder: str, keys: Sequence[str] = _META_KEYS, hint: str = "") -> Dict[str, Any]:
    """model.json of a checkpoint folder, the one reader of it (classifiers, segmenters, LinDiTs, the task of a
    checkpoint); ValueError in one line naming the file when it is not JSON, or is not a JSON object holding every
    one of ``keys`` (a classifier's by default; ``hint`` ends the message, saying what to do instead)."""
    path = os.path.join(folder, "model.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(meta, dict) or any(k not in meta for k in keys):
        have = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"checkpoint: {path} lacks {list(keys)} (has {have}){'; ' + hint if hint else ''}")
    return meta


# what model.json files written before the transform's interpolation and crop mode were recorded were trained and
# validated with
_DATA_CONFIG_FALLBACK = {"interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center",
                         "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def recorded_data_config(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The settings of the transform a checkpoint was validated with during training, from its model.json
    (``meta``): {"input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std"}, in the form of a timm
    pretrained cfg. A model.json of an older run lacks some: they are what such runs used (bilinear, crop 1.0,
    centre crop, ImageNet mean and std)."""
    out = {k: meta.get(k) if meta.get(k) is not None else v for k, v in _DATA_CONFIG_FALLBACK.items()}
    size = meta.get("img_size")
    if size is not None:
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        out["input_size"] = (int(meta.get("in_chans", 3)), int(height), int(width))
    return out


def checkpoint_task(path: str) -> str:
    """The task a checkpoint (or run folder: its best, else last) was trained for: model.json's ``"task"``
    ("segmentation" for ``linvision-train-seg``), "classification" when it names none. Raises FileNotFoundError
    for a missing checkpoint, ValueError for a model.json that is not a JSON object."""
    return str(read_checkpoint_meta(resolve_checkpoint(path), keys=()).get("task", "classification"))


def load_model(path: str, device: str = "cpu", img_size: Optional[int] = None,
               **model_kwargs) -> Tuple[nn.Module, Dict[str, Any]]:
    """Rebuild the model of a checkpoint folder (or a run folder: its best, else last) in eval mode.

    ``img_size`` rebuilds a model with a fixed input size for another size (its position embedding resampled
    by the model's ``checkpoint_filter_fn``); ``model_kwargs`` override the stored ones, a dict option (such as
    ``mixer_kwargs``) key by key. Returns (model, meta) where meta is model.json's content (name, classes,
    normalisation, image size).
    """
    folder = resolve_checkpoint(path)
    meta = read_checkpoint_meta(folder)
    kwargs = dict(meta.get("model_kwargs", {}))
    for key, value in model_kwargs.items():
        both = isinstance(value, dict) and isinstance(kwargs.get(key), dict)
        kwargs[key] = {**kwargs[key], **value} if both else value
    size = img_size if img_size is not None else meta.get("img_size")
    if img_size is not None and img_size != meta.get("img_size"):
        kwargs.pop("img_size", None)  # a stored training size gives way to the one asked for
    model = create_model(meta["model"], num_classes=meta["num_classes"], in_chans=meta.get("in_chans", 3),
                         model_kwargs=kwargs, img_size=size)
    load_checkpoint_weights(model, folder, meta["model"])
    return model.to(device).eval(), meta


def load_checkpoint_weights(model: nn.Module, folder: str, name: str, file: str = "model.safetensors",
                            unused: Optional[Callable[[str], bool]] = None) -> None:
    """Load ``folder/file`` into ``model`` strictly (through the model's ``checkpoint_filter_fn``, if any);
    FileNotFoundError or ValueError in one line naming the file and the model ``name`` that model.json
    describes. Keys the model lacks for which ``unused`` is true are left out first (weights an older version
    kept that no output used)."""
    weights = os.path.join(folder, file)
    try:
        state = load_file(weights)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint: no {file} in {folder}") from None
    except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
        raise ValueError(f"checkpoint: cannot read {weights} ({str(e).strip()[:200]})") from None
    if unused is not None:
        own = model.state_dict()
        state = {k: v for k, v in state.items() if k in own or not unused(k)}
    try:
        model.load_state_dict(_filter_state_dict(model, state))
    except RuntimeError as e:
        # torch's message: a header line ending in ':', then one line per mismatch; the first mismatch says most
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
        raise ValueError(f"checkpoint: {weights} does not hold the weights of the {name} that model.json "
                         f"describes ({detail[:200]})") from None
