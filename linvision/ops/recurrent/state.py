"""The state a causal or recurrent linear attention carries from token to token, and its check."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from torch import Tensor

from ..common import compute_dtype

__all__ = ["RecurrentState", "StepResult", "check_state"]


@dataclass
class RecurrentState:
    """State of a causal or recurrent linear attention, in the compute dtype (fp32, or float64 for float64 inputs).

    s: (B, H, D, Dv) state. z: (B, H, D) decayed key sum and count: (B, H, G) decayed token count (G = 1 for
    per-head gates and plain causal attention, D for per-channel gates), both only for the normalised forms (None
    otherwise). num_tokens: tokens seen so far (the position of the next token, e.g. for RoPE).
    """

    s: Tensor
    z: Optional[Tensor] = None
    count: Optional[Tensor] = None
    num_tokens: int = 0


class StepResult(NamedTuple):
    """One token of a recurrence: its output (B, H, Dv) and the state after it."""

    out: Tensor
    state: RecurrentState


def check_state(state: Optional[RecurrentState], q: Tensor, v: Tensor, g: Optional[int]) -> Optional[RecurrentState]:
    """Validate a state against q (B, H, ., D), v (B, H, ., Dv) and gate width g (None: unnormalised); returns it
    in the compute dtype."""
    if state is None:
        return None
    if not isinstance(state, RecurrentState):
        raise TypeError(f"state: expected a RecurrentState or None, got {type(state).__name__}")
    b, h, d, dv = q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]
    cdt = compute_dtype(q.dtype)
    if tuple(state.s.shape) != (b, h, d, dv):
        raise ValueError(f"state: s has shape {tuple(state.s.shape)}, expected {(b, h, d, dv)}")
    if g is None:
        return RecurrentState(state.s.to(cdt), num_tokens=state.num_tokens)
    if state.z is None or state.count is None:
        raise ValueError("state: the normalised form needs z and count; this state has none (normalize=False?)")
    if tuple(state.z.shape) != (b, h, d) or tuple(state.count.shape) != (b, h, g):
        raise ValueError(
            f"state: z {tuple(state.z.shape)} and count {tuple(state.count.shape)} do not match "
            f"expected {(b, h, d)} and {(b, h, g)}"
        )
    return RecurrentState(state.s.to(cdt), state.z.to(cdt), state.count.to(cdt), state.num_tokens)
