"""Rectified flow (flow matching): training loss and Euler / Heun samplers with classifier-free guidance.

The path from data x0 (t = 0) to noise eps (t = 1) is the straight line x_t = (1 - t) x0 + t eps; its velocity
dx_t/dt = eps - x0 is the regression target (Liu et al. 2022, "Flow Straight and Fast", arXiv:2209.03003;
Esser et al. 2024, "Scaling Rectified Flow Transformers", arXiv:2403.03206, for the logit-normal t).
Sampling integrates dx/dt = v(x, t) from t = 1 down to t = 0.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["logit_normal_timesteps", "caption_condition", "drop_condition", "flow_noise", "flow_matching_loss",
           "time_grid",
           "guided_velocity", "sample_flow", "SAMPLERS"]

SAMPLERS = ("euler", "heun")


def logit_normal_timesteps(
    batch: int, mean: float = 0.0, std: float = 1.0, generator: Optional[torch.Generator] = None, device=None
) -> Tensor:
    """t = sigmoid(mean + std * n), n ~ N(0, 1): (batch,) fp32 in (0, 1), denser in the middle of the path."""
    n = torch.randn(batch, generator=generator, device=device)
    return torch.sigmoid(mean + std * n)


def caption_condition(context: Tensor, context_mask: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """The keyword condition of a caption model: context (B, L, C') and its mask (all kept when None)."""
    if context_mask is None:
        context_mask = torch.ones(context.shape[:2], dtype=torch.bool, device=context.device)
    return {"context": context, "context_mask": context_mask}


def drop_condition(model: nn.Module, cond: Dict[str, Tensor], drop: Tensor) -> Dict[str, Tensor]:
    """``cond`` with the rows where ``drop`` (B,) is True made unconditional: a label becomes the null class
    ``model.null_class``; a caption becomes all padding, which the cross-attention turns into an exact zero."""
    if "y" in cond:
        return {"y": torch.where(drop, torch.full_like(cond["y"], model.null_class), cond["y"])}
    return {"context": cond["context"], "context_mask": cond["context_mask"] & ~drop[:, None]}


def flow_noise(
    batch: int, shape, class_dropout: float = 0.1, t_mean: float = 0.0, t_std: float = 1.0,
    generator: Optional[torch.Generator] = None, device=None, dtype=torch.float32,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The random draws of one training step, in this order: times t (batch,) logit-normal, noise eps
    (batch, *shape) and the condition drops (batch,) bool with probability ``class_dropout``."""
    t = logit_normal_timesteps(batch, t_mean, t_std, generator, device)
    eps = torch.randn((batch, *shape), generator=generator, device=device, dtype=dtype)
    drop = torch.rand(batch, generator=generator, device=device) < class_dropout
    return t, eps, drop


def flow_matching_loss(
    model: nn.Module, x0: Tensor, y: Optional[Tensor], class_dropout: float = 0.1, null_class: Optional[int] = None,
    t_mean: float = 0.0, t_std: float = 1.0, generator: Optional[torch.Generator] = None,
    context: Optional[Tensor] = None, context_mask: Optional[Tensor] = None,
    noise: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
) -> Tensor:
    """Mean squared error between model(x_t, t, y') and eps - x0; scalar fp32.

    With probability ``class_dropout`` a label is replaced by ``null_class`` (defaults to ``model.null_class``)
    so that the same network learns the unconditional velocity used by classifier-free guidance. A caption model
    takes ``context`` (B, L, C') and ``context_mask`` instead of ``y``; a dropped caption becomes all padding.
    ``noise``: the step's (t, eps, drop) of :func:`flow_noise`, drawn here from ``generator`` when None (a rank
    of a data-parallel run passes its slice of the whole batch's draws).
    """
    if not 0.0 <= class_dropout < 1.0:
        raise ValueError(f"class_dropout: must lie in [0, 1), got {class_dropout}")
    b = x0.shape[0]
    if noise is None:
        noise = flow_noise(b, x0.shape[1:], class_dropout, t_mean, t_std, generator, x0.device, x0.dtype)
    t, eps, drop = noise
    if y is not None:
        null_class = model.null_class if null_class is None else null_class
        y = torch.where(drop, torch.full_like(y, null_class), y)
        cond = {"y": y}
    else:
        cond = drop_condition(model, caption_condition(context, context_mask), drop)
    tb = t.view(b, *([1] * (x0.dim() - 1))).to(x0.dtype)
    x_t = (1 - tb) * x0 + tb * eps
    pred = model(x_t, t, **cond)
    return F.mse_loss(pred.float(), (eps - x0).float())


def time_grid(steps: int, shift: float = 1.0, device=None) -> Tensor:
    """(steps + 1,) times from 1 to 0. ``shift`` > 1 spends more steps at high noise (t' = s t / (1 + (s-1) t)),
    as Sana does at high resolution."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: must be a positive int, got {steps!r}")
    if shift <= 0:
        raise ValueError(f"shift: must be positive, got {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1, device=device)
    return shift * t / (1 + (shift - 1) * t)


def guided_velocity(model: nn.Module, x: Tensor, t: Tensor, cond: Dict[str, Tensor], cfg_scale: float) -> Tensor:
    """v_u + w (v_c - v_u) with one batched call (the unconditional half from :func:`drop_condition`); w = 1 is
    plain conditional, w = 0 unconditional."""
    if cfg_scale == 1.0:
        return model(x, t, **cond)
    null = drop_condition(model, cond, torch.ones(x.shape[0], dtype=torch.bool, device=x.device))
    both = model(torch.cat([x, x]), torch.cat([t, t]), **{k: torch.cat([cond[k], null[k]]) for k in cond})
    v_c, v_u = both.chunk(2)
    return v_u + cfg_scale * (v_c - v_u)


@torch.no_grad()
def sample_flow(
    model: nn.Module, y: Optional[Tensor], shape, steps: int = 20, cfg_scale: float = 1.0, sampler: str = "euler",
    shift: float = 1.0, generator: Optional[torch.Generator] = None, noise: Optional[Tensor] = None,
    progress: Optional[Callable[[int], None]] = None, context: Optional[Tensor] = None,
    context_mask: Optional[Tensor] = None,
) -> Tensor:
    """Integrate from noise at t = 1 to t = 0 for labels y (B,), or for captions ``context`` (B, L, C') with
    ``context_mask`` when y is None; returns x0 estimates (B, *shape) fp32.

    sampler: "euler" (one model call per step) or "heun" (two: the trapezoid of the velocities at both ends;
    the last step is Euler, so the model is never called at t = 0).
    noise: the starting noise (B, *shape); drawn from ``generator`` when None.
    Raises ValueError for an unknown sampler or a noise tensor of the wrong shape.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler: unknown {sampler!r}; allowed: {', '.join(SAMPLERS)}")
    cond = {"y": y} if y is not None else caption_condition(context, context_mask)
    first = next(iter(cond.values()))
    device, b = first.device, first.shape[0]
    if noise is None:
        noise = torch.randn((b, *shape), generator=generator, device=device)
    elif tuple(noise.shape) != (b, *shape):
        raise ValueError(f"noise: expected shape {(b, *shape)}, got {tuple(noise.shape)}")
    x = noise.float()
    ts = time_grid(steps, shift, device=device)
    for i in range(steps):
        t_cur, t_next = ts[i], ts[i + 1]
        v = guided_velocity(model, x, t_cur.expand(b), cond, cfg_scale).float()
        x_next = x + (t_next - t_cur) * v
        if sampler == "heun" and i < steps - 1:
            v_next = guided_velocity(model, x_next, t_next.expand(b), cond, cfg_scale).float()
            x_next = x + (t_next - t_cur) * 0.5 * (v + v_next)
        x = x_next
        if progress is not None:
            progress(i)
    return x
