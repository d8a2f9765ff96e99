"""The recipe of classification training as one dataclass, :class:`TrainConfig`: the training flags of the tools,
the keys of their YAML configs and the keyword arguments of :func:`linvision.training.train.train` are its fields.

A field's metadata holds its command-line spelling (timm's: ``-b``, ``-j``, ``--initial-checkpoint``), help and
group; :func:`add_config_args` makes the flags of any such dataclass from them (:func:`add_train_args`: those of
:class:`TrainConfig`), so a new option is one field. Another task's recipe
(:class:`~linvision.training.seg_config.SegTrainConfig`) is a dataclass beside this one, on the same base
(:class:`Recipe`), taking the fields both share from here with :func:`shared_field`.

The two sources of weights are one choice: ``--pretrained`` (``--no-pretrained``) and ``--pretrained-path FILE``.
The one typed on the command line wins over the other set by a config file (:class:`PretrainedFlag`,
:class:`PretrainedPathFlag`); both typed is refused by the recipe's ``check()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from linvision.data.datasets import INTERPOLATIONS
from linvision.utils.cli import AMP_HELP, amp_flag_options

__all__ = ["TrainConfig", "Recipe", "add_train_args", "add_config_args", "recipe_field", "shared_field", "require",
           "RUN_ONLY_KEYS", "PretrainedFlag", "PretrainedPathFlag"]

# Options of one invocation, not of the recipe: left out of a run's saved config.yaml, so that a resumed run does
# not take them as its defaults.
RUN_ONLY_KEYS = ("config", "resume", "stop_after_steps", "overwrite")


def recipe_field(default: Any, help: str, *aliases: str, group: str, **argparse_kwargs: Any) -> Any:
    """A recipe field: its default, help, extra flag spellings, help group and further add_argument options."""
    meta = {"help": help, "aliases": aliases, "group": group, "argparse": argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


_opt = recipe_field


def require(cfg: Any, ok: bool, key: str, what: str) -> None:
    """ValueError naming the field ``key`` (its flag and YAML key) and its value unless ``ok``."""
    if not ok:
        raise ValueError(f"{key}: {what}, got {getattr(cfg, key)!r}")


_TYPED = "_typed_weight_flags"  # attribute of a parsed namespace: which of the two weight flags were typed


def _typed(namespace: argparse.Namespace, dest: str) -> bool:
    return dest in getattr(namespace, _TYPED, ())


def _mark_typed(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, _TYPED, set(getattr(namespace, _TYPED, ())) | {dest})


def _note(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # once under torchrun, where every rank parses the flags
        print(text, flush=True)


class PretrainedFlag(argparse.BooleanOptionalAction):
    """``--pretrained/--no-pretrained``. A typed ``--pretrained`` wins over a ``pretrained_path`` that a config
    file set (the path is dropped, with a note); with ``--pretrained-path`` typed too both stay, for ``check()``
    to refuse."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        if getattr(namespace, self.dest) and getattr(namespace, "pretrained_path", None) \
                and not _typed(namespace, "pretrained_path"):
            _note(f"pretrained: --pretrained on the command line replaces the config's pretrained_path "
                  f"{namespace.pretrained_path}")
            namespace.pretrained_path = None
        _mark_typed(namespace, self.dest)


class PretrainedPathFlag(argparse.Action):
    """``--pretrained-path FILE``. A typed path wins over a ``pretrained: true`` that a config file set (the
    recipe's pretrained is turned off, with a note); with ``--pretrained`` typed too both stay, for ``check()`` to
    refuse."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if values and getattr(namespace, "pretrained", False) is True and not _typed(namespace, "pretrained"):
            _note(f"pretrained: --pretrained-path {values} on the command line replaces the config's pretrained: "
                  f"true (the model's own weights are not downloaded)")
            namespace.pretrained = False
        _mark_typed(namespace, self.dest)


class Recipe:
    """What every training recipe dataclass has besides its fields: built from parsed flags, copied with changes,
    and saved as a run's config.yaml. A subclass is a dataclass whose fields are made with :func:`recipe_field` or
    :func:`shared_field`, and has ``check()``, which raises ValueError naming the first field it cannot use."""

    @classmethod
    def from_namespace(cls, args: Any):
        """The config of parsed flags (or any object with these attributes; other attributes are ignored)."""
        if isinstance(args, cls):
            return args
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def replace(self, **changes: Any):
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def recipe(self) -> Dict[str, Any]:
        """The fields a run saves as its config.yaml: everything but this invocation's one-off options."""
        return {k: v for k, v in self.to_dict().items() if k not in RUN_ONLY_KEYS}


