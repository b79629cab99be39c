"""Key centering (`center=1`): the codes hold the keys less their per-channel prefill mean.

Keys often sit far from zero in a few channels, which sets every block's range; the mean is a
constant per channel, so the codes need not carry it. On decode the mean is added back; in the
fused read `q.k = q.(k - m) + q.m` shifts every score of a query by the same `q.m`, which the
softmax ignores unless a softcap bends the scores first (then it is added as a score bias).
State: `mean: [b, kv_heads, 1, head_dim]` float32, counted in the layer's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.transform import Attend, State, Transform, per_query_head
from kvstrata.knobs import flag, knob, render_flag


@dataclass(frozen=True)
class Center(Transform):
    center: bool = knob(
        False, "keys less their per-channel prefill mean are encoded; the mean (head_dim fp32 per KV "
        "head and layer, counted) is added back on decode", "0 or 1", flag, render=render_flag, position=50)
    order: ClassVar[int] = 10

    def fit(self, keys: torch.Tensor) -> State:
        return {"mean": keys.float().mean(-2, keepdim=True)}

    def forward(self, keys, values, state):
        return keys - state["mean"], values, {}

    def inverse_keys(self, keys, state, side):
        return (keys + state["mean"]).to(keys.dtype)

    def enter(self, a: Attend, state: State, side):
        m = state["mean"].float()
        if a.softcap:  # a shift the softmax forgets, unless a softcap bends the scores first
            qm = (a.query.float() * per_query_head(m, a.query)).sum(-1)  # [b, hq, 1]
            shift = qm.expand(-1, -1, a.tokens)
            a.bias = shift if a.bias is None else a.bias + shift
        a.tail_k = a.tail_k.float() - m
        return None
