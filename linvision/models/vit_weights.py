"""Weights into :class:`~linvision.models.linvit.LinViT`: timm's softmax VisionTransformer weights converted into
the start of linearization (:func:`convert_vit_state_dict`), and the checkpoint filter of the linvit entry points
(:func:`checkpoint_filter_fn`: training checkpoints unwrapped, softmax ViT weights converted, the position
embedding and the patch kernel resampled to the model's grid and patch)."""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor, nn
from timm.layers import resample_abs_pos_embed, resample_patch_embed

from .published import unwrap_state_dict

__all__ = ["checkpoint_filter_fn", "convert_vit_state_dict"]


# Silu(b) = b * sigmoid(b) = 1: an output gate with zero weights and this bias passes the attention output unchanged.
_IDENTITY_GATE_BIAS = 1.2784645427610738


def _pass_through_bias(mixer: nn.Module) -> float:
    """The bias b with gate_activation(b) = 1: an output gate at weight 0 and bias b passes the attention through
    (b for SiLU, 1 for RALA's output modulation, which has no activation). ValueError for another activation."""
    for bias in (_IDENTITY_GATE_BIAS, 1.0):
        if abs(float(mixer.gate_activation(torch.tensor(bias, dtype=torch.float64))) - 1.0) < 1e-9:
            return bias
    raise ValueError(f"state_dict: no pass-through start for the output gate of {type(mixer).__name__}")


def _is_softmax_vit(state_dict: Dict[str, Tensor]) -> bool:
    """A timm VisionTransformer state dict (DeiT, AugReg ViT, ...): attention weights under ``blocks.i.attn``."""
    return any(k.startswith("blocks.") and ".attn.qkv." in k for k in state_dict)


def _split_prefix_rows(pos_embed: Tensor, num_prefix_tokens: int, name: str = "pos_embed") -> Tuple[Tensor, Tensor]:
    """(prefix rows, grid rows) of a ViT position embedding (1, prefix + H*W, C); embeddings without rows for the
    class / register tokens (DeiT-III's ``no_embed_class``) have no prefix rows."""
    n = pos_embed.shape[1]
    for prefix in (num_prefix_tokens, 0):
        side = math.isqrt(n - prefix)
        if side * side == n - prefix:
            return pos_embed[:, :prefix], pos_embed[:, prefix:]
    raise ValueError(f"{name}: {n} rows are not a square grid with or without {num_prefix_tokens} prefix rows")


def _position_embedding_for(model: nn.Module, prefix_rows: Tensor, grid_rows: Tensor) -> Tensor:
    """A teacher's position embedding, split into (prefix rows, grid rows), as ``model`` holds it: the grid rows
    resampled to the model's grid, the prefix rows kept where the model has rows for its prefix tokens."""
    if grid_rows.shape[1] != model.patch_embed.num_patches:
        grid_rows = resample_abs_pos_embed(grid_rows, new_size=model.patch_embed.grid_size, num_prefix_tokens=0)
    wanted = 0 if model.no_embed_class else model.num_prefix_tokens
    if wanted == 0:
        return grid_rows
    if prefix_rows.shape[1] != wanted:
        raise ValueError(f"pos_embed: the model has position rows for {wanted} prefix tokens, the softmax ViT for "
                         f"{prefix_rows.shape[1]}; build the model with no_embed_class=True or matching prefix tokens")
    return torch.cat([prefix_rows, grid_rows], dim=1)


def _final_norm_name(name: str, model_state: Dict[str, Tensor]) -> str:
    """``name`` of a ViT's final norm (``norm.*`` before the pooling, ``fc_norm.*`` after it) moved to the other
    place when the model has its final norm there; any other name unchanged."""
    for here, there in (("norm.", "fc_norm."), ("fc_norm.", "norm.")):
        if name.startswith(here) and name not in model_state and there + name[len(here):] in model_state:
            return there + name[len(here):]
    return name


