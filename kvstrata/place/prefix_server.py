"""Serving a prompt through the persistent store: longest global-KV prefix hit, SWA liveness,
bounded replay.

- hit:    global KV and the SWA state at the last hit block are installed; only the rest of the
          prompt runs.
- replay: global KV hit, SWA state gone: the last `n_win` tokens of the cached prefix (from the
          block boundary at or before them) run again in the cold run's chunks, full-attention
          layers reading the cached global KV before each chunk and the chunk's own K/V as a cold
          run does (not re-appending them), sliding layers rebuilding their window from the
          replayed tokens -- never a full prefill. By default `n_win` is two sliding windows
          (bounded: an approximation, see `exact_replay_tokens`); `n_win="exact"` replays the
          receptive field of the sliding layers' windows, so they are the cold run's.
- miss:   full prefill.
New complete blocks (global KV) and the SWA state at the last block boundary are written back.
Records carry the codes as the cache held them (`kvstrata.place.block_format`): a write cuts
them out without decoding (tokens still in the full-precision tail are encoded once), a hit
installs them without re-encoding. A chain of records holds one transform state per layer: a
record written under another (a prefix whose blocks came from different prompts) ends the hit.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstrata.codecs.transform import Transform
from kvstrata.hf.cache import CompressedCache, head_dim, layer_classes
from kvstrata.hf.held import Held, cut, install, seal
from kvstrata.hf.projected import ced_plan, ced_stored, hidden_recipe
from kvstrata.hf.run import NO_LOGITS, chunk_end, forward, sealed_at, store_boundary
from kvstrata.methods import check_store, parse_method, render
from kvstrata.names import Retention, ServeKind, TierClass
from kvstrata.place.block_format import pack, unpack
from kvstrata.place.prefix_keys import block_hashes, model_fingerprint, namespace
from kvstrata.place.records import RecordError
from kvstrata.place.store import Entry, KVStore
from kvstrata.settings import EXACT, ReplayTokens


def weights_digest(model) -> str:
    """SHA-256 over every parameter's bytes, in name order (part of the store namespace)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


WHOLE = 1 << 62  # a replay of the whole cached prefix


def exact_replay_tokens(classes: list[tuple[str, int | None]], block: int = 1) -> int:
    """Tokens a replay must rerun so every sliding layer's rebuilt window is the cold run's: the sum
    over sliding layers of `window - 1`, plus `block - 1` for each full layer below a sliding one.
    A token's K/V at the k-th sliding layer depends on the tokens up to `window - 1` back at each
    sliding layer below it, and up to `block - 1` back at each full layer below it (a chunk, cut at
    block boundaries, attends its own K/V as computed; the positions before it, the cached global
    KV); the window held at the prefix's end reaches `window - 1` further back."""
    top = max((i for i, (c, _) in enumerate(classes) if c == "sliding"), default=0)
    full_below = sum(c != "sliding" for c, _ in classes[:top])
    return sum(w - 1 for c, w in classes if c == "sliding") + full_below * (block - 1)


def fits_on_data(recipe) -> bool:
    """Whether a recipe's transforms fit their state on the first tokens a layer encodes (centering,
    smoothing, outliers): a sliding layer rebuilt from a later token fits another state."""
    return any(type(t).fit is not Transform.fit for t in recipe.transforms)


def replay_window(classes: list[tuple[str, int | None]], n_win: ReplayTokens, block: int = 1) -> int:
    """`n_win` as a token count: "exact" (`exact_replay_tokens` at this store block), None (two of
    the longest sliding window: bounded), or a count of at least one sliding window."""
    windows = [w for c, w in classes if c == "sliding"]
    if n_win == EXACT:
        return exact_replay_tokens(classes, block)
    if n_win is None:
        return 2 * max(windows, default=0)
    if isinstance(n_win, str) or n_win < 0:
        raise ValueError(f"n_win must be a token count >= 0 or {EXACT!r}, got {n_win!r}")
    if windows and n_win < max(windows):
        raise ValueError(f"n_win must be >= the sliding window ({max(windows)}), got {n_win}")
    return n_win


