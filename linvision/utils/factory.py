"""Building models by name: timm's factory (linvision's models registered), at the input size asked for.

:func:`create_model` is what every tool builds a model with, from random or from trained weights;
:func:`check_pretrained` and :func:`check_img_size` turn a model without weights or a size the model cannot run
at into one line before any work starts.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

__all__ = ["check_model_name", "check_pretrained", "models_with_weights", "create_model", "check_img_size"]

# the timm module names linvision registers its models under (linvision.models.<module>)
_OWN_MODULES = ("mlla", "ravlt", "mavit", "polaformer", "inline", "vig", "linhier", "linvit")


def check_model_name(name: str) -> None:
    """ValueError in one line naming ``name`` unless timm (with linvision's models) knows it: the nearest
    registered name first (``unknown 'mla_tiny' (did you mean 'mlla_tiny'?)``, its ``.tag`` kept), then other
    close ones and the names that share its first word."""
    import difflib

    import timm

    import linvision.models  # noqa: F401  (registers linvision's models with timm)

    if not timm.is_model(name):
        base, dot, tag = name.partition(".")
        registered = timm.list_models()
        close = difflib.get_close_matches(base, registered, n=4, cutoff=0.6)
        family = [n for n in timm.list_models(f"*{base.split('_')[0]}*") if n not in close]
        similar = (close[1:] + family)[:12]
        nearest = f" (did you mean {close[0] + dot + tag!r}?)" if close else ""
        hint = f"; similar: {', '.join(similar)}" if similar else ""
        raise ValueError(f"model: unknown {name!r}{nearest}{hint}")


def models_with_weights() -> List[str]:
    """linvision's models that ``pretrained=True`` loads, as ``name.tag`` (the published MLLA, RAVLT, MAViT,
    InLine and ViG weights, and DeiT's softmax weights under linvit's ``.deit_fb_in1k``; PolaFormer's load from a
    local copy only)."""
    import timm

    import linvision.models  # noqa: F401

    own = set(timm.list_models(module=list(_OWN_MODULES)))
    return [n for n in timm.list_pretrained() if n.split(".")[0] in own]


def check_pretrained(name: str) -> None:
    """ValueError in one line, naming the models that have weights, unless ``name`` (with its ``.tag``, or the
    model's default tag) has trained weights that ``timm.create_model(name, pretrained=True)`` can load."""
    from timm.models import get_pretrained_cfg

    check_model_name(name)
    cfg = get_pretrained_cfg(name)
    if cfg is not None and not cfg.has_weights and any(n.startswith("published") for n in cfg.notes or ()):
        raise ValueError(f"pretrained: {name} loads {cfg.description.split(' (')[0]}, which is not downloaded "
                         f"for you: fetch the file (where: its model card, docs/models/published.md) and pass "
                         f"--pretrained-path FILE")
    if cfg is None or not cfg.has_weights:
        base = name.split(".")[0]
        tags = [n for n in models_with_weights() if n.split(".")[0] == base]
        other = f"; {base} loads weights under {', '.join(tags)}" if tags else ""
        raise ValueError(f"pretrained: {name} has no trained weights{other}; models with weights: "
                         f"{', '.join(n for n in models_with_weights() if n not in tags)} (or --pretrained-path "
                         f"FILE for a local checkpoint)")


def create_model(name: str, num_classes: Optional[int] = None, in_chans: int = 3,
                 model_kwargs: Optional[Dict[str, Any]] = None, img_size: Optional[int] = None,
                 pretrained: bool = False) -> nn.Module:
    """A timm model by name (linvision's models are registered by importing linvision.models).

    ``pretrained`` loads the trained weights of ``name`` (``mlla_tiny.in1k``, or a name whose default tag has
    weights) as ``timm.create_model(pretrained=True)`` does: through timm's hub cache (downloaded once into
    ``$TORCH_HOME/hub/checkpoints``; a ``pretrained_cfg_overlay`` in ``model_kwargs`` can name a local file), with
    the classifier replaced when ``num_classes`` differs from the weights' and the stem adapted to ``in_chans``.

    ``img_size`` is passed to models that take it (ViTs: the position-embedding grid; an ``img_size`` in
    ``model_kwargs`` wins), and ignored by models that run at any size without it (convolutional networks).
    Local weights are loaded afterwards with :func:`linvision.utils.checkpoint.load_pretrained`. Raises
    ValueError for an unknown ``name`` (with close names), TypeError for a keyword the model does not take.
    """
    import timm

    if pretrained and not (model_kwargs or {}).get("pretrained_cfg_overlay"):
        check_pretrained(name)
    check_model_name(name)
    kwargs = dict(model_kwargs or {})
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if img_size is not None and "img_size" not in kwargs:
        try:
            model = timm.create_model(name, pretrained=pretrained, in_chans=in_chans, img_size=img_size, **kwargs)
        except TypeError as e:  # a model without an img_size argument runs at any size
            if "img_size" not in str(e):
                raise
            model = timm.create_model(name, pretrained=pretrained, in_chans=in_chans, **kwargs)
        except ValueError as e:  # a size the model refuses as it is built: the line names the model
            if not str(e).startswith("img_size: "):
                raise
            raise ValueError(f"img_size: {name}: {str(e)[len('img_size: '):]}") from None
    else:
        model = timm.create_model(name, pretrained=pretrained, in_chans=in_chans, **kwargs)
    return model


def check_img_size(model: nn.Module, img_size: int, in_chans: int = 3) -> None:
    """Run one image of ``img_size`` through ``model`` (eval mode, no grad, on its device); ValueError in one
    line, naming the size and what the model needs, when it cannot run at that size."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, in_chans, img_size, img_size, device=device))
    except (AssertionError, RuntimeError, ValueError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
        hint = f"; use a multiple of {patch[0] if isinstance(patch, (tuple, list)) else patch}" if patch else ""
        name = getattr(model, "default_cfg", {}).get("architecture", type(model).__name__)
        raise ValueError(f"img_size: {name} cannot run at {img_size} px ({reason}){hint}") from None
    finally:
        model.train(was_training)
