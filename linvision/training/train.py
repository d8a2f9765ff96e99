"""The trainer behind ``linvision-train`` and ``linvision-train-seg``: :func:`train` runs a recipe (a
:class:`~linvision.training.train_config.TrainConfig`, or another task's, such as
:class:`~linvision.training.seg_config.SegTrainConfig`) in named steps (set up, restore, a step, an epoch, its end,
finish) over a :class:`_Run` that holds the run's parts and position.

What differs between tasks is a :class:`Task` given with the recipe: the data with its transforms and the model
(:meth:`Task.build`), the loss, the evaluation and the figure that picks ``best/``.
:class:`ClassificationTask` is image classification; ``linvision.training.seg_task.SegmentationTask`` is semantic
segmentation. Everything else is shared: the run folder and its records, the checkpoints, exact resumption,
saving on a signal, AMP, DistributedDataParallel, the EMA of the weights, progress bars and ``stop_after_steps``.

The recipe reuses timm's parts: ``create_optimizer_v2`` (layer decay through the model's ``group_matcher``),
``create_scheduler_v2`` (stepped every update), ``Mixup`` (Mixup/CutMix and label smoothing), ``ModelEmaV3``,
``create_transform`` and timm's losses. Around them: AMP (bf16/fp16), gradient clipping, gradient
checkpointing, channels_last, ``torch.compile``, DistributedDataParallel under torchrun, atomic checkpoints,
exact resumption and a checkpoint on Ctrl-C / SIGTERM.

Exact resumption: the data order of epoch e depends only on (seed, e), and the checkpoint holds every
rank's RNG states, the optimizer, scheduler, scaler and EMA, and the position inside the epoch. A resumed run
therefore repeats the uninterrupted run's losses exactly with ``workers: 0`` (data augmentation then draws
from the restored RNG) or when it resumes at an epoch boundary; with worker processes a run resumed
mid-epoch gets different augmentations for the rest of that epoch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from timm.utils import random_seed, unwrap_model
from torch import nn

from linvision.data.datasets import ShardedSampler, build_transform, create_dataset, create_loader, resolve_data_config
from linvision.data.image_check import check_image_files, find_unreadable
from linvision.data.naflex import NaFlexBatches, check_naflex_model, naflex_eval_parts, naflex_train_batches
from linvision.utils.amp import autocast
from linvision.utils.checkpoint import (load_pretrained, load_torch_file, read_checkpoint_meta, recorded_data_config,
                                        save_checkpoint)
from linvision.utils.config import parse_kwargs, save_yaml
from linvision.utils.distributed import DistInfo, all_reduce_max, all_reduce_sum, barrier, cleanup, init_distributed
from linvision.utils.factory import check_img_size, check_model_name, create_model
from linvision.utils.files import atomic_write, atomic_write_text
from linvision.utils.interrupt import StopFlag, TrainInterrupted
from linvision.utils.run_folder import claim_run_folder

from .distill import distillation_loss, load_teacher
from .evaluate import evaluate, to_device
from .resume import (gather_rng, is_external_checkpoint, load_timm_checkpoint, read_timm_checkpoint, resume_config,
                     resume_folder, set_rng_state, truncate_metrics)
from .train_config import Recipe, TrainConfig, add_train_args

__all__ = ["TrainConfig", "add_train_args", "train", "resume_config", "TrainInterrupted", "Task", "TaskParts",
           "ClassificationTask", "train_data_config", "resumed_data_config", "rank0_first"]


def _run_folder(cfg: Recipe, task: "Task") -> str:
    if cfg.resume and not is_external_checkpoint(cfg.resume):
        return resume_folder(cfg.resume)
    name = cfg.experiment or f"{task.run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    return os.path.join(cfg.output, name)


def _check_classes(train_set, val_set, num_classes: Optional[int]) -> List[str]:
    """The training classes, checked: at least two, the same in the validation split, and within the head."""
    classes = list(getattr(train_set, "classes", []))
    val_classes = list(getattr(val_set, "classes", []))
    if classes and len(classes) < 2:
        raise ValueError(f"dataset: the training split has one class ({classes[0]!r}); a classifier needs two")
    if classes and val_classes and val_classes != classes:
        missing = [c for c in classes if c not in val_classes]
        extra = [c for c in val_classes if c not in classes]
        raise ValueError(f"dataset: the validation split's classes differ from the training split's (missing in "
                         f"validation: {missing}, only in validation: {extra}); their labels would not match")
    if num_classes is not None and classes and num_classes < len(classes):
        raise ValueError(f"num_classes: {num_classes} is fewer than the {len(classes)} classes of the data")
    return classes


def _report_load(report: Dict[str, list], path: str, model: nn.Module) -> None:
    """Print what a weight load (:func:`load_pretrained`) did."""
    total = len(model.state_dict())
    missing, unexpected, skipped = report["missing"], report["unexpected"], report["skipped"]
    loaded = total - len(missing) - len(skipped)  # each tensor is in at most one of the lists

    def some(names):
        return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    print(f"pretrained: loaded {loaded} of {total} tensors from {path}"
          + (f"; new (shape changed): {some(skipped)}" if skipped else "")
          + (f"; missing: {some(missing)}" if missing else "")
          + (f"; unused: {some(unexpected)}" if unexpected else ""), flush=True)


def _report_pretrained(model: nn.Module, num_classes: int) -> None:
    """Print which trained weights ``--pretrained`` loaded and whether the classifier is new."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    name = cfg.get("architecture", "the model") + (f".{cfg['tag']}" if cfg.get("tag") else "")
    source = cfg.get("file") or cfg.get("url") or cfg.get("hf_hub_id") or "timm's cache"
    trained = cfg.get("num_classes")
    head = (f"; a new classifier for {num_classes} classes (the weights' has {trained})"
            if trained and trained != num_classes else "")
    print(f"pretrained: {name} from {source}{head}", flush=True)


