"""A cache layer's phase: where it is in its life, as one value (`CompressedLayer.phase`)."""

from __future__ import annotations

from dataclasses import dataclass

EMPTY, PREFILL, DECODE, DUE = "empty", "prefill", "decode", "flush due"


@dataclass(frozen=True)
class Phase:
    """Where a layer is, as one value: what its next append and flush do.

    `kind`: EMPTY (nothing held, or a sliding layer rebuilding its window: the next append is a
    prefill), PREFILL (the prefill is held in full precision; its flush encodes it whole, the last
    key group ragged; between calls this means it waits for the attention hook's keep scores), DECODE
    (appends are decode steps or chunks, every token so far settled), DUE (a decode step left its
    encoding to `flush_many`). `replay_until`: positions below it are held already and are not
    appended again (a bounded replay)."""

    kind: str = EMPTY
    replay_until: int = 0