def convert_vit_state_dict(state_dict: Dict[str, Tensor], model: nn.Module) -> Dict[str, Tensor]:
    """Map a timm softmax VisionTransformer state dict onto ``model``, a :class:`~linvision.models.linvit.LinViT`
    (the start of linearization).

    - patch_embed, blocks.i.norm1 / norm2 / mlp, norm and head keep their names; blocks.i.attn.qkv and attn.proj
      become blocks.i.mixer.qkv and mixer.proj; layer-scale factors (blocks.i.ls1 / ls2.gamma) are folded into
      attn.proj and mlp.fc2 (exact).
    - cls_token and reg_token are kept when the model has them (``class_token=True``, the same ``reg_tokens``), and
      dropped when it has none (it then pools the patch tokens; the head, trained on the class token, is kept as
      a starting point). The position embedding keeps its prefix-token rows where the model has rows for its
      prefix tokens, loses them otherwise, and is resampled to the model's grid; models with RoPE (no absolute
      embedding) drop it.
    - The final norm goes where the model has it: ``norm`` (before the pooling) or ``fc_norm`` (after it, timm's
      default for mean pooling). Where the ViT has it at the other place (a class-token ViT into a mean-pooled
      model with fc_norm) its weights are kept as a starting point, like the head's.
    - Parameters a softmax ViT does not have start where the block computes what the teacher's attention
      computes as nearly as it can: LePE at zero (it adds nothing), an output gate at weight 0 and
      bias b with act(b) = 1 for its activation (SiLU; none for RALA's output modulation: b = 1), so it
      passes the attention through; feature-map and RoPE parameters keep the
      model's own initialisation.
    Raises ValueError for teacher weights this mapping cannot carry (q/k norms, a pre-norm, other depths or
    widths), or for prefix tokens the model has and the teacher has not.
    """
    model_state = model.state_dict()
    num_prefix = sum(state_dict[k].shape[1] for k in ("cls_token", "reg_token") if k in state_dict)
    gammas = {k: v for k, v in state_dict.items() if k.endswith((".ls1.gamma", ".ls2.gamma"))}
    out: Dict[str, Tensor] = {}
    unsupported = []
    for token in ("cls_token", "reg_token"):
        mine = getattr(model, token)
        have = state_dict[token].shape[1] if token in state_dict else 0
        if mine is not None and mine.shape[1] != have:
            raise ValueError(f"state_dict: the model has {mine.shape[1]} {token}(s), the softmax ViT {have}; build "
                             "it with class_token / reg_tokens as the ViT has them")
    for name, value in state_dict.items():
        if name in gammas:
            continue
        if name in ("cls_token", "reg_token") and getattr(model, name) is None:
            continue
        if name == "pos_embed":
            if model.pos_embed is not None:
                out[name] = _position_embedding_for(model, *_split_prefix_rows(value, num_prefix))
            continue
        target = _final_norm_name(name.replace(".attn.qkv.", ".mixer.qkv.").replace(".attn.proj.", ".mixer.proj."),
                                  model_state)
        if target not in model_state and not target.startswith("head."):
            unsupported.append(name)
            continue
        for layer_scale, module in ((".ls1.gamma", ".mixer.proj."), (".ls2.gamma", ".mlp.fc2.")):
            if module in target:
                gamma = gammas.get(target.split(module)[0] + layer_scale)
                if gamma is not None:
                    value = value * (gamma[:, None] if value.dim() == 2 else gamma)
        expected = model_state.get(target)
        if expected is not None and not target.startswith(("head.", "patch_embed.proj.weight")) \
                and value.shape != expected.shape:
            raise ValueError(f"state_dict: {name} has shape {tuple(value.shape)}, {target} of this model is "
                             f"{tuple(expected.shape)} (a softmax ViT of another width?)")
        out[target] = value
    if unsupported:
        raise ValueError(f"state_dict: softmax ViT weights linvit has no place for: {', '.join(unsupported[:8])}"
                         + (" ..." if len(unsupported) > 8 else ""))
    for name, value in model_state.items():
        if name in out or name.startswith("head."):
            continue
        if ".mixer.lepe." in name:
            value = torch.zeros_like(value)
        elif ".mixer.gate.weight" in name:
            value = torch.zeros_like(value)
        elif ".mixer.gate.bias" in name:
            value = torch.full_like(value, _pass_through_bias(model.get_submodule(name.split(".gate.")[0])))
        elif ".mixer." not in name:
            raise ValueError(f"state_dict: the softmax ViT has no {name!r} (another depth or layout?)")
        out[name] = value
    return out


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: nn.Module) -> Dict[str, Tensor]:
    """Unwrap training checkpoints (:func:`linvision.models.published.unwrap_state_dict`: the EMA copy first, as
    timm), convert timm softmax ViT weights (:func:`convert_vit_state_dict`) and resample what depends on the
    resolution: the absolute position embedding (bicubic, to the model's patch grid) and the patch-embedding
    kernel (to the model's patch size)."""
    state_dict = unwrap_state_dict(state_dict)
    if _is_softmax_vit(state_dict):
        state_dict = convert_vit_state_dict(state_dict, model)
    out = {}
    rows = 0 if model.no_embed_class else model.num_prefix_tokens
    for name, value in state_dict.items():
        if name == "pos_embed" and model.pos_embed is not None and value.shape != model.pos_embed.shape:
            value = _position_embedding_for(model, value[:, :rows], value[:, rows:])
        elif name == "patch_embed.proj.weight" and value.shape[-2:] != model.patch_embed.proj.weight.shape[-2:]:
            value = resample_patch_embed(value, model.patch_embed.patch_size)
        out[name] = value
    return out
