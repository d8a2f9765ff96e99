"""Accuracy of a trained checkpoint at one or several resolutions, behind ``linvision/tools/validate.py``.

The same weights are evaluated at every resolution, with the transform the checkpoint's run validated with
(images resized with its ``interpolation`` to ``size / crop_pct``, centre-cropped, normalised with its ``mean``
and ``std``: model.json records them), or for a model's trained weights the transform of its pretrained cfg, as
``timm.data.create_transform(**resolve_data_config({}, model=model))`` builds it; ``interpolation`` and
``crop_pct`` given to :func:`validate_checkpoint` win over both. The model is rebuilt for each size: models with
RoPE or convolutions run at any size as they are, a learned absolute position embedding is resampled to the
size's grid; a model that cannot run at a size gets an ``error`` entry for it and the other sizes are still
evaluated.

Given a checkpoint alone, it is evaluated on the data its run was trained and validated on (:func:`~linvision.data.run_data.run_data`):
the dataset and data folder recorded in the config.yaml of the run folder it belongs to, else in its model.json.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from linvision.data.datasets import (INTERPOLATIONS, ShardedSampler, build_transform, check_transform_options,
                                     create_dataset, create_loader, resolve_data_config)
from linvision.data.naflex import check_naflex_model, naflex_eval_parts
from linvision.data.run_data import run_data
from linvision.utils.checkpoint import (checkpoint_task, load_model, read_checkpoint_meta, recorded_data_config,
                                        resolve_checkpoint)
from linvision.utils.cli import add_amp_arg, add_run_mode_args
from linvision.utils.run_mode import WEIGHT_DTYPES, check_run_mode, compiled
from linvision.utils.distributed import barrier, cleanup, init_distributed
from linvision.utils.factory import check_pretrained, create_model

from .evaluate import evaluate

__all__ = ["add_validate_args", "validate_checkpoint", "eval_data_config"]


def add_validate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=False, default=None, help="checkpoint or run folder")
    parser.add_argument("--model", default=None,
                        help="with --pretrained instead of --checkpoint: a timm model name whose trained weights "
                             "are evaluated (e.g. mlla_tiny.in1k)")
    parser.add_argument("--pretrained", action="store_true",
                        help="evaluate --model's trained weights, as timm's pretrained=True loads them (downloaded "
                             "once into timm's cache); the data's classes must be the weights' (e.g. ImageNet's)")
    parser.add_argument("--dataset", default=None,
                        help="'folder', 'digits' or a torchvision dataset, as in linvision-train; for a "
                             "segmenter 'folder' or 'mosaic' (default: the dataset the checkpoint was trained on; "
                             "with --pretrained, 'folder')")
    parser.add_argument("--data-dir", default=None,
                        help="folder with the val/ class sub-folders (a segmenter's: val/images and val/masks), "
                             "or a torchvision dataset's root (default: the one the checkpoint's run recorded, for "
                             "its dataset; digits, the photo sets and mosaics need none)")
    parser.add_argument("--img-size", type=int, nargs="+", default=None,
                        help="resolutions to evaluate (default: the training one)")
    parser.add_argument("--interpolation", default=None, choices=list(INTERPOLATIONS),
                        help="resize interpolation (default: the checkpoint's; with --pretrained, the model's "
                             "pretrained cfg's)")
    parser.add_argument("--crop-pct", type=float, default=None,
                        help="centre-crop fraction: resize to size / crop_pct, crop size (default: the "
                             "checkpoint's; with --pretrained, the model's pretrained cfg's)")
    parser.add_argument("--model-kwargs", nargs="*", default=None,
                        help="key=value pairs or a JSON object merged over the model options the checkpoint "
                             "records (a dict option such as mixer_kwargs key by key); with --pretrained, given "
                             "to the model. E.g. RoPE positions interpolated to a 12 x 12 training grid: "
                             "'{\"mixer_kwargs\": {\"rope_ref_grid\": 12}}'")
    parser.add_argument("--naflex-loader", action="store_true",
                        help="evaluate every image at its own aspect ratio, as timm's NaFlex loader batches it: "
                             "resized to at most --naflex-max-seq-len patches, cut into patches with their "
                             "(row, col) (models that take NaFlex batches: linvit); instead of --img-size")
    parser.add_argument("--naflex-max-seq-len", type=int, default=576,
                        help="with --naflex-loader: patches per image at most (timm's default)")
    parser.add_argument("--batch-size", "-b", type=int, default=64, help="images per batch on each rank")
    parser.add_argument("--workers", "-j", type=int, default=0, help="data-loading worker processes per rank")
    add_amp_arg(parser)
    add_run_mode_args(parser, " (once per size)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="'auto': CUDA when available, else CPU")
    parser.add_argument("--output", default=None, help="write the JSON results to this file as well")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                        help="progress bars (default: off)")
    return parser


def _check_classes(meta: Dict[str, Any], val_set, checkpoint: str) -> None:
    """ValueError when the data's classes are not the ones the checkpoint was trained on (by name where both
    list names, else by count against the head): its accuracy would be meaningless."""
    trained = list(meta.get("classes") or [])
    data = list(getattr(val_set, "classes", []) or [])
    if trained and data and trained != data:
        missing = [c for c in trained if c not in data]
        extra = [c for c in data if c not in trained]
        raise ValueError(f"dataset: its classes differ from those {checkpoint} was trained on (missing: "
                         f"{missing[:5]}, not trained on: {extra[:5]}); labels would not match")
    if data and len(data) > meta["num_classes"]:
        raise ValueError(f"dataset: {len(data)} classes, but {checkpoint} has a head of {meta['num_classes']}")


def _pretrained_meta(name: str) -> Dict[str, Any]:
    """What validation needs to know of ``name``'s trained weights, from its pretrained cfg (as a checkpoint's
    model.json says it of a trained run)."""
    from timm.models import get_pretrained_cfg

    check_pretrained(name)
    cfg = get_pretrained_cfg(name)
    return {"model": name, "num_classes": cfg.num_classes, "img_size": cfg.input_size[-1], "classes": [],
            "dataset": "folder"}


def eval_data_config(meta: Optional[Dict[str, Any]], size: int, model=None, interpolation: Optional[str] = None,
                     crop_pct: Optional[float] = None) -> Dict[str, Any]:
    """The settings of the validation transform at ``size``
    (:func:`~linvision.data.datasets.resolve_data_config`): ``interpolation`` and ``crop_pct`` where given, else
    those a checkpoint's model.json (``meta``) records, or with ``meta`` None, those of ``model``'s pretrained
    cfg (a model's trained weights)."""
    recorded = recorded_data_config(meta) if meta is not None else None
    return resolve_data_config(model if meta is None else None, recorded, img_size=size,
                               interpolation=interpolation, crop_pct=crop_pct)


def _validate_naflex(checkpoint, pretrained, meta, source, dataset, data_dir, max_seq_len, batch_size, workers,
                     amp, progress, info, interpolation, model_kwargs=None) -> Dict[str, Any]:
    """One evaluation of every image at its own aspect ratio through timm's NaFlex transform and collator."""
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"naflex_max_seq_len: must be an int >= 1, got {max_seq_len!r}")
    size = meta["img_size"]
    model = _model_at(checkpoint, pretrained, size, info, first=False, model_kwargs=model_kwargs)
    patch_size = check_naflex_model(model, meta["model"])
    data_config = eval_data_config(meta if checkpoint else None, size, model, interpolation, None)
    transform, collate = naflex_eval_parts(patch_size, max_seq_len, data_config)
    val_set = create_dataset(dataset, data_dir, "val", transform=transform, digits_size=size)
    _check_classes(meta, val_set, source)
    loader = create_loader(val_set, batch_size, ShardedSampler(len(val_set), info.rank, info.world_size,
                                                               shuffle=False), workers)
    loader.collate_fn = collate
    res = evaluate(model, loader, info, amp=amp, progress=progress)
    return {"naflex_max_seq_len": max_seq_len, **res, "interpolation": data_config["interpolation"]}


