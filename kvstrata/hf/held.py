"""A stretch of a cache layer's tokens as the layer holds them: cut out for a store record, and
installed back into an empty layer. Codes move as they are -- no decode, no re-encode -- with the
key transforms' state that describes them.

Positions count what a layer holds, oldest first: its sink, its encoded segments, its
full-precision tail (for a full-attention layer without a keep policy, absolute positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.codecs import QTensor
from kvstrata.codecs.transform import Fitted
from kvstrata.hf.layers import CompressedLayer
from kvstrata.hf.segments import Segment, cut_segment, encode_segment, join_segments


@dataclass(kw_only=True)
class Held:
    """`sink`: K, V `[b, h, s, d]` bf16 as held; `segments`: encoded runs (codes as held); `tail`:
    full-precision K, V or None; `fitted`: the transforms and state the segments were encoded
    through (None when there are no segments)."""

    sink: tuple[torch.Tensor, torch.Tensor] | None = None
    segments: list[Segment] = field(default_factory=list)
    tail: tuple[torch.Tensor, torch.Tensor] | None = None
    fitted: Fitted | None = None

    @property
    def tokens(self) -> int:
        rows = [0 if t is None else t[0].shape[-2] for t in (self.sink, self.tail)]
        return sum(rows) + sum(s.visible for s in self.segments)

    def agrees(self, other: "Held") -> bool:
        """Whether both were encoded under the same transforms and state (or one holds no codes)."""
        return self.fitted is None or other.fitted is None or self.fitted.same_as(other.fitted)


def cut(layer: CompressedLayer, lo: int, hi: int, encode_tail: bool) -> Held:
    """Held positions [lo, hi) of `layer`. Tail rows in range are kept in full precision, or with
    `encode_tail` encoded once, through the layer's transforms (fitted now if nothing was encoded
    yet, and kept: the layer encodes its later tokens under the same state)."""
    held = Held()
    s = layer.sink_held
    if lo < s:
        held.sink = tuple(t[..., lo:min(hi, s), :] for t in layer.sink)
    offset = s
    for seg in layer.segments:
        a, b = max(lo, offset), min(hi, offset + seg.visible)
        if a < b:
            held.segments.append(cut_segment(layer.recipe, seg, a - offset, b - offset))
        offset += seg.visible
    a, b = max(lo, offset), min(hi, offset + (layer.keys.shape[-2] if layer.is_initialized else 0))
    if a < b:
        k, v = (t[..., a - offset:b - offset, :] for t in (layer.keys, layer.values))
        if encode_tail:
            held.segments.append(encode_segment(layer.recipe, k, v, layer.fit()))
        else:
            held.tail = (k, v)
    held.fitted = layer.fitted if held.segments else None
    return held


def seal(cache, block: int) -> None:
    """Leave every layer of `cache` (a `CompressedCache` fed up to a multiple of `block`) holding what
    the store's records of it hold, so a prompt continued from here runs as one continued from the
    store: a full-attention layer's full-precision tail is encoded block by block, as `cut` encodes
    a record's; spare rows are given back (an installed layer has none: appends start a segment)."""
    for layer in cache.stored_layers():
        if not isinstance(layer, CompressedLayer) or not layer.is_initialized:
            continue
        n = layer.keys.shape[-2]
        if n and not layer.is_sliding:
            start = layer.stored_tokens() - n
            edges = [start, *range((start // block + 1) * block, start + n, block), start + n]
            blocks = [cut(layer, a, b, encode_tail=True).segments for a, b in zip(edges, edges[1:])]
            layer.segments += [seg for segs in blocks for seg in segs]
            layer.keys, layer.values = (t[..., :0, :].clone() for t in (layer.keys, layer.values))
        layer.shrink()


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own size: a view into a larger buffer (another cache's, a record's
    payload) is copied, so what the layer counts is what it holds."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _owned(seg: Segment) -> Segment:
    keys, values = (QTensor(codec=q.codec, shape=q.shape, dtype=q.dtype,
                            parts={n: _own(t) for n, t in q.parts.items()}) for q in (seg.keys, seg.values))
    return Segment(keys=keys, values=values, length=seg.length, skip=seg.skip, fitted=seg.fitted)


def install(layer: CompressedLayer, parts: list[Held], seen: int, like: torch.Tensor) -> None:
    """Fill an empty `layer` with `parts` in token order (sinks first, a tail only last) as if it had
    seen `seen` tokens; `like`: a `[b, h, 0, d]` tensor of the model's dtype. Adjacent runs that
    can share one are joined (a copy, no encode). Raises ValueError when the parts do not fit."""
    if layer.cumulative_length or layer.segments:
        raise RuntimeError("install needs an empty layer")
    sinks = [p.sink for p in parts if p.sink is not None]
    segs = [s for p in parts for s in p.segments]
    fitted = [p.fitted for p in parts if p.fitted is not None]
    order = [kind for p in parts for kind, there in (("sink", p.sink), ("seg", p.segments), ("tail", p.tail))
             if there]
    if order != sorted(order, key=("sink", "seg", "tail").index) or order.count("tail") > 1:
        raise ValueError("held parts out of order: sink tokens first, a full-precision tail last")
    if any(not fitted[0].same_as(f) for f in fitted[1:]):
        raise ValueError("held parts were encoded under different transform states")
    layer.lazy_initialization(like, like)
    layer.generation += 1
    if sinks:
        layer.sink = tuple(torch.cat([s[i] for s in sinks], -2) for i in (0, 1))  # a copy of its own
    layer.segments = [_owned(s) for s in join_segments(layer.recipe, segs)]
    layer.fitted = fitted[0] if fitted else None
    tail = next((p.tail for p in parts if p.tail is not None), None)
    if tail is not None:
        layer.keys, layer.values = (_own(t.to(like.dtype)) for t in tail)
    layer.installed(seen)