@dataclass(kw_only=True)
class Served:
    cache: CompressedCache
    logits: torch.Tensor  # next-token logits after the prompt: [1, vocab]
    kind: ServeKind
    reused_tokens: int  # prompt tokens whose global KV came from the store
    computed_tokens: int  # tokens run through the model
    ttft_s: float  # lookup + load + compute, up to the first token's logits
    write_s: float  # cutting new blocks out and handing them to the store (off the first-token path)


@dataclass(kw_only=True)
class Prefill:
    """A prompt on its way into `cache`: positions [pos, len(ids)) are still to run. Chunks never
    cross a multiple of `block` up to the prompt's last one (there the cache is sealed: it holds
    what the store's records hold; at the last, `boundary` Q, the records and SWA state are cut:
    its callback runs when the prompt reaches it) nor, with a `limit`, span more than `limit`
    tokens -- so where a prompt is cut depends on it alone, never on what else shares a step, and
    `kvstrata generate` cuts it alike (`kvstrata.hf.run.chunk_end`). `whole`: the method's keep
    policy must see the prompt at once (no chunks)."""

    cache: CompressedCache
    ids: list[int]
    pos: int
    kind: ServeKind
    reused_tokens: int
    t0: float
    boundary: tuple[int, Callable[[], None]] | None = None
    block: int | None = None  # the store's block size (None: no store)
    write: Callable[[], None] | None = None  # writes the new records back (after the first token)
    whole: bool = False
    write_s: float = 0.0
    start: int = field(init=False)

    def __post_init__(self):
        self.start = self.pos

    @property
    def done(self) -> bool:
        return self.pos >= len(self.ids)

    def next_chunk(self, limit: int | None = None) -> list[int]:
        """The next tokens to feed (at most `limit`, None: as many as the boundary allows)."""
        limit = None if self.whole else limit
        return self.ids[self.pos:chunk_end(self.pos, len(self.ids), limit, self.block)]

    def fed(self, n: int) -> None:
        """`n` more tokens ran through the model into `cache`."""
        self.pos += n
        if sealed_at(self.pos, len(self.ids), self.block):
            seal(self.cache, self.block)
        if self.boundary is not None and self.pos == self.boundary[0]:
            t = time.perf_counter()
            self.boundary[1]()
            self.write_s += time.perf_counter() - t

    def finish(self, logits: torch.Tensor) -> Served:
        """The prompt has run; `logits: [1, vocab]` after its last token. New records are written."""
        ttft = time.perf_counter() - self.t0 - self.write_s
        t = time.perf_counter()
        if self.write is not None:
            self.write()
        self.write_s += time.perf_counter() - t
        return Served(cache=self.cache, logits=logits, kind=self.kind, reused_tokens=self.reused_tokens,
                      computed_tokens=len(self.ids) - self.start, ttft_s=ttft, write_s=self.write_s)

    def run(self, model, limit: int | None = None) -> Served:
        """Feed the rest of the prompt one chunk per forward (one sequence alone); only the last chunk
        asks for logits (an encoder-decoder's decoder runs there, as in `generate`)."""
        while True:
            chunk = self.next_chunk(limit)
            last = self.pos + len(chunk) == len(self.ids)
            logits = forward(model, torch.tensor([chunk]), self.cache, 1 if last else NO_LOGITS)[:, -1:]
            self.fed(len(chunk))
            if self.done:
                return self.finish(logits[:, -1])


