"""Training of :class:`LinDiT` with rectified flow: the recipe and the loop the tools call, on linvision.utils'
and timm's parts: ``timm.optim.create_optimizer_v2`` (AdamW; the model's ``no_weight_decay()`` keeps the modulation
tables undecayed), ``timm.utils.ModelEmaV3`` (decay warmed up as min(ema_decay, (k + 1) / (k + 10)) at update
k), torch's ``LambdaLR`` (linear warm-up, cosine to 10%) and the shared checkpoint folder
(:mod:`linvision.diffusion.checkpoint`; the train state is read with ``weights_only=True``). Data comes from
:mod:`linvision.diffusion.data`.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3
from torch import Tensor, nn

from linvision.utils.checkpoint import load_torch_file
from linvision.utils.distributed import (
    DistInfo,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    cleanup,
    init_distributed,
)
from linvision.utils.files import recover_checkpoint_folder
from linvision.utils.interrupt import StopFlag, TrainInterrupted

from .checkpoint import load_train_state, optimizer_state, save_dit_checkpoint, save_sharded_dit_checkpoint
from .data import CaptionEmbeddings, ImageSet
from .flow import flow_matching_loss, flow_noise
from .latent_cache import LatentCache, build_latent_cache
from .model import DIT_CONFIGS, DiTConfig, LinDiT
from .parallel import parallelize

__all__ = ["DiffusionTrainConfig", "train_dit", "lr_factor", "create_ema", "ema_step", "optimizer_step"]


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A recipe field with its command-line help (the tool builds its flags from these fields)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class DiffusionTrainConfig:
    """The recipe of :func:`train_dit`; linvision-train-diffusion (linvision/tools/diffusion.py) derives its flags
    from these fields."""

    model: Union[str, Dict[str, Any]] = _opt("digits", f"base model config ({', '.join(DIT_CONFIGS)}) or a dict "
                                                       f"of DiTConfig fields")
    model_kwargs: Dict[str, Any] = _opt({}, "overrides of the model config as key=value pairs or a JSON object, "
                                            "e.g. depth=6")
    dataset: str = _opt("digits", "'digits' (offline) or 'folder' (<data-dir>/<class>/*)")
    data_dir: Optional[str] = _opt(None, "the image folder of dataset 'folder'")
    steps: int = _opt(2000, "optimizer steps")
    max_minutes: Optional[float] = _opt(None, "stop after this much training time")
    batch_size: int = _opt(64, "images per optimizer step over all ranks (each of N torchrun ranks takes "
                                "batch_size / N of them, so a run takes the same steps at any world size)")
    lr: float = _opt(1e-3, "peak learning rate")
    weight_decay: float = _opt(0.0, "AdamW weight decay (not on biases, norms and modulation tables)")
    warmup_steps: int = _opt(100, "linear warm-up steps before the cosine decay to 10%")
    grad_clip: float = _opt(1.0, "gradient-norm clip (0: none)")
    ema_decay: float = _opt(0.999, "decay of the weights' EMA (warmed up: min(decay, (k + 1) / (k + 10)))")
    class_dropout: float = _opt(0.1, "probability of the null class during training (for classifier-free "
                                     "guidance)")
    autoencoder: Optional[str] = _opt(None, "a local diffusers autoencoder folder (AutoencoderDC or AutoencoderKL): "
                                            "train on its latents of the images, encoded once and cached in the "
                                            "run folder; the model's img_size and in_chans are the latents'")
    encode_batch_size: int = _opt(32, "images per autoencoder call when encoding the latents")
    cache_latents: bool = _opt(True, "encode the latents once into a cache (latent_cache) and train on it; off: "
                                     "encode each batch when it is drawn (no cache, images read from disk per step)")
    latent_cache: Optional[str] = _opt(None, "folder of the latent cache (default <run>/latents): later runs that "
                                             "name it with the same autoencoder, data and size reuse it; a run "
                                             "killed while encoding keeps the shards it finished")
    cache_shard_size: int = _opt(1024, "images per file of the latent cache")
    captions: Optional[str] = _opt(None, "a safetensors file of caption embeddings, one per training image in the "
                                         "dataset's order: 'context' (N, L, caption_channels) and 'mask' (N, L); "
                                         "for a caption model (num_classes 0, caption_channels > 0)")
    init_from: Optional[str] = _opt(None, "a local diffusers SanaTransformer2DModel folder whose config and weights "
                                          "start the run (fine-tuning; model is then ignored, model_kwargs may set "
                                          "options such as eps=1e-15 eps_form=sum)")
    parallel: str = _opt("ddp", "under torchrun: 'ddp' (each rank holds the model, gradients averaged) or 'fsdp' "
                                "(FSDP2: weights, gradients and optimizer states sharded over the ranks, each block "
                                "gathered only while it runs; checkpoints through torch.distributed.checkpoint)")
    fsdp_param_dtype: str = _opt("bf16", "dtype an fsdp run computes in (bf16, fp16, fp32); its sharded weights "
                                         "and optimizer states stay fp32 and gradients are reduced in fp32")
    grad_checkpointing: bool = _opt(False, "recompute each block's activations in the backward (less memory, "
                                           "about a third more compute)")
    seed: int = _opt(0, "seed of the initialisation, the data order and the noise")
    log_every: int = _opt(50, "log the mean loss every this many steps")
    save_every: int = _opt(500, "checkpoint every this many steps (0: only at the end)")

    def model_config(self) -> DiTConfig:
        """The DiTConfig of ``model`` (a name of DIT_CONFIGS or a dict), or of the ``init_from`` folder, with
        ``model_kwargs`` applied; ValueError naming an unknown config or key."""
        if self.init_from is not None:
            from .sana import diffusers_folder_config

            base = diffusers_folder_config(self.init_from).to_dict()
        elif isinstance(self.model, str):
            if self.model not in DIT_CONFIGS:
                raise ValueError(f"model: unknown {self.model!r}; allowed: {', '.join(DIT_CONFIGS)}")
            base = DIT_CONFIGS[self.model].to_dict()
        else:
            base = dict(self.model)
        return DiTConfig.from_dict({**base, **(self.model_kwargs or {})})

    def check(self) -> None:
        """ValueError naming the first field whose value training cannot use."""
        def need(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{key}: {what}, got {getattr(self, key)!r}")

        for key in ("steps", "batch_size", "log_every", "encode_batch_size", "cache_shard_size"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, key, "must be an integer >= 1")
        for key in ("save_every", "warmup_steps"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 0, key, "must be an integer >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        need(self.weight_decay >= 0 and self.grad_clip >= 0, "weight_decay" if self.weight_decay < 0 else
             "grad_clip", "must be >= 0")
        need(0 < self.ema_decay < 1, "ema_decay", "must be within (0, 1)")
        need(0 <= self.class_dropout < 1, "class_dropout", "must be within [0, 1)")
        need(self.max_minutes is None or self.max_minutes > 0, "max_minutes", "must be > 0")
        from .parallel import PARALLEL_MODES, PARAM_DTYPES

        need(self.parallel in PARALLEL_MODES, "parallel", f"must be one of {', '.join(PARALLEL_MODES)}")
        need(self.fsdp_param_dtype in PARAM_DTYPES, "fsdp_param_dtype", f"must be one of {', '.join(PARAM_DTYPES)}")
        self.model_config()

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def lr_factor(step: int, cfg: DiffusionTrainConfig) -> float:
    """The learning rate of ``step`` over ``cfg.lr``: linear warm-up, then cosine decay to 10% over
    ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class _TrainingData:
    """What the model learns to generate: ``inputs(indices)`` -> (len, C, H, W) fp32 (images, cached latents or
    latents encoded on the spot), with the labels and class names of all N images."""

    inputs: Callable[[Tensor], Tensor]
    labels: Tensor
    classes: List[str]


