"""Training of :class:`LinDiT` with rectified flow: the recipe, the EMA, the schedule and the loop the tools
call. Data comes from :mod:`linvision.diffusion.data`, checkpoints go through :mod:`linvision.diffusion.checkpoint`
(the train state is read with ``weights_only=True``).
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from safetensors.torch import load_file
from torch import nn

from linvision.engine.checkpoint import load_torch_file
from linvision.engine.files import recover_checkpoint_folder
from linvision.engine.interrupt import StopFlag, TrainInterrupted

from .checkpoint import resolve_dit_checkpoint, save_dit_checkpoint
from .data import load_images
from .flow import flow_matching_loss
from .model import DiTConfig, LinDiT

__all__ = ["update_ema", "DiffusionTrainConfig", "train_dit"]


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model, parameter by parameter (buffers copied)."""
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm.detach(), 1.0 - decay)
    for be, bm in zip(ema.buffers(), model.buffers()):
        be.copy_(bm)


@dataclass
class DiffusionTrainConfig:
    """The recipe of :func:`train_dit` (the tool's flags mirror these fields)."""

    model: Dict[str, Any] = field(default_factory=lambda: DiTConfig().to_dict())
    dataset: str = "digits"
    data_dir: Optional[str] = None
    steps: int = 2000
    max_minutes: Optional[float] = None
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 100
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    class_dropout: float = 0.1
    seed: int = 0
    log_every: int = 50
    save_every: int = 500

    def check(self) -> None:
        """ValueError naming the first field whose value training cannot use."""
        def need(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{key}: {what}, got {getattr(self, key)!r}")

        for key in ("steps", "batch_size", "log_every"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, key, "must be an integer >= 1")
        for key in ("save_every", "warmup_steps"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 0, key, "must be an integer >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        need(self.weight_decay >= 0 and self.grad_clip >= 0, "weight_decay" if self.weight_decay < 0 else
             "grad_clip", "must be >= 0")
        need(0 < self.ema_decay < 1, "ema_decay", "must be within (0, 1)")
        need(0 <= self.class_dropout < 1, "class_dropout", "must be within [0, 1)")
        need(self.max_minutes is None or self.max_minutes > 0, "max_minutes", "must be > 0")


def _lr_at(step: int, cfg: DiffusionTrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% over ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_dit(cfg: DiffusionTrainConfig, out_dir: str, resume: bool = False, stop_after: Optional[int] = None,
              log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Train on CPU or the current CUDA device; checkpoints to ``out_dir/last``. With ``resume`` the run
    continues from ``out_dir/last`` (same batches, noise and schedule as an uninterrupted run).
    ``stop_after`` ends the run (with a checkpoint) at that step, as an interruption would. SIGINT/SIGTERM
    save a checkpoint at the current step and raise TrainInterrupted.

    Returns {"step", "losses" (the logged means), "elapsed_s"}. Stops at ``cfg.steps`` or after
    ``cfg.max_minutes`` of training, whichever comes first (a checkpoint is written either way).
    """
    cfg.check()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_cfg = DiTConfig.from_dict(cfg.model)
    x_all, y_all, classes = load_images(cfg.dataset, model_cfg.img_size, model_cfg.in_chans, cfg.data_dir)
    if len(classes) != model_cfg.num_classes:
        raise ValueError(f"model.num_classes: {model_cfg.num_classes}, but the data has {len(classes)} classes")
    torch.manual_seed(cfg.seed)
    model = LinDiT(model_cfg).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "scale_shift_table" in n]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "scale_shift_table" not in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.99))
    data_gen = torch.Generator().manual_seed(cfg.seed)
    noise_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    step = 0
    last = os.path.join(out_dir, "last")
    if resume:
        recover_checkpoint_folder(last)
        state = load_torch_file(os.path.join(resolve_dit_checkpoint(last), "train_state.pt"), "resume")
        model.load_state_dict(load_file(os.path.join(last, "model.safetensors")))
        ema.load_state_dict(load_file(os.path.join(last, "ema.safetensors")))
        opt.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_gen"])
        noise_gen.set_state(state["noise_gen"])
        step = state["step"]
        log(f"resumed from {last} at step {step}")
    meta = {"data": {"dataset": cfg.dataset, "classes": classes, "value_range": [-1.0, 1.0]}}

    def save() -> None:
        train_state = {"optimizer": opt.state_dict(), "step": step, "data_gen": data_gen.get_state(),
                       "noise_gen": noise_gen.get_state(), "config": cfg.__dict__}
        save_dit_checkpoint(last, model, ema, {**meta, "step": step}, train_state)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"LinDiT {n_params / 1e6:.2f}M params, {len(y_all)} images, device {device}")
    losses: List[float] = []
    window: List[float] = []
    start = time.perf_counter()
    model.train()
    with StopFlag() as stop:
        while step < (cfg.steps if stop_after is None else min(cfg.steps, stop_after)):
            if cfg.max_minutes is not None and time.perf_counter() - start > 60 * cfg.max_minutes:
                log(f"time budget of {cfg.max_minutes} min reached at step {step}")
                break
            idx = torch.randint(len(y_all), (cfg.batch_size,), generator=data_gen)
            x0, y = x_all[idx].to(device), y_all[idx].to(device)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, cfg)
            loss = flow_matching_loss(model, x0, y, cfg.class_dropout, generator=noise_gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            # Short runs would keep the EMA near the random init with a fixed 0.999: warm the decay up.
            update_ema(ema, model, min(cfg.ema_decay, (1 + step) / (10 + step)))
            step += 1
            window.append(loss.item())
            if step % cfg.log_every == 0 or step == cfg.steps:
                losses.append(sum(window) / len(window))
                log(f"step {step:6d}  loss {losses[-1]:.4f}  lr {_lr_at(step - 1, cfg):.2e}  "
                    f"{time.perf_counter() - start:.0f}s")
                window = []
            if stop.signum:  # saved at this step, then the tool exits with 128 + the signal
                save()
                raise TrainInterrupted(stop.signum, last)
            if cfg.save_every and step % cfg.save_every == 0:
                save()
    save()
    return {"step": step, "losses": losses, "elapsed_s": time.perf_counter() - start}
