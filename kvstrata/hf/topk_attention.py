"""Decode steps that read what the read stratum picks: `reading(model, cache, spec)`.

For a `topk` recipe the cache carries a read state (`cache.read`) for the block's lifetime; the one
attention function (`kvstrata.hf.rows.attend_rows`) then asks `kvstrata.read.sparse.select`, at
each decode step of a full-attention layer the state schedules, for the positions to read (sinks,
recent window, indexed top-k) and attends over only those: straight from the encoded entries when
the cache offered its encoded view (no dense copy of the layer), else by gathering from the dense
keys. A batched row carries its own state (`Row.read`). Everything else (prefill, sliding layers)
attends as it would without.
"""

from __future__ import annotations

import contextlib

from kvstrata.hf.attention import attending
from kvstrata.hf.cache import head_dim
from kvstrata.methods import parse_method
from kvstrata.read.sparse import LazyKeys, ReadState, TopK, build_index


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
    """Within the block, `cache`'s decode steps read sparsely; yields the ReadState with byte counts."""
    state = new_state(model, cache, cfg)
    with attending(model.config):
        cache.read = state
        try:
            yield state
        finally:
            cache.read = None


def reading(model, cache, spec):
    """Context in which decode steps read as `spec` (a spec string or a parsed MethodSpec) says:
    sparse for a `topk` component, else dense (yields None)."""
    spec = parse_method(spec) if isinstance(spec, str) else spec
    cfg = spec.full.read
    return sparse_reading(model, cache, cfg) if cfg else contextlib.nullcontext()
