"""Observation-window probe through transformers' public attention registry.

`probing(model)` swaps the model's attention implementation for one that computes ordinary
(eager) attention and records, per layer, the queries (post-RoPE) and attention probabilities of
the tokens it processes. Keep policies (SnapKV) use the probabilities; FreqDepthKV's head probe
uses the queries. Registered with `AttentionInterface` / `AttentionMaskInterface`, the public
extension points, so no model code or private keyword argument is touched.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvstrata.hf.attention import eager_attention, hooked

NAME = "kvstrata_probe"


@dataclass
class Recording:
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [b, q_heads, w, d]
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [b, q_heads, w, kv_len]


_ACTIVE: ContextVar[Recording | None] = ContextVar("kvstrata_probe", default=None)


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """Eager attention that records, per layer, the queries and probabilities it saw."""
    out, probs = eager_attention(module, query, key, value, attention_mask, **kwargs)
    rec = _ACTIVE.get()
    if rec is not None:
        rec.queries[module.layer_idx] = query.detach()
        rec.probs[module.layer_idx] = probs.detach()
    return out, probs


AttentionInterface.register(NAME, _probe_attention)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextlib.contextmanager
def probing(model):
    """Within the block, forward passes record queries and attention probabilities per layer."""
    with hooked(model, NAME, _ACTIVE, Recording()) as rec:
        yield rec
