"""linvision's transformer inside diffusers' pipelines: :class:`LinSanaTransformer2DModel`, a diffusers model
(``ModelMixin`` + ``ConfigMixin``) holding a caption-conditioned :class:`LinDiT`, which ``SanaPipeline`` takes as
its ``transformer`` in place of ``SanaTransformer2DModel`` (as does ``SanaSprintPipeline``, for a model with
``guidance_embeds``).

Its config is ``SanaTransformer2DModel``'s (what the pipelines read: ``sample_size``, ``in_channels``,
``out_channels``, ``timestep_scale``, ``guidance_embeds_scale``, ...) plus ``exact_eps`` (the linear attention's
eps, :mod:`linvision.diffusion.sana`); its ``forward`` has diffusers' signature and output. It is built from a
diffusers model folder (:meth:`~LinSanaTransformer2DModel.from_pretrained`), a linvision training checkpoint
(:meth:`~LinSanaTransformer2DModel.from_checkpoint`) or a LinDiT (:meth:`~LinSanaTransformer2DModel.from_lindit`),
and saves in diffusers' layout, which ``SanaTransformer2DModel.from_pretrained`` reads. Needs diffusers
(``SanaPipeline`` also needs transformers): ``pip install 'linvision[diffusers]'``.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

try:
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
except ImportError as e:  # an optional extra
    raise ImportError(f"linvision.diffusion.pipeline needs diffusers: pip install 'linvision[diffusers]' ({e})") from e

from .checkpoint import load_dit
from .model import LinDiT
from .sana import _PIPELINE_KEYS, DIFFUSERS_EPS, config_from_diffusers, config_to_diffusers, load_diffusers_folder
from .sana import save_diffusers_folder

__all__ = ["LinSanaTransformer2DModel"]

# loader options diffusers' pipelines pass that change nothing here (the safetensors are read directly)
_NO_EFFECT = ("low_cpu_mem_usage", "use_safetensors")


def _refuse_options(kwargs: Dict[str, Any], method: str) -> None:
    """ValueError naming the options of diffusers' ``method`` given a value linvision cannot honour."""
    bad = sorted(k for k, v in kwargs.items() if k not in _NO_EFFECT and v is not None and v is not False)
    if bad:
        raise ValueError(f"{method}: {bad} not supported by linvision's transformer (a local folder, safetensors, "
                         f"one device)")


def _size_bytes(size: Union[int, str, None]) -> Optional[int]:
    """``max_shard_size`` as bytes: an int, or diffusers' strings such as '10GB' (10**10) or '20KiB' (20 * 1024)."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG])(i?)B\s*", str(size), re.IGNORECASE)
    if m is None:
        raise ValueError(f"max_shard_size: expected a number of bytes or a size such as '5GB', got {size!r}")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** ("KMG".index(m.group(2).upper()) + 1))


def _per_sample(value: Union[Tensor, float], batch: int, name: str, device: torch.device) -> Tensor:
    """A timestep or guidance value (a number, a 0-d or (1,) tensor, or (B,)) as a (B,) fp32 tensor."""
    value = torch.as_tensor(value, device=device).float()
    if value.numel() == 1:
        return value.reshape(1).expand(batch)
    if value.shape != (batch,):
        raise ValueError(f"{name}: expected a number or shape ({batch},), got {tuple(value.shape)}")
    return value


def _context_mask(mask: Optional[Tensor], context: Tensor) -> Optional[Tensor]:
    """diffusers' ``encoder_attention_mask`` -- (B, L) bool or 0/1 (1 = keep), or its additive form (B, 1, L)
    with 0 = keep and <= -1000 = drop -- as LinDiT's (B, L) bool mask."""
    if mask is None:
        return None
    b, n = context.shape[:2]
    if tuple(mask.shape) == (b, n):
        if mask.dtype == torch.bool:
            return mask
        keep, drop = mask == 1, mask == 0
    elif tuple(mask.shape) == (b, 1, n):
        keep, drop = mask[:, 0] == 0, mask[:, 0] <= -1000
    else:
        raise ValueError(f"encoder_attention_mask: expected shape {(b, n)} (1 = keep) or {(b, 1, n)} (additive, "
                         f"0 = keep) for encoder_hidden_states {tuple(context.shape)}, got {tuple(mask.shape)}")
    if not bool((keep | drop).all()):
        raise ValueError("encoder_attention_mask: values must be 0 / 1 (additive form: 0 / <= -1000); "
                         "linvision's cross-attention takes a keep-or-drop mask")
    return keep


