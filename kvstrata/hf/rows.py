"""One step over rows: the append both cache adapters call, and the one attention function.

A row is one sequence's share of a forward: a single sequence (`CompressedCache.update`, the whole
query, under the mask transformers built) is a batch of one; a server's batched step
(`RaggedCache.update`) is many rows packed along the sequence axis, each under its own mask. Either
adapter appends each row through `append_part` (the policy for a step: offer the encoded view to a
decode step, leave its encoding to the step's end) and leaves the layer's parts for the attention
call that follows (`offer` / `take`: the one side channel transformers' interface forces). The
`kvstrata` attention function then attends every row the same way: a decode step whose mask hides
nothing reads straight from its codes (all such rows in one varlen kernel call, a top-k read state's
picks as a per-row selection), anything else densely as the implementation kvstrata replaced; a
keep policy waiting for the prefill's scores gets them from the same call.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvstrata.hf.attention import (
    NAME,
    READERS,
    all_visible,
    delegate,
    eager_attention,
    fit_mask,
    register_reader,
    score_keep,
)
from kvstrata.read.decode import EncodedView, decode_attention_rows
from kvstrata.read.sparse import LazyKeys, ReadState, select

#: the same function, for a batched forward: no mask function (each row builds its own mask)
BATCH = "kvstrata_batch"
_PARTS: ContextVar[tuple[int, list] | None] = ContextVar("kvstrata_parts", default=None)
MODEL_MASK = "model"  # a row of one: its queries attend under the mask transformers built


@dataclass
class Part:
    """One row's share of a layer's step: what its cache layer returned, and how its queries attend.

    `mask`: the row's own visibility as transformers would pass it for one sequence (None: causal
    alone, or nothing, hides keys), or MODEL_MASK; `row`: the batched row it belongs to (a row that
    fails fails alone), None for a single sequence (an error raises)."""

    n: int
    keys: torch.Tensor
    values: torch.Tensor
    view: EncodedView | None
    layer: object
    mask: torch.Tensor | str | None
    read: ReadState | None
    row: object = None


def row_mask(layer, n: int) -> torch.Tensor | None:
    """`[n, kv]` visibility of the keys `layer` returns for `n` new queries (taken before the append),
    or None when every key is visible: causal from the layer's query offset and mask sizes, and
    within its window when sliding -- what transformers' mask functions give a single sequence."""
    kv_len, kv_off = layer.get_mask_sizes(n)
    q0 = layer.get_seq_length()
    window = getattr(layer, "sliding_window", None) if layer.is_sliding else None
    if n == 1 and kv_off + kv_len - 1 <= q0 and (not window or q0 - kv_off < window):
        return None  # a decode step that sees every key held (no tensors built)
    q = q0 + torch.arange(n)[:, None]
    kv = kv_off + torch.arange(kv_len)[None]
    mask = kv <= q
    if window:
        mask &= q - kv < window
    return mask