@dataclass
class TrainConfig(Recipe):
    """Everything a classification run is made of (see the flags of ``linvision-train --help``)."""

    # data
    dataset: str = _opt("folder", "'folder' (--data-dir with train/ and val/), the offline sets 'digits', 'photos', "
                                  "'photos_aspect' (photo crops at aspect ratios 1:3 to 3:1, for NaFlex), "
                                  "'photos_fine' (look-alike nature photographs, 96 px) and 'photos_scale' (the "
                                  "same kind at varied crop scale), or a "
                                  "torchvision dataset on disk: 'torch/<name>' (timm's spelling, e.g. torch/cifar10) "
                                  "or 'torchvision/<Name>'", group="data")
    data_dir: Optional[str] = _opt(None, "folder with train/ and val/ class sub-folders", group="data")
    img_size: int = _opt(224, "training and validation resolution", group="data", type=int)
    workers: int = _opt(0, "data-loading worker processes per rank", "-j", group="data", type=int)
    mean: Optional[List[float]] = _opt(None, "normalisation mean (default: the model's pretrained cfg)", group="data",
                                       type=float, nargs=3)
    std: Optional[List[float]] = _opt(None, "normalisation std (default: the model's pretrained cfg)", group="data",
                                      type=float, nargs=3)
    interpolation: Optional[str] = _opt(None, "resize interpolation of training and validation images (default: the "
                                              "model's pretrained cfg, e.g. bicubic)", group="data",
                                        choices=list(INTERPOLATIONS))
    crop_pct: Optional[float] = _opt(None, "validation centre-crop fraction: resize to img_size / crop_pct, crop "
                                           "img_size (default: the model's pretrained cfg, e.g. 0.875)",
                                     group="data", type=float)
    no_aug: bool = _opt(False, "train on resized, centre-cropped images only", group="data")
    scale: List[float] = _opt([0.08, 1.0], "random-resized-crop area range", group="data", type=float, nargs=2)
    hflip: float = _opt(0.5, "horizontal-flip probability of training images", group="data", type=float)
    color_jitter: float = _opt(0.0, "colour-jitter strength of brightness, contrast and saturation (0: off; timm "
                                    "leaves it out when --aa is given)", group="data", type=float)
    aa: Optional[str] = _opt(None, "timm auto-augment policy, e.g. rand-m9-mstd0.5", group="data")
    reprob: float = _opt(0.0, "random-erasing probability", group="data", type=float)
    check_images: bool = _opt(True, "read every image file of a folder dataset before the first step, naming all "
                                    "that cannot be read at once (--no-check-images: find them when a batch draws "
                                    "them)", group="data", action=argparse.BooleanOptionalAction)
    skip_bad_images: bool = _opt(False, "train and validate without the image files that cannot be read (their "
                                        "count and names printed) instead of stopping", group="data")
    naflex_loader: bool = _opt(False, "train and validate on timm's NaFlex batches: every image at its own aspect "
                                      "ratio, cut into at most a sequence length of patches (models that take "
                                      "them: linvit); --img-size then sizes only the model's build", group="data")
    naflex_train_seq_lens: List[int] = _opt([128, 256, 576, 784, 1024], "with --naflex-loader: the sequence "
                                            "lengths (patches per image) of the training batches, each batch "
                                            "holding about --batch-size x the largest of them patches (timm's "
                                            "defaults)", group="data", type=int, nargs="+")
    naflex_max_seq_len: int = _opt(576, "with --naflex-loader: patches per validation image at most (timm's "
                                        "default)", group="data", type=int)
    # model
    model: str = _opt("mlla_tiny", "any timm model name, with a weight tag where it has several (linvision's are "
                                   "registered)", group="model")
    pretrained: bool = _opt(False, "start from the model's trained weights, as timm's pretrained=True loads them "
                                   "(e.g. mlla_tiny.in1k: downloaded once into timm's cache), with a new classifier "
                                   "for the data's classes; --no-pretrained turns a config's off", group="model",
                            action=PretrainedFlag)
    model_kwargs: Any = _opt(None, "key=value pairs or a JSON object passed to the model, e.g. "
                                   "token_mixers=none,linear", group="model", nargs="*")
    pretrained_path: Optional[str] = _opt(None, "local weights (safetensors, .pth/.pth.tar or checkpoint folder); "
                                                "the head is reset when the number of classes differs; given here, "
                                                "it replaces a config's pretrained: true",
                                          "--initial-checkpoint", group="model", action=PretrainedPathFlag)
    num_classes: Optional[int] = _opt(None, "classes of the classifier (default: the dataset's)", group="model",
                                      type=int)
    in_chans: int = _opt(3, "input channels the model is built for", group="model", type=int)
    grad_checkpointing: bool = _opt(False, "recompute activations in the backward pass (less memory, more compute)",
                                    group="model")
    channels_last: bool = _opt(False, "model and batches in channels_last memory format", group="model")
    compile: bool = _opt(False, "torch.compile the model", group="model")
    # optimisation
    epochs: int = _opt(10, "training epochs (the length of the schedule)", group="optimisation", type=int)
    batch_size: int = _opt(64, "images per step on each rank", "-b", group="optimisation", type=int)
    opt: str = _opt("adamw", "timm optimizer name (e.g. adamw, sgd, lamb)", group="optimisation")
    lr: float = _opt(1e-3, "peak learning rate, reached after the warm-up (not scaled by batch size or ranks)",
                     group="optimisation", type=float)
    weight_decay: float = _opt(0.05, "weight decay of the optimizer", group="optimisation", type=float)
    momentum: float = _opt(0.9, "momentum of the optimizers that take one (e.g. sgd)", group="optimisation",
                           type=float)
    layer_decay: Optional[float] = _opt(None, "layer-wise lr decay (needs group_matcher)", group="optimisation",
                                        type=float)
    sched: str = _opt("cosine", "timm learning-rate schedule (e.g. cosine, step, poly), updated every step",
                      group="optimisation")
    warmup_epochs: float = _opt(0, "epochs of linear warm-up from --warmup-lr to --lr (fractions allowed; 0: none)",
                                group="optimisation", type=float)
    warmup_lr: float = _opt(1e-5, "learning rate at the start of the warm-up", group="optimisation", type=float)
    min_lr: float = _opt(1e-6, "learning rate the schedule decays to", group="optimisation", type=float)
    clip_grad: Optional[float] = _opt(None, "max gradient norm", group="optimisation", type=float)
    smoothing: float = _opt(0.0, "label smoothing", group="optimisation", type=float)
    mixup: float = _opt(0.0, "Mixup alpha (0: off)", group="optimisation", type=float)
    cutmix: float = _opt(0.0, "CutMix alpha (0: off)", group="optimisation", type=float)
    drop_path: Optional[float] = _opt(None, "stochastic depth rate", group="optimisation", type=float)
    distill_teacher: Optional[str] = _opt(None, "checkpoint or run folder of a frozen teacher whose logits are "
                                                "distilled (e.g. the softmax ViT in stage 2 of linearization)",
                                          group="optimisation")
    distill_weight: float = _opt(0.5, "weight w of the distillation term: (1 - w) * task loss + w * T^2 * KL",
                                 group="optimisation", type=float)
    distill_temperature: float = _opt(1.0, "softmax temperature T of distillation", group="optimisation",
                                      type=float)
    model_ema: bool = _opt(False, "keep an EMA of the weights (ModelEmaV3)", group="optimisation")
    model_ema_decay: float = _opt(0.999, "decay of the weight EMA (with --model-ema)", group="optimisation",
                                  type=float)
    amp: str = _opt("none", AMP_HELP, group="optimisation", **amp_flag_options())
    # run
    output: str = _opt("output", "parent folder of run folders", group="run")
    experiment: Optional[str] = _opt(None, "run folder name (default: model name and time); a folder that holds a "
                                           "run is never overwritten: the run goes to <name>-<k> instead", group="run")
    overwrite: bool = _opt(False, "delete the earlier run in the run folder first", group="run")
    resume: Optional[str] = _opt(None, "continue a run: its folder, its last/ checkpoint or a file in it; or start "
                                       "from a timm train.py checkpoint file (.pth.tar: weights, optimizer, EMA and "
                                       "epoch)", group="run")
    seed: int = _opt(0, "random seed of the initialisation, data order and augmentation", group="run", type=int)
    device: str = _opt("auto", "'auto': CUDA when available, else CPU; under torchrun each rank takes "
                               "cuda:LOCAL_RANK", group="run", choices=["auto", "cpu", "cuda"])
    log_interval: int = _opt(10, "steps between step records in metrics.jsonl", group="run", type=int)
    stop_after_steps: Optional[int] = _opt(None, "save a resumable checkpoint and stop after this many steps in "
                                                 "total, counted from the run's start (a resumed run refuses one "
                                                 "it has passed; the schedule still follows --epochs)", group="run",
                                           type=int)
    progress: bool = _opt(True, "progress bars", group="run", action=argparse.BooleanOptionalAction)

    def check(self) -> None:
        """ValueError naming the flag (and YAML key) of the first value the recipe cannot use; a model without
        weights for ``pretrained`` fails here, before a run folder or the data are touched."""
        from linvision.utils.config import parse_kwargs
        from linvision.utils.factory import check_pretrained

        def need(ok: bool, key: str, what: str) -> None:
            require(self, ok, key, what)

        for key in ("epochs", "batch_size", "log_interval", "img_size", "in_chans"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, key, "must be an integer >= 1")
        need(self.workers >= 0, "workers", "must be >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        for key in ("weight_decay", "warmup_epochs", "warmup_lr", "min_lr", "mixup", "cutmix", "color_jitter"):
            need(getattr(self, key) >= 0, key, "must be >= 0")
        for key in ("hflip", "reprob"):
            need(0 <= getattr(self, key) <= 1, key, "must be within [0, 1]")
        need(0 <= self.smoothing < 1, "smoothing", "must be within [0, 1)")
        need(0 < self.model_ema_decay < 1, "model_ema_decay", "must be within (0, 1)")
        need(self.crop_pct is None or (isinstance(self.crop_pct, (int, float)) and 0 < self.crop_pct <= 1),
             "crop_pct", "must be within (0, 1]")
        need(self.interpolation is None or self.interpolation in INTERPOLATIONS, "interpolation",
             f"must be one of {', '.join(INTERPOLATIONS)}")
        for key in ("mean", "std"):
            value = getattr(self, key)
            need(value is None or (isinstance(value, (list, tuple)) and len(value) == 3
                                   and all(isinstance(v, (int, float)) for v in value)), key,
                 "must be 3 numbers (one per RGB channel)")
        need(self.std is None or min(self.std) > 0, "std", "must be > 0")
        need(len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] <= 1, "scale",
             "must be 0 < min <= max <= 1")
        need(self.num_classes is None or self.num_classes >= 2, "num_classes", "must be >= 2")
        need(self.clip_grad is None or self.clip_grad > 0, "clip_grad", "must be > 0")
        need(self.layer_decay is None or 0 < self.layer_decay <= 1, "layer_decay", "must be within (0, 1]")
        need(self.drop_path is None or 0 <= self.drop_path < 1, "drop_path", "must be within [0, 1)")
        need(self.stop_after_steps is None or self.stop_after_steps >= 1, "stop_after_steps", "must be >= 1")
        need(0 <= self.distill_weight <= 1, "distill_weight", "must be within [0, 1]")
        need(self.distill_temperature > 0, "distill_temperature", "must be > 0")
        need(all(isinstance(n, int) and n >= 1 for n in self.naflex_train_seq_lens) and self.naflex_train_seq_lens,
             "naflex_train_seq_lens", "must be integers >= 1")
        need(isinstance(self.naflex_max_seq_len, int) and self.naflex_max_seq_len >= 1, "naflex_max_seq_len",
             "must be an integer >= 1")
        if self.naflex_loader and (self.mixup > 0 or self.cutmix > 0 or self.distill_teacher):
            raise ValueError("naflex_loader: Mixup, CutMix and distillation take batches of one size; train NaFlex "
                             "batches without them")
        if self.pretrained and self.pretrained_path:
            raise ValueError("pretrained: give --pretrained (the model's own weights through timm's cache) or "
                             "--pretrained-path FILE (a local file), not both")
        if self.pretrained and not parse_kwargs(self.model_kwargs).get("pretrained_cfg_overlay"):
            check_pretrained(self.model)


