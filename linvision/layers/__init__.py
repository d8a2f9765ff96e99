"""nn.Modules built on linvision.ops: token mixers (selected by name through the registry), FFNs, blocks."""
from .registry import (
    TokenMixer,
    check_prefix_tokens,
    create_mixer,
    get_mixer_class,
    list_mixers,
    mixer_options,
    no_weight_decay_of,
    parse_mixer_list,
    register_mixer,
    takes_prefix_tokens,
    takes_layout,
    check_layout,
)
from .layout import TokenLayout
from .weight_init import init_linear_weights, init_model_weights, own_reset_parameters
from .options import (check_images, check_number, check_size, check_square_grid, merge_options, pad_to_kernel,
                      stage_mixer_options)
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
from . import variant_mixers  # registers inline, agent
from . import mala  # registers mala, mavit_mala
from . import rala  # registers rala, rala_premod, ravlt_rala
from . import pola  # registers pola, pola_swin
from .block import ConvPosEnc, DwConvMlp, MixerBlock