class PrefixServer:
    def __init__(
        self, model, store: KVStore, method: str = "bf16", block_size: int = 256, n_win: ReplayTokens = None,
        tenant: bytes = b"", fingerprint: str | None = None,
    ):
        self.model, self.store, self.block, self.tenant = model, store, block_size, tenant
        self.spec = parse_method(method)
        check_store(self.spec)
        self.classes = layer_classes(model.config)
        self.n_win = replay_window(self.classes, n_win, block_size)
        sliding = [self.spec.recipe(c, i) for i, (c, _) in enumerate(self.classes) if c == "sliding"]
        if n_win == EXACT and any(map(fits_on_data, sliding)):
            self.n_win = WHOLE  # a rebuilt window's transforms fit on its first tokens: a cold run's, from 0
        self.dtype = next(model.parameters()).dtype
        fp = fingerprint or model_fingerprint(model.config.to_dict(), weights_digest(model))
        self.ns = namespace(fp, render(self.spec), str(self.dtype))
        text = model.config.get_text_config()
        self.vocab, self.kv_heads = text.vocab_size, text.num_key_value_heads
        self.head_dim = head_dim(text)
        self.layers = {kind: [i for i, (c, _) in enumerate(self.classes) if c == cls]
                       for kind, cls in ((TierClass.GLOBAL, "full"), (TierClass.SWA, "sliding"))}
        #: per layer kept, its recipe and (KV heads, head_dim)
        self.recipes = {i: self.spec.recipe(c, i) for i, (c, _) in enumerate(self.classes)}
        self.shapes = {i: (self.kv_heads, self.head_dim) for i in range(len(self.classes))}
        self.ced = ced_plan(text)  # an encoder-decoder's (split, n_win)
        self.hidden = self.ced is not None and ced_stored(text) == "hidden"
        if self.hidden:  # the store keeps H(split), not the decoder layers' K/V: one more "layer"
            split, L = self.ced[0], len(self.classes)
            self.layers = {k: [i for i in v if i < split] for k, v in self.layers.items()}
            self.layers[TierClass.GLOBAL].append(L)
            self.shapes[L], self.recipes[L] = (1, text.hidden_size // 2), hidden_recipe(self.spec.full)

    def _open(self, entry: Entry, klass: TierClass, block: int | None) -> dict[int, Held] | None:
        """A verified record's per-layer held parts (global KV of block `block`, or the sliding
        windows), or None: a record that does not unpack to what these layers hold is counted and
        removed. A record found only in this process's memory is promoted once it unpacks."""
        recipes = {i: self.recipes[i] for i in self.layers[klass]}
        start, tokens = (None, None) if block is None else (block * self.block, self.block)
        try:
            held = unpack(recipes, *entry.open(), kv_heads=self.kv_heads, head_dim=self.head_dim,
                          dtype=self.dtype, start=start, tokens=tokens, shapes=self.shapes)
        except RecordError:
            entry.reject()
            return None
        entry.promote()
        return held

    def serve(self, ids: list[int], retention: Retention = Retention.PERSISTENT) -> Served:
        """The prompt's cache and next-token logits; new blocks are written back under `retention`."""
        return self.begin(ids, retention).run(self.model)

    def begin(self, ids: list[int], retention: Retention = Retention.PERSISTENT) -> Prefill:
        """Look the prompt up and install what the store holds: the rest of it is left to feed (a
        server feeds it in chunks, within its batched steps)."""
        if not ids or not all(isinstance(t, int) and 0 <= t < self.vocab for t in ids):
            raise ValueError(f"serve needs a non-empty list of token ids in [0, {self.vocab})")
        retention = Retention(retention)
        t0 = time.perf_counter()
        usable = (len(ids) - 1) // self.block  # keep >= 1 token to compute the next-token logits
        hashes = [h.hex() for h in block_hashes(ids, self.block, self.ns, self.tenant)][:usable]
        sliding = self.layers[TierClass.SWA]
        # a model without sliding layers has no SWA state to lose: its global KV is the whole state
        found = self.store.lookup(hashes, self.ns, swa=bool(sliding), retention=retention)
        records: list[dict[int, Held]] = []
        chain: dict[int, Held] = {}  # per layer, the first record that holds codes: its state rules
        for b, entry in enumerate(found.entries):
            held = self._open(entry, TierClass.GLOBAL, b)
            if held is None or not all(held[i].agrees(chain.get(i, held[i])) for i in held):
                break  # unusable, or encoded under another transform state than the chain's
            chain.update({i: h for i, h in held.items() if i not in chain and h.fitted is not None})
            records.append(held)
        cache, start, kind, P = self._install(records, found, sliding, len(ids))
        Q = max(P, store_boundary(len(ids), self.block))  # where `generate` cuts it too
        pending: dict = {}

        def snapshot() -> None:  # the state at the block boundary Q, before the remainder runs
            pending["blocks"], pending["windows"] = self._snapshot(cache, P, Q)

        def write() -> None:
            if not pending:
                return
            for b, record in pending["blocks"].items():
                self.store.put_global(hashes[b], *record, namespace=self.ns, retention=retention)
            if pending["windows"] is not None:
                self.store.put_swa(hashes[Q // self.block - 1], *pending["windows"], namespace=self.ns)

        return Prefill(cache=cache, ids=ids, pos=start, kind=kind, reused_tokens=P, t0=t0,
                       boundary=(Q, snapshot) if start < Q else None, block=self.block, write=write)

    def _rewind(self, n: int) -> int:
        """Where an `n`-token prompt's run must start at the latest: an encoder-decoder that keeps the
        projected K/V reruns the encoder from the block at or before the decoder's first row (its last
        `n_win`), which needs `H(split)`; any other model: nowhere before its end."""
        if self.ced is None or self.hidden:
            return n
        return max(0, n - self.ced[1]) // self.block * self.block

    def _install(self, records: list[dict[int, Held]], found, sliding: list[int], n: int):
        """(cache, first position to compute, kind, tokens reused): the records' codes installed as
        held, with the SWA windows when live; a fresh cache (a miss) when there are none -- or when
        they do not fit together, which unpacking each alone cannot see. An encoder-decoder's
        decoder layers get `H(split)`'s projections ("hidden") or rerun their window (`_rewind`)."""
        cache = CompressedCache(self.model.config, self.spec)
        if not records:
            return cache, 0, ServeKind.MISS, 0
        P = len(records) * self.block
        # the SWA state belongs to the lookup's last block: a shorter usable chain replays
        swa = found.swa if len(records) == found.global_blocks else None
        windows = self._open(swa, TierClass.SWA, None) if swa is not None else None
        live = windows is not None or not sliding
        start = P if live else max(0, P - self.n_win) // self.block * self.block  # where a cold run cut
        rewind = self._rewind(n)
        if rewind < start:  # then the windows held at P are not the ones the rerun needs
            start, live, windows = rewind, False, None
        kind = ServeKind.HIT if live else ServeKind.REPLAY
        layers = cache.stored_layers()
        try:
            for i in (*self.layers[TierClass.GLOBAL], *sliding):
                heads, dim = self.shapes[i]
                like = torch.zeros(1, heads, 0, dim, dtype=self.dtype)
                if i in sliding:
                    install(layers[i], [windows[i]] if windows is not None else [], start, like)
                else:
                    install(layers[i], [r[i] for r in records], P, like)
        except ValueError:
            return CompressedCache(self.model.config, self.spec), 0, ServeKind.MISS, 0
        if self.hidden:
            self.model.project_held(cache, P, self.block)
        if kind is ServeKind.REPLAY:
            cache.start_replay(start)
        if self.hidden:  # the decoder's rows pending as the cold run left them at `start`
            cache.pending = self.model.held_rows(cache, start)
        return cache, start, kind, P

    def _snapshot(self, cache: CompressedCache, P: int, Q: int):
        """Records of the new blocks [P, Q) (global KV, cut from the full layers as held) and of
        every sliding layer's window at Q (None without sliding layers)."""
        full, sliding = self.layers[TierClass.GLOBAL], self.layers[TierClass.SWA]
        layers = cache.stored_layers()
        blocks = {}
        for b in range(P // self.block, Q // self.block):
            lo, hi = b * self.block, (b + 1) * self.block
            blocks[b] = pack({i: cut(layers[i], lo, hi, encode_tail=True) for i in full}, self.block)
        windows = None
        if sliding:
            windows = pack({i: cut(layers[i], 0, layers[i].stored_tokens(), encode_tail=False)
                            for i in sliding})
        return blocks, windows
