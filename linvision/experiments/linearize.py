"""Linearization: a linear-attention linvit started from a softmax ViT and taught to attend like it.

1. Conversion. The student is built with the teacher's weights (patch embedding, qkv, projection, MLP, norms,
   head) through linvit's ``checkpoint_filter_fn``, which also keeps the class token when the student has one
   (``class_token=True``; else drops it), resamples or drops the position embedding, and starts LePE at zero and
   an output gate at identity.
2. Attention transfer (:func:`attention_transfer`). The teacher is frozen; at every block its attention
   module's input (the normalised tokens) and output are recorded, and the student's mixer of that block is fed
   the same input (with the class token when the student keeps it, else the patch tokens only) and trained to
   give the same branch output (mean squared error over those tokens, each layer scaled by its target's mean
   square, summed over layers). Both sides are compared after their block's layer scale (``ls1``, identity
   where a block has none): the conversion folds the teacher's layer scale into the student's projection, so
   the target is the teacher's ``ls1(attn(x))``, what the attention adds to the residual stream. Only the
   selected mixer parameters are trained: ``"new"`` (what a softmax ViT does not have: LePE, gate, feature-map
   and RoPE parameters) or ``"mixer"`` (every mixer parameter, qkv and projection included).
   Each layer learns from the teacher's inputs, not from the student's own earlier layers, so the layers are
   independent problems (as in LoLCATs, Zhang et al. 2024, arXiv:2410.10254).
3. Fine-tuning on the target dataset: ``linvision/tools/train.py --initial-checkpoint`` with the weights stage 1 wrote.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
from torch import Tensor, nn

from linvision.layers import MixerContext

__all__ = ["TRANSFER_PARAMS", "build_student", "attention_modules", "transfer_parameters", "attention_errors", "attention_transfer"]

TRANSFER_PARAMS = ("new", "mixer")
# Mixer parameters a softmax ViT has: everything else in a mixer is linear-attention specific.
_TEACHER_MIXER_PARTS = (".qkv.", ".proj.")


def build_student(name: str, teacher: nn.Module, img_size: int, **kwargs) -> nn.Module:
    """The linvit ``name`` (with ``kwargs``) for ``img_size`` px, its weights converted from ``teacher`` (a timm
    softmax ViT or a linvit) by linvit's ``checkpoint_filter_fn``, with the teacher's number of classes."""
    import timm

    from linvision.models.vit_weights import checkpoint_filter_fn

    if not name.startswith("linvit"):
        raise ValueError(f"name: {name!r} is not a linvit model; linearization converts ViT weights into linvit")
    kwargs.setdefault("img_size", img_size)
    student = timm.create_model(name, num_classes=teacher.num_classes, **kwargs)
    student.load_state_dict(checkpoint_filter_fn(teacher.state_dict(), student))
    return student.eval()


def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The attention module of every block: ``blocks[i].attn`` (timm ViT) or ``blocks[i].mixer`` (linvit).
    Raises ValueError for a model with neither."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"model: {type(model).__name__} has no 'blocks'; expected a timm ViT or a linvit")
    modules = [getattr(b, "attn", None) or getattr(b, "mixer", None) for b in blocks]
    if any(m is None for m in modules):
        raise ValueError(f"model: blocks of {type(model).__name__} have no 'attn' or 'mixer' module")
    return modules


def _layer_scales(model: nn.Module) -> List[nn.Module]:
    """The layer scale after the attention of every block (``blocks[i].ls1``; identity where a block has none)."""
    scales = [getattr(b, "ls1", None) for b in model.blocks]
    return [nn.Identity() if s is None else s for s in scales]


def transfer_parameters(student: nn.Module, which: str = "new") -> Dict[str, nn.Parameter]:
    """Parameters stage 1 trains: ``"new"`` (linear-attention specific) or ``"mixer"`` (all mixer parameters).
    Raises ValueError for another ``which``, or when the selection is empty (e.g. ``"new"`` for a plain elu+1
    mixer without LePE or gate: use ``"mixer"`` or a mixer with such parameters)."""
    if which not in TRANSFER_PARAMS:
        raise ValueError(f"which: {which!r}; allowed: {', '.join(TRANSFER_PARAMS)}")
    params = {
        name: p for name, p in student.named_parameters()
        if ".mixer." in name and (which == "mixer" or not any(part in name for part in _TEACHER_MIXER_PARTS))
    }
    if not params:
        raise ValueError(f"which: {which!r} selects no parameter of {type(student).__name__} (its mixers have "
                         "nothing a softmax ViT lacks); use 'mixer', or lepe / gate / feature_map='focused'")
    return params


class _Recorder:
    """Forward hooks keeping (input, output) of each teacher attention module for one batch."""

    def __init__(self, modules: List[nn.Module]):
        self.records: List[Tuple[Tensor, Tensor]] = [None] * len(modules)  # type: ignore[list-item]
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.records[index] = (args[0].detach(), output.detach())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _layer_losses(student: nn.Module, teacher: nn.Module, images: Tensor) -> List[Tensor]:
    """Per layer: mean squared error between the student's mixer output and the teacher's attention output on
    the teacher's input, each through its own block's layer scale (``ls1``), over the patch tokens (and the
    prefix tokens when the student keeps them), divided by the target's mean square."""
    teacher_modules, student_modules = attention_modules(teacher), attention_modules(student)
    if len(teacher_modules) != len(student_modules):
        raise ValueError(f"teacher: {len(teacher_modules)} blocks, student: {len(student_modules)}")
    recorder = _Recorder(teacher_modules)
    try:
        with torch.no_grad():
            teacher(images)
    finally:
        recorder.close()
    prefix = getattr(teacher, "num_prefix_tokens", 0)
    kept = getattr(student, "num_prefix_tokens", 0)  # the prefix tokens the student keeps (a class token)
    if kept not in (0, prefix):
        raise ValueError(f"student: {kept} prefix tokens, teacher: {prefix}; the student keeps all or none of them")
    patch = student.patch_embed.patch_size
    grid = (images.shape[2] // patch[0], images.shape[3] // patch[1])
    losses = []
    layers = zip(student_modules, _layer_scales(student), _layer_scales(teacher), recorder.records)
    for mixer, student_scale, teacher_scale, (inputs, target) in layers:
        if kept:  # every token, the prefix tokens included: (B, P + H*W, C)
            out = mixer(inputs, MixerContext(grid, kept))
        else:
            inputs, target = inputs[:, prefix:], target[:, prefix:]  # (B, H*W, C)
            out = mixer(inputs, grid)
        with torch.no_grad():  # the teacher's branch as its block adds it: the layer scale is per channel
            target = teacher_scale(target)
        out = student_scale(out)
        losses.append((out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12))
    return losses


def attention_errors(student: nn.Module, teacher: nn.Module, batches: Iterable[Tensor]) -> List[float]:
    """Per-layer relative attention-output error (see :func:`_layer_losses`), averaged over ``batches``."""
    sums: List[float] = []
    count = 0
    with torch.no_grad():
        for batch in batches:
            images = batch[0] if isinstance(batch, (tuple, list)) else batch
            losses = [float(x) for x in _layer_losses(student, teacher, images)]
            sums = [a + b for a, b in zip(sums, losses)] if sums else losses
            count += 1
    if count == 0:
        raise ValueError("batches: empty")
    return [s / count for s in sums]


def attention_transfer(student: nn.Module, teacher: nn.Module, batches: Iterable[Tensor], steps: int,
                       lr: float = 1e-3, which: str = "new") -> List[float]:
    """Stage 1: train the selected student parameters (:func:`transfer_parameters`) for ``steps`` AdamW steps on
    the summed per-layer losses, cycling through ``batches`` (image tensors (B, C, H, W), or (images, targets)
    pairs as a DataLoader gives). The teacher is frozen
    and in eval mode; the student's other parameters are left untouched. Returns the loss of every step."""
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    params = transfer_parameters(student, which)
    teacher.eval().requires_grad_(False)
    frozen = {n: p.requires_grad for n, p in student.named_parameters()}
    for name, p in student.named_parameters():
        p.requires_grad_(name in params)
    optimizer = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    history: List[float] = []
    student.train()
    try:
        while len(history) < steps:
            seen = False
            for batch in batches:
                seen = True
                images = batch[0] if isinstance(batch, (tuple, list)) else batch
                loss = torch.stack(_layer_losses(student, teacher, images)).sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                history.append(float(loss.detach()))
                if len(history) == steps:
                    break
            if not seen:
                raise ValueError("batches: empty")
    finally:
        for name, p in student.named_parameters():
            p.requires_grad_(frozen[name])
        student.eval()
    return history
