"""The scheduler side's bookkeeping, free of vLLM types: which chunks of which request to load
before a step and which to save after it.

A request's tokens are cut into chunks of `chunk_tokens` from its first token; chunk j's key chains
through every token before it, the namespace and the request's `cache_salt`
(`kvstrata.place.prefix_keys`), so a key names one exact prefix of one tenant. A lookup verifies
(signature, key, class, namespace) the chunks past what vLLM's own prefix cache holds and stops at
the first that does not verify; the hit ends on a vLLM block boundary before the prompt's last token
(which vLLM must compute), so the last chunk of a hit may load only its first blocks. A chunk is
saved once, after the step that computed its last token; chunks that came from the store, or from
vLLM's own cache, are not saved again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.place.prefix_keys import block_hashes
from kvstrata.place.store import KVStore


@dataclass
class Chunks:
    """Chunks `keys[i]` (store keys) cover positions [(first + i) * size, ...) of one request."""

    req_id: str
    blocks: list[int]  # the request's vLLM block ids, in position order
    first: int  # index of the first chunk listed
    keys: list[str]
    skip: int = 0  # positions before this are already in vLLM's own pages: never written over
    stop: int | None = None  # positions from this on are not loaded (vLLM computes them)


@dataclass
class StepPlan:
    """What the worker does around one forward: load these chunks before it, save these after."""

    chunk_tokens: int
    loads: list[Chunks] = field(default_factory=list)
    saves: list[Chunks] = field(default_factory=list)


@dataclass
class _Request:
    tokens: object  # the engine's live token list of the request (prompt, then each sampled token)
    salt: bytes
    blocks: list[int] = field(default_factory=list)
    saved: int = 0  # chunks [0, saved) are in the store or on their way there
    keys: list[str] = field(default_factory=list)
    load: tuple[int, int] | None = None  # positions [a, b) to load before the next forward


class Planner:
    def __init__(self, store: KVStore, namespace: bytes, chunk_tokens: int, block_size: int):
        self.store, self.ns, self.size, self.block = store, namespace, chunk_tokens, block_size
        self._hits: dict[str, int] = {}  # req_id -> tokens the last lookup found
        self._reqs: dict[str, _Request] = {}
        self.stats = {"lookups": 0, "hit_chunks": 0, "loaded_tokens": 0, "saved_chunks": 0}

    def _keys(self, tokens, salt: bytes, count: int) -> list[str]:
        ids = list(tokens[: count * self.size])
        return [h.hex() for h in block_hashes(ids, self.size, self.ns, tenant_salt=salt)]

    def matched(self, req_id: str, tokens, salt: bytes, computed: int) -> int:
        """Tokens beyond `computed` (vLLM's own hit) whose KV the store holds, verified, for a request
        about to start."""
        local = computed // self.size  # chunks vLLM holds whole: nothing to verify or load there
        keys = self._keys(tokens, salt, len(tokens) // self.size)
        look = self.store.lookup(keys[local:], self.ns, swa=False)
        self.stats["lookups"] += 1
        hit = min((local + look.global_blocks) * self.size, (len(tokens) - 1) // self.block * self.block)
        self._hits[req_id] = hit if look.global_blocks else 0
        return max(0, self._hits[req_id] - computed)

    def allocated(self, req_id: str, tokens, salt: bytes, external: int) -> None:
        """The scheduler gave the request its blocks; `external` tokens are to come from the store."""
        hit = self._hits.pop(req_id, 0)
        req = self._reqs.setdefault(req_id, _Request(tokens=tokens, salt=salt))
        req.tokens = tokens
        if external > 0:
            req.load = (hit - external, hit)
            req.saved = max(req.saved, -(-hit // self.size))  # a partly loaded chunk is in the store
            self.stats["hit_chunks"] += -(-external // self.size)

    def step(self, scheduled: list[tuple[str, list[int] | None, bool, int, int]]) -> StepPlan:
        """One scheduled step: per request (id, new block ids or None, whether they replace the old
        ones, tokens computed before the step, tokens scheduled in it) -> the worker's plan."""
        plan = StepPlan(chunk_tokens=self.size)
        for req_id, new_blocks, replace, before, count in scheduled:
            req = self._reqs.get(req_id)
            if req is None:
                continue
            if new_blocks is not None:
                req.blocks = list(new_blocks) if replace else req.blocks + list(new_blocks)
            if req.load is not None:
                a, b = req.load
                first = a // self.size
                keys = self._keys(req.tokens, req.salt, -(-b // self.size))[first:]
                plan.loads.append(Chunks(req_id, list(req.blocks), first, keys, skip=a, stop=b))
                self.stats["loaded_tokens"] += b - a
                req.load = None
            done = min(before + count, len(req.tokens)) // self.size
            if replace:  # a new or resumed request: chunks vLLM's own cache held are not written again
                req.saved = max(req.saved, min(before, len(req.tokens)) // self.size)
            if done > req.saved:
                if len(req.keys) < done:
                    req.keys = self._keys(req.tokens, req.salt, done)
                plan.saves.append(Chunks(req_id, list(req.blocks), req.saved, req.keys[req.saved:done]))
                self.stats["saved_chunks"] += done - req.saved
                req.saved = done
        return plan

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
