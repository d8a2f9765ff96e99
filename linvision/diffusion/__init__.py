"""Sana-style linear-attention diffusion: block, small DiT, rectified-flow training and sampling."""
from .block import CrossAttention, LinearSelfAttention, MixFFN, SanaBlock
from .flow import flow_matching_loss, logit_normal_timesteps, sample_flow, time_grid
from .model import DIT_CONFIGS, DiTConfig, LinDiT, create_dit
from .sampling import classify_images, sample_classes, save_grid
from .train import DiffusionTrainConfig, load_dit, load_images, save_dit_checkpoint, train_dit
