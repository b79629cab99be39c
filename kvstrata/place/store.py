"""The KV store: global KV in a persistent tier with guaranteed retention, SWA KV in a TTL pool.

Two classes, two policies:
- global KV (full-attention layers): never evicted inside its retention; a full tier refuses new
  writes (counted) rather than break that guarantee.
- SWA KV (sliding layers): a memory pool capped at a share of host RAM with a TTL of minutes;
  expired entries are reclaimed at once, live ones evicted oldest-first when the pool is full
  (an SWA miss costs a bounded replay, not a full prefill).
Every read is verified (`records.decode_record`); a record that cannot be proven intact is a miss,
counted, and removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstrata.place.records import RecordError, decode_record, encode_record
from kvstrata.place.tier import Tier


@dataclass
class Lookup:
    """Result of a prefix lookup: how many leading blocks hit in global KV, and whether the SWA
    state saved at the last hit block is still live."""

    global_blocks: int
    swa_live: bool

    @property
    def kind(self) -> str:
        if self.global_blocks == 0:
            return "miss"
        return "hit" if self.swa_live else "replay"


class KVStore:
    def __init__(self, global_tier: Tier, swa_tier: Tier, retention_s: float = 72 * 3600, swa_ttl_s: float = 300.0):
        self.global_tier = global_tier
        self.swa_tier = swa_tier
        self.retention_s = retention_s
        self.swa_ttl_s = swa_ttl_s

    # --- global KV -----------------------------------------------------------------------------
    def put_global(self, key: str, tensors, meta: dict) -> bool:
        """Persist one block's global KV; False (and counted) when the tier is full."""
        return self.global_tier.put(key, encode_record(tensors, {**meta, "class": "global"}))

    def get_global(self, key: str):
        return self._verified(self.global_tier, key)

    # --- SWA KV ---------------------------------------------------------------------------------
    def put_swa(self, key: str, tensors, meta: dict) -> bool:
        return self.swa_tier.put(key, encode_record(tensors, {**meta, "class": "swa"}), ttl_s=self.swa_ttl_s)

    def get_swa(self, key: str):
        return self._verified(self.swa_tier, key)

    def _verified(self, tier: Tier, key: str):
        blob = tier.get(key)
        if blob is None:
            return None
        try:
            return decode_record(blob)
        except RecordError:
            tier.stats.corrupt += 1
            tier.delete(key)
            return None

    # --- serving --------------------------------------------------------------------------------
    def lookup(self, hashes: list[str]) -> Lookup:
        """Longest prefix of `hashes` whose global KV is present and intact, and SWA liveness there."""
        n = 0
        for h in hashes:
            if self.get_global(h) is None:
                break
            n += 1
        live = n > 0 and self.get_swa(hashes[n - 1]) is not None
        return Lookup(n, live)

    @classmethod
    def from_config(cls, cfg) -> "KVStore":
        """Embedded default: local disk for global KV (or Redis when `redis_url` is set), RAM pool for SWA."""
        from pathlib import Path

        from kvstrata.place.disk import DiskTier
        from kvstrata.place.memory import MemoryTier
        from kvstrata.place.redis_tier import RedisTier

        if cfg.redis_url:
            g = RedisTier(cfg.redis_url, cluster=cfg.redis_cluster, socket_timeout=cfg.redis_timeout_seconds)
        else:
            g = DiskTier(Path(cfg.root).expanduser(), int(cfg.global_capacity_gb * 2**30))
        return cls(g, MemoryTier(cfg.swa_capacity_bytes), cfg.retention_hours * 3600, cfg.swa_ttl_seconds)

    def stats(self) -> dict:
        from dataclasses import asdict

        return {name: {"keys": len(t.keys()), "bytes": t.nbytes(), **asdict(t.stats)}
                for name, t in (("global", self.global_tier), ("swa", self.swa_tier))}

    def verify(self) -> dict:
        """Read back every global record; corrupt ones are removed and counted."""
        keys = self.global_tier.keys()
        bad = [k for k in keys if self.get_global(k) is None]
        return {"checked": len(keys), "corrupt_removed": len(bad)}

    def gc(self) -> dict:
        """Verify every global record (removing corrupt ones) and drop those past retention."""
        removed = corrupt = 0
        mtime = getattr(self.global_tier, "mtime", None)
        for key in self.global_tier.keys():
            if self.get_global(key) is None:
                corrupt += 1
                continue
            written = mtime(key) if mtime else None
            if written is not None and time.time() - written > self.retention_s:
                self.global_tier.delete(key)
                removed += 1
        reclaim = getattr(self.swa_tier, "reclaim_expired", None)
        expired = reclaim() if reclaim else 0
        return {"removed_past_retention": removed, "corrupt_removed": corrupt, "swa_expired": expired}
