"""One forward over many sequences, each with its own `CompressedCache`: a server's batched step.

The rows (a decode token of each running request, chunks of waiting prefills) are packed along the
sequence axis of a single `[1, tokens]` input with each row's own positions, so the linear layers
run once over the whole batch. Attention is per row: `RaggedCache.update` appends each row's new
K/V to that row's cache layer (its length, segments, sink, replay state -- nothing shared), and
the `kvstrata_batch` attention function attends each row over what its layer returned: decode
rows straight from their codes, all of them in one varlen kernel call
(`kvstrata.read.decode.decode_attention_rows`), prefill chunks densely under their own causal (and
sliding-window) mask, built from the layer's own sizes exactly as transformers builds it for one
sequence. Nothing is padded. A row that fails (an exception in its cache) fails alone: the rest of
the forward gives it zeros and `batched_forward` reports it; the other rows' results are unchanged.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from kvstrata.hf.attention import READERS, delegate, hooked, offer_keep, score_keep
from kvstrata.hf.layers import flush_many
from kvstrata.hf.run import cache_kwarg
from kvstrata.read.decode import EncodedView, decode_attention_rows
from kvstrata.read.sparse import LazyKeys, ReadState, select

NAME = "kvstrata_batch"
_BATCH: ContextVar["RaggedCache | None"] = ContextVar("kvstrata_batch", default=None)


@dataclass(kw_only=True)
class Row:
    """One sequence's share of a step: `ids` appended to `cache` (from its current length);
    `read`: its top-k read state when its method reads sparsely."""

    cache: object  # CompressedCache
    ids: list[int]
    read: ReadState | None = None
    error: BaseException | None = field(default=None, init=False)


@dataclass
class _Part:
    """What one row's layer returned for this step, and the mask its queries attend under."""

    keys: torch.Tensor
    values: torch.Tensor
    view: EncodedView | None
    mask: torch.Tensor | None  # bool [n, keys (+ view tokens)]; None: every key visible
    layer: object


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


class _Slot(CacheLayerMixin):
    """Stands in for a layer of the batch (the rows' own layers hold the K/V)."""

    is_compileable = is_croppable = False

    def __init__(self, sliding: bool):
        super().__init__()
        self.is_sliding = sliding

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never called
        raise NotImplementedError

    def update(self, *args, **kwargs):  # pragma: no cover - RaggedCache.update handles every call
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0


