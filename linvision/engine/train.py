"""Supervised image-classification training behind ``tools/train.py``.

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
import json
import os
import random
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from timm.utils import random_seed, unwrap_model
from torch import nn

from .checkpoint import load_pretrained, load_torch_file, save_checkpoint, strip_module_prefix
from .cli import add_amp_arg
from .config import parse_kwargs, save_yaml
from .data import ShardedSampler, build_transform, create_dataset, create_loader
from .distill import distillation_loss, load_teacher
from .distributed import DistInfo, all_reduce_max, all_reduce_sum, barrier, cleanup, init_distributed
from .evaluate import autocast, evaluate
from .factory import check_img_size, check_pretrained, create_model
from .files import atomic_write, atomic_write_text
from .interrupt import StopFlag, TrainInterrupted
from .run_folder import claim_run_folder

__all__ = ["add_train_args", "train", "resume_config", "TrainInterrupted"]


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every training flag; YAML configs use the same names (``img_size`` or ``img-size``)."""
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="folder",
                   help="'folder', 'digits' or a torchvision dataset on disk: 'torch/<name>' (timm's spelling, "
                        "e.g. torch/cifar10) or 'torchvision/<Name>'")
    g.add_argument("--data-dir", default=None, help="folder with train/ and val/ class sub-folders")
    g.add_argument("--img-size", type=int, default=224, help="training and validation resolution")
    g.add_argument("--workers", "-j", type=int, default=0, help="data-loading worker processes per rank")
    g.add_argument("--mean", type=float, nargs=3, default=None, help="normalisation mean (default: the model's)")
    g.add_argument("--std", type=float, nargs=3, default=None, help="normalisation std (default: the model's)")
    g.add_argument("--crop-pct", type=float, default=1.0, help="validation centre-crop fraction")
    g.add_argument("--no-aug", action="store_true", help="train on resized, centre-cropped images only")
    g.add_argument("--scale", type=float, nargs=2, default=[0.08, 1.0], help="random-resized-crop area range")
    g.add_argument("--hflip", type=float, default=0.5, help="horizontal-flip probability of training images")
    g.add_argument("--color-jitter", type=float, default=0.0,
                   help="colour-jitter strength of brightness, contrast and saturation (0: off; timm leaves it "
                        "out when --aa is given)")
    g.add_argument("--aa", default=None, help="timm auto-augment policy, e.g. rand-m9-mstd0.5")
    g.add_argument("--reprob", type=float, default=0.0, help="random-erasing probability")
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="mlla_tiny",
                   help="any timm model name, with a weight tag where it has several (linvision's are registered)")
    g.add_argument("--pretrained", action="store_true",
                   help="start from the model's trained weights, as timm's pretrained=True loads them (e.g. "
                        "mlla_tiny.in1k: downloaded once into timm's cache), with a new classifier for the data's "
                        "classes")
    g.add_argument("--model-kwargs", nargs="*", default=None,
                   help="key=value pairs or a JSON object passed to the model, e.g. token_mixers=none,linear")
    g.add_argument("--pretrained-path", "--initial-checkpoint", default=None,
                   help="local weights (safetensors, .pth/.pth.tar or checkpoint folder); the head is reset when "
                        "the number of classes differs")
    g.add_argument("--num-classes", type=int, default=None,
                   help="classes of the classifier (default: the dataset's)")
    g.add_argument("--in-chans", type=int, default=3, help="input channels the model is built for")
    g.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute activations in the backward pass (less memory, more compute)")
    g.add_argument("--channels-last", action="store_true", help="model and batches in channels_last memory format")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=10, help="training epochs (the length of the schedule)")
    g.add_argument("--batch-size", "-b", type=int, default=64, help="images per step on each rank")
    g.add_argument("--opt", default="adamw", help="timm optimizer name (e.g. adamw, sgd, lamb)")
    g.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate, reached after the warm-up (not scaled by batch size or ranks)")
    g.add_argument("--weight-decay", type=float, default=0.05, help="weight decay of the optimizer")
    g.add_argument("--momentum", type=float, default=0.9, help="momentum of the optimizers that take one (e.g. sgd)")
    g.add_argument("--layer-decay", type=float, default=None, help="layer-wise lr decay (needs group_matcher)")
    g.add_argument("--sched", default="cosine",
                   help="timm learning-rate schedule (e.g. cosine, step, poly), updated every step")
    g.add_argument("--warmup-epochs", type=float, default=0,
                   help="epochs of linear warm-up from --warmup-lr to --lr (fractions allowed; 0: none)")
    g.add_argument("--warmup-lr", type=float, default=1e-5, help="learning rate at the start of the warm-up")
    g.add_argument("--min-lr", type=float, default=1e-6, help="learning rate the schedule decays to")
    g.add_argument("--clip-grad", type=float, default=None, help="max gradient norm")
    g.add_argument("--smoothing", type=float, default=0.0, help="label smoothing")
    g.add_argument("--mixup", type=float, default=0.0, help="Mixup alpha (0: off)")
    g.add_argument("--cutmix", type=float, default=0.0, help="CutMix alpha (0: off)")
    g.add_argument("--drop-path", type=float, default=None, help="stochastic depth rate")
    g.add_argument("--distill-teacher", default=None,
                   help="checkpoint or run folder of a frozen teacher whose logits are distilled (e.g. the "
                        "softmax ViT in stage 2 of linearization)")
    g.add_argument("--distill-weight", type=float, default=0.5,
                   help="weight w of the distillation term: (1 - w) * task loss + w * T^2 * KL")
    g.add_argument("--distill-temperature", type=float, default=1.0, help="softmax temperature T of distillation")
    g.add_argument("--model-ema", action="store_true", help="keep an EMA of the weights (ModelEmaV3)")
    g.add_argument("--model-ema-decay", type=float, default=0.999, help="decay of the weight EMA (with --model-ema)")
    add_amp_arg(g)
    g = parser.add_argument_group("run")
    g.add_argument("--output", default="output", help="parent folder of run folders")
    g.add_argument("--experiment", default=None, help="run folder name (default: model name and time); a "
                   "folder that holds a run is never overwritten: the run goes to <name>-<k> instead")
    g.add_argument("--overwrite", action="store_true", help="delete the earlier run in the run folder first")
    g.add_argument("--resume", default=None,
                   help="continue a run: its folder, its last/ checkpoint or a file in it; or start from a "
                        "timm train.py checkpoint file (.pth.tar: weights, optimizer, EMA and epoch)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the initialisation, data order and augmentation")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="'auto': CUDA when available, else CPU; under torchrun each rank takes cuda:LOCAL_RANK")
    g.add_argument("--log-interval", type=int, default=10, help="steps between step records in metrics.jsonl")
    g.add_argument("--stop-after-steps", type=int, default=None,
                   help="save a resumable checkpoint and stop after this many steps in total (the schedule "
                        "still follows --epochs)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    return parser


def _rng_state() -> Dict[str, Any]:
    """Every RNG's state as tensors, ints and tuples, so train_state.pt loads with ``weights_only=True``."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                   "cached_gaussian": float(cached)}
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather_rng(info: DistInfo) -> List[Dict[str, Any]]:
    if not info.distributed:
        return [_rng_state()]
    states = [None] * info.world_size
    dist.all_gather_object(states, _rng_state())
    return states


_CHECKPOINT_FILES = ("train_state.pt", "model.safetensors", "model.json")


def _is_external_checkpoint(path: str) -> bool:
    """A file that is not part of a linvision checkpoint folder: a timm train.py checkpoint (.pth.tar)."""
    return os.path.isfile(path) and os.path.basename(path) not in _CHECKPOINT_FILES


def _resume_folder(path: str) -> str:
    folder = os.path.abspath(path)
    if os.path.isfile(folder):  # a file of a checkpoint folder (last/train_state.pt, ...)
        folder = os.path.dirname(folder)
    return os.path.dirname(folder) if os.path.basename(folder) in ("last", "best") else folder


def resume_config(path: str) -> Optional[str]:
    """The saved config.yaml of the run that ``path`` (a run folder, its last/, or a file in it) belongs to;
    None for a timm checkpoint file, whose recipe comes from the command line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"resume: not found: {path}")
    if _is_external_checkpoint(path):
        return None
    config = os.path.join(_resume_folder(path), "config.yaml")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"resume: no config.yaml in the run folder of {path}")
    return config


