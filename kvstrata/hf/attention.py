"""The scope in which a model attends with kvstrata's attention, and the pieces it shares.

Scope: `attending(config)` selects the `kvstrata` implementation on a config and puts back the
one it replaced when the last user leaves (users are counted, so caches and blocks nest). A
`CompressedCache` is such a user for its lifetime (until `close()`, the end of its `with` block,
or garbage collection); nothing stays switched after it. The function itself
(`kvstrata.hf.rows.attend_rows`, one for a single sequence, a batched step and top-k reads)
behaves exactly like the implementation it replaced (sdpa, or eager) for every call but a decode
step whose cache layer offered its encoded storage: that step attends straight from the codes.
This module holds what it delegates to (`delegate`, `eager_attention`), the mask helpers and the
keep policies' scoring (`score_keep`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvstrata.keep import window_scores

NAME = "kvstrata"
# id(config) -> [config, the implementation `kvstrata` replaced, users]
_SCOPES: dict[int, list] = {}
_LOCK = threading.Lock()


def attention_implementation(config) -> str | None:
    """The attention implementation a config selects (transformers keeps it in a private field)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, name: str) -> None:
    config._attn_implementation = name


def base_implementation(config) -> str:
    """What `kvstrata` delegates to for this config: the implementation it replaced."""
    scope = _SCOPES.get(id(config))
    return scope[1] if scope is not None and scope[0]() is config else "sdpa"


def enter_scope(config):
    """Select `kvstrata` attention on `config` (and so on every model sharing it) until the returned
    function is called; scopes on one config are counted, the last one out restores the
    implementation the first one replaced."""
    with _LOCK:
        key = id(config)
        scope = _SCOPES.get(key)
        if scope is None or scope[0]() is not config:
            current = attention_implementation(config)
            base = current if current in ("sdpa", "eager") else "sdpa"
            scope = _SCOPES[key] = [weakref.ref(config), base, 0]
            set_attention_implementation(config, NAME)
        scope[2] += 1
    done = []

    def leave() -> None:
        with _LOCK:
            if done or _SCOPES.get(key) is not scope:
                return
            done.append(True)
            scope[2] -= 1
            if scope[2] == 0:
                del _SCOPES[key]
                target = scope[0]()
                if target is not None and attention_implementation(target) == NAME:
                    set_attention_implementation(target, scope[1])

    return leave


@contextlib.contextmanager
def attending(config):
    """Within the block a model with `config` attends with `kvstrata` (see `enter_scope`)."""
    leave = enter_scope(config)
    try:
        yield
    finally:
        leave()


@contextlib.contextmanager
def hooked(model, name: str, var: ContextVar, value):
    """Within the block the model attends with implementation `name` and `var` holds `value` (the
    hook's state); the block holds an attention scope of its own, so what `kvstrata` replaced is
    restored after it even when the caches that selected it go away inside the block."""
    leave = enter_scope(model.config)
    model.set_attn_implementation(name)
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
        model.set_attn_implementation(NAME)
        leave()


@contextlib.contextmanager
def selecting(config, name: str):
    """Within the block a model with `config` attends with implementation `name` (one of kvstrata's);
    the block holds an attention scope of its own. Sets the config alone: no walk over the model's
    modules, which a batched step would pay at every step."""
    leave = enter_scope(config)
    set_attention_implementation(config, name)
    try:
        yield
    finally:
        set_attention_implementation(config, NAME)
        leave()


@contextlib.contextmanager
def stock_attention(config):
    """Within the block the model attends with the implementation kvstrata replaced (reference
    rows and peers run with no kvstrata code on the attention path)."""
    current = attention_implementation(config)
    if current not in READERS:
        yield
        return
    set_attention_implementation(config, base_implementation(config))
    try:
        yield
    finally:
        set_attention_implementation(config, current)


def reads_encoded(config) -> bool:
    """Whether a decode step's attention on `config` can take an offered encoded view."""
    return attention_implementation(config) in READERS


def score_keep(layer, module, query, key, value, attention_mask, **kwargs) -> None:
    """`layer`'s keep policy waits for the prefill's scores: the attention probabilities of its last
    `window` queries (eager, over the same keys and mask), averaged per KV group, handed over."""
    w = min(layer.recipe.keep.window, query.shape[2])
    mask = attention_mask[..., -w:, :] if attention_mask is not None else None
    _, probs = eager_attention(module, query[:, :, -w:], key, value, mask, **kwargs)
    layer.finish_keep(window_scores(probs, key.shape[1]))


def eager_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs
):
    """Plain attention (GQA, additive or boolean mask, optional softcap): `[b, q, hq, d]` and the
    probabilities `[b, hq, q, kv]`. The one eager implementation kvstrata's hooks share."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (
        scaling if scaling is not None else query.shape[-1] ** -0.5
    )
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., : k.shape[-2]]
        low = torch.finfo(scores.dtype).min  # not -inf: a fully masked (padding) row stays finite
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
    elif query.shape[2] > 1:  # sdpa-style masks leave plain causal attention to the kernel: apply it
        q_len, kv_len = query.shape[2], k.shape[-2]
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous(), probs


def delegate(module, query, key, value, attention_mask, **kwargs):
    """Attention as the replaced implementation computes it."""
    if base_implementation(module.config) == "sdpa" and kwargs.get("softcap") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return eager_attention(module, query, key, value, attention_mask, **kwargs)


def all_visible(mask: torch.Tensor | None, kv_len: int) -> bool:
    """A decode step's mask hides nothing among `kv_len` keys (no padding, nothing out of window)."""
    if mask is None:
        return True
    if mask.shape[-1] < kv_len:
        return False
    m = mask[..., :kv_len]
    return bool(m.all()) if m.dtype == torch.bool else bool((m == 0).all())


def fit_mask(mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """The model builds one mask per layer type from its first layer's sizes; a layer whose keep
    policy held a different number of entries (per-layer specs) gets it aligned to its own keys:
    held entries sit just before the queries, so the mask's last columns are the ones that apply
    (extra held entries at the front are visible as its first column is)."""
    if mask is None or mask.shape[-1] == kv_len:
        return mask
    if mask.shape[-1] > kv_len:
        return mask[..., -kv_len:]
    front = mask[..., :1].expand(*mask.shape[:-1], kv_len - mask.shape[-1])
    return torch.cat([front, mask], -1)


READERS = {NAME}


def register_reader(name: str, fn) -> None:
    """Register an attention implementation that accepts offered rows, with sdpa's mask function."""
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    READERS.add(name)

