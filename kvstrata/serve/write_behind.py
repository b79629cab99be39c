"""The store as the server uses it: writes off the first-token path, and two retention classes.

- Write-behind: `put_global` / `put_swa` hand the record to one writer thread and return at once,
  so a request's first token never waits for encoding, fsync or a Redis round trip. A record
  still on its way is read back from memory (read-your-writes): the next turn of a conversation
  hits even if its blocks are not yet on disk. At most `max_pending` records wait; beyond that
  the caller blocks (back-pressure, never unbounded memory).
- Retention classes (`prompt_cache_retention`, passed with each call as a `Retention`): "24h"
  writes global KV to the persistent tier (disk / Redis, kept at least `retention_hours`);
  "in_memory" keeps it in a RAM LRU of this process only (the store's `memory_tier`), never
  written out and lost on restart. A "24h" request that hits an in-memory block promotes it.
- One lock serialises tier access between the model worker (reads) and the writer (writes).

Built on `KVStore`'s public methods only, with the store's own secret (`from_config` reads the
persistent one, so a restarted server reads what it wrote): a record that fails verification is
still a counted miss. A pending record is returned only for the key, class and namespace it was
put under, as a written one would be.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from kvstrata.names import Retention, TierClass
from kvstrata.place.memory import MemoryTier
from kvstrata.place.store import Entry, KVStore

log = logging.getLogger("kvstrata.serve")


@dataclass(eq=False, kw_only=True)
class _Pending:
    cls: TierClass
    key: str
    tensors: dict
    meta: dict
    retention: Retention
    namespace: bytes = b""


class WriteBehindStore(KVStore):
    """A `KVStore` (persistent global tier + SWA pool + a RAM tier for "in_memory" global KV) whose
    writes happen on a thread of their own."""

    def __init__(self, *args, memory_global_bytes: int = 1 << 30, max_pending: int = 1024, **kwargs):
        super().__init__(*args, **kwargs)
        if self.memory_tier is None:
            self.memory_tier = MemoryTier(memory_global_bytes)
        self._lock = threading.RLock()
        self._pending: dict[tuple[TierClass, str], _Pending] = {}
        self._jobs: queue.Queue[_Pending | None] = queue.Queue(maxsize=max_pending)
        self.write_failures = 0
        self._writer = threading.Thread(target=self._drain, name="kvstrata-store-writer", daemon=True)
        self._writer.start()

    @classmethod
    def open(cls, cfg, memory_global_bytes: int = 1 << 30) -> "WriteBehindStore":
        """The store a `StoreConfig` describes, with an "in_memory" global tier of `memory_global_bytes`."""
        store = cls.from_config(cfg)  # the store's persistent secret
        store.memory_tier = MemoryTier(memory_global_bytes)
        return store

    def tiers(self) -> dict:
        """Every tier by the name metrics give it."""
        return {"global": self.global_tier, "memory_global": self.memory_tier, "swa": self.swa_tier}

    # --- reads: pending first, then the tiers --------------------------------------------------
    def _find(self, klass: TierClass, key: str, namespace: bytes | None) -> tuple[Entry | None, bool]:
        with self._lock:
            p = self._pending.get((klass, key))
        if p is not None and (namespace is None or p.namespace == namespace):
            found = Entry(payload=None, reject=lambda: None,
                          parsed=(p.tensors, {k: str(v) for k, v in p.meta.items()}))
            return found, p.retention is Retention.IN_MEMORY
        with self._lock:
            return super()._find(klass, key, namespace)

    # --- writes: queued ------------------------------------------------------------------------
    def put_global(self, key: str, tensors, meta: dict, namespace: bytes = b"",
                   retention: Retention = Retention.PERSISTENT) -> bool:
        return self._enqueue(_Pending(cls=TierClass.GLOBAL, key=key, tensors=tensors, meta=dict(meta),
                                      retention=Retention(retention), namespace=namespace))

    def put_swa(self, key: str, tensors, meta: dict, namespace: bytes = b"") -> bool:
        return self._enqueue(_Pending(cls=TierClass.SWA, key=key, tensors=tensors, meta=dict(meta),
                                      retention=Retention.PERSISTENT, namespace=namespace))

    def _enqueue(self, item: _Pending) -> bool:
        with self._lock:
            self._pending[(item.cls, item.key)] = item
        self._jobs.put(item)
        return True

    def _drain(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                with self._lock:
                    if item.cls is TierClass.SWA:
                        super().put_swa(item.key, item.tensors, item.meta, item.namespace)
                    else:
                        super().put_global(item.key, item.tensors, item.meta, item.namespace, item.retention)
            except Exception:  # a failed write is a later miss, never a failed request
                self.write_failures += 1
                log.exception("writing %s record %s failed", item.cls, item.key)
            finally:
                if item is not None:
                    with self._lock:
                        if self._pending.get((item.cls, item.key)) is item:
                            del self._pending[(item.cls, item.key)]
                self._jobs.task_done()

    @property
    def pending(self) -> int:
        """Records accepted but not yet written."""
        with self._lock:
            return len(self._pending)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every accepted record is written; False if `timeout_s` ran out first."""
        end = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float = 60.0) -> bool:
        done = self.flush(timeout_s)
        self._jobs.put(None)
        self._writer.join(timeout=5)
        return done