def _model_at(checkpoint: Optional[str], pretrained: Optional[str], size: int, info, first: bool,
              model_kwargs: Optional[Dict[str, Any]] = None):
    """The model to evaluate at ``size``, built for it (a fixed position-embedding grid is resampled to it) with
    ``model_kwargs`` over its options: the checkpoint's, or ``pretrained``'s trained weights; for the ``first``
    size rank 0 fills timm's cache before the other ranks read it."""
    if checkpoint:
        model, _ = load_model(checkpoint, device=str(info.device), img_size=size, **(model_kwargs or {}))
        return model
    if first and not info.is_main:
        barrier(info)
    model = create_model(pretrained, img_size=size, pretrained=True, model_kwargs=model_kwargs)
    model = model.to(info.device).eval()
    if first and info.is_main:
        barrier(info)
    return model


def _print_note(note: Optional[str], info) -> None:
    """Say on rank 0 (on stderr) where the data came from, when the run's record chose it."""
    if note and info.is_main:
        print(note, file=sys.stderr, flush=True)


def _validate_sizes(checkpoint, pretrained, meta, source, dataset, data_dir, sizes, batch_size, workers, amp,
                    progress, info, interpolation, crop_pct, note, model_kwargs=None, compile: str = "none",
                    weights: str = "fp32") -> List[Dict[str, Any]]:
    """One evaluation at each of ``sizes``, the model rebuilt for each (in the ``weights`` dtype, under
    ``compile``); a size the model cannot run at gets an ``error`` entry."""
    results = []
    for size in sizes:
        model = _model_at(checkpoint, pretrained, size, info, first=size == sizes[0], model_kwargs=model_kwargs)
        dtype = WEIGHT_DTYPES[weights]
        model = compiled(model.to(dtype).eval(), compile)
        data_config = eval_data_config(meta if checkpoint else None, size, model, interpolation, crop_pct)
        transform = build_transform(is_training=False, **data_config)
        val_set = create_dataset(dataset, data_dir, "val", transform=transform, digits_size=size)
        _check_classes(meta, val_set, source)
        _print_note(note, info)
        note = None
        sampler = ShardedSampler(len(val_set), info.rank, info.world_size, shuffle=False)
        loader = create_loader(val_set, batch_size, sampler, workers)
        try:
            res = evaluate(model, loader, info, amp=amp, progress=progress, dtype=dtype)
        except (RuntimeError, ValueError, AssertionError) as e:  # a model tied to one input size
            res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
        results.append({"img_size": size, **res, "interpolation": data_config["interpolation"],
                        "crop_pct": data_config["crop_pct"]})
    return results


