"""A diffusers autoencoder (``AutoencoderDC``, Sana's DC-AE, or ``AutoencoderKL``) from a local model folder,
for training the DiT on latents and decoding its samples.

Latents are scaled as diffusers' pipelines scale them: z = (mean of the encoding - shift_factor) *
scaling_factor for AutoencoderKL (the mode of its Gaussian, so encoding is deterministic), z = encoding *
scaling_factor for AutoencoderDC; decoding inverts that. Needs diffusers (the ``diffusers`` extra).
"""
from __future__ import annotations

import json
import os
from typing import Tuple

import torch
from torch import Tensor, nn

__all__ = ["AUTOENCODERS", "load_autoencoder", "autoencoder_geometry", "encode_images", "decode_latents"]

AUTOENCODERS = ("AutoencoderDC", "AutoencoderKL")


def load_autoencoder(path: str, device: str = "cpu") -> nn.Module:
    """The autoencoder of a local diffusers folder (config.json names its class), frozen, in eval mode.
    FileNotFoundError / ValueError in one line naming the folder or its class."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"autoencoder: no config.json in {path}")
    with open(config_path) as f:
        cls_name = json.load(f).get("_class_name")
    if cls_name not in AUTOENCODERS:
        raise ValueError(f"autoencoder: {config_path} describes a {cls_name!r}; allowed: {', '.join(AUTOENCODERS)}")
    try:
        import diffusers
    except ImportError:
        raise ValueError("autoencoder: needs diffusers (pip install 'linvision[diffusers]')") from None
    ae = getattr(diffusers, cls_name).from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False)
    return ae.to(device).eval().requires_grad_(False)


def autoencoder_geometry(ae: nn.Module) -> Tuple[int, int, int]:
    """(image channels, latent channels, spatial downscale factor) of an autoencoder."""
    cfg = ae.config
    if type(ae).__name__ == "AutoencoderDC":
        factor = 2 ** (len(cfg.encoder_block_out_channels) - 1)
    else:
        factor = 2 ** (len(cfg.block_out_channels) - 1)
    return cfg.in_channels, cfg.latent_channels, factor


def _shift_scale(ae: nn.Module) -> Tuple[float, float]:
    shift = getattr(ae.config, "shift_factor", None) or 0.0
    return float(shift), float(ae.config.scaling_factor)


@torch.no_grad()
def encode_images(ae: nn.Module, images: Tensor, batch_size: int = 32) -> Tensor:
    """Images (B, C, H, W) in [-1, 1] -> scaled latents (B, latent_channels, H / f, W / f) fp32 on the CPU, in
    batches on the autoencoder's device."""
    device = next(ae.parameters()).device
    shift, scale = _shift_scale(ae)
    out = []
    for i in range(0, len(images), batch_size):
        x = images[i:i + batch_size].to(device)
        enc = ae.encode(x)
        z = enc.latent if hasattr(enc, "latent") else enc.latent_dist.mode()
        out.append(((z.float() - shift) * scale).cpu().contiguous())  # the layout a cached copy has
    return torch.cat(out)


@torch.no_grad()
def decode_latents(ae: nn.Module, latents: Tensor) -> Tensor:
    """Scaled latents (B, latent_channels, h, w) -> images (B, C, h * f, w * f) fp32 on the latents' device."""
    device = next(ae.parameters()).device
    shift, scale = _shift_scale(ae)
    z = latents.to(device) / scale + shift
    return ae.decode(z).sample.float().to(latents.device)