def _training_data(cfg: DiffusionTrainConfig, model_cfg: DiTConfig, out_dir: str, info: DistInfo,
                   log: Callable[[str], None]) -> _TrainingData:
    """The images themselves, or with ``cfg.autoencoder`` their latents: from the latent cache (built or
    completed here by all ranks, :mod:`linvision.diffusion.latent_cache`) or, without ``cache_latents``,
    encoded per batch."""
    if cfg.autoencoder is None:
        data = ImageSet(cfg.dataset, model_cfg.img_size, model_cfg.in_chans, cfg.data_dir)
        data.preload()  # up to 1 GiB of images decoded once, a larger folder image by image
        return _TrainingData(data.images, data.labels, data.classes)
    from .latents import autoencoder_geometry, encode_images, load_autoencoder

    ae = load_autoencoder(cfg.autoencoder, str(info.device))
    img_chans, latent_chans, factor = autoencoder_geometry(ae)
    if model_cfg.in_chans != latent_chans:
        raise ValueError(f"model.in_chans: {model_cfg.in_chans}, but the autoencoder's latents have {latent_chans} "
                         f"channels")
    size = model_cfg.img_size * factor
    data = ImageSet(cfg.dataset, size, 1 if cfg.dataset == "digits" else img_chans, cfg.data_dir)

    def encode(x: Tensor) -> Tensor:
        # grey digits for an RGB autoencoder
        return encode_images(ae, x.expand(-1, img_chans, -1, -1), cfg.encode_batch_size)

    if not cfg.cache_latents:
        data.preload()
        return _TrainingData(lambda idx: encode(data.images(idx)), data.labels, data.classes)
    folder = cfg.latent_cache or os.path.join(out_dir, "latents")
    source = {"autoencoder": os.path.abspath(cfg.autoencoder), "dataset": cfg.dataset,
              "data_dir": cfg.data_dir and os.path.abspath(cfg.data_dir), "image_size": size}
    build_latent_cache(folder, source, len(data), data.images, encode, cfg.cache_shard_size, info, log)
    cache = LatentCache(folder)
    return _TrainingData(cache.latents, data.labels, data.classes)


