"""nn.Modules built on linvision.ops: token mixers (selected by name through the registry), FFNs, blocks.

Each attention mechanism has one module, which holds its ablation form and its published form (the mixer the
published backbones of :mod:`linvision.models` load the authors' weights into) side by side; importing this
package registers every mixer by name:

- :mod:`~linvision.layers.mixers`: the attention skeleton and the generic mixers (linear, linear_rope, causal,
  softmax and RAVLT's ravlt_softmax, hybrid, gated_cnn / none);
- :mod:`~linvision.layers.recurrent`: bidir_decay, bidir_gated and ViG's vig_gla, bidir_delta;
- :mod:`~linvision.layers.pola`: pola, pola_swin; :mod:`~linvision.layers.inline`: inline, inline_deit,
  inline_cswin; :mod:`~linvision.layers.rala`: rala, rala_premod, ravlt_rala; :mod:`~linvision.layers.mala`: mala,
  mavit_mala; :mod:`~linvision.layers.agent`: agent; :mod:`~linvision.layers.mlla`: mlla;
  :mod:`~linvision.layers.window`: swin_window; :mod:`~linvision.layers.cswin`: cswin_stripes.

All the attention mixers are :class:`~linvision.layers.mixers.AttentionMixer` subclasses (qkv projection, optional
LePE, output gate, projection), so every model family and the ablation take them by name. Which of the linear
designs run on the fused kernels: see :mod:`linvision.ops.attention_variants`.
"""
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
    mixer_accepts,
    check_context,
)
from .context import CONTEXT_PARTS, MixerContext
from .layout import TokenLayout
from .weight_init import init_linear_weights, init_model_weights, own_reset_parameters
from .options import (check_images, check_number, check_size, check_square_grid, merge_options, pad_to_kernel,
                      routed_options, stage_mixer_options)
from .mixers import (
    AttentionMixer,
    CausalLinearAttention,
    GatedConvMixer,
    HybridAttention,
    LinearAttention,
    LinearRopeAttention,
    SoftmaxAttention,
)
# the mechanisms' modules, each registering its mixers by name
from . import agent, cswin, inline, mala, mlla, pola, rala, recurrent, window
from .block import ConvPosEnc, DwConvMlp, MixerBlock, RecomputeMlp