def check_data_files(cfg: Recipe, info: DistInfo, datasets: Dict[str, Any]) -> None:
    """Read every image file of ``datasets`` ({split name: dataset}) before the first step, unless
    ``cfg.check_images`` is off (:func:`~linvision.data.image_check.check_image_files`): one error naming every
    unreadable file, or with ``cfg.skip_bad_images`` the samples without them. Rank 0 reads; the other ranks
    take its findings, so every rank keeps the same samples."""
    if not cfg.check_images:
        return

    def scan(files, split):
        found = [find_unreadable(files, cfg.progress, f"reading the {split} images") if info.is_main else None]
        if info.distributed:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    check_image_files(datasets, skip=cfg.skip_bad_images, find_bad=scan,
                      report=lambda line: print(line, flush=True) if info.is_main else None)


@contextlib.contextmanager
def rank0_first(info: DistInfo, active: bool = True):
    """Rank 0 runs the block first, then the other ranks (a download into timm's cache that they then read)."""
    if active and not info.is_main:
        barrier(info)
    yield
    if active and info.is_main:
        barrier(info)


@dataclass
class TaskParts:
    """What :meth:`Task.build` makes: the datasets with their transforms, the model on its device, what
    model.json records (``meta``) and the number of classes."""

    train_set: Any
    val_set: Any
    model: nn.Module
    meta: Dict[str, Any]
    num_classes: int


