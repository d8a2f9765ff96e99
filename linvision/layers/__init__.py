"""nn.Modules built on linvision.ops: token mixers (selected by name through the registry), FFNs, blocks."""
from .registry import create_mixer, list_mixers, mixer_options, register_mixer
from .mixers import (
    AttentionMixer,
    CausalLinearAttention,
    GatedConvMixer,
    HybridAttention,
    LinearAttention,
    LinearRopeAttention,
    SoftmaxAttention,
)
from . import recurrent  # registers the bidirectional recurrent mixers
