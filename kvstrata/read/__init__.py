"""Read stratum: what one decode step reads (dense, or top-k sparse with a layer schedule)."""

from __future__ import annotations

import contextlib

from kvstrata.read.sparse import ReadState, TopK, sparse_reading


def reading(model, cache, spec):
    """Context in which decode steps read as `spec` says: sparse for a `topk` component, else dense
    (yields None)."""
    cfg = spec.full.read_config()
    return sparse_reading(model, cache, cfg) if cfg else contextlib.nullcontext()


__all__ = ["ReadState", "TopK", "reading", "sparse_reading"]
