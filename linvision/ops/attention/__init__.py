"""Linear attention: non-causal and causal, reference PyTorch path and backend dispatch.

Non-causal, per batch and head, with phi >= 0 (mean-normalised; the 1/N cancels except against eps):

    S = (1/N) sum_j (R_j phi(k_j))^T v_j        (D x Dv)
    z = (1/N) sum_j phi(k_j)                    (D)
    o_i = ((R_i phi(q_i)) S) / (phi(q_i) . z + eps)

R_i is the optional RoPE rotation of token i, applied to the numerator only: rotated features can be
negative, and a denominator that can change sign or vanish is not a normaliser. The numerator then depends on
relative positions only, since (R_i a)^T (R_j b) = a^T R_{j-i} b.

Causal (the RNN view): token i sees tokens j <= i, with S_i, z_i the means over those i tokens. It is the gated
recurrence of :mod:`linvision.ops.recurrent` with a zero log-gate, and runs through the same chunked scan
(quadratic inside a chunk, states passed between chunks) and the same step (:func:`linear_attention_step`, token
by token with a constant-size :class:`RecurrentState`), which give the same outputs.

Dispatch: ``backend="auto"`` runs CUDA tensors through the fused kernels of ``linvision.kernels`` where they
apply; where they do not (or cannot be imported), it says why in a warning, once per reason, and runs PyTorch.

Accumulation of S and z and the division are fp32 (float64 for float64 inputs) whatever the input dtype; the
output has the input dtype. The default eps (1e-4) is representable in fp16 and bf16 and small against the
denominator of any non-degenerate input (phi(q).z is of order D times the typical feature value).

Layout: :mod:`.reference` (the non-causal PyTorch path and the checks the family shares), :mod:`.chunk` (causal,
chunked), :mod:`.step` (token by token), :mod:`.dispatch` (:func:`~.dispatch.linear_attention`: the checks once,
then the fused kernels or PyTorch) and :mod:`.softmax` (softmax attention with the same call shape).
"""
from .chunk import causal_linear_attention
from .dispatch import GATE_ACTIVATIONS, linear_attention
from .reference import linear_attention_reference
from .softmax import softmax_attention
from .step import LinearAttentionState, linear_attention_step

__all__ = [
    "GATE_ACTIVATIONS",
    "linear_attention",
    "linear_attention_reference",
    "causal_linear_attention",
    "LinearAttentionState",
    "linear_attention_step",
    "softmax_attention",
]
