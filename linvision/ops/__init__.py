"""Pure tensor functions: linear attention (non-causal, causal, step), softmax attention, feature maps, RoPE,
decay/gated/delta-rule recurrences. Dispatches to ``linvision.kernels``; nothing there imports from here.

Each op family is a package (``attention``: linear and softmax attention; ``recurrent``: the decay, gated and
delta-rule recurrences; each holds the reference, the chunked form, the step, the kernel dispatch),
``feature_maps``, ``rope`` and ``attention_variants`` are modules, and ``common`` holds the checks and constants
they share."""
from .common import (
    BACKENDS,
    DEFAULT_EPS,
    check_grid,
    check_int,
    check_qkv,
    check_rope,
    check_valid,
    compute_dtype,
    is_exporting,
    is_tracing,
    record_backends,
)
from .feature_maps import (
    FEATURE_MAP_NAMES,
    FeatureMap,
    FocusedFeatureMap,
    PerformerFeatureMap,
    get_feature_map,
)
from .attention import (
    GATE_ACTIVATIONS,
    LinearAttentionState,
    causal_linear_attention,
    linear_attention,
    linear_attention_reference,
    linear_attention_step,
    softmax_attention,
)
from .rope import (
    Rope,
    apply_rope,
    axial_rope,
    axial_rope_freqs,
    grid_positions,
    halves_from_interleaved,
    interpolate_positions,
    interpolation_scale,
    mixed_rope_freqs,
    rope_1d,
    rope_at,
    rotate_pairs,
)
from .recurrent import (  # chunked forms, their steps, bidirectional scans
    RecurrentState,
    decay_linear_attention,
    gated_linear_attention,
    delta_rule_attention,
    decay_linear_attention_step,
    gated_linear_attention_step,
    delta_rule_step,
    bidirectional_gated_linear_attention,
    bidirectional_delta_rule_attention,
)
from .attention_variants import (  # PolaFormer, InLine, RALA, MALA, Agent attention
    agent_attention,
    injective_linear_attention,
    magnitude_aware_linear_attention,
    polarity_linear_attention,
    rank_augmented_linear_attention,
)
