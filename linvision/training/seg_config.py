"""The recipe of semantic-segmentation training as one dataclass, :class:`SegTrainConfig`: the flags of
``linvision-train-seg``, the keys of its YAML configs and the keyword arguments of
:func:`linvision.training.seg_task.train_segmentation` are its fields.

It stands beside :class:`~linvision.training.train_config.TrainConfig` on the same base: the fields both have
(the optimizer, schedule, EMA, AMP and run options) are TrainConfig's (:func:`shared_field`: the same spellings
and help), the others are the segmentation task's (the head, the encoder, the ignore index, the mosaics).
:func:`add_seg_train_args` makes the flags with the builder of TrainConfig's.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, List, Optional

from .segmenter import DECODERS
from .train_config import (PretrainedFlag, PretrainedPathFlag, Recipe, add_config_args, recipe_field, require,
                           shared_field)

__all__ = ["SegTrainConfig", "add_seg_train_args"]


@dataclass
class SegTrainConfig(Recipe):
    """Everything a segmentation run is made of (see the flags of ``linvision-train-seg --help``)."""

    # data
    dataset: str = recipe_field("folder", "'folder': image/mask folders under --data-dir; 'mosaic': the offline "
                                          "texture mosaics (nothing on disk)", group="data",
                                choices=["folder", "mosaic"])
    data_dir: Optional[str] = recipe_field(None, "folder with train/ and val/, each holding images/ and masks/ "
                                                 "(PNG class indices of the same file names)", group="data")
    img_size: int = shared_field("img_size", 512, "side of the square training crops (a multiple of 32, of 16 "
                                                  "with dpt); validation runs on the whole images")
    mosaic_size: int = recipe_field(512, "side of the mosaics of --dataset mosaic (128 to 1024 px)", group="data",
                                    type=int)
    mosaic_train: int = recipe_field(1000, "training mosaics of --dataset mosaic", group="data", type=int)
    mosaic_val: int = recipe_field(200, "validation mosaics of --dataset mosaic", group="data", type=int)
    workers: int = shared_field("workers")
    mean: Optional[List[float]] = shared_field("mean", help="normalisation mean (default: the encoder's)")
    std: Optional[List[float]] = shared_field("std", help="normalisation std (default: the encoder's)")
    scale: List[float] = shared_field("scale", [0.25, 1.0], "area range of the random resized crops, as a "
                                                            "fraction of the image (image and mask alike)")
    hflip: float = shared_field("hflip", help="horizontal-flip probability of training crops (image and mask "
                                              "alike)")
    check_images: bool = shared_field("check_images", help="read every image and mask file of a folder dataset "
                                                      "before the first step, naming all that cannot be read at "
                                                      "once (--no-check-images: find them when a batch draws them)")
    skip_bad_images: bool = shared_field("skip_bad_images", help="train and validate without the samples whose "
                                                                "image or mask cannot be read (their count and "
                                                                "names printed) instead of stopping")
    # model
    decoder: str = recipe_field("unet", "segmentation head of segmentation_models_pytorch: unet, fpn, segformer, "
                                        "upernet (hierarchical encoders: linhier, mlla, ravlt) or dpt (linvit)",
                                group="model", choices=list(DECODERS))
    encoder: str = recipe_field("mlla_tiny", "any timm model, as smp's tu-<name> encoder (linvision's are "
                                             "registered), with a weight tag for --pretrained, e.g. mlla_tiny.in1k",
                                group="model")
    pretrained: bool = recipe_field(False, "start the encoder from its trained weights as timm's pretrained=True "
                                           "loads them (e.g. mlla_tiny.in1k: downloaded once into timm's cache); "
                                           "the head starts new; --no-pretrained turns a config's off",
                                    group="model", action=PretrainedFlag)
    pretrained_path: Optional[str] = recipe_field(None, "a local copy of the encoder's trained weights (e.g. the "
                                                        "authors' MLLA-T.pth), loaded as --pretrained loads the "
                                                        "download; given here, it replaces a config's pretrained: "
                                                        "true", group="model", action=PretrainedPathFlag)
    model_kwargs: Any = shared_field("model_kwargs", help="key=value pairs or a JSON object passed to the encoder's "
                                                          "timm.create_model, e.g. depths=[1,1,1,1]")
    decoder_kwargs: Any = recipe_field(None, "key=value pairs or a JSON object passed to the smp head, e.g. "
                                             "decoder_channels=[128,64,32,16,8]", group="model", nargs="*")
    num_classes: Optional[int] = shared_field("num_classes", help="classes of the masks (default: the dataset's: "
                                                                  "the classes of dataset.json, 10 for the mosaics)")
    ignore_index: int = recipe_field(255, "mask value of unlabelled pixels: no loss, not scored; crops and "
                                          "padding fill masks with it", group="model", type=int)
    channels_last: bool = shared_field("channels_last")
    compile: bool = shared_field("compile")
    # optimisation
    epochs: int = shared_field("epochs")
    batch_size: int = shared_field("batch_size", 8)
    opt: str = shared_field("opt")
    lr: float = shared_field("lr", 2e-4)
    weight_decay: float = shared_field("weight_decay", 0.01)
    momentum: float = shared_field("momentum")
    sched: str = shared_field("sched")
    warmup_epochs: float = shared_field("warmup_epochs")
    warmup_lr: float = shared_field("warmup_lr")
    min_lr: float = shared_field("min_lr")
    clip_grad: Optional[float] = shared_field("clip_grad")
    drop_path: Optional[float] = shared_field("drop_path", help="stochastic depth rate of the encoder")
    model_ema: bool = shared_field("model_ema")
    model_ema_decay: float = shared_field("model_ema_decay")
    amp: str = shared_field("amp")
    # run
    output: str = shared_field("output")
    experiment: Optional[str] = shared_field("experiment", help="run folder name (default: decoder, encoder and "
                                                                "time); a folder that holds a run is never "
                                                                "overwritten: the run goes to <name>-<k> instead")
    overwrite: bool = shared_field("overwrite")
    resume: Optional[str] = shared_field("resume", help="continue a run: its folder, its last/ checkpoint or a file "
                                                        "in it")
    seed: int = shared_field("seed")
    device: str = shared_field("device")
    log_interval: int = shared_field("log_interval")
    stop_after_steps: Optional[int] = shared_field("stop_after_steps")
    progress: bool = shared_field("progress")

    def check(self) -> None:
        """ValueError naming the flag (and YAML key) of the first value the recipe cannot use; a missing data
        folder, a missing segmentation_models_pytorch, an unknown encoder and an encoder without weights for
        ``pretrained`` fail here, before a run folder is made or the data are read."""
        from linvision.utils.config import parse_kwargs
        from linvision.utils.factory import check_model_name, check_pretrained
        from linvision.data.mosaic import MAX_SIZE, MIN_SIZE
        from .segmenter import STRIDE, import_smp

        def need(ok: bool, key: str, what: str) -> None:
            require(self, ok, key, what)

        for key in ("epochs", "batch_size", "log_interval", "img_size", "mosaic_train", "mosaic_val"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, key, "must be an integer >= 1")
        need(self.dataset in ("folder", "mosaic"), "dataset", "must be 'folder' or 'mosaic'")
        need(self.decoder in DECODERS, "decoder", f"must be one of {', '.join(DECODERS)}")
        stride = STRIDE[self.decoder]
        need(self.img_size % stride == 0, "img_size", f"must be a multiple of {stride} for {self.decoder}")
        need(MIN_SIZE <= self.mosaic_size <= MAX_SIZE, "mosaic_size", f"must be {MIN_SIZE} to {MAX_SIZE}")
        need(self.workers >= 0, "workers", "must be >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        for key in ("weight_decay", "warmup_epochs", "warmup_lr", "min_lr"):
            need(getattr(self, key) >= 0, key, "must be >= 0")
        need(0 <= self.hflip <= 1, "hflip", "must be within [0, 1]")
        need(0 < self.model_ema_decay < 1, "model_ema_decay", "must be within (0, 1)")
        need(len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] <= 1, "scale",
             "must be 0 < min <= max <= 1")
        need(self.num_classes is None or 2 <= self.num_classes <= 255, "num_classes", "must be 2 to 255")
        need(0 <= self.ignore_index <= 255, "ignore_index", "must be 0 to 255 (masks are 8-bit)")
        need(self.num_classes is None or self.ignore_index >= self.num_classes, "ignore_index",
             f"must not be a class index (0 to {(self.num_classes or 0) - 1})")
        need(self.clip_grad is None or self.clip_grad > 0, "clip_grad", "must be > 0")
        need(self.drop_path is None or 0 <= self.drop_path < 1, "drop_path", "must be within [0, 1)")
        need(self.stop_after_steps is None or self.stop_after_steps >= 1, "stop_after_steps", "must be >= 1")
        if self.dataset == "folder" and not self.data_dir:
            raise ValueError("data_dir: required for dataset 'folder' (train/ and val/ with images/ and masks/); "
                             "'mosaic' needs none")
        if self.dataset == "folder" and not os.path.isdir(self.data_dir):
            raise FileNotFoundError(f"data_dir: folder not found: {self.data_dir}")
        parse_kwargs(self.model_kwargs)
        parse_kwargs(self.decoder_kwargs, "decoder_kwargs")
        import_smp()
        if self.pretrained and self.pretrained_path:
            raise ValueError("pretrained: give --pretrained (the encoder's own weights through timm's cache) or "
                             "--pretrained-path FILE (a local file), not both")
        if self.pretrained_path and not os.path.isfile(self.pretrained_path):
            raise FileNotFoundError(f"pretrained_path: file not found: {self.pretrained_path}")
        if self.pretrained and not parse_kwargs(self.model_kwargs).get("pretrained_cfg_overlay"):
            check_pretrained(self.encoder)
        else:
            check_model_name(self.encoder)


def add_seg_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of segmentation training, made from :class:`SegTrainConfig`'s fields by the builder of the
    classification flags; YAML configs use the same names (``img_size`` or ``img-size``)."""
    return add_config_args(parser, SegTrainConfig)
