"""One forward over many sequences, each with its own `CompressedCache`: a server's batched step.

The rows (a decode token of each running request, chunks of waiting prefills) are packed along the
sequence axis of a single `[1, tokens]` input with each row's own positions, so the linear layers
run once over the whole batch. Attention is per row: `RaggedCache.update` appends each row's new
K/V to that row's cache layer through the same `append_part` a single sequence's cache calls (its
length, segments, sink, replay state -- nothing shared), and the one attention function
(`kvstrata.hf.rows.attend_rows`) attends each row over what its layer returned: decode rows
straight from their codes, all of them in one varlen kernel call, prefill chunks densely under
their own causal (and sliding-window) mask, built from the layer's own sizes exactly as
transformers builds it for one sequence. Nothing is padded. A row that fails (an exception in its
cache) fails alone: the rest of the forward gives it zeros and `batched_forward` reports it; the
other rows' results are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvstrata.hf.attention import selecting
from kvstrata.hf.layers import flush_many
from kvstrata.hf.rows import BATCH, Part, append_part, offer
from kvstrata.hf.run import cache_kwarg
from kvstrata.read.sparse import ReadState


@dataclass(kw_only=True)
class Row:
    """One sequence's share of a step: `ids` appended to `cache` (from its current length);
    `read`: its top-k read state when its method reads sparsely."""

    cache: object  # CompressedCache
    ids: list[int]
    read: ReadState | None = None
    error: BaseException | None = field(default=None, init=False)


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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        parts: list[Part | None] = []
        start = 0
        for row in self.rows:
            n = len(row.ids)
            k, v = key_states[:, :, start:start + n], value_states[:, :, start:start + n]
            start += n
            parts.append(_append(row, layer_idx, k, v))
        _flush(self.rows, layer_idx)
        offer(layer_idx, parts)
        return key_states, value_states


def _append(row: Row, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> Part:
    """The row's share of the step (a row that failed before, or fails now, is carried as failed)."""
    if row.error is None:
        try:
            return append_part(row.cache, layer_idx, k, v, reads=True, defer=True, row=row)
        except Exception as exc:  # noqa: BLE001 - this row fails, the batch goes on
            row.error = exc
    return Part(k.shape[-2], k, v, None, None, None, None, row)


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
    with torch.inference_mode(), selecting(model.config.get_text_config(decoder=True), BATCH):
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True,
                    logits_to_keep=torch.tensor(ends), **{cache_kwarg(model): batch})
        logits = out.logits[0]
        for i, row in enumerate(rows):
            if row.error is not None:
                logits[i] = 0
    return logits
