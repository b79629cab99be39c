"""Key smoothing (`smooth=A`): keys divided per channel by their prefill magnitude to the power A.

A per-token scale is set by the token's largest channel, so a few outlier channels cost every
other channel its precision. Dividing each channel by (its prefill absmax)^A, normalised per head
so the keys' overall scale is kept, flattens them; the query is multiplied by the same divisors,
so `q.k` is unchanged. State: `scale: [b, kv_heads, 1, head_dim]` float32, counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.transform import Attend, State, Transform, per_query_head
from kvstrata.knobs import knob, number


def smoothing_scale(keys: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-channel key divisors `[b, kv_heads, 1, head_dim]`: each channel's largest magnitude over
    `keys: [b, kv_heads, n, head_dim]` to the power `alpha`, over their geometric mean per head."""
    s = keys.float().abs().amax(-2, keepdim=True).clamp_min(1e-6).pow(alpha)
    return s / s.log().mean(-1, keepdim=True).exp()


@dataclass(frozen=True)
class Smooth(Transform):
    smooth: float = knob(
        0.0, "keys divided per channel by their prefill magnitude to this power (normalised per head), "
        "the query multiplied by the same: q.k unchanged, outlier channels no longer set every "
        "token's scale; the divisors (head_dim fp32 per KV head and layer) are counted",
        "[0, 1]", number(0, 1), position=40)
    order: ClassVar[int] = 20

    def check_state(self, state: State, head_dim: int) -> None:
        super().check_state(state, head_dim)
        if not (state["scale"] > 0).all():
            raise ValueError("Smooth state scale holds divisors <= 0")

    def fit(self, keys: torch.Tensor) -> State:
        return {"scale": smoothing_scale(keys, self.smooth)}

    def forward(self, keys, values, state):
        return keys / state["scale"], values, {}

    def inverse_keys(self, keys, state, side):
        return (keys * state["scale"]).to(keys.dtype)

    def enter(self, a: Attend, state: State, side):
        s = state["scale"].float()
        a.query = a.query.float() * per_query_head(s, a.query)
        a.tail_k = a.tail_k.float() / s
        return None
