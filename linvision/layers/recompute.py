"""Layers that keep less for the backward than autograd would, and form the rest again there (each an elementwise
pass, where the saved tensor would be a full copy of the activations held until the backward):

- :class:`RecomputeMlp`: timm's ``Mlp`` keeping the GELU's input, not its output;
- :func:`gated_linear`: ``linear(a * act(g))``, an attention's output gate and projection, keeping ``a`` and ``g``,
  not ``act(g)`` nor the product.

Each is the plain computation where it would gain nothing or cannot run: in inference, traced by FX, under
``torch.compile`` (whose partitioner chooses what to recompute itself) and TorchScript.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import Tensor, nn
try:  # torch's is_fx_tracing logs a warning on its first call; this one is silent (and also false under export)
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing
except ImportError:  # older torch: is_fx_tracing, silent there
    from torch.fx._symbolic_trace import is_fx_tracing as is_fx_symbolic_tracing

__all__ = ["RecomputeMlp", "gated_linear"]


def _recomputes() -> bool:
    """Whether a training step here may keep less and recompute: a gradient is wanted and the step runs eagerly."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.jit.is_scripting()
            and not is_fx_symbolic_tracing())


class _GeluLinear(torch.autograd.Function):
    """fc2(gelu(h)) keeping h and fc2's weight for the backward, not gelu(h) (nor, under autocast, the weight's
    cast copy): the activation and the cast are formed again there, each one elementwise pass."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Optional[Tensor], approximate: str) -> Tensor:
        ctx.save_for_backward(h, weight)
        ctx.approximate, ctx.bias_dtype = approximate, None if bias is None else bias.dtype
        return F.linear(F.gelu(h, approximate=approximate), weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight = ctx.saved_tensors
        a = F.gelu(h, approximate=ctx.approximate)
        w = weight.to(grad.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = (g2.t() @ a.reshape(-1, a.shape[-1])).to(weight.dtype)
        grad_b = None if ctx.bias_dtype is None else g2.sum(0).to(ctx.bias_dtype)
        grad_h = torch.ops.aten.gelu_backward(grad @ w, h, approximate=ctx.approximate)
        return grad_h, grad_w, grad_b, None


class RecomputeMlp(Mlp):
    """timm's ``Mlp`` (the same arguments, parameters and state dict) that, in a training step, keeps for the
    backward the hidden pre-activations instead of the GELU's output: one tensor of the hidden width per block
    instead of two, the GELU formed again in the backward. Eager only: traced by FX, under ``torch.compile``
    (whose partitioner chooses what to recompute itself), in inference, and for another activation, dropout or
    norm inside the MLP it is timm's forward."""

    def forward(self, x: Tensor) -> Tensor:
        if (self.training and isinstance(self.act, nn.GELU) and isinstance(self.fc2, nn.Linear)
                and isinstance(self.norm, nn.Identity) and not self.drop1.p and _recomputes()):
            return self.drop2(_GeluLinear.apply(self.fc1(x), self.fc2.weight, self.fc2.bias, self.act.approximate))
        return super().forward(x)


class _GatedLinear(torch.autograd.Function):
    """linear(a * act(g)) keeping a, g and the weight for the backward, not act(g) nor the product (nor, under
    autocast, the weight's cast copy): both are formed again there. ``act`` is any differentiable function of g
    (its backward runs on the recomputed activation)."""

    @staticmethod
    def forward(ctx, a: Tensor, g: Tensor, weight: Tensor, bias: Optional[Tensor], act: Callable[[Tensor], Tensor]
                ) -> Tensor:
        out = F.linear(a * act(g), weight, bias)  # under autocast: the product and the weight cast as F.linear does
        ctx.save_for_backward(a, g, weight)
        ctx.act, ctx.bias_dtype = act, None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, g, weight = ctx.saved_tensors
        with torch.enable_grad():
            g_ = g.detach().requires_grad_(ctx.needs_input_grad[1])
            s = ctx.act(g_)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_b = None
        if ctx.needs_input_grad[2]:  # the product formed again only for the weight's gradient (none when frozen)
            h = (a * s.detach()).to(grad.dtype)
            grad_w = (g2.t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        grad_h = (grad @ weight.to(grad.dtype)).to(torch.promote_types(a.dtype, s.dtype))
        grad_a = (grad_h * s.detach()).to(a.dtype) if ctx.needs_input_grad[0] else None
        grad_g = None
        if ctx.needs_input_grad[1]:
            grad_g = torch.autograd.grad(s, g_, grad_h * a)[0].to(g.dtype) if s.requires_grad else None
        return grad_a, grad_g, grad_w, grad_b, None


def gated_linear(a: Tensor, g: Tensor, act: Callable[[Tensor], Tensor], linear: nn.Module) -> Tensor:
    """``linear(a * act(g))``: an attention's output ``a`` through its gate's activation of ``g`` into its output
    projection. In a training step with an ``nn.Linear`` it keeps ``a``, ``g`` and the weight for the backward
    (:class:`_GatedLinear`); elsewhere, or for another projection, it is the plain computation."""
    if isinstance(linear, nn.Linear) and (a.requires_grad or g.requires_grad or linear.weight.requires_grad) \
            and _recomputes():
        return _GatedLinear.apply(a, g, linear.weight, linear.bias, act)
    return linear(a * act(g))
