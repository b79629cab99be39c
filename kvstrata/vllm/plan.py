"""The scheduler side's bookkeeping, free of vLLM types: which chunks of which request to load
before a step and which to save after it.

A request's tokens are cut into chunks of `chunk_tokens` from its first token; chunk j's key chains
through every token before it, the namespace and the request's `cache_salt`
(`kvstrata.place.prefix_keys`), so a key names one exact prefix of one tenant. A chunk is held as
two records under its key: the layers of vLLM's full-attention groups in the persistent tier (the
store's global class) and, when vLLM's hybrid allocator runs a model with sliding-window groups,
those groups' layers in the store's SWA pool (minutes). A lookup verifies (signature, key, class,
namespace) the chunks past what vLLM's own prefix cache holds and stops at the first that does not
verify; the hit ends on a vLLM block boundary before the prompt's last token (which vLLM must
compute), and, with sliding-window groups, where the pool still holds every chunk the window before
it needs: vLLM gives one computed count for all groups and replays no window for these layers, so a
hit reaches only as far as both kinds are present. A chunk is saved once, after the step that
computed its last token; chunks that came from the store, or from vLLM's own cache, are not saved
again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.names import TierClass
from kvstrata.place.prefix_keys import block_hash, root
from kvstrata.place.store import KVStore

NULL_BLOCK = 0  # vLLM's placeholder block: positions a sliding-window group no longer holds


@dataclass(frozen=True)
class Groups:
    """vLLM's KV-cache groups as the connector sees them: each group's model layers and its sliding
    window (None: full attention, every position kept)."""

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @classmethod
    def single(cls, n_layers: int) -> "Groups":
        return cls(layers=(tuple(range(n_layers)),), windows=(None,))

    @property
    def persistent(self) -> tuple[int, ...]:
        """Layers whose chunks go to the persistent tier (full-attention groups)."""
        return tuple(sorted(i for g, w in zip(self.layers, self.windows) if w is None for i in g))

    @property
    def pooled(self) -> tuple[int, ...]:
        """Layers whose chunks go to the SWA pool (sliding-window groups)."""
        return tuple(sorted(i for g, w in zip(self.layers, self.windows) if w is not None for i in g))

    def kept_from(self, group: int, hit: int, block_size: int) -> int:
        """First position whose block a group still holds once `hit` tokens are computed (vLLM frees a
        sliding group's whole blocks below the next token's window)."""
        w = self.windows[group]
        return 0 if w is None else max(0, (hit - w + 1) // block_size * block_size)

    def window_from(self, hit: int, block_size: int) -> int | None:
        """First position any sliding group holds at `hit` (None: no sliding group)."""
        starts = [self.kept_from(g, hit, block_size) for g, w in enumerate(self.windows) if w is not None]
        return min(starts) if starts else None


@dataclass
class Chunks:
    """Chunks `keys[i]` (store keys) cover positions [(first + i) * size, ...) of one request."""

    req_id: str
    blocks: tuple[list[int], ...]  # per KV-cache group, the request's vLLM block ids in position order
    first: int  # index of the first chunk listed
    keys: list[str]
    skip: int = 0  # positions before this are already in vLLM's own pages: never written over
    stop: int = 0  # positions from this on are not loaded (vLLM computes them)


@dataclass
class StepPlan:
    """What the worker does around one forward: load these chunks (for requests waiting on them) and
    save these after it."""

    chunk_tokens: int
    loads: list[Chunks] = field(default_factory=list)
    saves: list[Chunks] = field(default_factory=list)


@dataclass
class _Request:
    tokens: object  # the engine's live token list of the request (prompt, then each sampled token)
    salt: bytes
    blocks: tuple[list[int], ...] = ()
    saved: int = 0  # chunks [0, saved) are in the store or on their way there
    keys: list[str] = field(default_factory=list)


class Planner:
    def __init__(self, store: KVStore, namespace: bytes, chunk_tokens: int, block_size: int,
                 groups: Groups | None = None):
        self.store, self.ns, self.size, self.block = store, namespace, chunk_tokens, block_size
        self.groups = groups or Groups.single(1)
        self._hits: dict[str, tuple[int, list[str]]] = {}  # req_id -> (tokens the lookup found, chunk keys)
        self._reqs: dict[str, _Request] = {}
        self._loads: list[Chunks] = []  # planned at allocation, handed to the worker with the next step
        self.stats = {"lookups": 0, "hit_chunks": 0, "loaded_tokens": 0, "saved_chunks": 0,
                      "short_of_window": 0}

    def _keys(self, tokens, salt: bytes, count: int, known: list[str] = ()) -> list[str]:
        """Keys of the first `count` chunks; `known` (keys of a prefix of them) are kept and the chain
        goes on from the last of them, so a growing request hashes each chunk once."""
        keys = list(known[:count])
        parent = bytes.fromhex(keys[-1]) if keys else root(self.ns, salt)
        for j in range(len(keys), count):
            parent = block_hash(parent, list(tokens[j * self.size:(j + 1) * self.size]))
            keys.append(parent.hex())
        return keys

    def matched(self, req_id: str, tokens, salt: bytes, computed: int) -> int:
        """Tokens beyond `computed` (vLLM's own hit) whose KV the store holds, verified, for a request
        about to start."""
        local = computed // self.size  # chunks vLLM holds whole: nothing to verify or load there
        keys = self._keys(tokens, salt, len(tokens) // self.size)
        look = self.store.lookup(keys[local:], self.ns, swa=False)
        self.stats["lookups"] += 1
        hit = 0
        if look.global_blocks:
            hit = min((local + look.global_blocks) * self.size, (len(tokens) - 1) // self.block * self.block)
            hit = self._with_window(keys, hit, computed)
        self._hits[req_id] = (hit, keys)
        return max(0, hit - computed)

    def _with_window(self, keys: list[str], hit: int, computed: int) -> int:
        """The furthest hit at most `hit` whose sliding-window groups' chunks the pool still holds
        (positions below `computed` are vLLM's own)."""
        while hit > computed:
            start = self.groups.window_from(hit, self.block)
            if start is None:
                return hit
            need = range(max(start, computed) // self.size, -(-hit // self.size))
            if all(self.store.entry(TierClass.SWA, keys[j], self.ns) is not None for j in need):
                return hit
            self.stats["short_of_window"] += 1
            hit = (hit - 1) // self.size * self.size
        return hit

    def allocated(self, req_id: str, tokens, salt: bytes, external: int,
                  blocks: tuple[list[int], ...] = ()) -> None:
        """The scheduler gave the request its blocks; `external` tokens are to come from the store, loaded
        (with the next step) into `blocks` while the request waits for them."""
        hit, keys = self._hits.pop(req_id, (0, []))
        req = self._reqs.setdefault(req_id, _Request(tokens=tokens, salt=salt))
        req.tokens = tokens
        req.keys = keys or req.keys
        if external > 0:
            first, a = (hit - external) // self.size, hit - external
            req.blocks = tuple(list(b) for b in blocks)
            self._loads.append(Chunks(req_id, req.blocks, first, keys[first: -(-hit // self.size)],
                                      skip=a, stop=hit))
            self.stats["loaded_tokens"] += external
            req.saved = max(req.saved, -(-hit // self.size))  # a partly loaded chunk is in the store
            self.stats["hit_chunks"] += -(-external // self.size)

    def step(self, scheduled: list[tuple[str, tuple[list[int], ...] | None, bool, int, int]]) -> StepPlan:
        """One scheduled step: per request (id, new block ids per group or None, whether they replace
        the old ones, tokens computed before the step, tokens scheduled in it) -> the worker's plan."""
        plan = StepPlan(chunk_tokens=self.size, loads=self._loads)
        self._loads = []
        for req_id, new_blocks, replace, before, count in scheduled:
            req = self._reqs.get(req_id)
            if req is None:
                continue
            if new_blocks is not None:
                req.blocks = tuple(list(n) if replace or not req.blocks else req.blocks[g] + list(n)
                                   for g, n in enumerate(new_blocks))
            done = min(before + count, len(req.tokens)) // self.size
            if replace:  # a new or resumed request: chunks vLLM's own cache held are not written again
                req.saved = max(req.saved, min(before, len(req.tokens)) // self.size)
            if done > req.saved:
                req.keys = self._keys(req.tokens, req.salt, done, req.keys)
                plan.saves.append(Chunks(req_id, tuple(list(b) for b in req.blocks), req.saved,
                                         req.keys[req.saved:done]))
                self.stats["saved_chunks"] += done - req.saved
                req.saved = done
        return plan

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
