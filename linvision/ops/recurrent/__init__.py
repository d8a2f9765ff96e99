"""Linear attention that forgets or corrects: decay (RetNet), gated (GLA) and delta-rule (DeltaNet) recurrences.

Plain causal linear attention keeps a running sum S_t = S_{t-1} + phi(k_t)^T v_t and never forgets. The three
recurrences here change only the state update (states are (D, Dv), read as o_t = phi(q_t) S_t):

- fixed decay per head (Sun et al. 2023, "Retentive Network", arXiv:2307.08621):
  S_t = gamma * S_{t-1} + phi(k_t)^T v_t
- data-dependent gate (Yang et al. 2023, "Gated Linear Attention", arXiv:2312.06635), per head or per key channel:
  S_t = diag(gamma_t) S_{t-1} + phi(k_t)^T v_t
- delta rule (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule",
  arXiv:2406.06484), one step of online gradient descent on 1/2 ||S^T k_t - v_t||^2:
  S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

Each has a chunked form for training (quadratic inside a chunk, one state handed from chunk to chunk) and a step
form for token-by-token inference; both give the per-token recurrence's outputs.

Normalisation. The decay and gated forms keep the normaliser of :func:`causal_linear_attention`, decayed like the
state: z_t = gamma_t z_{t-1} + phi(k_t) and a decayed token count c_t = gamma_t c_{t-1} + 1, with

    o_t = phi(q_t) S_t / (phi(q_t) . z_t + c_t * eps)

i.e. the decayed mean of the values, and exactly causal linear attention when gamma = 1 (c_t = t). With per-channel
gates c_t is the mean over channels of the per-channel counts. ``normalize=False`` gives the plain o_t = phi(q_t) S_t
(RetNet's retention). The delta rule is unnormalised: its keys (and queries) are L2-normalised after the feature map,
so that with beta in [0, 1] each update is a contraction of the stored value along k_t and the state stays bounded.

Numerical safety: gates enter as log-gates (log gamma <= 0, e.g. ``F.logsigmoid``), cumulated in fp32; every decay
factor formed is exp of a non-positive number, so nothing overflows whatever the chunk size. All accumulation,
the triangular solve of the delta rule and the division run in fp32 (float64 for float64 inputs); outputs have the
input dtype. RoPE is not supported by these recurrences (plain causal linear attention, the zero-gate case, rotates
its numerator through the same scan).

Bidirectional forms (for images, which have no natural order) run the scan forward and backward over the token
order and add the two, with the backward scan strictly anti-causal so that the diagonal counts once; the
normalised forms merge numerators, denominators and counts before dividing, so with gamma = 1 the bidirectional
decay form is exactly non-causal linear attention.

Kernels: the chunked forms take ``backend=`` as :func:`linvision.ops.linear_attention` does: "auto" runs CUDA tensors
on fla-core's chunked Triton kernels where they apply (:mod:`.kernels` says what runs where, and with what
precision), "triton" forces them, "torch" is the PyTorch chunk loop here. The step forms are PyTorch.

Layout, one module per piece: :mod:`.state` (the state and its check), :mod:`.scan` (chunking and the chain of states,
shared by every scan), :mod:`.gated_chunk` and :mod:`.gated_step` (decay and gated forms: the scans and ops, the
step), :mod:`.delta_chunk` and :mod:`.delta_step` (the delta rule), :mod:`.kernels` (the dispatch to fla-core).
"""
from .delta_chunk import bidirectional_delta_rule_attention, delta_rule_attention
from .delta_step import delta_rule_step
from .gated_chunk import bidirectional_gated_linear_attention, decay_linear_attention, gated_linear_attention
from .gated_step import decay_linear_attention_step, gated_linear_attention_step
from .scan import unit_lower_solve
from .state import RecurrentState

__all__ = [
    "RecurrentState",
    "decay_linear_attention",
    "decay_linear_attention_step",
    "gated_linear_attention",
    "gated_linear_attention_step",
    "bidirectional_gated_linear_attention",
    "delta_rule_attention",
    "delta_rule_step",
    "bidirectional_delta_rule_attention",
    "unit_lower_solve",
]
