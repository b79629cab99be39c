"""Decode steps that read what the read stratum picks: `reading(model, cache, spec)`.

For a `topk` recipe the model's attention becomes `kvstrata_sparse`: at a decode step each
full-attention layer asks `kvstrata.read.sparse.select` for the positions to read (sinks, recent
window, indexed top-k) and attends over only those, straight from the encoded entries when the
cache offered its encoded view (no dense copy of the layer), else by gathering from the dense
keys. Everything else (prefill, sliding layers) attends as `kvstrata` attention does.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from kvstrata.hf.attention import (
    attend_view,
    delegate,
    eager_attention,
    hooked,
    register_reader,
    take,
)
from kvstrata.hf.cache import head_dim
from kvstrata.methods import parse_method
from kvstrata.read.decode import decode_attention
from kvstrata.read.sparse import LazyKeys, ReadState, TopK, build_index, select

NAME = "kvstrata_sparse"
_STATE: ContextVar[ReadState | None] = ContextVar("kvstrata_read_state", default=None)


def _sparse_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    state, layer = _STATE.get(), module.layer_idx
    view = take(layer)
    decoding = state is not None and query.shape[2] == 1 and layer in state.modes
    if not decoding:
        if view is not None:
            return attend_view(module, query, view, key, value, attention_mask, scaling=scaling, **kwargs)
        return delegate(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefix = state.layers[layer].read_prefix  # the rows of this step's keys held encoded
    if view is not None:
        idx = select(state, layer, query, LazyKeys(view, key), prefix)
        out = decode_attention(query, view, key, value, scaling, kwargs.get("softcap"), idx=idx)
        return out[:, None].to(query.dtype), None
    idx = select(state, layer, query, key, prefix)
    gather = idx[..., None].expand(-1, -1, -1, key.shape[-1])
    return eager_attention(
        module, query, key.gather(2, gather), value.gather(2, gather), None, scaling=scaling, **kwargs
    )


register_reader(NAME, _sparse_attention)


def new_state(model, cache, cfg: TopK) -> ReadState:
    """A fresh read state for `cache`: which full-attention layers read top-k, byte counts at zero,
    and the index rows of what the cache holds now (a prefilled cache's Full and Reindex layers
    start decoding with their index written; an empty one's is written at its first step)."""
    full = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    modes = dict(zip(full, cfg.modes(len(full))))
    state = ReadState(cfg=cfg, modes=modes, layers=list(cache.layers), head_dim=head_dim(model.config))
    if getattr(cache, "fused", False):
        for i, mode in modes.items():
            layer = cache.layers[i]
            view = layer.view() if mode in "FR" and layer.reads_views and layer.is_initialized else None
            if view is not None and view.tokens:
                build_index(state, i, LazyKeys(view, layer.keys), (layer.generation, view.tokens))
    return state


def read_state(model, cache, spec) -> ReadState | None:
    """`cache`'s read state when `spec` (a string or parsed MethodSpec) reads top-k, else None (a
    batched step carries one per row)."""
    spec = parse_method(spec) if isinstance(spec, str) else spec
    return new_state(model, cache, spec.full.read) if spec.full.read else None


@contextlib.contextmanager
def sparse_reading(model, cache, cfg: TopK):
    """Within the block, decode steps read sparsely; yields the ReadState with byte counts."""
    with hooked(model, NAME, _STATE, new_state(model, cache, cfg)) as state:
        yield state


def reading(model, cache, spec):
    """Context in which decode steps read as `spec` (a spec string or a parsed MethodSpec) says:
    sparse for a `topk` component, else dense (yields None)."""
    spec = parse_method(spec) if isinstance(spec, str) else spec
    cfg = spec.full.read
    return sparse_reading(model, cache, cfg) if cfg else contextlib.nullcontext()
