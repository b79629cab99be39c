"""Serving with the persistent store: longest global-KV prefix hit, SWA liveness, bounded replay.

- hit:    global KV and the SWA state at the last hit block are loaded; only the rest of the prompt runs.
- replay: global KV hit, SWA state gone: the last `n_win` tokens of the cached prefix run again,
          full-attention layers reading the cached global KV (and not re-appending it), sliding
          layers rebuilding their window from the replayed tokens -- never a full prefill.
- miss:   full prefill.
New complete blocks (global KV) and the SWA state at the last block boundary are written back.
Records carry the method's encoded bytes (e.g. NVFP4), decoded on load.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from kvstrata.hf.cache import CompressedCache, head_dim, layer_classes
from kvstrata.hf.run import forward
from kvstrata.methods import parse_method
from kvstrata.place.prefix_keys import block_hashes, model_fingerprint, namespace
from kvstrata.place.records import RecordError, pack_block, unpack_block
from kvstrata.place.store import Entry, KVStore


def weights_digest(model) -> str:
    """SHA-256 over every parameter's bytes, in name order (part of the store namespace)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class Served:
    cache: CompressedCache
    logits: torch.Tensor  # next-token logits after the prompt: [1, vocab]
    kind: str  # hit | replay | miss
    reused_tokens: int  # prompt tokens whose global KV came from the store
    computed_tokens: int  # tokens run through the model
    ttft_s: float  # lookup + load + compute, up to the first token's logits
    write_s: float  # writing new blocks back (off the first-token path in a real server)