class Task:
    """The task-specific parts of a run; the trainer does the rest. A run takes one instance, which may keep what
    it builds (a teacher) between the calls.

    Attributes:
        score: the figure of :meth:`evaluate` that picks ``best/`` (higher is better).
        score_label: how the log lines name it.
        record_keys: the figures of :meth:`evaluate` an epoch record keeps (``val_<key>``, ``ema_val_<key>``) and
            ``best`` in summary.json holds.
        command: the tool that runs the task, for the messages that say how to resume a run.
        timm_checkpoints: whether ``--resume FILE.pth.tar`` (a checkpoint of timm's train.py) can start a run.
        timm_config: whether its checkpoints also hold timm's config.json (the model is a timm classifier:
            ``timm.create_model("local-dir:RUN/best", pretrained=True)`` loads it).
        val_collate: the validation loader's ``collate_fn``, when not the default.
    """

    score: str
    score_label: str
    record_keys: Tuple[str, ...]
    command: str = "linvision-train"
    timm_checkpoints: bool = False
    timm_config: bool = False
    val_collate: Optional[Callable] = None

    def run_name(self, cfg: Recipe) -> str:
        """The start of a run folder's default name."""
        raise NotImplementedError

    def build(self, cfg: Recipe, info: DistInfo, fresh: bool) -> TaskParts:
        """The data with its transforms and the model on ``info.device``, from trained weights when ``fresh`` and
        the recipe asks for them. Called right after the trainer seeds the RNG with ``cfg.seed`` on every rank."""
        raise NotImplementedError

    def optimizer_options(self, cfg: Recipe) -> Dict[str, Any]:
        """Further keyword arguments of timm's ``create_optimizer_v2``."""
        return {}

    def criterion(self, cfg: Recipe, parts: TaskParts, info: DistInfo) -> Tuple[nn.Module, Optional[Callable]]:
        """(the training loss, a transform of every training batch on the device, e.g. Mixup, or None)."""
        raise NotImplementedError

    def loss(self, run: "_Run", images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one batch through ``run.train_model`` (called under autocast)."""
        return run.criterion(run.train_model(images), targets)

    def evaluate(self, run: "_Run", model: nn.Module) -> Dict[str, Any]:
        """The figures of ``model`` on ``run.val_loader``, exact over all ranks; they include :attr:`score` and
        :attr:`record_keys`."""
        raise NotImplementedError

    def summary(self, run: "_Run") -> Dict[str, Any]:
        """What summary.json says the run trained, before the epochs and the best score."""
        raise NotImplementedError


def opening_line(cfg: TrainConfig, info: DistInfo, num_classes: int, train_count: int, val_count: int,
                 model: nn.Module) -> str:
    """The line ``linvision-train`` prints before any image is read: the data (folder, classes, training and
    validation images), the model and its parameters, the image size, the device, the precision and the torch
    threads with why (:func:`linvision.utils.threads.threads_note`)."""
    from linvision.utils.threads import threads_note

    data = f"{cfg.dataset} {cfg.data_dir}" if cfg.data_dir else cfg.dataset
    params = sum(p.numel() for p in model.parameters())
    count = f"{params / 1e6:.2f}M" if params >= 10_000 else f"{params:,}"
    precision = {"none": "fp32 (no AMP)", "bf16": "bf16 autocast (AMP)",
                 "fp16": "fp16 autocast (AMP, loss scaling)"}.get(cfg.amp, cfg.amp)
    ranks = f" x {info.world_size} ranks" if info.distributed else ""
    return (f"training {cfg.model} ({count} parameters) at {cfg.img_size} px on {data}: {num_classes} classes, "
            f"{train_count} training / {val_count} validation images; {info.device.type}{ranks}, {precision}, "
            f"{threads_note()}")


def train_data_config(cfg: TrainConfig, model: nn.Module,
                      recorded: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The settings of a classification run's transforms (:func:`~linvision.data.datasets.resolve_data_config`):
    the recipe's ``img_size``, and its ``interpolation``, ``crop_pct``, ``mean`` and ``std`` where given, else
    those of ``recorded`` (a resumed run's: :func:`resumed_data_config`) when given, else those of ``model``'s
    pretrained cfg."""
    return resolve_data_config(model, recorded, img_size=cfg.img_size, interpolation=cfg.interpolation,
                               crop_pct=cfg.crop_pct, mean=cfg.mean, std=cfg.std)


def resumed_data_config(cfg: TrainConfig) -> Optional[Dict[str, Any]]:
    """The transform settings that the run ``cfg.resume`` continues recorded in its ``last/model.json``
    (:func:`~linvision.utils.checkpoint.recorded_data_config`), so that resuming does not change how images are
    transformed mid-run: a run started before the transform's interpolation was configurable (its config.yaml
    has no ``interpolation``, its model.json none either) goes on with bilinear and the crop_pct it recorded, not
    with the model's pretrained cfg. None when ``cfg`` starts a run, or starts from a timm checkpoint file, or
    the run's last/ has no model.json."""
    if not cfg.resume or is_external_checkpoint(cfg.resume):
        return None
    last = os.path.join(resume_folder(cfg.resume), "last")
    if not os.path.isfile(os.path.join(last, "model.json")):
        return None
    return recorded_data_config(read_checkpoint_meta(last))


class ClassificationTask(Task):
    """Image classification (``linvision-train``): image folders, torchvision datasets, digits or photos; any timm
    model with a classifier for the data's classes; timm's transforms, Mixup/CutMix, label smoothing and
    distillation; top-1 picks ``best/``."""

    score, score_label, record_keys = "top1", "top-1", ("top1", "top5", "loss")
    timm_checkpoints = timm_config = True

    def __init__(self):
        self.teacher: Optional[nn.Module] = None
        self.naflex: Optional[NaFlexBatches] = None  # the training batches of --naflex-loader

    def run_name(self, cfg: TrainConfig) -> str:
        return cfg.model

    def build(self, cfg: TrainConfig, info: DistInfo, fresh: bool) -> TaskParts:
        check_model_name(cfg.model)  # a misspelt name before any image is read
        train_set = create_dataset(cfg.dataset, cfg.data_dir, "train", digits_size=cfg.img_size)
        val_set = create_dataset(cfg.dataset, cfg.data_dir, "val", digits_size=cfg.img_size)
        classes = _check_classes(train_set, val_set, cfg.num_classes)
        num_classes = cfg.num_classes or len(classes)
        if not num_classes:
            raise ValueError("num_classes: the dataset does not list its classes; give --num-classes")
        model_kwargs = parse_kwargs(cfg.model_kwargs)
        if cfg.drop_path is not None:
            model_kwargs["drop_path_rate"] = cfg.drop_path
        # a resumed run takes every weight from its checkpoint: nothing is downloaded or read again
        download = cfg.pretrained and fresh
        with rank0_first(info, download):  # rank 0 fills timm's cache first; the others read the file it wrote
            model = create_model(cfg.model, num_classes=num_classes, in_chans=cfg.in_chans,
                                 model_kwargs=model_kwargs, img_size=cfg.img_size, pretrained=download)
        if info.is_main:  # what the run is, in one line, before the images are read
            print(opening_line(cfg, info, num_classes, len(train_set), len(val_set), model), flush=True)
        check_data_files(cfg, info, {"training": train_set, "validation": val_set})
        if download and info.is_main:
            _report_pretrained(model, num_classes)
        if cfg.pretrained_path and fresh:
            report = load_pretrained(model, cfg.pretrained_path)
            if info.is_main:
                _report_load(report, cfg.pretrained_path, model)
        # a resumed run keeps the settings its checkpoint recorded for what the recipe leaves unset
        data_config = train_data_config(cfg, model, None if fresh else resumed_data_config(cfg))
        if cfg.naflex_loader:  # images at their own aspect ratio: the loader transforms them (_set_up)
            patch_size = check_naflex_model(model, cfg.model)
            self.naflex = naflex_train_batches(
                train_set, patch_size, cfg.naflex_train_seq_lens, cfg.batch_size, data_config, cfg.seed, info.rank,
                info.world_size, scale=cfg.scale, hflip=cfg.hflip, color_jitter=cfg.color_jitter,
                auto_augment=cfg.aa, re_prob=cfg.reprob, no_aug=cfg.no_aug)
            val_set.transform, self.val_collate = naflex_eval_parts(patch_size, cfg.naflex_max_seq_len, data_config)
        else:
            train_set.transform = build_transform(is_training=True, **data_config, scale=cfg.scale, hflip=cfg.hflip,
                                                  color_jitter=cfg.color_jitter, auto_augment=cfg.aa,
                                                  re_prob=cfg.reprob, no_aug=cfg.no_aug)
            val_set.transform = build_transform(is_training=False, **data_config)
        if cfg.grad_checkpointing:
            model.set_grad_checkpointing(True)
        model.to(info.device)
        check_img_size(model, cfg.img_size, cfg.in_chans)  # one line now rather than a traceback at step 1
        if cfg.channels_last:
            model.to(memory_format=torch.channels_last)
        # the transform's settings as resolved (img_size, interpolation, crop_pct, crop_mode, mean, std): what
        # linvision-validate --checkpoint evaluates with
        meta = {"model": cfg.model, "num_classes": num_classes, "in_chans": cfg.in_chans,
                "model_kwargs": model_kwargs, **data_config, "classes": classes, "dataset": cfg.dataset}
        if cfg.naflex_loader:  # trained at each image's own aspect: the sequence lengths, not img_size, say how
            meta["naflex_train_seq_lens"] = list(cfg.naflex_train_seq_lens)
        return TaskParts(train_set, val_set, model, meta, num_classes)

    def optimizer_options(self, cfg: TrainConfig) -> Dict[str, Any]:
        return {"layer_decay": cfg.layer_decay}

    def criterion(self, cfg: TrainConfig, parts: TaskParts, info: DistInfo):
        from timm.data import Mixup
        from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

        mixup = None
        if cfg.mixup > 0 or cfg.cutmix > 0:
            mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing,
                          num_classes=parts.num_classes)
            criterion = SoftTargetCrossEntropy()
        elif cfg.smoothing > 0:
            criterion = LabelSmoothingCrossEntropy(cfg.smoothing)
        else:
            criterion = nn.CrossEntropyLoss()
        self.teacher = (load_teacher(cfg.distill_teacher, parts.num_classes, cfg.img_size, info.device)
                        if cfg.distill_teacher else None)
        return criterion, mixup

    def loss(self, run: "_Run", images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cfg = run.cfg
        logits = run.train_model(images)
        loss = run.criterion(logits, targets)
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(images)
            loss = distillation_loss(logits, teacher_logits, loss, cfg.distill_weight, cfg.distill_temperature)
        return loss

    def evaluate(self, run: "_Run", model: nn.Module) -> Dict[str, Any]:
        cfg = run.cfg
        return evaluate(model, run.val_loader, run.info, cfg.amp, cfg.channels_last, cfg.progress)

    def summary(self, run: "_Run") -> Dict[str, Any]:
        return {"model": run.cfg.model, "num_classes": run.num_classes}


def _append_jsonl(path: str, record: Dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(cfg: Union[Recipe, argparse.Namespace], task: Optional[Task] = None) -> Dict[str, Any]:
    """Run training as ``cfg`` says for ``task``: by default image classification (:class:`ClassificationTask`)
    with a :class:`TrainConfig` or the flags of :func:`add_train_args`; another task comes with its own recipe
    (:func:`linvision.training.seg_task.train_segmentation`: a ``SegmentationTask`` and a ``SegTrainConfig``).
    Returns the summary it also writes.

    Writes into the run folder: config.yaml, metrics.jsonl (step and epoch records), summary.json, and the
    checkpoints ``last/`` and ``best/`` (rank 0 only). Raises TrainInterrupted after saving when SIGINT or
    SIGTERM arrived; ValueError / FileNotFoundError for bad arguments and missing data.
    """
    if task is None:
        if isinstance(cfg, Recipe) and not isinstance(cfg, TrainConfig):
            raise TypeError(f"train: a {type(cfg).__name__} needs the task it is the recipe of")
        cfg, task = TrainConfig.from_namespace(cfg), ClassificationTask()
    info = init_distributed(cfg.device)
    try:
        result = _train(cfg, task, info)
        barrier(info)
        return result
    finally:
        cleanup(info)


def _train(cfg: Recipe, task: Task, info: DistInfo) -> Dict[str, Any]:
    cfg.check()
    resuming_run = bool(cfg.resume) and not is_external_checkpoint(cfg.resume)
    if cfg.resume and not resuming_run and not task.timm_checkpoints:
        raise ValueError(f"resume: {cfg.resume} is not a file of a run folder; give the run folder (or its last/) "
                         f"to continue")
    run_dir, folder = _run_folder(cfg, task), None
    if info.is_main:  # one process owns the folder; the others write nothing there
        folder = claim_run_folder(run_dir, resume=resuming_run, overwrite=cfg.overwrite)
        run_dir = folder.path
        for note in folder.notes:
            print(note, flush=True)
    if info.distributed:
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)
        run_dir = shared[0]
    try:
        result = _train_in_folder(cfg, task, info, run_dir, resuming_run)
    except BaseException:
        # a new run that ends before its first checkpoint leaves no folder behind (its name stays free)
        if folder is not None and not resuming_run and not os.path.isdir(os.path.join(run_dir, "last")):
            folder.discard()
        raise
    finally:
        if folder is not None:
            folder.release()
    return result


def _train_in_folder(cfg: Recipe, task: Task, info: DistInfo, run_dir: str,
                     resuming_run: bool) -> Dict[str, Any]:
    """The run, step by step: what to resume from, the parts, their restored state, the folder's files, then the
    epochs; each step is one function below."""
    state, external = _read_resume_state(cfg, run_dir, resuming_run)
    if state:
        _check_stop_after(cfg, state["global_step"])  # before the data and the model are built
    run = _set_up(cfg, task, info, run_dir, fresh=not (state or external))
    _restore(run, state, external)
    if external:
        _check_stop_after(cfg, run.global_step)
    _wrap_for_training(run)
    _open_records(run, resumed=bool(state))
    _report_layer_decay(run)
    with StopFlag() as stop:
        for epoch in range(run.start_epoch, cfg.epochs):
            stopped = _train_epoch(run, epoch, stop)
            if stopped is not None:
                return stopped
            _end_of_epoch(run, epoch)
    return _finish(run)


@dataclass
class _Run:
    """What one training run holds while it runs: its parts (built by :func:`_set_up`) and its position."""

    cfg: Recipe
    task: Task
    info: DistInfo
    run_dir: str
    model: nn.Module
    num_classes: int
    meta: Dict[str, Any]
    optimizer: Any
    scheduler: Any
    criterion: nn.Module
    batch_transform: Optional[Callable]  # of every training batch on the device (Mixup / CutMix)
    ema: Any
    scaler: Any
    sampler: Any  # a ShardedSampler, or the NaFlexBatches of --naflex-loader
    loader: Any
    val_loader: Any
    steps_per_epoch: int
    train_model: Optional[nn.Module] = None  # the model as it runs the steps (compiled, DDP-wrapped)
    metrics_path: str = ""
    start_epoch: int = 0
    start_step: int = 0
    global_step: int = 0
    best: Dict[str, Any] = field(default_factory=dict)  # {task.score: -1.0, "epoch": -1} until an epoch ends
    # loss sum, sample count of the epoch so far (this rank)
    running: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    epoch_start: float = 0.0
    updating: bool = False  # inside an optimizer update (see _train_step)
    steps_taken: int = 0  # updates this process made (not counting those a resumed run starts after)


def _check_stop_after(cfg: Recipe, step: int) -> None:
    """ValueError in one line when ``stop_after_steps`` (the run's steps in total) is not after ``step``, where a
    resumed run stands: it would take one more step and stop there, past the number asked for."""
    if cfg.stop_after_steps is not None and cfg.stop_after_steps <= step:
        raise ValueError(f"stop_after_steps: the run resumes at step {step} and --stop-after-steps counts the "
                         f"run's steps from its start, so {cfg.stop_after_steps} is behind it; give more than "
                         f"{step} (e.g. --stop-after-steps {step + cfg.stop_after_steps} for {cfg.stop_after_steps} "
                         f"more)")


def _read_resume_state(cfg: Recipe, run_dir: str, resuming_run: bool):
    """(the run's own last/train_state.pt, or None; what a timm checkpoint to start from holds, or None)."""
    if cfg.resume and not resuming_run:
        return None, read_timm_checkpoint(cfg.resume)
    if cfg.resume:
        state_path = os.path.join(run_dir, "last", "train_state.pt")
        if not os.path.isfile(state_path):
            raise FileNotFoundError(f"resume: no last/train_state.pt in {run_dir}")
        return load_torch_file(state_path, "resume"), None
    return None, None


def _set_up(cfg: Recipe, task: Task, info: DistInfo, run_dir: str, fresh: bool) -> _Run:
    """The task's data and model (from trained weights when ``fresh`` and asked for) and its loss, then the
    optimizer, EMA, loss scaler, loaders and schedule."""
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    # same seed on every rank for the model's initialisation (the EMA copy is taken before DDP broadcasts)
    random_seed(cfg.seed)
    parts = task.build(cfg, info, fresh)
    model, train_set, val_set = parts.model, parts.train_set, parts.val_set
    optimizer = create_optimizer_v2(model, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                    momentum=cfg.momentum, **task.optimizer_options(cfg))
    criterion, batch_transform = task.criterion(cfg, parts, info)
    ema = ModelEmaV3(model, decay=cfg.model_ema_decay) if cfg.model_ema else None
    scaler = torch.amp.GradScaler(info.device.type) if cfg.amp == "fp16" else None

    naflex = getattr(task, "naflex", None)
    if naflex is not None:  # timm's NaFlex batches: batch sizes and sequence lengths from its schedule
        sampler = naflex
        loader = create_loader(naflex, None, None, cfg.workers, pin_memory=info.device.type == "cuda",
                               generator=torch.Generator())
    else:
        sampler = ShardedSampler(len(train_set), info.rank, info.world_size, shuffle=True, seed=cfg.seed)
        # a loader-owned generator keeps the loader from drawing on the global RNG (exact resumption)
        # a last batch of one sample would break BatchNorm in training mode: drop it (it returns next epoch)
        drop_last = batch_transform is not None or len(sampler) % cfg.batch_size == 1
        loader = create_loader(train_set, cfg.batch_size, sampler, cfg.workers, drop_last=drop_last,
                               pin_memory=info.device.type == "cuda", generator=torch.Generator())
    val_loader = create_loader(val_set, cfg.batch_size, ShardedSampler(len(val_set), info.rank, info.world_size,
                                                                       shuffle=False), cfg.workers)
    if task.val_collate is not None:  # e.g. padding validation images of several sizes into one batch
        val_loader.collate_fn = task.val_collate
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ValueError(f"batch_size: {cfg.batch_size} leaves no full batch of {len(train_set)} training images "
                         f"per rank")
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.sched, num_epochs=cfg.epochs,
                                       warmup_epochs=cfg.warmup_epochs, warmup_lr=cfg.warmup_lr,
                                       min_lr=cfg.min_lr, step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    return _Run(cfg=cfg, task=task, info=info, run_dir=run_dir, model=model, num_classes=parts.num_classes,
                meta=parts.meta, optimizer=optimizer, scheduler=scheduler, criterion=criterion,
                batch_transform=batch_transform, ema=ema, scaler=scaler, sampler=sampler, loader=loader,
                val_loader=val_loader, steps_per_epoch=steps_per_epoch, best={task.score: -1.0, "epoch": -1})


def _restore(run: _Run, state: Optional[Dict[str, Any]], external: Optional[Dict[str, Any]]) -> None:
    """Put the parts where the run's own checkpoint (``state``) or a timm checkpoint (``external``) left them;
    a new run seeds each rank's augmentation instead."""
    cfg, info = run.cfg, run.info
    if state:
        saved_batch = state.get("batch_size", cfg.batch_size)
        if saved_batch != cfg.batch_size:
            raise ValueError(f"batch_size: the run trained with {saved_batch} per rank; resuming with "
                             f"{cfg.batch_size} would misplace the data order and the schedule (start a new run "
                             f"from its weights with --initial-checkpoint instead)")
        unwrap_model(run.model).load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        saved_epochs = state.get("epochs", cfg.epochs)
        if saved_epochs == cfg.epochs:
            run.scheduler.load_state_dict(state["scheduler"])
        else:  # a new length: the schedule is rebuilt for it and continues from the current update
            run.scheduler.step_update(num_updates=state["global_step"])
            if info.is_main:
                change = "extended" if cfg.epochs > saved_epochs else "shortened"
                print(f"resume: schedule {change} from {saved_epochs} to {cfg.epochs} epochs", flush=True)
        if run.scaler is not None and state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
        if run.ema is not None and state.get("ema"):
            run.ema.module.load_state_dict(state["ema"])
        run.start_epoch, run.start_step, run.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        run.best, run.running = state["best"], state["running"][info.rank]
        if len(state["rng"]) != info.world_size:
            raise ValueError(f"resume: the checkpoint was written by {len(state['rng'])} processes, this run has "
                             f"{info.world_size}")
        set_rng_state(state["rng"][info.rank])
        if info.is_main:
            best = (f"best {run.task.score_label} so far {run.best[run.task.score]:.2f} (epoch {run.best['epoch']})"
                    if run.best.get("epoch", -1) >= 0 else "no epoch evaluated yet")
            print(f"resume: {run.run_dir}/last at epoch {run.start_epoch}, step {run.start_step} of "
                  f"{run.steps_per_epoch} (update {run.global_step}), {best}", flush=True)
    else:
        random_seed(cfg.seed, info.rank)
    if external:
        run.start_epoch = load_timm_checkpoint(external, cfg, run.model, run.optimizer, run.ema, run.scaler)
        run.global_step = run.start_epoch * run.steps_per_epoch
        run.scheduler.step_update(num_updates=run.global_step)
        if info.is_main:
            print(f"starting at epoch {run.start_epoch} from {cfg.resume}", flush=True)


def _wrap_for_training(run: _Run) -> None:
    """``torch.compile`` and DistributedDataParallel around the model, as asked for and as the ranks need."""
    run.train_model = run.model
    if run.cfg.compile:
        run.train_model = torch.compile(run.train_model)
    if run.info.distributed:
        run.train_model = nn.parallel.DistributedDataParallel(
            run.train_model, device_ids=[run.info.device.index] if run.info.device.type == "cuda" else None)


def _open_records(run: _Run, resumed: bool) -> None:
    """metrics.jsonl (new, or cut back to the checkpoint a resumed run starts from) and config.yaml."""
    run.metrics_path = os.path.join(run.run_dir, "metrics.jsonl")
    if not run.info.is_main:
        return
    os.makedirs(run.run_dir, exist_ok=True)
    if not resumed:
        open(run.metrics_path, "w").close()
    else:
        dropped = truncate_metrics(run.metrics_path, run.global_step, run.start_epoch)
        if dropped:
            print(f"resume: dropped {dropped} metric records written after the checkpoint", flush=True)
    # the recipe, not this invocation's one-off flags, so that a resumed run can take it as defaults
    atomic_write(os.path.join(run.run_dir, "config.yaml"), lambda p: save_yaml(p, run.cfg.recipe()))


def _save_last(run: _Run, epoch: int, step_in_epoch: int) -> None:
    """The resumable checkpoint last/: weights, optimizer, schedule, scaler, EMA, position and every rank's RNG."""
    info = run.info
    rng = gather_rng(info)
    runs = [run.running.clone() for _ in range(info.world_size)]
    if info.distributed:
        dist.all_gather_object(runs, run.running.clone())
    if info.is_main:
        save_checkpoint(os.path.join(run.run_dir, "last"), run.model, run.meta, {
            "model": unwrap_model(run.model).state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict() if run.scaler else None,
            "ema": run.ema.module.state_dict() if run.ema else None, "epoch": epoch, "step_in_epoch": step_in_epoch,
            "global_step": run.global_step, "best": run.best, "running": runs, "rng": rng,
            "batch_size": run.cfg.batch_size, "epochs": run.cfg.epochs}, timm_config=run.task.timm_config)
    barrier(info)


def base_lr(optimizer) -> float:
    """The schedule's learning rate now: a parameter group's lr without its layer-decay factor (timm's
    ``lr_scale``), the same for every group."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def _report_layer_decay(run: _Run) -> None:
    """The layer-decayed range of learning rates, once (the progress bar and the records show the base rate)."""
    scales = [g.get("lr_scale", 1.0) for g in run.optimizer.param_groups]
    if run.info.is_main and min(scales) != max(scales):
        print(f"layer decay {run.cfg.layer_decay}: {len(set(scales))} depths learn at {min(scales):.3g} to "
              f"{max(scales):.3g} x the learning rate (lr {run.cfg.lr:g}: {run.cfg.lr * min(scales):.2e} to "
              f"{run.cfg.lr * max(scales):.2e} at the peak)", flush=True)


def resume_command(run: _Run) -> str:
    """The command line that continues ``run`` from its last/."""
    import shlex

    return f"{run.task.command} --resume {shlex.quote(run.run_dir)}"


def _train_step(run: _Run, images: torch.Tensor, targets: torch.Tensor) -> float:
    """One optimizer update on one batch (the task's batch transform and loss, AMP, clipping, the schedule and the
    EMA); returns the batch's loss."""
    cfg, info = run.cfg, run.info
    images, targets = to_device(images, info.device), targets.to(info.device)
    if run.batch_transform is not None:
        images, targets = run.batch_transform(images, targets)
    if cfg.channels_last and not isinstance(images, dict):
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast(info.device, cfg.amp):
        loss = run.task.loss(run, images, targets)
    run.optimizer.zero_grad(set_to_none=True)
    run.updating = True  # from here to the end of the update the weights are not those of a whole step
    if run.scaler is not None:
        run.scaler.scale(loss).backward()
        if cfg.clip_grad:
            run.scaler.unscale_(run.optimizer)
            nn.utils.clip_grad_norm_(run.model.parameters(), cfg.clip_grad)
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        loss.backward()
        if cfg.clip_grad:
            nn.utils.clip_grad_norm_(run.model.parameters(), cfg.clip_grad)
        run.optimizer.step()
    run.global_step += 1
    run.scheduler.step_update(num_updates=run.global_step)
    if run.ema is not None:
        run.ema.update(run.model, step=run.global_step)
    run.updating = False
    loss_value = loss.item()
    run.running += torch.tensor([loss_value * len(targets), len(targets)], dtype=torch.float64)
    return loss_value


def _train_epoch(run: _Run, epoch: int, stop: StopFlag) -> Optional[Dict[str, Any]]:
    """The steps of ``epoch`` from where the run stands, with step records and progress; on a signal or at
    ``stop_after_steps`` saves last/ and returns (or raises TrainInterrupted) instead of finishing the epoch. An
    error between updates (a batch that cannot be read, a loss that cannot be computed) after this process's
    first update saves last/ too, before it propagates, so that the run can be resumed (one process only: in
    a distributed run the other ranks would wait for the failed one)."""
    from tqdm import tqdm

    cfg, info = run.cfg, run.info
    if isinstance(run.sampler, NaFlexBatches):  # batches of several sizes: the position counts batches
        run.sampler.set_position(epoch, run.start_step)
    else:
        run.sampler.set_epoch(epoch, start=run.start_step * cfg.batch_size)
    run.loader.generator.manual_seed(cfg.seed * 100_003 + epoch)
    run.train_model.train()
    run.epoch_start = time.time()
    bar = tqdm(run.loader, desc=f"epoch {epoch}", disable=not (cfg.progress and info.is_main),
               total=run.steps_per_epoch, initial=run.start_step)
    step = run.start_step
    try:
        for images, targets in bar:
            loss_value = _train_step(run, images, targets)
            step += 1
            run.steps_taken += 1
            lr = base_lr(run.optimizer)
            if step % cfg.log_interval == 0 or step == run.steps_per_epoch:
                mean_loss = all_reduce_sum(torch.tensor([loss_value], dtype=torch.float64), info).item()
                if info.is_main:
                    _append_jsonl(run.metrics_path, {"kind": "step", "epoch": epoch, "step": run.global_step,
                                                     "loss": mean_loss / info.world_size, "lr": lr})
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
            signum = all_reduce_max(stop.signum, info)  # every rank stops at the same step
            if signum or (cfg.stop_after_steps is not None and run.global_step >= cfg.stop_after_steps):
                bar.close()
                done = step == run.steps_per_epoch
                _save_last(run, epoch + 1 if done else epoch, 0 if done else step)
                if signum:
                    raise TrainInterrupted(signum, run.run_dir, resume_command(run))
                if info.is_main:
                    print(f"stopped after step {run.global_step} (--stop-after-steps {cfg.stop_after_steps}); "
                          f"checkpoint saved in {run.run_dir}/last; continue with: {resume_command(run)}",
                          flush=True)
                return {"stopped_at_step": run.global_step, "run_dir": run.run_dir}
    except TrainInterrupted:
        raise
    except Exception as e:
        bar.close()
        if run.updating or run.steps_taken == 0 or info.distributed:
            raise
        _save_last(run, epoch, step)
        message = (f"{e}; checkpoint saved in {run.run_dir}/last (epoch {epoch}, step {step}); after fixing "
                   f"the cause, continue with: {resume_command(run)}")
        # the tools print a ValueError, TypeError or FileNotFoundError in one line
        kind = next((k for k in (FileNotFoundError, ValueError, TypeError) if isinstance(e, k)), RuntimeError)
        raise kind(message) from e
    bar.close()
    run.start_step = 0
    return None


def _share_buffers(run: _Run) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, for the model and its EMA: each rank's own
    were updated by its last batch, and every rank must evaluate the weights rank 0 saves."""
    if not run.info.distributed:
        return
    for module in [run.model] + ([run.ema.module] if run.ema is not None else []):
        for buffer in unwrap_model(module).buffers():
            dist.broadcast(buffer.data, src=0)


def _end_of_epoch(run: _Run, epoch: int) -> None:
    """The epoch's record: mean training loss, the schedule's epoch step, evaluation of the weights (and of their
    EMA), the best checkpoint, then last/."""
    info = run.info
    train_loss = all_reduce_sum(run.running, info)
    run.running = torch.zeros(2, dtype=torch.float64)
    record = {"kind": "epoch", "epoch": epoch, "train_loss": (train_loss[0] / train_loss[1]).item(),
              "lr": base_lr(run.optimizer), "time_s": round(time.time() - run.epoch_start, 2)}
    run.scheduler.step(epoch + 1)
    task, score, label = run.task, run.task.score, run.task.score_label
    _share_buffers(run)
    results = {"model": task.evaluate(run, run.model)}
    if run.ema is not None:
        results["ema"] = task.evaluate(run, run.ema.module)
    for which, res in results.items():
        prefix = "val" if which == "model" else "ema_val"
        record.update({f"{prefix}_{key}": res[key] for key in task.record_keys})
    which, res = max(results.items(), key=lambda kv: kv[1][score])
    if res[score] > run.best[score]:
        run.best = {**{key: res[key] for key in task.record_keys}, "epoch": epoch, "weights": which}
        if info.is_main:
            weights = run.model if which == "model" else run.ema.module
            save_checkpoint(os.path.join(run.run_dir, "best"), weights, {**run.meta, "weights": which,
                                                                         "epoch": epoch, **res},
                            timm_config=run.task.timm_config)
    if info.is_main:
        _append_jsonl(run.metrics_path, record)
        print(f"epoch {epoch}: train loss {record['train_loss']:.4f}, val {label} {results['model'][score]:.2f}"
              + (f", EMA {label} {results['ema'][score]:.2f}" if run.ema else ""), flush=True)
    _save_last(run, epoch + 1, 0)


def _finish(run: _Run) -> Dict[str, Any]:
    """summary.json and the closing line; returns the summary."""
    best, score = run.best, run.task.score
    summary = {"run_dir": run.run_dir, **run.task.summary(run), "epochs": run.cfg.epochs,
               f"best_{score}": best[score], "best_epoch": best["epoch"], "best": best}
    if run.info.is_main:
        atomic_write_text(os.path.join(run.run_dir, "summary.json"), json.dumps(summary, indent=2))
        print(f"best {run.task.score_label} {best[score]:.2f} at epoch {best['epoch']} ({best.get('weights', 'model')} weights); "
              f"checkpoints in {run.run_dir}", flush=True)
    return summary
