"""Top-k sparse decode attention with a Full / Reindex / Reuse layer schedule (read stratum).

At each decode step a full-attention layer attends to the sink tokens, the recent window and the
top-k cached positions its schedule mode gives it; nothing else is read:
  F (Full)    -- scores every cached position with its own indexer and takes its top-k
                 (plus a 4k candidate set for the Reindex layers after it);
  R (Reindex) -- re-scores the source Full layer's candidates with its own query, takes its top-k;
  U (Reuse)   -- takes the source Full layer's top-k as is.
`schedule` repeats over the full-attention layers, e.g. `F1U3` = one Full then three Reuse.
Prefill (more than one query) is dense and unchanged. This module decides what is read
(`select`) and counts the bytes (index keys scanned plus entries gathered); `kvstrata.hf.topk_attention`
hooks it into transformers' attention and reads the picked entries straight from the codes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from kvstrata.codecs.blocks import check_finite
from kvstrata.read.indexers import (
    INDEXERS,
    held,
    held_scale,
    hierarchical,
    index_row_bytes,
    index_rows,
    key_basis,
    queries,
    relu_sum,
    score,
)
from kvstrata.read.kernels import cpu

LIMIT = 1 << 24  # k, sinks, window: tokens, beyond any context we run
MAX_REPEAT = 1024  # layers a schedule count may span


@dataclass(frozen=True)
class TopK:
    k: int = 256
    schedule: str = "F1"
    indexer: str = "exact"
    sinks: int = 4
    window: int = 64
    hier: bool = False
    rank: int = 16  # index-key dims of the lowrank indexer (a multiple of 16: NVFP4 blocks)
    name: ClassVar[str] = "topk"
    summary: ClassVar[str] = (
        "top-k sparse decode reads (sinks + window + indexed top-k), Full/Reindex/Reuse schedule"
    )

    def __post_init__(self):
        if not 1 <= self.k <= LIMIT or not 0 <= self.sinks <= LIMIT or not 1 <= self.window <= LIMIT:
            raise ValueError(
                f"topk: need 1 <= k <= {LIMIT}, 0 <= sinks <= {LIMIT}, 1 <= window <= {LIMIT}; got {self}"
            )
        if self.indexer not in INDEXERS:
            raise ValueError(f"topk: unknown indexer {self.indexer!r} (known: {', '.join(INDEXERS)})")
        if not 16 <= self.rank <= 1024 or self.rank % 16:
            raise ValueError(
                f"topk: rank must be a multiple of 16 (NVFP4 blocks) in [16, 1024], got {self.rank}"
            )
        self.modes(1)

    def check(self, head_dim: int) -> None:
        """Refuse a model shape this read cannot work on: the lowrank indexer keeps at most head_dim dims."""
        if self.indexer == "lowrank" and self.rank > head_dim:
            raise ValueError(f"topk: rank must be in 1..{head_dim} (the head dim), got {self.rank}")

    def modes(self, n_layers: int) -> list[str]:
        """The schedule unrolled over `n_layers` full-attention layers; always starts with Full."""
        parts = re.findall(r"([FRU])(\d+)", self.schedule.upper())
        if not parts or "".join(f"{m}{c}" for m, c in parts) != self.schedule.upper() or parts[0][0] != "F":
            raise ValueError(
                f"topk: schedule must look like F1R3 or F1U1R2 and start with F, got {self.schedule!r}"
            )
        if any(not 1 <= int(c) <= MAX_REPEAT for _, c in parts) or len(parts) > MAX_REPEAT:
            raise ValueError(
                f"topk: each schedule count must be in [1, {MAX_REPEAT}] (at most {MAX_REPEAT} parts), got "
                f"{self.schedule!r}"
            )
        pattern = [m for m, c in parts for _ in range(int(c))]
        return [pattern[i % len(pattern)] for i in range(n_layers)]


class HeldLayer(Protocol):
    """What a sparse read needs of a cache layer: the bytes one encoded K row and V row take."""

    def row_bytes(self) -> tuple[float, float]: ...


#: (generation, n): the first n keys a step reads come from encoded storage and keep their index
#: rows while the generation holds (None: keep nothing)
Stable = tuple[int, int] | None


@dataclass(kw_only=True)
class ReadState:
    cfg: TopK
    modes: dict[int, str]  # layer index -> F / R / U (full-attention layers only)
    layers: list[HeldLayer] = field(default_factory=list)  # the cache's layers (their encoded row sizes)
    head_dim: int = 0
    row_bytes: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # K row, V row, index row
    source: dict[str, torch.Tensor] = field(default_factory=dict)  # the current Full layer's picks
    picked: dict[int, torch.Tensor] = field(default_factory=dict)  # last step's positions per layer
    bases: dict[int, torch.Tensor] = field(default_factory=dict)  # lowrank indexer: per-layer key basis
    index: dict[int, tuple] = field(default_factory=dict)  # layer -> (generation, rows kept, index rows)
    # lowrank: layer -> ((generation, scale), rows kept, NVFP4 rows)
    held: dict[int, tuple] = field(default_factory=dict)
    # lowrank, C++ kernel: layer -> the held rows again, transposed in tiles of 16 rows (`read_positions`),
    # kept beside `held[layer]`
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)
    # lowrank: layer -> (generation, rows kept, their largest |x|)
    amax: dict[int, tuple] = field(default_factory=dict)
    bytes_read: float = 0.0  # index rows scanned + entries gathered, all decode steps
    dense_bytes: float = 0.0  # what dense attention would have read
    steps_seen: int = 0  # Full-layer calls (first layer per step counts one step per Full layer)
    reindexes: bool = field(init=False)  # the schedule has Reindex layers (they need Full layers' candidates)

    def rows(self, layer: int) -> tuple[float, float, float]:
        """Bytes of one K row, V row and index-key row per KV head, measured once the layer holds data."""
        if layer not in self.row_bytes:
            kb, vb = self.layers[layer].row_bytes()
            self.row_bytes[layer] = (
                kb, vb, index_row_bytes(self.cfg.indexer, self.head_dim, self.cfg.rank, kb),
            )
        return self.row_bytes[layer]

    def __post_init__(self):
        self.reindexes = "R" in self.modes.values()

    @property
    def steps(self) -> int:
        return self.steps_seen // max(1, list(self.modes.values()).count("F"))

    def per_step(self) -> tuple[float, float]:
        """(sparse, dense) bytes read per decode step."""
        n = max(1, self.steps)
        return self.bytes_read / n, self.dense_bytes / n


def _kept(kept: dict, layer: int, tag, stable: int, empty):
    """(rows kept, what was kept for them) of `kept[layer]` while `tag` holds and no more than
    `stable` rows are kept; else (0, `empty`)."""
    entry = kept.get(layer)
    if tag is None or entry is None or entry[0] != tag or entry[1] > stable:
        return 0, empty
    return entry[1], entry[2]


def _room(buf: torch.Tensor | None, kept: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """`buf` if it has room for `n` rows, else a buffer twice its size (a new one: `n` rows and an
    eighth more, so decode steps after a prefill's index do not copy it at once; shaped and typed as
    `like` but for its rows) holding its first `kept` rows."""
    if buf is not None and buf.shape[-2] >= n:
        return buf
    rows = max(n + n // 8 + 64, 2 * (0 if buf is None else buf.shape[-2]))
    grown = like.new_empty(*like.shape[:-2], rows, like.shape[-1])
    if kept:
        grown[..., :kept, :] = buf[..., :kept, :]
    return grown


def _extend(kept: dict, layer: int, tag, stable: int, fn, src: torch.Tensor) -> torch.Tensor:
    """`fn` over every row of `src`. `fn` acts row by row, so its rows below `stable` are kept in
    `kept[layer]` = (tag, stable, buffer) and reused while `tag` holds (None: keep nothing); later
    rows are recomputed, in one call, into the buffer's spare rows (it grows by doubling), so a step
    computes only its new rows and copies nothing it kept."""
    n = src.shape[-2]
    done, buf = _kept(kept, layer, tag, stable, None)
    new = fn(src[..., done:, :])
    buf = _room(buf, done, n, new)
    buf[..., done:n, :] = new
    if tag is not None:
        kept[layer] = (tag, stable, buf)
    return buf[..., :n, :]


def _amax(kept: dict, layer: int, tag, stable: int, rows: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of `rows`; that of the rows below `stable` is kept while `tag` holds."""
    done, top = _kept(kept, layer, tag, stable, rows.new_zeros(()))
    top = top if torch.is_tensor(top) else rows.new_tensor(top)  # kept by the C++ path as a float
    if stable > done:
        top = torch.maximum(top, rows[..., done:stable, :].abs().amax())
    if tag is not None:
        kept[layer] = (tag, stable, top)
    return torch.maximum(top, rows[..., stable:, :].abs().amax()) if rows.shape[-2] > stable else top