class PrefixServer:
    def __init__(
        self, model, store: KVStore, method: str = "bf16", block_size: int = 256, n_win: int | None = None,
        tenant: bytes = b"", fingerprint: str | None = None,
    ):
        self.model, self.store, self.block, self.tenant = model, store, block_size, tenant
        self.spec = parse_method(method)
        if any(r.keep for r in self.spec.recipes()):
            raise ValueError("the persistent store keeps every token: keep policies do not apply here")
        extras = (r.smooth or r.center or r.sink or r.outliers or r.vcodec for r in self.spec.recipes())
        if self.spec.layers or any(extras):
            raise ValueError("the persistent store encodes one recipe per layer class from its blocks alone: "
                             "per-layer assignments (layers[...]=), key smoothing or centering, sink tokens, "
                             "outlier channels and a values codec (v=) are not supported there")
        self.classes = layer_classes(model.config)
        windows = [w for c, w in self.classes if c == "sliding"]
        self.n_win = n_win if n_win is not None else 2 * max(windows, default=0)
        if windows and self.n_win < max(windows):
            raise ValueError(f"n_win must be >= the sliding window ({max(windows)}), got {self.n_win}")
        dtype = str(next(model.parameters()).dtype)
        fp = fingerprint or model_fingerprint(model.config.to_dict(), weights_digest(model))
        self.ns = namespace(fp, str(self.spec), dtype)
        self.dtype = next(model.parameters()).dtype
        text = model.config.get_text_config()
        self.vocab, self.kv_heads = text.vocab_size, text.num_key_value_heads
        self.head_dim = head_dim(text)

    def _unpack(self, entry: Entry, klass: str, layers: list[int], tokens: int | None):
        """A verified record's per-layer K/V `[1, kv_heads, tokens, head_dim]`, or None: a record that
        does not decode to exactly that is counted and removed."""
        try:
            recipe = self.spec.full if klass == "global" else self.spec.sliding
            kv = unpack_block(recipe, *entry.open(), self.dtype)
            if sorted(kv) != layers:
                raise RecordError(f"record holds layers {sorted(kv)}, expected {layers}")
            for k, v in kv.values():
                fits = k.shape == v.shape and k.dim() == 4 and (tokens is None or k.shape[2] == tokens)
                if not fits or (k.shape[0], k.shape[1], k.shape[3]) != (1, self.kv_heads, self.head_dim):
                    raise RecordError(f"record tensors {tuple(k.shape)} / {tuple(v.shape)} do not fit the "
                                      "model")
        except RecordError:
            entry.reject()
            return None
        return kv

    def serve(self, ids: list[int]) -> Served:
        if not ids or not all(isinstance(t, int) and 0 <= t < self.vocab for t in ids):
            raise ValueError(f"serve needs a non-empty list of token ids in [0, {self.vocab})")
        t0 = time.perf_counter()
        usable = (len(ids) - 1) // self.block  # keep >= 1 token to compute the next-token logits
        hashes = [h.hex() for h in block_hashes(ids, self.block, self.ns, self.tenant)][:usable]
        full = [i for i, (c, _) in enumerate(self.classes) if c == "full"]
        sliding = [i for i, (c, _) in enumerate(self.classes) if c == "sliding"]
        # a model without sliding layers has no SWA state to lose: its global KV is the whole state
        found = self.store.lookup(hashes, self.ns, swa=bool(sliding))
        records = []
        for entry in found.entries:
            kv = self._unpack(entry, "global", full, self.block)
            if kv is None:
                break
            records.append(kv)
        P = len(records) * self.block
        cache = CompressedCache(self.model.config, self.spec)
        start, kind = 0, "miss"
        if records:
            # the SWA state belongs to the lookup's last block: a shorter usable chain replays
            swa = found.swa if len(records) == found.global_blocks else None
            swa_kv = self._unpack(swa, "swa", sliding, None) if swa is not None else None
            live = swa_kv is not None or not sliding
            kind = "hit" if live else "replay"
            start = P if live else max(0, P - self.n_win)
            for i, (layer, (cls, _)) in enumerate(zip(cache.layers, self.classes)):
                if cls == "full":
                    k = torch.cat([r[i][0] for r in records], dim=-2)
                    v = torch.cat([r[i][1] for r in records], dim=-2)
                    layer.load_prefill(k, v, P)
                    if kind == "replay":
                        layer.start_replay(start)
                else:
                    k, v = swa_kv[i] if swa_kv is not None else self._empty(i)
                    layer.load_prefill(k, v, start)
        Q = max(P, usable * self.block)
        write_s, snapshot = 0.0, None
        if start < Q:
            forward(self.model, torch.tensor([ids[start:Q]]), cache)
            t1 = time.perf_counter()
            snapshot = self._snapshot(cache, P, Q)  # the state at the block boundary, before the remainder
            write_s += time.perf_counter() - t1
        logits = forward(self.model, torch.tensor([ids[Q:]]), cache)[:, -1]
        ttft = time.perf_counter() - t0 - write_s
        t1 = time.perf_counter()
        if snapshot is not None:
            blocks, swa = snapshot
            for b, kv in blocks.items():
                self.store.put_global(hashes[b], *pack_block(self.spec.full, kv), namespace=self.ns)
            if swa:
                self.store.put_swa(
                    hashes[Q // self.block - 1], *pack_block(self.spec.sliding, swa), namespace=self.ns
                )
        write_s += time.perf_counter() - t1
        return Served(cache, logits, kind, P, len(ids) - start, ttft, write_s)

    def _snapshot(self, cache: CompressedCache, P: int, Q: int):
        """Global KV of the new blocks [P, Q) and every sliding layer's window at Q."""
        full = {i: layer.dense() for i, layer in enumerate(cache.layers) if not layer.is_sliding}
        blocks = {}
        for b in range(P // self.block, Q // self.block):
            s = slice(b * self.block, (b + 1) * self.block)
            blocks[b] = {i: (k[..., s, :], v[..., s, :]) for i, (k, v) in full.items()}
        swa = {i: layer.dense() for i, layer in enumerate(cache.layers) if layer.is_sliding}
        return blocks, swa

    def _empty(self, i: int):
        z = torch.zeros(1, self.kv_heads, 0, self.head_dim, dtype=self.dtype)
        return z, z