def _captions(cfg: DiffusionTrainConfig, model_cfg: DiTConfig, count: int) -> Optional[CaptionEmbeddings]:
    """The caption embeddings of ``cfg.captions``, checked against the model and the data; None for a
    class-conditional run. ValueError naming the file or the field."""
    if (cfg.captions is None) != (model_cfg.caption_channels <= 0):
        raise ValueError("captions: a caption model (caption_channels > 0) needs a captions file, a "
                         "class-conditional one takes none")
    return None if cfg.captions is None else CaptionEmbeddings(cfg.captions, count, model_cfg.caption_channels)


def create_ema(model: nn.Module, decay: float) -> ModelEmaV3:
    """timm's EMA of ``model`` whose decay at update k (0-based, given as ``step=ema_step(k)``) is
    min(decay, (k + 1) / (k + 10)): short runs would otherwise keep the EMA near the random init."""
    return ModelEmaV3(model, decay=decay, use_warmup=True, warmup_gamma=9.0, warmup_power=1.0)


def ema_step(k: int) -> int:
    """timm counts from 1 and warms up as 1 - (1 + s / gamma)^-power with s = step - 1; with gamma 9, power 1
    and step k + 2 that is (k + 1) / (k + 10)."""
    return k + 2


def optimizer_step(loss: Tensor, model: nn.Module, opt: torch.optim.Optimizer, ema: ModelEmaV3, k: int,
                   grad_clip: float) -> None:
    """The update of step ``k`` (0-based) from ``loss``: backward, the gradient norm clipped to ``grad_clip``
    (0: not clipped), the optimizer step, the EMA update."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    # Short runs would keep the EMA near the random init with a fixed 0.999: the decay is warmed up.
    ema.update(model, step=ema_step(k))


def train_dit(cfg: DiffusionTrainConfig, out_dir: str, resume: bool = False, stop_after: Optional[int] = None,
              log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Train on CPU or the current CUDA device, or on every rank of a torchrun job (``cfg.parallel``: DDP or
    FSDP2); checkpoints to ``out_dir/last``. With ``resume`` the run continues from ``out_dir/last`` (same
    batches, noise and schedule as an uninterrupted run; a sharded checkpoint resumes at any world size).
    ``stop_after`` ends the run (with a checkpoint) at that step, as an interruption would. SIGINT/SIGTERM
    save a checkpoint at the current step and raise TrainInterrupted.

    Every rank draws the same global batch of indices and noise and takes its slice of it, so N ranks with
    ``batch_size`` / N images each take the steps one process takes with ``batch_size``. Only rank 0 logs.

    Returns {"step", "losses" (the logged means over all ranks), "elapsed_s"}. Stops at ``cfg.steps`` or after
    ``cfg.max_minutes`` of training, whichever comes first (a checkpoint is written either way).
    """
    cfg.check()
    info = init_distributed("auto", group=cfg.parallel == "fsdp")
    try:
        result = _train(cfg, out_dir, resume, stop_after, log if info.is_main else (lambda s: None), info)
        barrier(info)
        return result
    finally:
        if info.owns_group:
            cleanup(info)


