"""Read stratum: what one decode step reads (dense, or top-k sparse with a layer schedule), and the
decode-attention op that reads it straight from encoded KV. One read method per module, one
registry line each."""

from __future__ import annotations

from kvstrata.read.decode import EncodedView, decode_attention
from kvstrata.read.sparse import ReadState, TopK
from kvstrata.registry import register

register(TopK, "read")

__all__ = ["EncodedView", "ReadState", "TopK", "decode_attention"]