class LinSanaTransformer2DModel(ModelMixin, ConfigMixin):
    """``SanaTransformer2DModel``'s interface around linvision's :class:`LinDiT` (kept as ``self.dit``).

    ``LinSanaTransformer2DModel(**config)`` builds a randomly initialised model from a ``SanaTransformer2DModel``
    config, as diffusers' class does. ``exact_eps`` (default True): diffusers' linear-attention eps, so that the
    model computes what ``SanaTransformer2DModel`` computes; False: linvision's default eps (in the config of a
    wrapped LinDiT: whether it has diffusers' eps). A saved folder is in diffusers' layout and does not record it:
    a pipeline loaded from its model_index.json gets the default.

    Differences from diffusers' class: a caption whose every token is masked out gets no cross-attention
    (diffusers attends to all its tokens); ``attention_mask`` is ignored, as diffusers' Sana ignores it;
    ControlNet residuals, attention processors, LoRA and gradient checkpointing are not supported.
    """

    @register_to_config
    def __init__(self, in_channels: int = 32, out_channels: Optional[int] = 32, num_attention_heads: int = 70,
                 attention_head_dim: int = 32, num_layers: int = 20, num_cross_attention_heads: Optional[int] = 20,
                 cross_attention_head_dim: Optional[int] = 112, cross_attention_dim: Optional[int] = 2240,
                 caption_channels: int = 2304, mlp_ratio: float = 2.5, dropout: float = 0.0,
                 attention_bias: bool = False, sample_size: int = 32, patch_size: int = 1,
                 norm_elementwise_affine: bool = False, norm_eps: float = 1e-6,
                 interpolation_scale: Optional[int] = None, guidance_embeds: bool = False,
                 guidance_embeds_scale: float = 0.1, qk_norm: Optional[str] = None, timestep_scale: float = 1.0,
                 exact_eps: bool = True):
        super().__init__()
        sana = {k: v for k, v in self.config.items() if k != "exact_eps" and not k.startswith("_")}
        self.dit = LinDiT(config_from_diffusers(sana, exact_eps=exact_eps, source=f"{type(self).__name__} config"))

    @classmethod
    def from_lindit(cls, model: LinDiT, source: str = "model") -> "LinSanaTransformer2DModel":
        """Wrap ``model`` (a caption-conditioned LinDiT, shared, not copied). ValueError for a class-conditional
        model or one ``SanaTransformer2DModel`` cannot describe (RoPE, softmax self-attention)."""
        if not isinstance(model, LinDiT):
            raise TypeError(f"{source}: expected a LinDiT, got {type(model).__name__}")
        cfg = model.cfg
        if cfg.caption_channels <= 0:
            raise ValueError(f"{source}: a class-conditional LinDiT (num_classes={cfg.num_classes}) cannot be "
                             f"SanaPipeline's transformer; it needs a caption model (caption_channels > 0)")
        config = config_to_diffusers(cfg, getattr(model, "diffusers_extra", None))
        exact = cfg.eps == DIFFUSERS_EPS and cfg.eps_form == "sum"
        with torch.device("meta"):  # the random init is replaced at once
            wrapper = cls(**{k: v for k, v in config.items() if not k.startswith("_")}, exact_eps=exact)
        wrapper.dit = model
        return wrapper.train(model.training)  # the model's mode, unchanged

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], exact_eps: bool = True,
                        torch_dtype: Optional[torch.dtype] = None, subfolder: Optional[str] = None,
                        device_map: Union[str, int, torch.device, None] = None, variant: Optional[str] = None,
                        dtype: Optional[torch.dtype] = None, **kwargs: Any) -> "LinSanaTransformer2DModel":
        """Load a local ``SanaTransformer2DModel`` folder (config.json + safetensors, single or sharded) with
        linvision's conversion, in eval mode. ``dtype`` (diffusers' newer name) wins over ``torch_dtype``;
        ``device_map``: one device or None (CPU). The other options diffusers' pipelines pass are accepted when they
        ask for nothing (None / False). FileNotFoundError for a missing folder or file, ValueError for a config or
        weights linvision cannot run or an unsupported option."""
        path = os.fspath(pretrained_model_name_or_path)
        if subfolder:
            path = os.path.join(path, subfolder)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"pretrained_model_name_or_path: no folder {path} (linvision reads local folders; "
                                    f"download with huggingface_hub.snapshot_download)")
        if variant is not None:
            raise ValueError(f"variant: {variant!r} not supported (linvision reads {path}'s "
                             f"diffusion_pytorch_model.safetensors or its shards)")
        _refuse_options(kwargs, "from_pretrained")
        dtype = dtype if dtype is not None else torch_dtype
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"torch_dtype / dtype: expected a torch.dtype such as torch.bfloat16, got {dtype!r}")
        try:
            device = torch.device("cpu" if device_map is None else device_map)
        except (RuntimeError, TypeError):
            raise ValueError(f"device_map: expected one device such as 'cuda' or None, got {device_map!r}") from None
        return cls.from_lindit(load_diffusers_folder(path, exact_eps, device, dtype), source=path)

    @classmethod
    def from_checkpoint(cls, path: str, ema: bool = True, dtype: Optional[torch.dtype] = None,
                        device: str = "cpu") -> "LinSanaTransformer2DModel":
        """The caption LinDiT of a linvision training checkpoint or run folder (EMA weights unless ``ema=False``;
        :func:`linvision.diffusion.checkpoint.load_dit`), in eval mode. ValueError for a class-conditional one."""
        model, _ = load_dit(path, ema=ema, device=device)
        return cls.from_lindit(model.to(dtype=dtype), source=f"checkpoint {path}")

    def save_pretrained(self, save_directory: Union[str, os.PathLike], max_shard_size: Union[int, str, None] = None,
                        safe_serialization: bool = True, variant: Optional[str] = None, **kwargs: Any) -> None:
        """Write a ``SanaTransformer2DModel`` folder (:func:`linvision.diffusion.sana.save_diffusers_folder`),
        in shards of at most ``max_shard_size`` when given. safetensors only; ``is_main_process=False`` writes
        nothing."""
        if not kwargs.pop("is_main_process", True):
            return
        if not safe_serialization:
            raise ValueError("safe_serialization: linvision writes safetensors only")
        if variant is not None:
            raise ValueError(f"variant: {variant!r} not supported (linvision writes "
                             f"diffusion_pytorch_model.safetensors)")
        _refuse_options(kwargs, "save_pretrained")
        self.dit.diffusers_extra = {k: self.config[k] for k in _PIPELINE_KEYS}  # the pipeline keys go with it
        save_diffusers_folder(self.dit, os.fspath(save_directory), max_shard_bytes=_size_bytes(max_shard_size))

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor, timestep: Union[Tensor, float],
                guidance: Union[Tensor, float, None] = None, encoder_attention_mask: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, attention_kwargs: Optional[Dict[str, Any]] = None,
                controlnet_block_samples: Optional[Tuple[Tensor, ...]] = None,
                return_dict: bool = True) -> Union[Transformer2DModelOutput, Tuple[Tensor]]:
        """``SanaTransformer2DModel.forward``: latents (B, in_channels, H, W), caption embeddings (B, L,
        caption_channels), ``timestep`` diffusers' 1000 t (number or (B,)), ``guidance`` (guidance-embedding
        models), ``encoder_attention_mask`` (B, L) 1 = keep -> the velocity (B, out_channels, H, W), as
        ``Transformer2DModelOutput(sample=...)`` or a 1-tuple. ``attention_mask`` is ignored (see the class)."""
        if controlnet_block_samples is not None:
            raise ValueError("controlnet_block_samples: linvision's transformer takes no ControlNet residuals")
        if attention_kwargs:
            raise ValueError(f"attention_kwargs: {sorted(attention_kwargs)} not supported (linvision's transformer has "
                             f"no attention processors or LoRA layers)")
        b, device = hidden_states.shape[0], hidden_states.device
        t = _per_sample(timestep, b, "timestep", device) / 1000.0  # LinDiT embeds 1000 t
        g = None if guidance is None else _per_sample(guidance, b, "guidance", device)
        mask = _context_mask(encoder_attention_mask, encoder_hidden_states)
        out = self.dit(hidden_states, t, context=encoder_hidden_states, context_mask=mask, guidance=g)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)