def _raw_rows(state: ReadState, layer: int, k: torch.Tensor, prefix: Stable) -> torch.Tensor:
    """The layer's index rows of every cached key before the index holds them (the lowrank basis is
    fitted here, once, from every key the layer holds then). Rows of keys the layer read from
    encoded storage (`prefix`) never change while its generation holds: they are computed once."""
    cfg = state.cfg
    if cfg.indexer == "lowrank" and layer not in state.bases:
        state.bases[layer] = key_basis(k[..., :, :], cfg.rank)
    basis = state.bases.get(layer)
    if cfg.indexer == "exact":  # the keys themselves: nothing to keep
        return k.float()
    generation, stable = prefix if prefix is not None else (None, 0)
    return _extend(state.index, layer, generation, stable, lambda x: index_rows(cfg.indexer, x, basis), k)


def _held_rows(state: ReadState, layer: int, rows: torch.Tensor, prefix: Stable) -> torch.Tensor:
    """`rows` as the index holds them: lowrank rows rounded to NVFP4 under one tensor scale, the
    stable ones once while that scale holds."""
    return _index_rows(state, layer, rows, prefix)[0]


def _index_rows(state: ReadState, layer: int, rows: torch.Tensor,
                prefix: Stable) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`_held_rows`, and where the kernel selects, the same rows transposed in tiles of 16, else None)."""
    if state.cfg.indexer != "lowrank" or not rows.shape[-2]:
        return rows, None
    module = _native_index(rows)
    if module is not None:
        return _held_native(module, state, layer, rows, prefix, tiled=_tiled(state))
    generation, stable = prefix if prefix is not None else (None, 0)
    scale = held_scale(_amax(state.amax, layer, generation, stable, rows))
    tag = None if generation is None else (generation, scale.item())
    return _extend(state.held, layer, tag, stable, lambda x: held("lowrank", x, scale), rows), None


def _native_index(rows: torch.Tensor):
    """The C++ module that keeps `rows` held in place (float32 on the CPU, the kernel built), or None."""
    return cpu.load() if rows.device.type == "cpu" and rows.dtype == torch.float32 else None


def _tiled(state: ReadState) -> bool:
    """Whether the state's Full layers select in the kernel (`_kernel_read`), which scores the tiles."""
    return not state.cfg.hier and not state.reindexes


