"""Observation-window probe through transformers' public attention registry.

`probing(model)` swaps the model's attention implementation for one that computes ordinary
(eager) attention and records, per layer, the queries (post-RoPE) and attention probabilities of
the tokens it processes. Keep policies (SnapKV) use the probabilities; FreqDepthKV's head probe
uses the queries. Registered with `AttentionInterface` / `AttentionMaskInterface`, the public
extension points, so no model code or private keyword argument is touched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "kvstrata_probe"


@dataclass
class Recording:
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [b, q_heads, w, d]
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [b, q_heads, w, kv_len]


_ACTIVE: list[Recording] = []


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Eager attention (GQA-aware, additive mask, optional softcap) that records what it saw."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[-2]]
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    if _ACTIVE:
        rec = _ACTIVE[-1]
        rec.queries[module.layer_idx] = query.detach()
        rec.probs[module.layer_idx] = probs.detach()
    return torch.matmul(probs, v).transpose(1, 2).contiguous(), probs


AttentionInterface.register(NAME, _probe_attention)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextlib.contextmanager
def probing(model):
    """Within the block, forward passes record queries and attention probabilities per layer."""
    previous = model.config._attn_implementation
    rec = Recording()
    model.set_attn_implementation(NAME)
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.pop()
        model.set_attn_implementation(previous)