def _read_timm_checkpoint(path: str) -> Dict[str, Any]:
    """Weights, optimizer, EMA, scaler and the epoch to start from, out of a checkpoint written by timm's
    train.py (``{"epoch", "arch", "state_dict", "optimizer", "version", "args", ...}``). Nothing is unpickled
    beyond tensors, containers and the argparse.Namespace timm stores its arguments in."""
    ckpt = load_torch_file(path, "resume")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ValueError(f"resume: {path} holds no 'state_dict' (not a timm training checkpoint); give weights "
                         f"alone with --initial-checkpoint, or a linvision run folder")
    epoch = int(ckpt.get("epoch", -1))
    # timm's checkpoints from version 2 on store the epoch just finished
    start = epoch + 1 if int(ckpt.get("version", 1)) > 1 else max(epoch, 0)
    ema = ckpt.get("state_dict_ema")
    return {"model": strip_module_prefix(ckpt["state_dict"]), "optimizer": ckpt.get("optimizer"),
            "ema": strip_module_prefix(ema) if isinstance(ema, dict) else None, "scaler": ckpt.get("amp_scaler"),
            "start_epoch": start}


def _run_folder(args) -> str:
    if args.resume and not _is_external_checkpoint(args.resume):
        return _resume_folder(args.resume)
    name = args.experiment or f"{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    return os.path.join(args.output, name)


