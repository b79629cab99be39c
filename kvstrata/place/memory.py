"""In-process memory tier: byte-capacity LRU with per-entry expiry."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstrata.place import tier as _tier
from kvstrata.place.tier import TierBase, TierStats, WriteGuard


class MemoryTier(TierBase):
    """LRU over `capacity_bytes`. Expired entries are reclaimed before anything live is evicted;
    with `evict=False` a full tier refuses new writes instead of evicting live entries. Safe to share
    between threads (a serving engine's scheduler reads while its writer thread puts)."""

    def __init__(self, capacity_bytes: int, evict: bool = True):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.evict = evict
        self._data: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()
        self._bytes = 0
        self.stats = TierStats()
        self._lock = threading.RLock()

    def _drop(self, key: str) -> None:
        value, _ = self._data.pop(key)
        self._bytes -= len(value)

    def reclaim_expired(self) -> int:
        with self._lock:
            t = _tier.now()
            dead = [k for k, (_, exp) in self._data.items() if exp is not None and exp <= t]
            for k in dead:
                self._drop(k)
            self.stats.expired += len(dead)
            return len(dead)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            item = self._data.get(key)
            if item is None or (item[1] is not None and item[1] <= _tier.now()):
                if item is not None:
                    self._drop(key)
                    self.stats.expired += 1
                self.stats.misses += 1
                return None
            self._data.move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: str, value: bytes, ttl_s: float | None = None,
            guard: WriteGuard | None = None) -> bool:
        with self._lock:
            old = self._data.get(key)
            live = old is not None and (old[1] is None or old[1] > _tier.now())
            if guard is not None and live and guard.keeps(old[0][: guard.head_bytes], len(old[0])):
                self.stats.writes_skipped_foreign += 1
                return False
            if len(value) > self.capacity:
                self.stats.refused += 1
                return False
            if key in self._data:
                self._drop(key)
            if self._bytes + len(value) > self.capacity:
                self.reclaim_expired()
            while self._bytes + len(value) > self.capacity:
                if not self.evict or not self._data:
                    self.stats.refused += 1
                    return False
                self._drop(next(iter(self._data)))
                self.stats.evicted += 1
            self._data[key] = (value, None if ttl_s is None else _tier.now() + ttl_s)
            self._bytes += len(value)
            self.stats.writes += 1
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            if key in self._data:
                self._drop(key)

    def clear(self) -> None:
        """Drop every entry (e.g. to simulate the SWA pool losing a session's state)."""
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)

    def nbytes(self) -> int:
        with self._lock:
            return self._bytes
