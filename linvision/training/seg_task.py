"""Semantic segmentation as a task of the engine's trainer (``linvision-train-seg``): :class:`SegmentationTask`
gives :func:`linvision.training.train.train` the image/mask data with joint transforms (:mod:`.seg_data`), an smp
segmenter on a timm encoder (:mod:`.segmenter`), cross-entropy that skips the ignore index, and mIoU and pixel
accuracy over the whole validation set (:mod:`.seg_metrics`), mIoU picking ``best/``. The run folder, its records
and checkpoints, exact resumption, signals, AMP, DDP, the EMA and the progress bars are the trainer's.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Union

import torch
from torch import nn

from linvision.data.segmentation import JointTransform, PadCollate, SegmentationSamples, segmentation_sets
from linvision.utils.config import parse_kwargs
from linvision.utils.distributed import DistInfo

from .seg_config import SegTrainConfig
from .seg_metrics import evaluate_segmentation
from .segmenter import STRIDE, build_segmenter, encoder_pretrained_cfg
from .train import Task, TaskParts, check_data_files, rank0_first, train

__all__ = ["SegmentationTask", "train_segmentation"]


def train_segmentation(cfg: Union[SegTrainConfig, argparse.Namespace]) -> Dict[str, Any]:
    """Train a segmenter as ``cfg`` (a :class:`SegTrainConfig`, or the flags of ``linvision-train-seg``) says;
    returns the summary it also writes into the run folder (see :func:`linvision.training.train.train`)."""
    cfg = SegTrainConfig.from_namespace(cfg)
    return train(cfg, SegmentationTask(cfg))


class SegmentationTask(Task):
    """Semantic segmentation: smp's Unet, FPN, Segformer, UPerNet or DPT on a timm encoder, image/mask folders or the
    offline mosaics, cross-entropy with the ignore index; mIoU picks ``best/``."""

    score, score_label, record_keys = "miou", "mIoU", ("miou", "pixel_acc", "loss")
    command = "linvision-train-seg"

    def __init__(self, cfg: SegTrainConfig):
        self.val_collate = PadCollate(cfg.ignore_index, STRIDE[cfg.decoder])

    def run_name(self, cfg: SegTrainConfig) -> str:
        return f"{cfg.decoder}-{cfg.encoder}"

    def build(self, cfg: SegTrainConfig, info: DistInfo, fresh: bool) -> TaskParts:
        train_raw, val_raw, classes = segmentation_sets(cfg.dataset, cfg.data_dir, cfg.mosaic_size,
                                                        cfg.mosaic_train, cfg.mosaic_val)
        check_data_files(cfg, info, {"training": train_raw, "validation": val_raw})
        num_classes = cfg.num_classes or len(classes)
        if not num_classes:
            raise ValueError(f"num_classes: {cfg.data_dir} has no dataset.json listing the classes; give "
                             f"--num-classes")
        if classes and num_classes < len(classes):
            raise ValueError(f"num_classes: {num_classes} is fewer than the {len(classes)} classes of the data")
        if cfg.ignore_index < num_classes:
            raise ValueError(f"ignore_index: {cfg.ignore_index} is a class index of the {num_classes} classes")
        model_kwargs = parse_kwargs(cfg.model_kwargs)
        if cfg.drop_path is not None:
            model_kwargs["drop_path_rate"] = cfg.drop_path
        decoder_kwargs = parse_kwargs(cfg.decoder_kwargs, "decoder_kwargs")
        # a resumed run takes every weight from its checkpoint: nothing is downloaded or read again
        download, local = cfg.pretrained and fresh, cfg.pretrained_path if fresh else None
        with rank0_first(info, download):  # rank 0 fills timm's cache first; the others read the file it wrote
            model = build_segmenter(cfg.decoder, cfg.encoder, num_classes, model_kwargs, decoder_kwargs,
                                    pretrained=download, pretrained_path=local)
        encoder_cfg = encoder_pretrained_cfg(model)
        if (download or local) and info.is_main:
            source = encoder_cfg.get("file") or encoder_cfg.get("url") or encoder_cfg.get("hf_hub_id") or "timm"
            print(f"pretrained: encoder {cfg.encoder} from {source}; a new {cfg.decoder} head for {num_classes} "
                  f"classes", flush=True)
        mean = list(cfg.mean or encoder_cfg.get("mean", (0.485, 0.456, 0.406)))
        std = list(cfg.std or encoder_cfg.get("std", (0.229, 0.224, 0.225)))
        train_set = SegmentationSamples(train_raw, num_classes, cfg.ignore_index,
                                        JointTransform(mean, std, crop=cfg.img_size, scale=cfg.scale, hflip=cfg.hflip))
        val_set = SegmentationSamples(val_raw, num_classes, cfg.ignore_index, JointTransform(mean, std))
        model.to(info.device)
        if cfg.channels_last:
            model.to(memory_format=torch.channels_last)
        meta = {"task": "segmentation", "encoder": cfg.encoder, "decoder": cfg.decoder, "num_classes": num_classes,
                "classes": classes or [str(i) for i in range(num_classes)], "in_chans": 3,
                "model_kwargs": model_kwargs, "decoder_kwargs": decoder_kwargs, "img_size": cfg.img_size,
                "mean": mean, "std": std, "ignore_index": cfg.ignore_index, "dataset": cfg.dataset}
        # what linvision-validate needs to score the checkpoint on the same validation set
        meta.update(dict(mosaic_size=cfg.mosaic_size, mosaic_val=cfg.mosaic_val) if cfg.dataset == "mosaic"
                    else dict(data_dir=cfg.data_dir))
        return TaskParts(train_set, val_set, model, meta, num_classes)

    def criterion(self, cfg: SegTrainConfig, parts: TaskParts, info: DistInfo):
        return nn.CrossEntropyLoss(ignore_index=cfg.ignore_index), None

    def evaluate(self, run, model: nn.Module) -> Dict[str, Any]:
        cfg = run.cfg
        return evaluate_segmentation(model, run.val_loader, run.num_classes, cfg.ignore_index, run.info, cfg.amp,
                                     cfg.channels_last, cfg.progress)

    def summary(self, run) -> Dict[str, Any]:
        return {"encoder": run.cfg.encoder, "decoder": run.cfg.decoder, "num_classes": run.num_classes}
