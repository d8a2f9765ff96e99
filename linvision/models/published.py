"""Published checkpoint files loaded into linvision's models; the files are read with
:func:`linvision.safe_pickle.read_checkpoint` (no code from the file runs).

:func:`unwrap_state_dict` is the one place where the weights are picked out of a loaded checkpoint: linvit's and
linhier's ``checkpoint_filter_fn``, the published families' filters and :mod:`linvision.engine.checkpoint`
(``--pretrained-path``) all call it, with one order of keys, :data:`DEFAULT_WEIGHT_KEYS`.

:func:`load_published` is what a family's ``load_pretrained`` (timm's ``custom_load`` hook) and
``pretrained_cfg_overlay=dict(file=...)`` run: read the file, hand it to the family's ``checkpoint_filter_fn``
(which chooses the weights and maps the published names), keep the model's own classifier where the class count
differs (timm's rule for a new head), and load strictly: a tensor missing, left over or of another shape fails
in one line that names it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from timm.models import adapt_input_conv, clean_state_dict, resolve_pretrained_cfg
from torch import Tensor, nn

from linvision.safe_pickle import read_checkpoint

__all__ = ["DEFAULT_WEIGHT_KEYS", "unwrap_state_dict", "load_published", "require_weights", "published_file_overlay",
           "published_cfg"]


# Where a training checkpoint keeps its weights, most preferred first: timm's order (``timm.models.load_state_dict``
# with ``use_ema=True``), the EMA copy first as timm's train.py writes it, then the raw weights.
DEFAULT_WEIGHT_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")


def unwrap_state_dict(checkpoint: Any, keys=DEFAULT_WEIGHT_KEYS) -> Dict[str, Tensor]:
    """The weights of a loaded checkpoint: the dict under the first of ``keys`` it holds (default
    :data:`DEFAULT_WEIGHT_KEYS`), or the checkpoint itself when it is a state dict; its tensors only, with the
    wrapper prefixes of DistributedDataParallel and torch.compile (``module.``, ``_orig_mod.``) removed by timm's
    ``clean_state_dict``. Other ``keys`` are for a family whose published files name their weights otherwise
    (MLLA, RAVLT: the raw weights under ``model``, their ``WEIGHT_KEYS``). ValueError when there are none."""
    if not isinstance(checkpoint, dict):
        raise ValueError(f"checkpoint: expected a dict of tensors, got {type(checkpoint).__name__}")
    state = next((checkpoint[k] for k in keys if isinstance(checkpoint.get(k), dict)), None)
    if state is None:
        if not any(isinstance(v, Tensor) for v in checkpoint.values()):
            raise ValueError(f"checkpoint: no weights under {list(keys)} (keys: {sorted(map(str, checkpoint))[:8]})")
        state = checkpoint
    return clean_state_dict({k: v for k, v in state.items() if isinstance(v, Tensor)})


def load_published(model: nn.Module, path: str, filter_fn: Callable[[Any, nn.Module], Dict[str, Tensor]]) -> None:
    """Load the published file ``path`` into ``model``: :func:`read_checkpoint` (a .safetensors file is read as
    it is), then ``filter_fn(checkpoint, model)`` (the family's mapping to linvision's names), then a strict load.
    As timm adapts its own pretrained weights (the model's ``pretrained_cfg`` names the layers): the classifier
    keeps the model's own values when the class count differs and is dropped when the model has none
    (``num_classes=0``), and the first conv is adapted to another ``in_chans`` (``adapt_input_conv``).
    ValueError in one line naming the first tensor that is missing, unexpected or of another shape."""
    if path.endswith(".safetensors"):  # linvision's own checkpoints: tensors only, nothing to unpickle
        from safetensors.torch import load_file

        state = filter_fn(load_file(path), model)
    else:
        state = filter_fn(read_checkpoint(path, "pretrained file"), model)
    own = model.state_dict()
    cfg = getattr(model, "pretrained_cfg", None) or {}
    first_conv, classifier = cfg.get("first_conv"), cfg.get("classifier")
    if first_conv and f"{first_conv}.weight" in state and f"{first_conv}.weight" in own:
        weight, target = state[f"{first_conv}.weight"], own[f"{first_conv}.weight"]
        if weight.ndim == 4 and weight.shape[1] != target.shape[1]:
            state[f"{first_conv}.weight"] = adapt_input_conv(target.shape[1], weight)
    if classifier:
        for name in [k for k in state if k.startswith(classifier + ".")]:
            if name not in own:  # no classifier (num_classes=0)
                del state[name]
            elif own[name].shape != state[name].shape:
                state[name] = own[name]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    for problem, names in (("has no tensor", missing), ("has a tensor the model lacks", unexpected)):
        if names:
            raise ValueError(f"pretrained file {path}: {problem} {names[0]!r} ({len(names)} such; "
                             f"a checkpoint of another model?)")
    if wrong:
        k = wrong[0]
        raise ValueError(f"pretrained file {path}: tensor {k!r} has shape {tuple(state[k].shape)}, the model's is "
                         f"{tuple(own[k].shape)} (a checkpoint of another model?)")
    model.load_state_dict(state, strict=True)


def require_weights(variant: str, pretrained: bool, kwargs: Dict[str, Any], hint: str = "") -> None:
    """With ``pretrained=True``, ValueError in one line unless the pretrained cfg that ``timm.create_model`` resolved
    for ``variant`` (its tag, with any ``pretrained_cfg_overlay``) names weights: timm would otherwise warn and
    return random weights, which a user takes for a trained model. ``hint`` says what to use instead."""
    if not pretrained:
        return
    cfg = resolve_pretrained_cfg(variant, kwargs.get("pretrained_cfg"), kwargs.get("pretrained_cfg_overlay"))
    if not cfg.has_weights:
        tag = f"{variant}.{cfg.tag}" if cfg.tag else variant
        raise ValueError(f"pretrained: {tag} has no trained weights{'; ' + hint if hint else ''} "
                         f"(or pretrained_cfg_overlay=dict(file=...) for a local checkpoint)")


def published_cfg(top1: float, **kwargs) -> Dict[str, Any]:
    """The pretrained cfg of a published ImageNet-1k classifier evaluated at 224 px (ImageNet mean/std, bicubic,
    crop 0.875, stride 32, classifier ``head.fc``), read by :func:`load_published` (``custom_load``); ``kwargs``
    give the source (url, licence, paper, first conv). The published top-1 goes into notes and description."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    return {
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "test_input_size": (3, 224, 224),
        "fixed_input_size": False,
        "pool_size": (7, 7),
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "classifier": "head.fc",
        "custom_load": True,
        "notes": (f"published ImageNet-1k top-1 {top1} (224 px)",),
        "description": f"the authors' ImageNet-1k weights (top-1 {top1}% as published)",
        **kwargs,
    }


def published_file_overlay(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` of a model entrypoint with ``custom_load=True`` added to a ``pretrained_cfg_overlay`` that names a
    file or url: timm resets ``custom_load`` when an overlay gives a weight source, and these families read every
    source with :func:`load_published` (the authors' pickles need it). An explicit ``custom_load`` is kept."""
    overlay = kwargs.get("pretrained_cfg_overlay")
    if overlay and (overlay.get("file") or overlay.get("url")) and "custom_load" not in overlay:
        kwargs = dict(kwargs, pretrained_cfg_overlay=dict(overlay, custom_load=True))
    return kwargs