class RaggedCache(Cache):
    """The batch as transformers sees one cache: `update` appends each row's slice to its own cache."""

    def __init__(self, rows: list[Row]):
        self.rows = rows
        first = rows[0].cache.layers
        super().__init__(layers=[_Slot(layer.is_sliding) for layer in first])
        self.parts: dict[int, list[_Part | None]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        parts: list[_Part | None] = []
        start = 0
        for row in self.rows:
            n = len(row.ids)
            k, v = key_states[:, :, start:start + n], value_states[:, :, start:start + n]
            start += n
            parts.append(None if row.error is not None else _append(row, layer_idx, k, v))
        self.parts[layer_idx] = parts
        _flush(self.rows, layer_idx)
        return key_states, value_states


def _append(row: Row, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> _Part | None:
    try:
        layer = row.cache.layers[layer_idx]
        mask = row_mask(layer, k.shape[-2])
        keys, values, view = layer.append(k, v, offer=row.cache.fused, defer=True)
        return _Part(keys, values, view, mask, layer)
    except Exception as exc:  # noqa: BLE001 - this row fails, the batch goes on
        row.error = exc
        return None


def _flush(rows: list[Row], layer_idx: int) -> None:
    """Encode the decode rows' new tokens of this layer together; should that fail, each row alone
    (a row whose own flush fails fails alone)."""
    due = [row for row in rows if row.error is None and row.cache.layers[layer_idx].deferred]
    try:
        flush_many([row.cache.layers[layer_idx] for row in due])
    except Exception:  # noqa: BLE001 - find the row it came from: flushing is idempotent
        for row in due:
            try:
                row.cache.layers[layer_idx]._flush()
            except Exception as exc:  # noqa: BLE001
                row.error = exc


def _batch_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """`query: [1, hq, tokens, d]` of every row -> `[1, tokens, hq, d]`, each row over its own cache."""
    batch = _BATCH.get()
    layer_idx = module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    outs: list[torch.Tensor | None] = []
    fused: list[tuple[int, torch.Tensor, _Part, torch.Tensor | None]] = []  # (row, query, part, idx)
    start = 0
    for i, (row, part) in enumerate(zip(batch.rows, batch.parts.pop(layer_idx))):
        n = len(row.ids)
        q = query[:, :, start:start + n]
        start += n
        outs.append(None)
        if part is None or row.error is not None:
            outs[i] = query.new_zeros(1, n, *query.shape[1::2])
            continue
        try:
            if part.view is not None and n == 1 and (part.mask is None or bool(part.mask.all())):
                fused.append((i, q, part, _sparse_idx(row, layer_idx, q, part)))
                continue
            outs[i] = _dense(module, row, layer_idx, q, part, scaling, **kwargs)
        except Exception as exc:  # noqa: BLE001 - this row fails, the batch goes on
            row.error = exc
            outs[i] = query.new_zeros(1, n, *query.shape[1::2])
    if fused:
        got = decode_attention_rows([q for _, q, _, _ in fused], [p.view for _, _, p, _ in fused],
                                    [p.keys for _, _, p, _ in fused], [p.values for _, _, p, _ in fused],
                                    scaling, softcap, idxs=[ix for *_, ix in fused])
        for (i, *_), out in zip(fused, got):
            outs[i] = out[:, None].to(query.dtype)
    return torch.cat(outs, 1), None


def _sparse_idx(row: Row, layer_idx: int, q: torch.Tensor, part: _Part) -> torch.Tensor | None:
    """The positions a top-k read picks for this row's decode step, or None (read everything)."""
    state = row.read
    if state is None or layer_idx not in state.modes:
        return None
    return select(state, layer_idx, q, LazyKeys(part.view, part.keys), state.layers[layer_idx].read_prefix)


def _dense(module, row: Row, layer_idx: int, q: torch.Tensor, part: _Part, scaling: float, **kwargs):
    """A prefill chunk (or a step whose layer offered no view): attention over the dense keys the layer
    returned, under the row's own mask; a keep policy waiting for scores gets them here."""
    keys, values = part.keys, part.values
    if part.view is not None:  # a decode step whose mask hides something: decode the view once
        ks, vs = part.view.dense(keys.dtype)
        keys, values = torch.cat(ks + [keys], -2), torch.cat(vs + [values], -2)
    # what transformers passes one sequence: no mask where causality alone (or nothing) hides keys
    mask = part.mask
    if mask is not None:
        n, kv = mask.shape
        causal = n == kv and bool(mask.equal(torch.ones(n, n, dtype=torch.bool).tril()))
        mask = None if causal or bool(mask.all()) else mask[None, None]
    out, _ = delegate(module, q, keys, values, mask, scaling=scaling, **kwargs)
    if part.layer.pending_keep:
        offer_keep(layer_idx, part.layer)
        score_keep(module, q, keys, values, mask, scaling=scaling, **kwargs)
    return out


AttentionInterface.register(NAME, _batch_attention)
READERS.add(NAME)  # decode rows read their codes; no mask function: each row builds its own


def batched_forward(model, rows: list[Row]) -> torch.Tensor:
    """Append every row's `ids` to its cache in one forward; next-token logits after each row's last
    token, `[rows, vocab]` (a failed row's are zeros and its `error` is set)."""
    ids = [t for row in rows for t in row.ids]
    starts = [row.cache.get_seq_length() for row in rows]
    positions = [p for row, s in zip(rows, starts) for p in range(s, s + len(row.ids))]
    ends, at = [], -1
    for row in rows:
        at += len(row.ids)
        ends.append(at)
    batch = RaggedCache(rows)
    with torch.inference_mode(), hooked(model, NAME, _BATCH, batch):
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True,
                    logits_to_keep=torch.tensor(ends), **{cache_kwarg(model): batch})
        logits = out.logits[0]
        for i, row in enumerate(rows):
            if row.error is not None:
                logits[i] = 0
    return logits
