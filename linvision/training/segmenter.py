"""Segmenters: a timm backbone (linvision's registered) as the encoder of a segmentation_models_pytorch head, built by
name, and rebuilt from a checkpoint folder of ``linvision-train-seg``.

smp is an optional dependency (``pip install "linvision[seg]"``); it is imported here only, when a segmenter is
built, and its absence is one :class:`MissingExtraError` naming that command.

A checkpoint of a segmenter is the engine's folder (:mod:`linvision.utils.checkpoint`)::

    model.safetensors   the segmenter's weights (encoder and head)
    model.json          {"task": "segmentation", "encoder", "decoder", "num_classes", "classes", "in_chans",
                         "model_kwargs", "decoder_kwargs", "img_size", "mean", "std", "ignore_index", ...}

Load it with :func:`load_segmenter`::

    from .segmenter import load_segmenter
    model, meta = load_segmenter("output/seg_mosaics")     # the run's best checkpoint, in eval mode
    classes = model(images).argmax(1)                      # images normalised with meta["mean"], meta["std"]
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from torch import nn

__all__ = ["DECODERS", "STRIDE", "MissingExtraError", "import_smp", "check_decoder", "build_segmenter",
           "encoder_pretrained_cfg", "load_segmenter"]

# The one table of heads: the --decoder names of linvision-train-seg, linvision-ablate and linvision-benchmark and
# smp's class names, as strings (this module imports smp only when a segmenter is built, so the flags read it
# without smp). The heads that work on linvision's encoders (docs/segmentation.md): Unet, FPN, Segformer and
# UPerNet on the hierarchical ones, DPT on the isotropic ones.
DECODERS = {"unet": "Unet", "fpn": "FPN", "segformer": "Segformer", "upernet": "UPerNet", "dpt": "DPT"}
# what a head's input sides must be a multiple of: the coarsest feature map (stride 32), or a ViT's patch (16)
STRIDE = {"unet": 32, "fpn": 32, "segformer": 32, "upernet": 32, "dpt": 16}


class MissingExtraError(ImportError, ValueError):
    """An optional dependency that is not installed; the message names the ``pip install`` that adds it. A
    ValueError too, so the tools print it as one ``error:`` line."""


def import_smp():
    """segmentation_models_pytorch, or :class:`MissingExtraError` naming ``pip install "linvision[seg]"``."""
    try:
        import segmentation_models_pytorch as smp
    except ImportError:
        raise MissingExtraError('segmentation needs segmentation_models_pytorch, which is not installed: '
                                'pip install "linvision[seg]"') from None
    return smp


def check_decoder(decoder: str):
    """smp, once ``decoder`` is known to be a key of :data:`DECODERS`: ValueError in one line naming the keys
    otherwise, :class:`MissingExtraError` (a ValueError too) when smp is not installed."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder: unknown {decoder!r}; one of {', '.join(DECODERS)}")
    return import_smp()


def build_segmenter(decoder: str, encoder: str, num_classes: int, model_kwargs: Optional[Dict[str, Any]] = None,
                    decoder_kwargs: Optional[Dict[str, Any]] = None, pretrained: bool = False,
                    pretrained_path: Optional[str] = None, in_chans: int = 3) -> nn.Module:
    """smp's ``decoder`` head (a key of :data:`DECODERS`) on the timm model ``encoder`` (smp's ``tu-<encoder>``)
    for ``num_classes`` classes.

    ``model_kwargs`` go to ``timm.create_model`` of the encoder (``depths``, ``drop_path_rate``, ...),
    ``decoder_kwargs`` to the head (``decoder_channels``, ...). ``pretrained`` loads the encoder's trained weights
    as ``timm.create_model(encoder, pretrained=True)`` does (through timm's cache); ``pretrained_path`` loads them
    from a local copy of that file instead. DPT gets ``dynamic_img_size=True`` unless ``model_kwargs`` says
    otherwise, so that it runs at the training crops' size and at the validation images' own.
    """
    import linvision.models  # noqa: F401  (registers linvision's models with timm)

    smp = check_decoder(decoder)
    kwargs = {**(decoder_kwargs or {}), **(model_kwargs or {})}
    if decoder == "dpt":
        kwargs.setdefault("dynamic_img_size", True)
    if pretrained_path:
        kwargs["pretrained_cfg_overlay"] = dict(file=pretrained_path)
    weights = True if (pretrained or pretrained_path) else None
    head = getattr(smp, DECODERS[decoder])
    return head(f"tu-{encoder}", encoder_weights=weights, in_channels=in_chans, classes=num_classes, **kwargs)


def encoder_pretrained_cfg(model: nn.Module) -> Dict[str, Any]:
    """The timm pretrained config of a segmenter's encoder (mean, std, the weights' source); empty if none."""
    inner = getattr(getattr(model, "encoder", None), "model", None)
    return dict(getattr(inner, "pretrained_cfg", None) or {})


_META_KEYS = ("encoder", "decoder", "num_classes")


def load_segmenter(path: str, device: str = "cpu") -> Tuple[nn.Module, Dict[str, Any]]:
    """Rebuild the segmenter of a checkpoint folder written by ``linvision-train-seg`` (or of a run folder: its
    best, else last) in eval mode; returns (model, meta), meta being model.json's content (encoder, decoder,
    classes, normalisation, ignore index, the training crop size).

    Raises FileNotFoundError when there is no checkpoint, ValueError when model.json describes no segmenter or the
    weights do not fit it.
    """
    from linvision.utils.checkpoint import load_checkpoint_weights, read_checkpoint_meta, resolve_checkpoint

    folder = resolve_checkpoint(path)
    meta = read_checkpoint_meta(folder, _META_KEYS, "it describes no segmenter (a classifier's checkpoint loads "
                                                    "with linvision.load_model)")
    model = build_segmenter(meta["decoder"], meta["encoder"], meta["num_classes"], meta.get("model_kwargs"),
                            meta.get("decoder_kwargs"), in_chans=meta.get("in_chans", 3))
    # checkpoints written before the features-only encoder dropped its unused final layer still hold it
    load_checkpoint_weights(model, folder, f"{meta['decoder']} on {meta['encoder']}",
                            unused=lambda key: key.startswith("encoder.") and ".final." in key)
    return model.to(device).eval(), meta