def _load_timm_checkpoint(external: Dict[str, Any], args, model, optimizer, ema, scaler) -> int:
    """Load what a timm checkpoint holds into the new run's objects; returns the epoch to start at."""
    def load(target, sd, what):
        try:
            target.load_state_dict(sd)
        except (RuntimeError, ValueError, KeyError) as e:
            reason = str(e).strip().splitlines()[0][:300]
            raise ValueError(f"resume: the {what} in {args.resume} does not fit {args.model} ({reason})") from None

    load(unwrap_model(model), external["model"], "weights")
    if external["optimizer"]:
        load(optimizer, external["optimizer"], "optimizer state")
    if ema is not None and external["ema"]:
        load(ema.module, external["ema"], "EMA weights")
    if scaler is not None and external["scaler"]:
        load(scaler, external["scaler"], "loss-scaler state")
    start = external["start_epoch"]
    if start >= args.epochs:
        raise ValueError(f"epochs: {args.resume} has finished {start} epochs; give --epochs above {start}")
    return start


def _check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag (and YAML key) of the first value the recipe cannot use."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{key}: {what}, got {getattr(args, key)!r}")

    for key in ("epochs", "batch_size", "log_interval", "img_size", "in_chans"):
        need(isinstance(getattr(args, key), int) and getattr(args, key) >= 1, key, "must be an integer >= 1")
    need(args.workers >= 0, "workers", "must be >= 0")
    need(args.lr > 0, "lr", "must be > 0")
    for key in ("weight_decay", "warmup_epochs", "warmup_lr", "min_lr", "mixup", "cutmix", "color_jitter"):
        need(getattr(args, key) >= 0, key, "must be >= 0")
    for key in ("hflip", "reprob"):
        need(0 <= getattr(args, key) <= 1, key, "must be within [0, 1]")
    need(0 <= args.smoothing < 1, "smoothing", "must be within [0, 1)")
    need(0 < args.model_ema_decay < 1, "model_ema_decay", "must be within (0, 1)")
    need(0 < args.crop_pct <= 1, "crop_pct", "must be within (0, 1]")
    need(len(args.scale) == 2 and 0 < args.scale[0] <= args.scale[1] <= 1, "scale", "must be 0 < min <= max <= 1")
    need(args.num_classes is None or args.num_classes >= 2, "num_classes", "must be >= 2")
    need(args.clip_grad is None or args.clip_grad > 0, "clip_grad", "must be > 0")
    need(args.layer_decay is None or 0 < args.layer_decay <= 1, "layer_decay", "must be within (0, 1]")
    need(args.drop_path is None or 0 <= args.drop_path < 1, "drop_path", "must be within [0, 1)")
    need(args.stop_after_steps is None or args.stop_after_steps >= 1, "stop_after_steps", "must be >= 1")
    need(0 <= args.distill_weight <= 1, "distill_weight", "must be within [0, 1]")
    need(args.distill_temperature > 0, "distill_temperature", "must be > 0")
    if args.pretrained and args.pretrained_path:
        raise ValueError("pretrained: give --pretrained (the model's own weights through timm's cache) or "
                         "--pretrained-path FILE (a local file), not both")
    if args.pretrained and not parse_kwargs(args.model_kwargs).get("pretrained_cfg_overlay"):
        check_pretrained(args.model)  # before the run folder or the data are touched


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


