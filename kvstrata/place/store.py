"""The KV store: global KV in a persistent tier with guaranteed retention, SWA KV in a TTL pool.

Two classes, two policies:
- global KV (full-attention layers): never evicted inside its retention; a full tier refuses new
  writes (counted) rather than break that guarantee. On Redis the retention is each record's TTL.
- SWA KV (sliding layers): a memory pool capped at a share of host RAM with a TTL of minutes;
  expired entries are reclaimed at once, live ones evicted oldest-first when the pool is full
  (an SWA miss costs a bounded replay, not a full prefill).
Global KV a request asks to keep only "in_memory" (`Retention`) goes to an optional RAM tier of
this process instead; a persistent request that hits it there promotes it. Tier class and
retention are arguments of every call (enums: an unknown one is an error).
Invariant: a read returns a record only if it proves it is intact, signed with this store's
secret and written under the key, class and namespace asked for (`records.decode_record`);
anything else is a miss, counted (`stats.corrupt`) and removed -- except a record signed by a
secret this store does not hold (another fleet's, a rotated-out one) or of another record version:
counted apart (`stats.unverifiable`) and left alone, since in a shared tier it may be another
machine's good KV; the admin commands delete those only when told the secret id to delete.
Writes keep the same rule (`records.write_guard`): a put never replaces a record this store cannot
verify -- a fleet member with the wrong secret misses on the fleet's records and its writes of them are
skipped (`stats.writes_skipped_foreign`), so neither side erases the other's. A read-only store
(`read_only`, or a disk root found not writable) serves hits and refuses writes, counted.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstrata.names import Retention, ServeKind, TierClass
from kvstrata.place.disk import DiskTier
from kvstrata.place.disk_root import SECRET
from kvstrata.place.memory import MemoryTier
from kvstrata.place.records import (
    SECRET_ID_BYTES,
    RecordError,
    UnverifiableRecord,
    decode_record,
    encode_record,
    parse_payload,
    secret_id,
    verify_record,
    write_guard,
)
from kvstrata.place.redis_tier import RedisTier
from kvstrata.place.secret import fleet_secrets
from kvstrata.place.tier import StoreUnavailable, Tier

OTHER_VERSION = "other-version"  # how the admin commands name records of another record version


def _is_secret_id(text: str) -> bool:
    return len(text) == 2 * SECRET_ID_BYTES and all(c in "0123456789abcdef" for c in text)


@dataclass(kw_only=True)
class Entry:
    """A record proven intact and written under the key, class and namespace asked for (signature
    checked), its tensors not parsed yet; `open` parses them, and a record that then does not parse
    (or, for the caller, does not fit) is counted and removed with `reject`."""

    payload: bytes | None
    reject: Callable[[], None]
    parsed: tuple[dict, dict] | None = None  # a record not yet written: already (tensors, meta)
    #: for a record found only in memory that a persistent request reads: write it to the persistent
    #: tier (called by the reader once the record proved usable)
    promote: Callable[[], None] = lambda: None

    def open(self) -> tuple[dict, dict]:
        """(tensors, str metadata); raises RecordError when the payload does not parse."""
        return self.parsed if self.parsed is not None else parse_payload(self.payload)


@dataclass(kw_only=True)
class Lookup:
    """Result of a prefix lookup: how many leading blocks hit in global KV, and whether the SWA
    state saved at the last hit block is still live; with those records, verified, not parsed."""

    global_blocks: int
    swa_live: bool
    entries: list[Entry] = field(default_factory=list, repr=False)
    swa: Entry | None = field(default=None, repr=False)

    @property
    def kind(self) -> ServeKind:
        if self.global_blocks == 0:
            return ServeKind.MISS
        return ServeKind.HIT if self.swa_live else ServeKind.REPLAY


class KVStore:
    """`secret` signs and verifies records; None draws a fresh one, so records live as long as this
    object (`from_config` reads or creates the store's persistent secret). `previous_secrets` only
    verify (key rotation: a fleet moves to a new secret without losing its KV). `memory_tier`: where
    "in_memory" global KV goes (None: such a request is refused)."""

    def __init__(
        self, global_tier: Tier, swa_tier: Tier, retention_s: float = 72 * 3600, swa_ttl_s: float = 300.0,
        secret: bytes | None = None, memory_tier: Tier | None = None,
        previous_secrets: tuple[bytes, ...] = (),
    ):
        self.global_tier = global_tier
        self.swa_tier = swa_tier
        self.memory_tier = memory_tier
        self.retention_s = retention_s
        self.swa_ttl_s = swa_ttl_s
        self.secret = secrets.token_bytes(32) if secret is None else secret
        self.secrets = (self.secret, *previous_secrets)  # the first signs, all verify
        self.guard = write_guard(self.secrets)  # what a write may replace: only records these verify

    @property
    def read_only(self) -> str:
        """Why the persistent tier takes no writes ("" when it does)."""
        return self.global_tier.read_only

    def _tier(self, klass: TierClass, retention: Retention = Retention.PERSISTENT) -> Tier:
        if TierClass(klass) is TierClass.SWA:
            return self.swa_tier
        if Retention(retention) is Retention.PERSISTENT:
            return self.global_tier
        if self.memory_tier is None:
            raise ValueError("this store has no in-memory tier for 'in_memory' retention")
        return self.memory_tier

    # --- global KV -----------------------------------------------------------------------------
    def put_global(self, key: str, tensors, meta: dict, namespace: bytes = b"",
                   retention: Retention = Retention.PERSISTENT) -> bool:
        """Keep one block's global KV (persistently, or in this process's memory); False (and counted)
        when the tier is full."""
        tier = self._tier(TierClass.GLOBAL, retention)
        by_ttl = tier.retention_by_ttl and self.retention_s > 0
        blob = encode_record(tensors, meta, key=key, secret=self.secret, klass=TierClass.GLOBAL,
                             namespace=namespace)
        return tier.put(key, blob, ttl_s=self.retention_s if by_ttl else None, guard=self.guard)

    def get_global(self, key: str, namespace: bytes | None = None):
        """(tensors, meta) of a verified global record, or None (missing, expired, or rejected)."""
        return self._verified(TierClass.GLOBAL, key, namespace)

    # --- SWA KV ---------------------------------------------------------------------------------
    def put_swa(self, key: str, tensors, meta: dict, namespace: bytes = b"") -> bool:
        blob = encode_record(tensors, meta, key=key, secret=self.secret, klass=TierClass.SWA,
                             namespace=namespace)
        return self.swa_tier.put(key, blob, ttl_s=self.swa_ttl_s, guard=self.guard)

    def get_swa(self, key: str, namespace: bytes | None = None):
        return self._verified(TierClass.SWA, key, namespace)

    def _verified(self, klass: TierClass, key: str, namespace: bytes | None):
        entry = self.entry(klass, key, namespace)
        if entry is None:
            return None
        try:
            rec = entry.open()
        except RecordError:
            entry.reject()
            return None
        entry.promote()
        return rec

    def entry(self, klass: TierClass, key: str, namespace: bytes | None = None,
              retention: Retention = Retention.PERSISTENT) -> Entry | None:
        """`key`'s record in `klass`, verified (no tensor parsed), or None: missing, or a counted miss.
        Global KV found only in the memory tier carries a `promote` when `retention` is persistent."""
        klass = TierClass(klass)
        found, in_memory = self._find(klass, key, namespace)
        if in_memory and Retention(retention) is Retention.PERSISTENT and namespace is not None:
            def promote(entry=found):
                tensors, meta = entry.open()
                self.put_global(key, tensors, dict(meta), namespace)

            found.promote = promote
        return found

    def _find(self, klass: TierClass, key: str, namespace: bytes | None) -> tuple[Entry | None, bool]:
        """(the record, whether it came from the memory tier)."""
        found = self._entry(self._tier(klass), klass, key, namespace)
        if found is not None or klass is TierClass.SWA or self.memory_tier is None:
            return found, False
        found = self._entry(self.memory_tier, klass, key, namespace)
        return found, found is not None

    def _entry(self, tier: Tier, klass: TierClass, key: str, namespace: bytes | None) -> Entry | None:
        blob = tier.get(key)
        if blob is None:
            return None
        try:
            payload = verify_record(blob, key=key, secret=self.secrets, klass=klass, namespace=namespace)
        except UnverifiableRecord:
            tier.stats.unverifiable += 1  # not ours to judge: left for whoever holds its secret
            return None
        except RecordError:
            self._reject(tier, key)
            return None
        return Entry(payload=payload, reject=lambda: self._reject(tier, key))


    def reject(self, key: str, klass: TierClass = TierClass.GLOBAL) -> None:
        """A record that verified but cannot be used (e.g. its payload does not decode): counted, removed."""
        self._reject(self._tier(klass), key)

    @staticmethod
    def _reject(tier: Tier, key: str) -> None:
        tier.stats.corrupt += 1
        tier.delete(key)

    # --- serving --------------------------------------------------------------------------------
    def lookup(self, hashes: list[str], namespace: bytes | None = None, swa: bool = True,
               retention: Retention = Retention.PERSISTENT) -> Lookup:
        """Longest prefix of `hashes` whose global KV is present and intact, and SWA liveness at its
        last block (`swa=False`: the model has no sliding layers, so no SWA state to lose)."""
        entries = []
        for h in hashes:
            entry = self.entry(TierClass.GLOBAL, h, namespace, retention)
            if entry is None:
                break
            entries.append(entry)
        n = len(entries)
        live = self.entry(TierClass.SWA, hashes[n - 1], namespace) if n and swa else None
        return Lookup(global_blocks=n, swa_live=n > 0 and (live is not None or not swa), entries=entries,
                      swa=live)

    @classmethod
    def from_config(cls, cfg) -> "KVStore":
        """Embedded default: local disk for global KV (or Redis when `redis_url` is set, after checking
        it can be reached and keeps retention), RAM pool for SWA, the store's persistent secret."""

        if cfg.redis_url:
            secret, previous = fleet_secrets(cfg, lambda: Path(cfg.root).expanduser() / SECRET)
            g = RedisTier(cfg.redis_url, cluster=cfg.redis_cluster, socket_timeout=cfg.redis_timeout_seconds,
                          check_interval_s=cfg.redis_check_seconds, read_only=cfg.read_only)
            g.connect(global_class=True, allow_eviction=cfg.redis_allow_eviction)
        else:
            g = DiskTier(cfg.root, int(cfg.global_capacity_gb * 2**30), read_only=cfg.read_only)
            secret, previous = fleet_secrets(cfg, lambda: g.root / SECRET)
        return cls(
            g, MemoryTier(cfg.swa_capacity_bytes), cfg.retention_hours * 3600, cfg.swa_ttl_seconds, secret,
            previous_secrets=previous,
        )

    # --- admin ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Every tier's counters and description; a tier's live check runs first (forced)."""
        self.problems(force=True)
        out = {}
        for name, t in (("global", self.global_tier), ("swa", self.swa_tier)):
            out[name] = {"keys": len(t.keys()), "bytes": t.nbytes(), **asdict(t.stats)}
            out[name].update(t.describe())
        out["global"]["secret_id"] = secret_id(self.secret).hex()
        out["global"]["verifies"] = [secret_id(s).hex() for s in self.secrets]
        return out

    def problems(self, force: bool = False) -> list[str]:
        """What currently breaks the store's guarantees (a tier's live check, e.g. Redis's policy)."""
        return self.global_tier.problems(force)

    def _admin_read(self, key: str) -> tuple[str, str]:
        """(state, secret id): 'ok' | 'corrupt' | 'gone' | 'unverifiable' (with the signer's id, ""
        for another record version); a failing tier raises StoreUnavailable."""
        t = self.global_tier
        errors, corrupt = t.stats.errors, t.stats.corrupt
        blob = t.get(key)
        if t.stats.errors > errors:
            raise StoreUnavailable(f"the global tier failed while reading {key}")
        if blob is None:
            if t.stats.corrupt > corrupt:
                return "corrupt", ""
            self.problems(force=True)  # listed, then gone: was it evicted? (the tier's live check says)
            return "gone", ""
        try:
            decode_record(blob, key=key, secret=self.secrets, klass=TierClass.GLOBAL)
        except UnverifiableRecord as exc:
            t.stats.unverifiable += 1
            return "unverifiable", exc.secret_id
        except RecordError:
            self._reject(t, key)
            return "corrupt", ""
        return "ok", ""

    def _sweep(self, delete_foreign: tuple[str, ...]) -> tuple[dict, list[str]]:
        """Read back every global record: corrupt ones removed, unverifiable ones counted by signer and
        removed only when their secret id is in `delete_foreign` ("other-version": another record
        version). (report, keys of intact records)."""
        unknown = [i for i in delete_foreign if i != OTHER_VERSION and not _is_secret_id(i)]
        if unknown:
            raise ValueError(f"not a secret id: {unknown[0]!r} (ids are {2 * SECRET_ID_BYTES} hex digits, as "
                             "'store stats' and 'store verify' show them, or 'other-version')")
        counts = {"checked": 0, "corrupt_removed": 0, "gone": 0, "foreign_removed": 0}
        signers: dict[str, int] = {}
        alive = []
        for key in self.global_tier.keys():
            counts["checked"] += 1
            state, signer = self._admin_read(key)
            if state == "ok":
                alive.append(key)
            elif state == "unverifiable":
                signer = signer or OTHER_VERSION
                signers[signer] = signers.get(signer, 0) + 1
                if signer in delete_foreign:
                    self.global_tier.delete(key)
                    counts["foreign_removed"] += 1
            else:
                counts["corrupt_removed" if state == "corrupt" else "gone"] += 1
        report = {**counts, "unverifiable": dict(sorted(signers.items())), **self._skipped()}
        problems = self.problems()
        if problems:
            report["problems"] = problems
        return report, alive

    def _skipped(self) -> dict:
        return {"skipped": self.global_tier.describe().get("skipped", {})}

    def verify(self, delete_foreign: tuple[str, ...] = ()) -> dict:
        """Read back every global record; corrupt ones are removed and counted, records signed by a
        secret this store does not hold are counted by signer and kept (unless named for deletion)."""
        return self._sweep(delete_foreign)[0]

    def gc(self, delete_foreign: tuple[str, ...] = ()) -> dict:
        """`verify`, then drop intact records past retention; on a tier that keeps retention as TTLs,
        report them and give a TTL to records that lack one."""
        report, keys = self._sweep(delete_foreign)
        removed, alive = 0, []
        for key in keys:
            written = self.global_tier.mtime(key)
            if written is not None and time.time() - written > self.retention_s:
                self.global_tier.delete(key)
                removed += 1
            else:
                alive.append(key)
        out = {"removed_past_retention": removed, **report, "swa_expired": self.swa_tier.reclaim_expired()}
        if self.global_tier.retention_by_ttl:
            out["ttl"] = self._ttl_report(alive)
        return out

    def _ttl_report(self, keys: list[str]) -> dict:
        ttls = self.global_tier.ttls(keys)
        missing = [k for k, t in zip(keys, ttls) if t is None]
        if self.retention_s > 0:
            for k in missing:
                self.global_tier.set_ttl(k, self.retention_s)
        left = [t for t in ttls if t is not None and t >= 0]
        return {
            "retention_s": self.retention_s, "with_ttl": len(left),
            "ttl_set_now": len(missing) if self.retention_s > 0 else 0,
            "min_remaining_s": min(left, default=None), "max_remaining_s": max(left, default=None),
        }