def _check_segmenter_options(interpolation: Optional[str], crop_pct: Optional[float],
                             naflex_max_seq_len: Optional[int], model_kwargs: Optional[Dict[str, Any]]) -> None:
    """ValueError for the options of classifiers given with a segmenter's checkpoint."""
    if model_kwargs:
        raise ValueError("model_kwargs: a segmenter's checkpoint is rebuilt as its run recorded it; other model "
                         "options apply to classifiers only")
    if interpolation is not None or crop_pct is not None:
        raise ValueError("interpolation/crop_pct: a segmenter is scored on whole images; these apply to "
                         "classifiers only")
    if naflex_max_seq_len is not None:
        raise ValueError("naflex_loader: a segmenter is scored on whole images at their own size already; "
                         "the NaFlex loader is for classifiers")


def validate_checkpoint(checkpoint: Optional[str], dataset: Optional[str] = None, data_dir: Optional[str] = None,
                        img_sizes: Optional[Sequence[int]] = None, batch_size: int = 64, workers: int = 0,
                        amp: str = "none", device: str = "auto", progress: bool = False,
                        pretrained: Optional[str] = None, interpolation: Optional[str] = None,
                        crop_pct: Optional[float] = None, naflex_max_seq_len: Optional[int] = None,
                        model_kwargs: Optional[Dict[str, Any]] = None, compile: str = "none",
                        weights: str = "fp32") -> Dict[str, Any]:
    """Evaluate ``checkpoint`` (or, with ``pretrained`` naming a model, that model's trained weights as
    ``timm.create_model(pretrained=True)`` loads them) on the validation split at each of ``img_sizes``.

    Images are transformed as :func:`eval_data_config` says: with the checkpoint's recorded settings (or the
    pretrained cfg's of ``pretrained``), ``interpolation`` and ``crop_pct`` winning where given.

    With ``naflex_max_seq_len`` every image is evaluated once at its own aspect ratio instead (timm's NaFlex
    transform: resized to at most that many patches, patchified, batched by timm's NaFlex collator; the model must
    take NaFlex batches), one result {"naflex_max_seq_len", ...} in place of the sizes.

    ``compile`` and ``weights`` (:mod:`linvision.utils.run_mode`): the model evaluated under torch.compile, in
    bf16 or fp16 weights with its inputs in that dtype (no autocast); the NaFlex loader and a segmenter take
    neither (ValueError).

    ``model_kwargs`` are merged over the options the checkpoint records (:func:`~linvision.utils.load_model`),
    or given to ``pretrained``'s model: the same weights built with other options that keep their shapes (RoPE
    positions interpolated, ``rope_ref_grid``); options that change the weights' shapes fail to load in one line.

    Returns {"checkpoint", "model", "train_img_size" (or for a run trained on NaFlex batches
    "train_naflex_seq_lens"), "results": [{"img_size", "top1", "top5", "loss", "count"} or
    {"img_size", "error"}, each with the "interpolation" and "crop_pct" it ran with]}; a segmenter's checkpoint
    (``linvision-train-seg``) is scored by :func:`~linvision.training.seg_validate.validate_segmenter` instead
    (mIoU and pixel accuracy). Raises FileNotFoundError for a missing checkpoint or data folder, ValueError for a
    model without trained weights or a bad ``interpolation`` or ``crop_pct``. Runs under torchrun too (each rank
    evaluates a shard; the figures are reduced).
    """
    if (checkpoint is None) == (pretrained is None):
        raise ValueError("checkpoint: give a checkpoint (or run folder), or a model name with --pretrained")
    check_run_mode(compile, weights, amp)
    if (compile, weights) != ("none", "fp32") and (naflex_max_seq_len is not None or (
            checkpoint and checkpoint_task(checkpoint) == "segmentation")):
        raise ValueError("compile/weights: for classifiers evaluated at --img-size; the NaFlex loader and "
                         "segmenters run eager in fp32 (or under --amp)")
    if checkpoint and checkpoint_task(checkpoint) == "segmentation":  # a checkpoint of linvision-train-seg
        from .seg_validate import validate_segmenter

        _check_segmenter_options(interpolation, crop_pct, naflex_max_seq_len, model_kwargs)
        return validate_segmenter(checkpoint, dataset, data_dir, img_sizes, batch_size, workers, amp, device,
                                  progress)
    check_transform_options(interpolation, crop_pct)  # a bad value ends here, before any model is built
    info = init_distributed(device)
    try:
        meta = read_checkpoint_meta(resolve_checkpoint(checkpoint)) if checkpoint else _pretrained_meta(pretrained)
        source = checkpoint or f"{pretrained} (trained weights)"
        note = None
        if checkpoint:  # the data its run recorded, for what is not given
            dataset, data_dir, note = run_data(checkpoint, meta, dataset, data_dir)
        dataset = dataset or meta.get("dataset", "folder")
        if naflex_max_seq_len is not None:
            if img_sizes:
                raise ValueError("img_size: --naflex-loader evaluates each image at its own size; give one or the "
                                 "other")
            _print_note(note, info)
            results = [_validate_naflex(checkpoint, pretrained, meta, source, dataset, data_dir, naflex_max_seq_len,
                                        batch_size, workers, amp, progress, info, interpolation, model_kwargs)]
        else:
            sizes: List[int] = list(img_sizes or [meta["img_size"]])
            results = _validate_sizes(checkpoint, pretrained, meta, source, dataset, data_dir, sizes, batch_size,
                                      workers, amp, progress, info, interpolation, crop_pct, note, model_kwargs,
                                      compile, weights)
        barrier(info)
        # how it was trained: at its img_size, or on NaFlex batches (each image at its own aspect)
        trained = ({"train_naflex_seq_lens": meta["naflex_train_seq_lens"]} if meta.get("naflex_train_seq_lens")
                   else {"train_img_size": meta["img_size"]})
        return {"checkpoint": checkpoint or "pretrained", "model": meta["model"], **trained, "results": results}
    finally:
        cleanup(info)