def _truncate_metrics(path: str, global_step: int, start_epoch: int) -> int:
    """Drop the records an interrupted run wrote after its checkpoint (steps after ``global_step``, epochs from
    ``start_epoch`` on), so a resumed run does not log them twice; returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if (record.get("kind") == "step" and record.get("step", 0) <= global_step) or \
                (record.get("kind") == "epoch" and record.get("epoch", 0) < start_epoch):
            keep.append(json.dumps(record) + "\n")
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(keep))
    return len(lines) - len(keep)


def _report_load(report: Dict[str, list], path: str, model: nn.Module) -> None:
    """Print what a weight load (:func:`load_pretrained`) did."""
    total = len(model.state_dict())
    missing, unexpected, skipped = report["missing"], report["unexpected"], report["skipped"]
    loaded = total - len(missing) - len(skipped)

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


def _append_jsonl(path: str, record: Dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """Run training as ``args`` (from :func:`add_train_args`) says; returns the summary it also writes.

    Writes into the run folder: config.yaml, metrics.jsonl (step and epoch records), summary.json, and the
    checkpoints ``last/`` and ``best/`` (rank 0 only). Raises TrainInterrupted after saving when SIGINT or
    SIGTERM arrived; ValueError / FileNotFoundError for bad arguments and missing data.
    """
    info = init_distributed(args.device)
    try:
        result = _train(args, info)
        barrier(info)
        return result
    finally:
        cleanup(info)


def _train(args: argparse.Namespace, info: DistInfo) -> Dict[str, Any]:
    _check_args(args)
    resuming_run = bool(args.resume) and not _is_external_checkpoint(args.resume)
    run_dir, folder = _run_folder(args), None
    if info.is_main:  # one process owns the folder; the others write nothing there
        folder = claim_run_folder(run_dir, resume=resuming_run, overwrite=args.overwrite)
        run_dir = folder.path
        for note in folder.notes:
            print(note, flush=True)
    if info.distributed:
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)
        run_dir = shared[0]
    try:
        return _train_in_folder(args, info, run_dir, resuming_run)
    finally:
        if folder is not None:
            folder.release()


def _train_in_folder(args: argparse.Namespace, info: DistInfo, run_dir: str, resuming_run: bool) -> Dict[str, Any]:
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3
    from tqdm import tqdm

    state = external = None
    if args.resume and not resuming_run:
        external = _read_timm_checkpoint(args.resume)
    elif args.resume:
        state_path = os.path.join(run_dir, "last", "train_state.pt")
        if not os.path.isfile(state_path):
            raise FileNotFoundError(f"resume: no last/train_state.pt in {run_dir}")
        state = load_torch_file(state_path, "resume")

    # same seed on every rank for the model's initialisation (the EMA copy is taken before DDP broadcasts)
    random_seed(args.seed)
    train_set = create_dataset(args.dataset, args.data_dir, "train", digits_size=args.img_size)
    val_set = create_dataset(args.dataset, args.data_dir, "val", digits_size=args.img_size)
    classes = _check_classes(train_set, val_set, args.num_classes)
    num_classes = args.num_classes or len(classes)
    if not num_classes:
        raise ValueError("num_classes: the dataset does not list its classes; give --num-classes")
    model_kwargs = parse_kwargs(args.model_kwargs)
    if args.drop_path is not None:
        model_kwargs["drop_path_rate"] = args.drop_path
    # a resumed run takes every weight from its checkpoint: nothing is downloaded or read again
    fresh = not (state or external)
    download = args.pretrained and fresh
    if download and not info.is_main:
        barrier(info)  # rank 0 fills timm's cache first; the others read the file it wrote
    model = create_model(args.model, num_classes=num_classes, in_chans=args.in_chans, model_kwargs=model_kwargs,
                         img_size=args.img_size, pretrained=download)
    if download and info.is_main:
        barrier(info)
    if args.pretrained and fresh and info.is_main:
        _report_pretrained(model, num_classes)
    if args.pretrained_path and fresh:
        report = load_pretrained(model, args.pretrained_path)
        if info.is_main:
            _report_load(report, args.pretrained_path, model)
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    mean = list(args.mean or cfg.get("mean", (0.485, 0.456, 0.406)))
    std = list(args.std or cfg.get("std", (0.229, 0.224, 0.225)))
    train_set.transform = build_transform(args.img_size, True, mean, std, scale=args.scale, hflip=args.hflip,
                                          color_jitter=args.color_jitter, auto_augment=args.aa,
                                          re_prob=args.reprob, no_aug=args.no_aug)
    val_set.transform = build_transform(args.img_size, False, mean, std, crop_pct=args.crop_pct)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(info.device)
    check_img_size(model, args.img_size, args.in_chans)  # one line now rather than a traceback at step 1
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    meta = {"model": args.model, "num_classes": num_classes, "in_chans": args.in_chans,
            "model_kwargs": model_kwargs, "img_size": args.img_size, "mean": mean, "std": std,
            "crop_pct": args.crop_pct, "classes": classes, "dataset": args.dataset}

    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum, layer_decay=args.layer_decay)
    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                      num_classes=num_classes)
        criterion = SoftTargetCrossEntropy()
    elif args.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(args.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    ema = ModelEmaV3(model, decay=args.model_ema_decay) if args.model_ema else None
    teacher = (load_teacher(args.distill_teacher, num_classes, args.img_size, info.device)
               if args.distill_teacher else None)
    scaler = torch.amp.GradScaler(info.device.type) if args.amp == "fp16" else None

    sampler = ShardedSampler(len(train_set), info.rank, info.world_size, shuffle=True, seed=args.seed)
    # a loader-owned generator keeps the loader from drawing on the global RNG (exact resumption)
    # a last batch of one sample would break BatchNorm in training mode: drop it (it returns next epoch)
    drop_last = mixup is not None or len(sampler) % args.batch_size == 1
    loader = create_loader(train_set, args.batch_size, sampler, args.workers, drop_last=drop_last,
                           pin_memory=info.device.type == "cuda", generator=torch.Generator())
    val_loader = create_loader(val_set, args.batch_size, ShardedSampler(len(val_set), info.rank, info.world_size,
                                                                        shuffle=False), args.workers)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ValueError(f"batch_size: {args.batch_size} leaves no full batch of {len(sampler)} training images "
                         f"per rank")
    scheduler, _ = create_scheduler_v2(optimizer, sched=args.sched, num_epochs=args.epochs,
                                       warmup_epochs=args.warmup_epochs, warmup_lr=args.warmup_lr,
                                       min_lr=args.min_lr, step_on_epochs=False, updates_per_epoch=steps_per_epoch)

    start_epoch, start_step, global_step, best = 0, 0, 0, {"top1": -1.0, "epoch": -1}
    running = torch.zeros(2, dtype=torch.float64)  # loss sum, sample count of the epoch so far (this rank)
    if state:
        saved_batch = state.get("batch_size", args.batch_size)
        if saved_batch != args.batch_size:
            raise ValueError(f"batch_size: the run trained with {saved_batch} per rank; resuming with "
                             f"{args.batch_size} would misplace the data order and the schedule (start a new run "
                             f"from its weights with --initial-checkpoint instead)")
        unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        saved_epochs = state.get("epochs", args.epochs)
        if saved_epochs == args.epochs:
            scheduler.load_state_dict(state["scheduler"])
        else:  # a new length: the schedule is rebuilt for it and continues from the current update
            scheduler.step_update(num_updates=state["global_step"])
            if info.is_main:
                print(f"resume: schedule extended from {saved_epochs} to {args.epochs} epochs", flush=True)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema"):
            ema.module.load_state_dict(state["ema"])
        start_epoch, start_step, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        best, running = state["best"], state["running"][info.rank]
        if len(state["rng"]) != info.world_size:
            raise ValueError(f"resume: the checkpoint was written by {len(state['rng'])} processes, this run has "
                             f"{info.world_size}")
        _set_rng_state(state["rng"][info.rank])
        if info.is_main:
            print(f"resume: {run_dir}/last at epoch {start_epoch}, step {start_step} of {steps_per_epoch} "
                  f"(update {global_step}), best top-1 so far {best['top1']:.2f}", flush=True)
    else:
        random_seed(args.seed, info.rank)
    if external:
        start_epoch = _load_timm_checkpoint(external, args, model, optimizer, ema, scaler)
        global_step = start_epoch * steps_per_epoch
        scheduler.step_update(num_updates=global_step)
        if info.is_main:
            print(f"starting at epoch {start_epoch} from {args.resume}", flush=True)

    train_model = model
    if args.compile:
        train_model = torch.compile(train_model)
    if info.distributed:
        train_model = nn.parallel.DistributedDataParallel(
            train_model, device_ids=[info.device.index] if info.device.type == "cuda" else None)

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if info.is_main:
        os.makedirs(run_dir, exist_ok=True)
        if not state:
            open(metrics_path, "w").close()
        else:
            dropped = _truncate_metrics(metrics_path, global_step, start_epoch)
            if dropped:
                print(f"resume: dropped {dropped} metric records written after the checkpoint", flush=True)
        # the recipe, not this invocation's one-off flags, so that a resumed run can take it as defaults
        recipe = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "stop_after_steps",
                                                                   "overwrite")}
        atomic_write(os.path.join(run_dir, "config.yaml"), lambda p: save_yaml(p, recipe))

    def save_last(epoch: int, step_in_epoch: int) -> None:
        rng = _gather_rng(info)
        runs = [running.clone() for _ in range(info.world_size)]
        if info.distributed:
            dist.all_gather_object(runs, running.clone())
        if info.is_main:
            save_checkpoint(os.path.join(run_dir, "last"), model, meta, {
                "model": unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None,
                "ema": ema.module.state_dict() if ema else None, "epoch": epoch, "step_in_epoch": step_in_epoch,
                "global_step": global_step, "best": best, "running": runs, "rng": rng,
                "batch_size": args.batch_size, "epochs": args.epochs})
        barrier(info)

    with StopFlag() as stop:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch, start=start_step * args.batch_size)
            loader.generator.manual_seed(args.seed * 100_003 + epoch)
            train_model.train()
            t0 = time.time()
            bar = tqdm(loader, desc=f"epoch {epoch}", disable=not (args.progress and info.is_main),
                       total=steps_per_epoch, initial=start_step)
            step = start_step
            for images, targets in bar:
                images, targets = images.to(info.device), targets.to(info.device)
                if mixup is not None:
                    images, targets = mixup(images, targets)
                if args.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                with autocast(info.device, args.amp):
                    logits = train_model(images)
                    loss = criterion(logits, targets)
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_logits = teacher(images)
                        loss = distillation_loss(logits, teacher_logits, loss, args.distill_weight,
                                                 args.distill_temperature)
                optimizer.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    if args.clip_grad:
                        scaler.unscale_(optimizer)
                        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    if args.clip_grad:
                        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                    optimizer.step()
                step += 1
                global_step += 1
                scheduler.step_update(num_updates=global_step)
                if ema is not None:
                    ema.update(model, step=global_step)
                loss_value = loss.item()
                running += torch.tensor([loss_value * len(images), len(images)], dtype=torch.float64)
                lr = optimizer.param_groups[0]["lr"]
                if step % args.log_interval == 0 or step == steps_per_epoch:
                    mean_loss = all_reduce_sum(torch.tensor([loss_value], dtype=torch.float64), info).item()
                    if info.is_main:
                        _append_jsonl(metrics_path, {"kind": "step", "epoch": epoch, "step": global_step,
                                                     "loss": mean_loss / info.world_size, "lr": lr})
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                signum = all_reduce_max(stop.signum, info)  # every rank stops at the same step
                if signum or (args.stop_after_steps is not None and global_step >= args.stop_after_steps):
                    bar.close()
                    done = step == steps_per_epoch
                    save_last(epoch + 1 if done else epoch, 0 if done else step)
                    if signum:
                        raise TrainInterrupted(signum, run_dir)
                    return {"stopped_at_step": global_step, "run_dir": run_dir}
            bar.close()
            start_step = 0
            train_loss = all_reduce_sum(running, info)
            running = torch.zeros(2, dtype=torch.float64)
            record = {"kind": "epoch", "epoch": epoch, "train_loss": (train_loss[0] / train_loss[1]).item(),
                      "lr": optimizer.param_groups[0]["lr"], "time_s": round(time.time() - t0, 2)}
            scheduler.step(epoch + 1)
            results = {"model": evaluate(model, val_loader, info, args.amp, args.channels_last, args.progress)}
            if ema is not None:
                results["ema"] = evaluate(ema.module, val_loader, info, args.amp, args.channels_last, args.progress)
            for which, res in results.items():
                prefix = "val" if which == "model" else "ema_val"
                record.update({f"{prefix}_top1": res["top1"], f"{prefix}_top5": res["top5"],
                               f"{prefix}_loss": res["loss"]})
            which, res = max(results.items(), key=lambda kv: kv[1]["top1"])
            if res["top1"] > best["top1"]:
                best = {"top1": res["top1"], "top5": res["top5"], "loss": res["loss"], "epoch": epoch,
                        "weights": which}
                if info.is_main:
                    weights = model if which == "model" else ema.module
                    save_checkpoint(os.path.join(run_dir, "best"), weights, {**meta, "weights": which,
                                                                             "epoch": epoch, **res})
            if info.is_main:
                _append_jsonl(metrics_path, record)
                print(f"epoch {epoch}: train loss {record['train_loss']:.4f}, val top-1 "
                      f"{results['model']['top1']:.2f}" + (f", EMA top-1 {results['ema']['top1']:.2f}" if ema
                                                            else ""), flush=True)
            save_last(epoch + 1, 0)

    summary = {"run_dir": run_dir, "model": args.model, "num_classes": num_classes, "epochs": args.epochs, "best_top1": best["top1"],
               "best_epoch": best["epoch"], "best": best}
    if info.is_main:
        atomic_write_text(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2))
        print(f"best top-1 {best['top1']:.2f} at epoch {best['epoch']} ({best.get('weights', 'model')} weights); "
              f"checkpoints in {run_dir}", flush=True)
    return summary
