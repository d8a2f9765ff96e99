"""Distilling a frozen teacher's logits into the model being trained (``--distill-teacher``).

The loss is ``(1 - w) * task_loss + w * T^2 * KL(softmax(teacher / T) || softmax(student / T))``: the task
loss (cross-entropy, with label smoothing or Mixup targets when those are on) blended with the soft targets of
a teacher that sees the same (augmented) batch. ``T^2`` keeps the gradient scale of the soft term independent
of the temperature. Used by stage 2 of linearization: the softmax ViT teaches the linear-attention model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linvision.utils.checkpoint import load_model

__all__ = ["distillation_loss", "load_teacher"]


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, task_loss: Tensor, weight: float,
                      temperature: float) -> Tensor:
    """The blended loss of the module docstring, computed in fp32 (batch mean of the KL divergence)."""
    t = float(temperature)
    log_p_student = F.log_softmax(student_logits.float() / t, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True)
    return (1.0 - weight) * task_loss + weight * (t * t) * kl


def load_teacher(path: str, num_classes: int, img_size: Optional[int], device) -> nn.Module:
    """The model of a checkpoint or run folder, frozen, in eval mode, on ``device``; ValueError when its head
    does not have ``num_classes`` outputs."""
    teacher, meta = load_model(path, device=str(device), img_size=img_size)
    if meta["num_classes"] != num_classes:
        raise ValueError(f"distill_teacher: {path} predicts {meta['num_classes']} classes, the model being "
                         f"trained {num_classes}")
    return teacher.requires_grad_(False).eval()