def add_config_args(parser: argparse.ArgumentParser, config_class: type) -> argparse.ArgumentParser:
    """A flag for every field of ``config_class`` (a :class:`Recipe` dataclass), in groups by the fields'
    metadata; YAML configs use the same names (``img_size`` or ``img-size``)."""
    groups: Dict[str, Any] = {}
    for f in fields(config_class):
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        kwargs = dict(meta["argparse"])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default is False and "action" not in kwargs:
            kwargs["action"] = "store_true"
        group.add_argument(f"--{f.name.replace('_', '-')}", *meta["aliases"], default=default, help=meta["help"],
                           **kwargs)
    return parser


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every training flag, made from :class:`TrainConfig`'s fields; YAML configs use the same names
    (``img_size`` or ``img-size``)."""
    return add_config_args(parser, TrainConfig)


_UNSET: Any = object()


def shared_field(name: str, default: Any = _UNSET, help: Optional[str] = None) -> Any:
    """:class:`TrainConfig`'s field ``name`` for another recipe dataclass: the same flag spellings, group and
    argparse options, with its own ``default`` or ``help`` where given."""
    f = {g.name: g for g in fields(TrainConfig)}[name]
    meta = f.metadata
    if default is _UNSET:
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return recipe_field(default, meta["help"] if help is None else help, *meta["aliases"], group=meta["group"],
                **meta["argparse"])
