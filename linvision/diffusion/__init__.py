"""Sana-style linear-attention diffusion: block, DiT (class- or caption-conditioned; diffusers Sana checkpoints),
rectified-flow training and sampling; ``LinSanaTransformer2DModel`` (the DiT as diffusers' SanaPipeline's
transformer) is imported on first use, as it needs diffusers."""
from .block import CrossAttention, MixFFN, SanaBlock, self_attention
from .flow import flow_matching_loss, logit_normal_timesteps, sample_flow, time_grid
from .model import DIT_CONFIGS, DiTConfig, LinDiT, create_dit
from .sampling import classify_images, sample_classes, save_grid
from .checkpoint import load_dit, save_dit_checkpoint
from .data import load_images
from .train import DiffusionTrainConfig, train_dit
from .sana import load_diffusers_folder, save_diffusers_folder


def __getattr__(name: str):
    """``LinSanaTransformer2DModel`` (:mod:`linvision.diffusion.pipeline`) on first use: it needs diffusers."""
    if name == "LinSanaTransformer2DModel":
        from .pipeline import LinSanaTransformer2DModel

        return LinSanaTransformer2DModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