def _train(cfg: DiffusionTrainConfig, out_dir: str, resume: bool, stop_after: Optional[int],
           log: Callable[[str], None], info: DistInfo) -> Dict[str, Any]:
    """The run, step by step: the parts, the state it resumes from, then the steps until ``cfg.steps``,
    ``stop_after``, the time budget or a signal, and the last checkpoint; each step is one function below."""
    run = _set_up(cfg, out_dir, resume, log, info)
    if resume:
        _restore(run)
    _report(run)
    run.start = time.perf_counter()
    run.model.train()
    with StopFlag() as stop:
        while run.step < (cfg.steps if stop_after is None else min(cfg.steps, stop_after)):
            if _out_of_time(run):
                break
            loss, lr = _train_step(run)
            run.window += torch.tensor([loss, 1.0], dtype=torch.float64)
            if run.step % cfg.log_every == 0 or run.step == cfg.steps:
                _log_losses(run, lr)
            _checkpoint_when_due(run, stop)
    if not (cfg.save_every and run.step % cfg.save_every == 0 and run.step > 0):  # else just saved
        _save(run)
    return {"step": run.step, "losses": run.losses, "elapsed_s": time.perf_counter() - run.start}


@dataclass
class _Run:
    """What one run of :func:`train_dit` holds while it runs: its parts (built by :func:`_set_up`) and its
    position."""

    cfg: DiffusionTrainConfig
    info: DistInfo
    log: Callable[[str], None]
    last: str  # the checkpoint folder, out_dir/last
    per_rank: int  # images of each step on this rank
    data: _TrainingData
    captions: Optional[CaptionEmbeddings]
    model: LinDiT
    ema: ModelEmaV3
    step_model: nn.Module  # the model as it runs the steps (DDP- or FSDP-wrapped)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    data_gen: torch.Generator  # the batches' indices, the same on every rank
    noise_gen: torch.Generator  # the batches' noise, the same on every rank
    meta: Dict[str, Any]  # of every checkpoint: the data and the parallel mode
    step: int = 0
    start: float = 0.0  # perf_counter() when the steps began
    losses: List[float] = field(default_factory=list)  # the logged means over all ranks
    # this rank's loss sum and step count since the last log line (summed over the ranks when logged)
    window: Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))

    @property
    def rows(self) -> slice:
        """This rank's rows of each global batch."""
        return slice(self.info.rank * self.per_rank, (self.info.rank + 1) * self.per_rank)