def _as_passed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A row's `[n, kv]` mask as transformers passes one sequence's: none where causality alone (or
    nothing) hides keys, else `[1, 1, n, kv]`."""
    if mask is None:
        return None
    n, kv = mask.shape
    causal = n == kv and bool(mask.equal(torch.ones(n, n, dtype=torch.bool).tril()))
    return None if causal or bool(mask.all()) else mask[None, None]


def append_part(cache, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, *,
                reads: bool, defer: bool, row=None) -> Part:
    """Append one row's new K/V to `cache`'s layer: the step's policy, for both adapters. `reads`: the
    attention that follows takes encoded views (a decode step then gets only the tail back);
    `defer`: the layer's encoding waits for the step's end (`flush_many`); `row`: a batched row,
    whose mask is built from its own layer."""
    layer = cache.layers[layer_idx]
    n = key_states.shape[-2]
    mask = _as_passed(row_mask(layer, n)) if row is not None else MODEL_MASK
    keys, values, view = layer.append(key_states, value_states, offer=reads and cache.fused, defer=defer)
    read = getattr(row, "read", None) or getattr(cache, "read", None)
    return Part(n, keys, values, view, layer, mask, read, row)


def offer(layer_idx: int, parts: list[Part]) -> None:
    """The parts of `layer_idx`'s step, for exactly its next attention call (set on every update,
    so none outlives the call it is for)."""
    _PARTS.set((layer_idx, parts))


def take(layer_idx: int) -> list[Part] | None:
    """The parts offered for `layer_idx` (once), or None."""
    got = _PARTS.get()
    if got is None or got[0] != layer_idx:
        return None
    _PARTS.set(None)
    return got[1]


def _decoding(part: Part, layer_idx: int) -> bool:
    """A top-k read applies: a decode step of a layer its read state schedules."""
    return part.read is not None and part.n == 1 and layer_idx in part.read.modes


def _picks(part: Part, layer_idx: int, q: torch.Tensor, keys) -> torch.Tensor:
    """The positions the row's read state picks for this decode step over `keys` (dense, or `LazyKeys`
    over its view and tail)."""
    return select(part.read, layer_idx, q, keys, part.read.layers[layer_idx].read_prefix)


def _dense(module, q: torch.Tensor, part: Part, visible: bool, scaling: float, **kwargs) -> torch.Tensor:
    """A prefill chunk, a step whose layer offered no view, or one whose mask hides something:
    attention over the dense keys under the row's mask (a top-k decode step gathers its picks); a
    keep policy waiting for scores gets them here."""
    keys, values = part.keys, part.values
    if part.view is not None:  # decode the view once
        ks, vs = part.view.dense(keys.dtype)
        keys, values = torch.cat(ks + [keys], -2), torch.cat(vs + [values], -2)
    layer_idx = module.layer_idx
    if visible and _decoding(part, layer_idx):
        idx = _picks(part, layer_idx, q, keys)
        gather = idx[..., None].expand(-1, -1, -1, keys.shape[-1])
        out, _ = eager_attention(module, q, keys.gather(2, gather), values.gather(2, gather), None,
                                 scaling=scaling, **kwargs)
        return out
    out, _ = delegate(module, q, keys, values, part.mask, scaling=scaling, **kwargs)
    if part.layer.pending_keep:
        score_keep(part.layer, module, q, keys, values, part.mask, scaling=scaling, **kwargs)
    return out


def attend_rows(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """`query: [b, hq, tokens, d]` of every row offered for this layer -> `[b, tokens, hq, d]`, each row
    over its own cache layer (rows are along the token axis; a row of one may hold a batch)."""
    layer_idx = module.layer_idx
    parts = take(layer_idx)
    if parts is None:  # nothing offered: a forward over a cache that is not kvstrata's
        return delegate(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    outs: list[torch.Tensor | None] = []
    fused: list[tuple[int, torch.Tensor, Part, torch.Tensor | None]] = []  # (row, query, part, picks)
    start = 0
    for i, part in enumerate(parts):
        q = query[:, :, start:start + part.n]
        start += part.n
        outs.append(None)
        if part.row is not None and part.row.error is not None:
            outs[i] = query.new_zeros(q.shape[0], part.n, *query.shape[1::2])
            continue
        try:
            tokens = part.keys.shape[-2] + (part.view.tokens if part.view is not None else 0)
            if part.mask is MODEL_MASK:
                part.mask = fit_mask(attention_mask, tokens)
            visible = part.n == 1 and all_visible(part.mask, tokens)
            if part.view is not None and visible:
                sparse = _decoding(part, layer_idx)
                picks = _picks(part, layer_idx, q, LazyKeys(part.view, part.keys)) if sparse else None
                fused.append((i, q, part, picks))
                continue
            outs[i] = _dense(module, q, part, visible, scaling, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a batched row fails alone; a single sequence raises
            if part.row is None:
                raise
            part.row.error = exc
            outs[i] = query.new_zeros(q.shape[0], part.n, *query.shape[1::2])
    if fused:
        got = decode_attention_rows([q for _, q, _, _ in fused], [p.view for _, _, p, _ in fused],
                                    [p.keys for _, _, p, _ in fused], [p.values for _, _, p, _ in fused],
                                    scaling, kwargs.get("softcap"), idxs=[ix for *_, ix in fused])
        for (i, *_), out in zip(fused, got):
            outs[i] = out[:, None].to(query.dtype)
    return torch.cat(outs, 1), None


register_reader(NAME, attend_rows)
AttentionInterface.register(BATCH, attend_rows)
READERS.add(BATCH)  # a batched forward: no mask function, each row builds its own
