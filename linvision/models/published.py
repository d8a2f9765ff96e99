"""Published checkpoint files loaded into linvision's models; the files are read with
:func:`linvision.safe_pickle.read_checkpoint` (no code from the file runs).

:func:`unwrap_state_dict` is the one place where the weights are picked out of a loaded checkpoint and the
wrapper prefixes (``module.``, ``_orig_mod.``) come off: linvit's and linhier's ``checkpoint_filter_fn``, the
published families' filters, :mod:`linvision.utils.checkpoint` (``--pretrained-path``) and
:mod:`linvision.training.resume` (a timm train.py checkpoint's weights and EMA) all call it, with one order of keys,
:data:`DEFAULT_WEIGHT_KEYS`. It sits here, in models/, the lowest layer among its callers (utils/ imports models/,
never the reverse).

:func:`load_published` is what a family's ``load_pretrained`` (timm's ``custom_load`` hook) and
``pretrained_cfg_overlay=dict(file=...)`` run: read the file, hand it to the family's ``checkpoint_filter_fn``
(which chooses the weights and maps the published names), keep the model's own classifier where the class count
differs (timm's rule for a new head), and load strictly: a tensor missing, left over or of another shape fails
in one line that names it.

:func:`explain_failed_download` is what the entrypoints of the families with published weights build their models
in: a download of those weights that fails (no network, a moved file) becomes :class:`WeightsDownloadError`, one
line naming the model, the address tried and how to give a local copy instead.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from timm.models import adapt_input_conv, clean_state_dict, resolve_pretrained_cfg
from torch import Tensor, nn

from linvision.safe_pickle import read_checkpoint

__all__ = ["DEFAULT_WEIGHT_KEYS", "unwrap_state_dict", "load_published", "require_weights", "published_file_overlay",
           "published_cfg", "WeightsDownloadError", "explain_failed_download", "build_published", "map_mixer_groups"]


# Where a training checkpoint keeps its weights, most preferred first: timm's order (``timm.models.load_state_dict``
# with ``use_ema=True``), the EMA copy first as timm's train.py writes it, then the raw weights.
DEFAULT_WEIGHT_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")


def unwrap_state_dict(checkpoint: Any, keys=DEFAULT_WEIGHT_KEYS) -> Dict[str, Tensor]:
    """The weights of a loaded checkpoint: the dict under the first of ``keys`` it holds (default
    :data:`DEFAULT_WEIGHT_KEYS`), or the checkpoint itself when it is a state dict; its tensors only, with the
    wrapper prefixes of DistributedDataParallel and torch.compile (``module.``, ``_orig_mod.``) removed by timm's
    ``clean_state_dict``. Other ``keys`` are for a family whose published files name their weights otherwise
    (MLLA, RAVLT: the raw weights under ``model``, their ``WEIGHT_KEYS``); ``keys=()`` takes ``checkpoint`` as the
    state dict it is (a timm train.py checkpoint's ``state_dict`` and ``state_dict_ema``, each read on its own).
    ValueError when there are none."""
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
        raise ValueError(f"pretrained: {tag} has no trained weights{'; ' + hint if hint else ''}; the families with "
                         f"trained weights: {', '.join(families_with_weights())} (or "
                         f"pretrained_cfg_overlay=dict(file=...) for a local checkpoint)")


def families_with_weights() -> List[str]:
    """``["inline_cswin_*", "mlla_*", ...]``: the name prefixes (all but the size) of linvision's models whose
    default weights are trained classifiers (downloaded by timm, or published and loaded from a local copy),
    read from timm's registry."""
    import timm

    names = set()
    for arch in timm.list_models():
        if not timm.models.model_entrypoint(arch).__module__.startswith("linvision."):
            continue
        cfg = timm.models.get_pretrained_cfg(arch)  # the default tag's: linvit's DeiT conversion is not one
        if cfg is not None and (cfg.has_weights or any(n.startswith("published") for n in cfg.notes or ())):
            names.add(arch.rsplit("_", 1)[0] + "_*")
    return sorted(names)


def published_cfg(top1: Optional[float], **kwargs) -> Dict[str, Any]:
    """The pretrained cfg of a published ImageNet-1k classifier evaluated at 224 px (ImageNet mean/std, bicubic,
    crop 0.875, stride 32, classifier ``head.fc``), read by :func:`load_published` (``custom_load``); ``kwargs``
    give the source (url or hub file, licence, paper, first conv). The published top-1 goes into notes and
    description; None where it is not recorded (the description says so)."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    if top1 is None:
        notes, description = (), "the authors' ImageNet-1k weights (published top-1 not recorded here)"
    else:
        notes = (f"published ImageNet-1k top-1 {top1} (224 px)",)
        description = f"the authors' ImageNet-1k weights (top-1 {top1}% as published)"
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
        "notes": notes,
        "description": description,
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


class WeightsDownloadError(FileNotFoundError):
    """The trained weights ``pretrained=True`` asked for are not on this machine and could not be downloaded; the
    message (one line) names the model, the address tried and how to load a local copy. A FileNotFoundError (an
    OSError, as the download's own error was), so that the tools print it as one line."""


def _remote_source(cfg: Any, cache_dir: Optional[str]) -> Optional[Tuple[str, str]]:
    """(where the weights come from, what to do with a copy fetched elsewhere) when timm downloads them for
    ``cfg`` (a resolved pretrained cfg); None when it reads them from this machine (a file, a state dict)."""
    if cfg.file or cfg.state_dict or cfg.source == "local-dir":
        return None
    overlay = ("pretrained_cfg_overlay=dict(file=PATH) to timm.create_model, or --pretrained-path PATH to "
               "linvision-train / linvision-train-seg")
    if cfg.hf_hub_id:
        from timm.models._hub import has_hf_hub

        if has_hf_hub(necessary=False) or not cfg.url:
            filename = f", file {cfg.hf_hub_filename}" if cfg.hf_hub_filename else ""
            return (f"the Hugging Face hub (repository {cfg.hf_hub_id}{filename})",
                    f"download the weights file of https://huggingface.co/{cfg.hf_hub_id} elsewhere and pass "
                    f"{overlay}")
    if not cfg.url:
        return None
    url, filename = cfg.url if isinstance(cfg.url, (tuple, list)) else (cfg.url, None)
    if filename is None:
        from urllib.parse import urlparse

        filename = os.path.basename(urlparse(url).path)
    if cache_dir is None:
        import torch.hub

        cache_dir = os.path.join(torch.hub.get_dir(), "checkpoints")
    return url, (f"download that file elsewhere and either put it at {os.path.join(cache_dir, filename)} (timm's "
                 f"cache, where pretrained=True looks first) or pass {overlay}")


def _reason(error: BaseException) -> str:
    """The first line of the innermost error under ``error`` (the network's own answer: an unknown host, a
    refused connection, an HTTP status), with its type."""
    inner = error
    for _ in range(8):
        nxt = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
        if nxt is None:
            nxt = getattr(inner, "reason", None)  # urllib's URLError keeps the socket's error there
        if not isinstance(nxt, BaseException):
            break
        inner = nxt
    text = str(inner).strip()
    text = text.splitlines()[0][:200] if text else ""
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


@contextlib.contextmanager
def explain_failed_download(variant: str, pretrained: bool, kwargs: Dict[str, Any], listed_in: str) -> Iterator[None]:
    """Around a model entrypoint's ``build_model_with_cfg``: with ``pretrained=True`` and weights that timm
    downloads (a url or a Hugging Face hub repository in the resolved pretrained cfg, no file), an OSError on the
    way (no network, an unknown host, an HTTP error; timm's and the hub's download errors all are) becomes
    :class:`WeightsDownloadError` in one line: the model with its tag, the address, the reason, and the way
    offline (the file fetched elsewhere, given with ``pretrained_cfg_overlay=dict(file=PATH)`` or the tools'
    ``--pretrained-path``), with ``listed_in``, the manual's page whose model cards name the files. A model built
    from a local file, or without pretrained weights, is left as timm builds it, errors included."""
    try:
        yield
    except OSError as e:
        if not pretrained or isinstance(e, WeightsDownloadError):
            raise
        cfg = resolve_pretrained_cfg(variant, kwargs.get("pretrained_cfg"), kwargs.get("pretrained_cfg_overlay"))
        source = _remote_source(cfg, kwargs.get("cache_dir"))
        if source is None:
            raise
        where, offline = source
        tag = f"{variant}.{cfg.tag}" if cfg.tag else variant
        raise WeightsDownloadError(
            f"pretrained: cannot download the weights of {tag} from {where} ({_reason(e)}); offline, {offline} "
            f"(where each model's file is: the model cards in {listed_in})") from None


def build_published(model_cls: type, variant: str, pretrained: bool, filter_fn: Callable, **kwargs: Any) -> nn.Module:
    """A published hierarchical family's model through timm's ``build_model_with_cfg``: every weight source read
    by :func:`load_published` (:func:`published_file_overlay`), its four stages as features, and a failed download
    one line naming the offline way (:func:`explain_failed_download`)."""
    from timm.models import build_model_with_cfg

    kwargs = published_file_overlay(kwargs)
    with explain_failed_download(variant, pretrained, kwargs, "docs/models/published.md"):
        return build_model_with_cfg(model_cls, variant, pretrained, pretrained_filter_fn=filter_fn,
                                    feature_cfg=dict(out_indices=(0, 1, 2, 3), feature_cls="getter"), **kwargs)


def map_mixer_groups(groups: Dict[str, Dict[str, Tensor]], model: nn.Module,
                     mixer_tensors: Callable[[str, Dict[str, Tensor], nn.Module], Dict[str, Tensor]]
                     ) -> Dict[str, Tensor]:
    """A published checkpoint's tensors grouped by the mixer they belong to (``groups``: the mixer's name in
    ``model`` -> its tensors, in linvision's names), each group through ``mixer_tensors(prefix, tensors, mixer)``
    (a family's mapping of its own mixer's tensors). A group whose mixer the model lacks is kept as it is, so
    that the strict load names it."""
    out: Dict[str, Tensor] = {}
    for prefix, tensors in groups.items():
        try:
            mixer = model.get_submodule(prefix)
        except AttributeError:
            out.update(tensors)
            continue
        out.update(mixer_tensors(prefix, tensors, mixer))
    return out