def _set_up(cfg: DiffusionTrainConfig, out_dir: str, resume: bool, log: Callable[[str], None],
            info: DistInfo) -> _Run:
    """This rank's share of the batch, the data (and captions), the model (from ``cfg.init_from`` when not
    resuming), its EMA and parallel wrapper, the optimizer, the schedule and the generators of the batches and
    the noise. ValueError when the batch does not split over the ranks or the classes do not fit the model."""
    if cfg.batch_size % info.world_size:
        raise ValueError(f"batch_size: {cfg.batch_size} images per step do not split over {info.world_size} ranks")
    model_cfg = cfg.model_config()
    data = _training_data(cfg, model_cfg, out_dir, info, log)
    captions = _captions(cfg, model_cfg, len(data.labels))
    if captions is None and len(data.classes) != model_cfg.num_classes:
        raise ValueError(f"model.num_classes: {model_cfg.num_classes}, but the data has {len(data.classes)} classes")
    torch.manual_seed(cfg.seed)
    model = LinDiT(model_cfg)
    if cfg.init_from is not None and not resume:
        from .sana import load_diffusers_weights

        load_diffusers_weights(model, cfg.init_from)
        log(f"weights from {cfg.init_from}")
    model.set_grad_checkpointing(cfg.grad_checkpointing)
    ema = create_ema(model, cfg.ema_decay)
    step_model = parallelize(model, ema.module, cfg.parallel, info, cfg.fsdp_param_dtype)
    opt = create_optimizer_v2(model, opt="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, cfg))
    meta = {"data": {"dataset": cfg.dataset, "classes": data.classes, "value_range": [-1.0, 1.0],
                     "autoencoder": cfg.autoencoder and os.path.abspath(cfg.autoencoder),
                     "captions": cfg.captions and os.path.abspath(cfg.captions)},
            "parallel": {"mode": cfg.parallel, "world_size": info.world_size}}
    return _Run(cfg, info, log, os.path.join(out_dir, "last"), cfg.batch_size // info.world_size, data, captions,
                model, ema, step_model, opt, sched, data_gen=torch.Generator().manual_seed(cfg.seed),
                noise_gen=torch.Generator(device=info.device).manual_seed(cfg.seed + 1), meta=meta)


def _restore(run: _Run) -> None:
    """The weights, EMA, optimizer, schedule, generators and step of ``run.last`` (a folder an interrupted save
    left half-written recovered first). ValueError when its noise generator was on another kind of device."""
    info, last = run.info, run.last
    if info.is_main:
        recover_checkpoint_folder(last)
    barrier(info)
    state = load_torch_file(os.path.join(last, "train_state.pt"), "resume")
    load_train_state(last, run.step_model, run.ema.module, run.opt, state)
    run.sched.load_state_dict(state["scheduler"])
    run.data_gen.set_state(state["data_gen"])
    try:
        run.noise_gen.set_state(state["noise_gen"])
    except RuntimeError:  # a CUDA generator's state does not fit a CPU one, and the other way round
        raise ValueError(f"resume: {last} was trained with its noise on another kind of device than this "
                         f"run's {info.device.type}; resume it on the same kind") from None
    run.step = state["step"]
    run.log(f"resumed from {last} at step {run.step}")


def _report(run: _Run) -> None:
    """The run's line in the log: the model's size, the data, the device and how the ranks share each step."""
    cfg, info = run.cfg, run.info
    n_params = sum(p.numel() for p in run.model.parameters())  # a sharded parameter reports its whole size
    parallel = f", {cfg.parallel}" if info.distributed or cfg.parallel == "fsdp" else ""
    run.log(f"LinDiT {n_params / 1e6:.2f}M params, {len(run.data.labels)} images"
            f"{' with captions' if run.captions else ''}, device {info.device}, {info.world_size} rank(s) x "
            f"{run.per_rank} images per step{parallel}")


def _save(run: _Run) -> None:
    """The checkpoint ``run.last`` at the current step: sharded by every rank with FSDP, else by rank 0; no rank
    leaves before it is whole."""
    cfg, info, step = run.cfg, run.info, run.step
    train_state = {"scheduler": run.sched.state_dict(), "step": step, "data_gen": run.data_gen.get_state(),
                   "noise_gen": run.noise_gen.get_state(), "config": cfg.to_dict()}
    if cfg.parallel == "fsdp":
        save_sharded_dit_checkpoint(run.last, run.model, run.ema.module, run.opt, {**run.meta, "step": step},
                                    train_state, info)
    elif info.is_main:
        save_dit_checkpoint(run.last, run.model, run.ema.module, {**run.meta, "step": step},
                            {**train_state, "optimizer": optimizer_state(run.model, run.opt)})
    barrier(info)  # no rank leaves (and ends the job on an interruption) before the checkpoint is whole


def _out_of_time(run: _Run) -> bool:
    """Whether ``cfg.max_minutes`` of training have passed on any rank (so that every rank stops at the same
    step); logged when they have."""
    cfg = run.cfg
    out_of_time = cfg.max_minutes is not None and time.perf_counter() - run.start > 60 * cfg.max_minutes
    if all_reduce_max(int(out_of_time), run.info):
        run.log(f"time budget of {cfg.max_minutes} min reached at step {run.step}")
        return True
    return False


def _train_step(run: _Run) -> Tuple[float, float]:
    """One optimizer update: this rank's rows of the global batch of indices and noise, the flow-matching loss
    (class- or caption-conditioned), the update and the schedule's step; returns (the loss, the learning rate
    it used)."""
    cfg, data, device, rows = run.cfg, run.data, run.info.device, run.rows
    idx = torch.randint(len(data.labels), (cfg.batch_size,), generator=run.data_gen)[rows]
    x0 = data.inputs(idx).to(device)
    t, eps, drop = flow_noise(cfg.batch_size, x0.shape[1:], cfg.class_dropout, generator=run.noise_gen,
                              device=device, dtype=x0.dtype)
    noise = (t[rows], eps[rows], drop[rows])
    lr = run.opt.param_groups[0]["lr"]
    if run.captions is None:
        loss = flow_matching_loss(run.step_model, x0, data.labels[idx].to(device), cfg.class_dropout,
                                  null_class=run.model.null_class, noise=noise)
    else:
        context, mask = run.captions.rows(idx)
        loss = flow_matching_loss(run.step_model, x0, None, cfg.class_dropout, noise=noise,
                                  context=context.to(device), context_mask=mask.to(device))
    optimizer_step(loss, run.model, run.opt, run.ema, run.step, cfg.grad_clip)
    run.sched.step()
    run.step += 1
    return loss.item(), lr


def _log_losses(run: _Run, lr: float) -> None:
    """The mean loss over all ranks since the last log line, into ``run.losses`` and the log."""
    total = all_reduce_sum(run.window, run.info)
    run.losses.append(float(total[0] / total[1]))
    run.log(f"step {run.step:6d}  loss {run.losses[-1]:.4f}  lr {lr:.2e}  {time.perf_counter() - run.start:.0f}s")
    run.window.zero_()


def _checkpoint_when_due(run: _Run, stop: StopFlag) -> None:
    """After a step: on a signal to any rank, the checkpoint at this step, then TrainInterrupted (the tool exits
    with 128 + the signal); else the checkpoint every ``cfg.save_every`` steps."""
    signum = all_reduce_max(stop.signum, run.info)  # every rank stops at the same step
    if signum:
        _save(run)
        raise TrainInterrupted(signum, run.last, "the same command with --resume")
    if run.cfg.save_every and run.step % run.cfg.save_every == 0:
        _save(run)
