"""The per-layer cache storage: `CompressedLayer` (full attention) and `CompressedSlidingLayer`,
each a transformers `CacheLayerMixin` that stores K/V through a kvstrata codec.

What a layer holds, oldest first: the `sink` (its first tokens in bf16, `sink=`), encoded
`segments`, and the full-precision tail of the newest tokens (the KIVI residual `r`, and tokens
waiting for a whole key group). `fitted` is the recipe's key transforms with their state, fitted
on the first tokens encoded and shared by every segment. `nbytes()` counts the storage actually
held. Sliding-window layers keep only their window.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import CacheLayerMixin

from kvstrata.codecs.qtensor import held_bytes
from kvstrata.codecs.transform import IDENTITY, Fitted
from kvstrata.hf.phase import DECODE, DUE, EMPTY, PREFILL, Phase
from kvstrata.hf.segments import (
    APPEND_ROWS,
    COMPACT_ROWS,
    Segment,
    append,
    append_many,
    drop_front,
    encode_segment,
    probe_row_bytes,
    shrink,
)
from kvstrata.methods import StoreRecipe
from kvstrata.read.decode import EncodedView


class CompressedLayer(CacheLayerMixin):
    """Full-attention layer: a sink, encoded segments and a full-precision tail of the newest tokens."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    reads_views = True  # a decode step can attend straight from the encoded segments

    def __init__(self, recipe: StoreRecipe, **kwargs):
        super().__init__()
        self.recipe = recipe
        self.generation = 0  # bumped whenever held rows are rewritten rather than appended to
        self._fresh()

    def _fresh(self) -> None:
        """The state of a layer that holds nothing (`__init__` and `reset` both start from it)."""
        self.segments: list[Segment] = []
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V of the oldest tokens, bf16
        self.fitted: Fitted | None = None  # the key transforms and their state, set by the first flush
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.phase = Phase()
        # (generation, n): the last update's K/V began with n rows from encoded storage
        self.read_prefix = (self.generation, 0)

    def _set(self, kind: str) -> None:
        self.phase = replace(self.phase, kind=kind)

    def installed(self, seen: int) -> None:
        """Filled from outside (`held.install`) as having seen `seen` tokens: the next append continues."""
        self.cumulative_length = seen
        self._set(DECODE if seen else EMPTY)

    @property
    def pending_keep(self) -> bool:
        """The prefill waits in full precision for the attention hook's keep scores (`finish_keep`)."""
        return self.phase.kind == PREFILL

    @property
    def deferred(self) -> bool:
        """A decode step left its encoding to `flush_many`."""
        return self.phase.kind == DUE

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :].clone()  # the full-precision tail
        self.values = value_states[..., :0, :].clone()
        self.is_initialized = True

    def held(self) -> list[torch.Tensor]:
        """Every tensor the layer holds (encoded parts with their spare rows, sink, state, tail)."""
        out = [t for seg in self.segments for t in seg.parts()]
        out += list(self.sink or ()) + (self.fitted.tensors() if self.fitted is not None else [])
        return out + ([self.keys, self.values] if self.is_initialized else [])

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything held, decoded: `[batch, kv_heads, stored_tokens, head_dim]` K and V."""
        ks, vs = self.view().dense(self.dtype)  # one reconstruction: sink first, transforms undone
        return torch.cat(ks + [self.keys], dim=-2), torch.cat(vs + [self.values], dim=-2)

    def view(self) -> EncodedView:
        """The sink and encoded segments as they are now (later appends do not change it)."""
        runs = [(seg.keys, seg.values, seg.skip) for seg in self.segments]
        channel = self.recipe.key_axis == "channel"
        return EncodedView(key_channel=channel, runs=runs, generation=self.generation,
                           fitted=self.fitted or IDENTITY, sink=self.sink)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new K/V; returns what attention reads: everything held + the new tokens."""
        keys, values, _ = self.append(key_states, value_states, offer=False)
        return keys, values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, offer: bool, defer: bool = False,
               attend: bool = True):
        """Append new K/V -> (K, V, view). With `offer` (the cache's attention reads encoded views) a
        decode step returns only the full-precision tail + the new tokens and the encoded part as
        `view` (no dense copy is made); otherwise everything held + the new tokens, and None. With
        `defer` a decode step leaves its encoding to `flush_many` (a batched step encodes every
        sequence's new token at once); `deferred` says it is due. Without `attend`: (None, None, None)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.phase.kind == DUE:  # a step that never reached its end (its forward raised): encode it now
            self._flush()
            self._set(DECODE)
        if self.phase.kind == PREFILL:
            raise RuntimeError(
                f"{self.recipe.keep.name} needs the prefill's attention scores, which kvstrata's attention "
                "gathers (CompressedCache selects it on the model's config); this model attended without it")
        first = self.cumulative_length == 0 or self.phase.kind == EMPTY
        view = None
        skip = self._known(key_states.shape[-2])
        if attend and offer and self.reads_views and key_states.shape[-2] == 1 and not first and not skip:
            view, past_k, past_v = self.view(), self.keys, self.values
            self.read_prefix = (self.generation, view.tokens)
        elif attend:  # else nothing is read back
            past_k, past_v = self.dense()
            if skip:  # a replay: the positions before the chunk as held, the chunk's own K/V as computed
                past_k, past_v = (t[..., :self.cumulative_length, :] for t in (past_k, past_v))
            encoded = self.stored_tokens() - self.keys.shape[-2]
            self.read_prefix = (self.generation, min(past_k.shape[-2], encoded))
        attend_k, attend_v = key_states, value_states  # the cold run's prefill chunk attends these too
        self.cumulative_length += key_states.shape[-2]
        key_states, value_states = key_states[..., skip:, :], value_states[..., skip:, :]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        joined = self.keys, self.values  # past + new for a view read (skip 0); flushes rebind, never write
        if first:  # the prefill's flush may end on a ragged key group
            self._set(PREFILL)
        if not (first and self.needs_scores()):  # else scored by the attention hook, which calls finish_keep
            if first:  # the context prefill: the keep policy acts once, after it
                self._keep(scores=None)
            self._trim()  # first, so tokens already out of a sliding window are never encoded
            if defer and not first:
                self._set(DUE)
            else:
                self._flush()
                self._set(DECODE)
        if not attend:
            return None, None, None
        if view is not None:  # a decode step reads the tail as it was plus the new token: `joined`
            return *joined, view
        # New tokens are attended in full precision now; later steps read them encoded
        return torch.cat([past_k, attend_k], dim=-2), torch.cat([past_v, attend_v], dim=-2), view

    def load_prefill(self, keys: torch.Tensor, values: torch.Tensor, seen: int, scores=None):
        """Fill an empty layer from a prefilled context (`update` with the whole context): `keys, values:
        [batch, kv_heads, n, head_dim]` after `seen` tokens, keep policies' `scores: [batch, kv_heads, n]`."""
        if self.cumulative_length:
            raise RuntimeError("load_prefill needs an empty layer")
        self.lazy_initialization(keys, values)
        self.generation += 1
        self.cumulative_length = seen
        self.keys, self.values = keys, values
        self._set(PREFILL)
        self._keep(scores)
        self._trim()  # first, so tokens already out of a sliding window are never encoded
        self._flush()
        self._set(DECODE)

    def needs_scores(self) -> bool:
        """Whether the keep policy scores positions by attention (full-attention layers only)."""
        policy = self.recipe.keep
        return policy is not None and policy.needs_scores and not self.is_sliding

    def finish_keep(self, scores: torch.Tensor) -> None:
        """The prefill's observation-window scores `[batch, kv_heads, n]`: keep, then encode."""
        self._keep(scores)
        self._trim()
        self._flush()
        self._set(DECODE)

    def _keep(self, scores: torch.Tensor | None) -> None:
        """Apply the recipe's keep policy to the tail (full-attention layers only)."""
        policy = self.recipe.keep
        if policy is None or self.is_sliding:
            return
        if policy.needs_scores and scores is None:
            raise ValueError(
                f"{policy.name} needs observation-window attention scores (load_prefill got none)"
            )
        idx = policy.select(self.keys, scores)[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, idx)
        self.values = self.values.gather(2, idx)

    def fit(self) -> Fitted:
        """The key transforms' state: fitted once, from every full-precision token held then."""
        if self.fitted is None:
            self.fitted = Fitted.fit(self.recipe.transforms, self.keys)
        return self.fitted

    def appendable(self) -> int:
        """Tokens the next flush encodes when it can only append whole key groups into the last
        segment (a decode step's flush); 0 when that flush would do anything else."""
        if self.phase.kind == PREFILL or not self.segments or not self.segments[-1].buffers:
            return 0
        n = self.keys.shape[-2] - self.recipe.r
        return max(0, n - n % self.recipe.key_group)

    def _flush(self) -> None:
        """Encode all but the newest `r` tail tokens (the oldest `sink` stay apart): the prefill's
        flush all of them, its last key group ragged; later flushes in whole key groups."""
        ragged = self.phase.kind == PREFILL
        self._take_sink()
        group = self.recipe.key_group
        n = self.keys.shape[-2] - self.recipe.r
        if not ragged:
            n -= n % group
        if n <= 0:
            return
        fitted = self.fit()
        k, v = self.keys[..., :n, :], self.values[..., :n, :]
        if not (self.segments and append(self.recipe, self.segments[-1], k, v)):
            # the first segment (the prefill) is exact; later small flushes reserve rows to append to
            rows = max(APPEND_ROWS, 4 * group)
            reserve = rows - n if self.segments and n < rows else 0
            self.segments.append(encode_segment(self.recipe, k, v, fitted, reserve))
        self.keys = self.keys[..., n:, :].clone()
        self.values = self.values[..., n:, :].clone()

    @property
    def sink_size(self) -> int:
        """How many of the oldest tokens stay in bf16 (full-attention layers; a window drops them)."""
        return self.recipe.sink

    @property
    def sink_held(self) -> int:
        """How many tokens the sink holds now."""
        return 0 if self.sink is None else self.sink[0].shape[-2]

    def _take_sink(self) -> None:
        """Move the oldest tail tokens into the sink until it holds `sink_size` (before anything
        is encoded, the tail's front is the oldest position)."""
        take = min(self.sink_size - self.sink_held, self.keys.shape[-2]) if not self.segments else 0
        if take <= 0:
            return
        new = [t[..., :take, :].to(torch.bfloat16, copy=True) for t in (self.keys, self.values)]
        if self.sink is not None:
            new = [torch.cat([old, t], -2) for old, t in zip(self.sink, new)]
        self.sink = tuple(new)
        self.keys, self.values = self.keys[..., take:, :].clone(), self.values[..., take:, :].clone()

    def _trim(self) -> None:
        """Full-attention layers keep everything."""

    def stored_tokens(self) -> int:
        tail = self.keys.shape[-2] if self.is_initialized else 0
        return sum(s.visible for s in self.segments) + self.sink_held + tail

    def row_bytes(self, tokens: int = 256) -> tuple[float, float]:
        """Bytes one token's K row and V row take per KV head once encoded (averaged over a chunk)."""
        return probe_row_bytes(self.recipe, self.keys.shape[-1] if self.is_initialized else 0, tokens)

    def nbytes(self) -> int:
        """Bytes held: encoded segments (codes, scales, spare rows), sink, transform state and tail."""
        return held_bytes(self.held()) if self.is_initialized else 0

    def shrink(self) -> None:
        """Free the rows reserved for appends and the hidden rows a sliding window dropped (what
        `nbytes` counts is then exactly the tokens held, up to whole key groups)."""
        if self.segments and self.segments[0].skip:
            self.segments[0] = drop_front(self.recipe, self.segments[0], 0)
        for seg in self.segments:
            shrink(seg)

    def _known(self, n: int) -> int:
        """How many of the next `n` tokens are already held (replayed positions)."""
        return max(0, min(n, self.phase.replay_until - self.cumulative_length))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Held entries sit just before the queries (evicted or windowed-out tokens shift them right),
        # so causality among new tokens holds while positions (RoPE) continue from the full length.
        # During a replay the queries read the held positions before them and their own K/V
        # (`update`), as the cold run's prefill chunk did: offset 0.
        if self._known(query_length):
            return self.cumulative_length + query_length, 0
        stored = self.stored_tokens()
        return stored + query_length, max(0, self.cumulative_length - stored)

    def start_replay(self, position: int, rebuild: bool | None = None) -> None:
        """A replay: positions from `position` are fed again. Full layers keep what they hold and do not
        append the replayed tokens; sliding layers (or `rebuild`) start empty and rebuild their window
        from them, encoding it as a prefill does (a ragged last key group included), as a cold run's is."""
        rebuild = self.is_sliding if rebuild is None else rebuild
        self.phase = (replace(self.phase, kind=EMPTY) if rebuild
                      else replace(self.phase, replay_until=self.cumulative_length))
        self.cumulative_length = position
        self.generation += 1

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Back to holding nothing, as `__init__` leaves it (a pending replay or flush included)."""
        self.generation += 1
        self._fresh()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "CompressedCache cannot be cropped: encoded tokens cannot be rolled back exactly"
        )

    def _map_batch(self, fn) -> None:
        """`fn` over the batch dimension of everything held (beam search, batch selection)."""
        self.generation += 1
        if self.fitted is not None:
            self.fitted = self.fitted.map(fn)
        for seg in self.segments:
            for q in (seg.keys, seg.values):
                q.parts = {k: (t if k == "tensor_scale" else fn(t)) for k, t in q.parts.items()}
            seg.buffers = {}  # the parts are new tensors now: nothing to append into
            seg.fitted = self.fitted
        if self.sink is not None:
            self.sink = tuple(fn(t) for t in self.sink)
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])


class CompressedSlidingLayer(CompressedLayer):
    """Sliding-window layer: keeps only the newest `sliding_window - 1` tokens (as transformers does).
    Keep policies do not apply here: the window already bounds what is held."""

    is_sliding = True

    def __init__(self, recipe: StoreRecipe, sliding_window: int, **kwargs):
        super().__init__(recipe)
        self.sliding_window = sliding_window

    @property
    def sink_size(self) -> int:
        return 0

    def _trim(self) -> None:
        excess = self.stored_tokens() - (self.sliding_window - 1)
        if excess > 0 and self.segments:
            self.generation += 1
        while excess > 0 and self.segments:
            seg = self.segments[0]
            kept = drop_front(self.recipe, seg, excess, COMPACT_ROWS)
            excess -= seg.visible - (kept.visible if kept else 0)
            if kept is None:
                self.segments.pop(0)
            else:
                self.segments[0] = kept
        if excess > 0:  # the tail itself is longer than the window
            self.keys = self.keys[..., excess:, :].clone()
            self.values = self.values[..., excess:, :].clone()

    def get_max_length(self) -> int:
        return self.sliding_window


def flush_many(layers: list[CompressedLayer]) -> None:
    """The deferred flushes of many sequences' layers (one depth of a batched step): those that only
    append whole key groups into their last segment share one encode per recipe
    (`segments.append_many`); the rest flush alone. Each layer ends as its own `_flush` leaves it."""
    groups: dict[tuple, list[CompressedLayer]] = {}
    for layer in layers:
        n = layer.appendable()
        if n:
            groups.setdefault((layer.recipe, n), []).append(layer)
        else:
            layer._flush()
        layer._set(DECODE)
    for (recipe, n), members in groups.items():
        done = append_many(recipe, [m.segments[-1] for m in members], [m.keys[..., :n, :] for m in members],
                           [m.values[..., :n, :] for m in members])
        for m, ok in zip(members, done):
            if ok:
                m.keys, m.values = m.keys[..., n:, :].clone(), m.values[..., n:, :].clone()
            else:
                m._flush()

