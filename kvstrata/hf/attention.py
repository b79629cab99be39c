"""kvstrata's attention functions in transformers' `AttentionInterface`, the scope in which a model
attends with them, and the one side channel the interface forces.

Scope: `attending(config)` selects the `kvstrata` implementation on a config and puts back the
one it replaced when the last user leaves (users are counted, so caches and blocks nest). A
`CompressedCache` is such a user for its lifetime (until `close()`, the end of its `with` block,
or garbage collection); nothing stays switched after it. The `kvstrata` function behaves exactly
like the implementation it replaced (sdpa, or eager) for every call but one: a decode step whose
cache layer offered its encoded storage. Then it attends straight from the codes
(`kvstrata.read.decode.decode_attention`) and the layer never builds a dense copy.

Side channel: transformers calls `cache.update(...)` and then the layer's attention function with
no way to pass anything between them, so the cache leaves its offer (`offer`: the encoded view;
`offer_keep`: a layer waiting for keep scores) in a `ContextVar` for exactly the next attention
call of that layer (`take`). Threads (a server) never see each other's offers.
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
from kvstrata.read.decode import EncodedView, decode_attention

NAME = "kvstrata"
_OFFER: ContextVar[tuple[int, EncodedView] | None] = ContextVar("kvstrata_offer", default=None)
_KEEP: ContextVar[tuple[int, object] | None] = ContextVar("kvstrata_keep", default=None)
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


def offer(layer_idx: int, view: EncodedView | None) -> None:
    """The cache's `update` for `layer_idx` returned only its full-precision tail; the rest is `view`
    (None: it returned everything)."""
    _OFFER.set(None if view is None else (layer_idx, view))


def take(layer_idx: int) -> EncodedView | None:
    """The view offered for `layer_idx` (once), or None."""
    got = _OFFER.get()
    if got is None or got[0] != layer_idx:
        return None
    _OFFER.set(None)
    return got[1]


def offer_keep(layer_idx: int, layer) -> None:
    """`layer` (None: no layer) holds its prefill in full precision until this layer's attention
    scores it; set on every cache update, so an offer never outlives the attention call it is for."""
    _KEEP.set(None if layer is None else (layer_idx, layer))


def score_keep(module, query, key, value, attention_mask, **kwargs) -> None:
    """If this layer's keep policy waits for scores: the attention probabilities of the prompt's last
    `window` queries (eager, over the same keys and mask), averaged per KV group, handed over."""
    got = _KEEP.get()
    if got is None or got[0] != module.layer_idx:
        return
    _KEEP.set(None)
    layer = got[1]
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


def attend_view(module, query, view: EncodedView, key, value, attention_mask, scaling=None, **kwargs):
    """A decode step over `view` + the tail `key, value`: fused when the mask hides nothing, else
    through the dense reference (decoded once) and the replaced implementation."""
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1 and all_visible(attention_mask, view.tokens + key.shape[-2]):
        out = decode_attention(query, view, key, value, scaling, kwargs.get("softcap"))
        return out[:, None].to(query.dtype), None
    ks, vs = view.dense(key.dtype)
    key, value = torch.cat(ks + [key], -2), torch.cat(vs + [value], -2)
    return delegate(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


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


def _kvstrata_attention(module, query, key, value, attention_mask, **kwargs):
    view = take(module.layer_idx)
    if attention_mask is not None:  # decode steps without padding pass none: nothing to align
        attention_mask = fit_mask(attention_mask, key.shape[-2] + (view.tokens if view is not None else 0))
    if view is None:
        out = delegate(module, query, key, value, attention_mask, **kwargs)
        score_keep(module, query, key, value, attention_mask, **kwargs)
        return out
    return attend_view(module, query, view, key, value, attention_mask, **kwargs)


READERS = {NAME}


def register_reader(name: str, fn) -> None:
    """Register an attention implementation that accepts offered views (the sparse reader)."""
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    READERS.add(name)


register_reader(NAME, _kvstrata_attention)