def _held_native(module, state: ReadState, layer: int, rows: torch.Tensor, prefix: Stable,
                 tiled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_held_rows` kept up in place by the C++ kernel (`hold_lowrank`: one call, the same rows,
    largest magnitude and scale as the PyTorch path), and with `tiled` the same rows transposed in
    tiles of 16 (what `read_positions` scores). Rows held under the scale they were rounded at are
    kept while it and the generation hold (tiles beside them); buffers grow by doubling."""
    n = rows.shape[-2]
    generation, stable = prefix if prefix is not None else (None, 0)
    stable = min(stable, n)
    counted, top = _kept(state.amax, layer, generation, stable, 0.0)
    entry = state.held.get(layer) if generation is not None else None
    ok = entry is not None and entry[0][0] == generation and entry[1] <= stable
    tiles = state.tiles.get(layer) if ok and tiled else None
    reuse = ok and (tiles is not None or not tiled)
    kept, scale, buf = (entry[1], entry[0][1], entry[2]) if reuse else (0, -1.0, None)
    buf = _room(buf, kept, n, rows)
    if tiled and (tiles is None or tiles.shape[2] * 16 < buf.shape[-2]):
        grown = rows.new_empty(*rows.shape[:2], -(-buf.shape[-2] // 16), rows.shape[-1], 16)
        if kept:
            grown[:, :, :-(-kept // 16)] = tiles[:, :, :-(-kept // 16)]
        tiles = grown
    top, scale, first = module.hold_lowrank(rows, buf, tiles if tiled else rows.new_empty(0), counted, stable,
                                            n, float(top), kept, scale)
    if first < 0:
        check_finite(rows, "nvfp4")  # a row is not finite: refused as the codec refuses it
    if generation is not None:
        state.amax[layer] = (generation, stable, top)
        state.held[layer] = ((generation, scale), stable, buf)
        if tiled:
            state.tiles[layer] = tiles
    return buf[..., :n, :], tiles


def build_index(state: ReadState, layer: int, k: torch.Tensor, prefix: Stable) -> None:
    """Write the layer's index rows for the keys it holds now (after the prefill), so the first
    decode step scores them instead of building them."""
    _held_rows(state, layer, _raw_rows(state, layer, k, prefix), prefix)


def _scores(
    state: ReadState, layer: int, q: torch.Tensor, k: torch.Tensor, prefix: Stable,
    cand: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's indexer scores for `q` of every cached key, or of the candidate positions `cand`
    (a subset is held under its own scale)."""
    indexer = state.cfg.indexer
    rows = _raw_rows(state, layer, k, prefix)
    basis = state.bases.get(layer)
    if cand is not None:
        subset = rows.gather(2, cand[..., None].expand(-1, -1, -1, rows.shape[-1]))
        return score(indexer, q, held(indexer, subset), basis)
    return score(indexer, q, _held_rows(state, layer, rows, prefix), basis)


def _kernel_read(state: ReadState, layer: int, q: torch.Tensor, k: torch.Tensor, prefix: Stable, lo: int,
                 hi: int, end: int) -> torch.Tensor | None:
    """What the Full layer reads, scored and selected in the C++ kernel: per KV head, ascending, the
    sinks [0, lo), the top-k of [lo, hi) and the window [hi, end); or None where it does not apply
    (no kernel, hierarchical, Reindex candidates)."""
    cfg = state.cfg
    module = cpu.load() if q.device.type == "cpu" and _tiled(state) else None
    if module is None:
        return None
    rows, tiles = _index_rows(state, layer, _raw_rows(state, layer, k, prefix), prefix)
    read = tiles if tiles is not None else rows.float()
    qs = queries(cfg.indexer, q, read.shape[1], state.bases.get(layer)).contiguous()
    return module.read_positions(qs, read, cfg.k, lo, hi, end, relu_sum(cfg.indexer))


def select(
    state: ReadState, layer: int, q: torch.Tensor, k: torch.Tensor, prefix: Stable = None
) -> torch.Tensor:
    """Positions `[b, kv_heads, m]` (sorted) this layer reads over keys `k: [b, h, n, d]`; counts the
    bytes scanned and gathered. `prefix`: which leading keys are stable (`Stable`)."""
    cfg, (b, heads, n, _) = state.cfg, k.shape
    kb, vb, ib = state.rows(layer)  # one K row, one V row, one index-key row (per KV head)
    sinks = min(cfg.sinks, n)
    recent = max(sinks, n - cfg.window)
    middle = recent - sinks
    mode = state.modes[layer]
    idx = None
    if mode == "F":
        state.steps_seen += 1
        if cfg.k >= middle:  # everything fits: no index scan needed
            top = torch.arange(sinks, recent).expand(b, heads, middle)
            cand = top
        else:
            state.bytes_read += n * heads * ib
            indexed = _head(k, recent, prefix)  # the recent window is read anyway: no index rows needed
            idx, cand = _kernel_read(state, layer, q, indexed, prefix, sinks, recent, n), None
            top = None if idx is None else idx[..., sinks:sinks + cfg.k]
            if top is None:
                scores = _scores(state, layer, q, indexed, prefix)
                scores[..., :sinks] = float("-inf")
                scores[..., recent:] = float("-inf")
                top = hierarchical(scores, cfg.k) if cfg.hier else scores.topk(cfg.k, -1).indices
                # Reindex layers re-score the Full layer's 4k candidates; without them nobody needs those
                cand = scores.topk(min(4 * cfg.k, middle), -1).indices if state.reindexes else None
        state.source = {"top": top, "cand": cand}
    elif mode == "R":
        cand = state.source["cand"]
        sub = _scores(state, layer, q, _head(k, recent, prefix), prefix, cand)
        state.bytes_read += cand.shape[-1] * heads * ib
        top = cand.gather(-1, sub.topk(min(cfg.k, cand.shape[-1]), -1).indices)
    else:
        top = state.source["top"]
    if idx is None:  # sinks + recent window (disjoint from the picks), then every position ascending
        fixed = torch.cat([torch.arange(sinks), torch.arange(recent, n)])
        idx = torch.cat([fixed.expand(b, heads, -1), top], -1).sort(-1).values
    state.bytes_read += idx.shape[-1] * heads * (kb + vb)
    state.dense_bytes += n * heads * (kb + vb)
    state.picked[layer] = idx
    return idx


def _head(k, n: int, prefix: Stable):
    """The first `n` keys, and the stable ones past them (their index rows are kept once computed):
    only keys not yet stable past `n` are left out."""
    n = max(n, prefix[1] if prefix is not None else 0)
    return k.head(n) if isinstance(k, LazyKeys) else k[..., :n, :]


class LazyKeys:
    """The keys a step can read, `[b, h, n, d]`: encoded runs then a full-precision tail, decoded
    only where sliced (`keys[..., a:b, :]`). Selection touches encoded rows only when their index
    rows are not kept yet, so a decode step does not decode the layer."""

    def __init__(self, view, tail: torch.Tensor):
        self.view, self.tail = view, tail
        self.encoded = view.tokens
        b, h, t, d = tail.shape
        self.shape = torch.Size((b, h, self.encoded + t, d))

    def head(self, n: int) -> "LazyKeys":
        """These keys up to `n`, or up to the encoded ones where `n` falls before the tail."""
        return LazyKeys(self.view, self.tail[..., : max(0, n - self.encoded), :])

    def __getitem__(self, item) -> torch.Tensor:
        rows = item[-2] if isinstance(item, tuple) else slice(None)
        start, stop, _ = rows.indices(self.shape[2])
        parts = [self.tail[..., :0, :]]
        if start < min(stop, self.encoded):
            parts.append(self.view.key_rows(start, min(stop, self.encoded), self.tail.dtype))
        if stop > max(start, self.encoded):
            parts.append(self.tail[..., max(0, start - self.encoded) : stop - self.encoded, :])
        return torch.cat(parts, -2)

    def float(self) -> torch.Tensor:
        return self[..., :, :].float()
