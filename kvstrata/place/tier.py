"""The tier contract: bytes in, bytes out, by key, with an optional time to live; a write may carry
a `WriteGuard`, and a tier may be read-only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Protocol


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    refused: int = 0  # writes a full tier declined (retention guarantees)
    evicted: int = 0
    expired: int = 0
    errors: int = 0  # transport failures answered as misses
    corrupt: int = 0  # records that failed verification and were removed
    unverifiable: int = 0  # records signed by a secret this store does not hold: misses, left alone
    skipped: int = 0  # entries the tier did not create, left alone (disk: other files, links, FIFOs)
    writes_skipped_foreign: int = 0  # writes not made: the key holds a record another secret signed
    refused_read_only: int = 0  # writes a read-only tier declined (also counted in `refused`)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WriteGuard:
    """What a write may replace. Invariant: a write never replaces a value that is a record this store
    cannot verify -- another secret's (a fleet member with the wrong secret) or another record version
    -- so in a shared tier neither side erases the other's KV. The rule reads only a value's first
    `head_bytes` bytes and its length, so Redis applies it atomically (`redis_tier`'s Lua script) and the
    disk tier under its ledger's lock. Built by `records.write_guard`, which owns the record layout.

    A value is kept when it is at least `min_length` bytes, starts with `magic`, and either its version
    (`version`, right after the magic) is another or the signer id at `id_at` is none of `ids`. Anything
    else (no record, a cut one, one of ours) may be replaced: the store would remove it as corrupt."""

    magic: bytes
    version: bytes
    id_at: int
    ids: frozenset[bytes]
    min_length: int

    @property
    def head_bytes(self) -> int:
        return self.id_at + len(next(iter(self.ids)))

    def keeps(self, head: bytes, length: int) -> bool:
        """True when the value already under the key (its first `head_bytes` bytes, its total length)
        must not be replaced."""
        n = len(self.magic)
        if length < self.min_length or head[:n] != self.magic:
            return False
        other_version = head[n:n + len(self.version)] != self.version
        return other_version or head[self.id_at:self.head_bytes] not in self.ids


class StoreUnavailable(RuntimeError):
    """A tier cannot be reached or refuses us (server down, authentication): said, never a silent
    empty answer."""


class Tier(Protocol):
    """Everything the store calls on a tier (`TierBase` supplies the optional parts' defaults)."""

    stats: TierStats
    #: why the tier takes no writes ("" when it does): `read_only = true`, or a root found not writable
    read_only: str
    #: the store keeps global retention as a TTL on each record (Redis) rather than by age scans
    retention_by_ttl: ClassVar[bool]

    def get(self, key: str) -> bytes | None:
        """The stored value, or None (missing, expired, or unreachable: a miss either way)."""
        ...

    def put(self, key: str, value: bytes, ttl_s: float | None = None,
            guard: WriteGuard | None = None) -> bool:
        """Store `value`; False when the tier declined (full, unreachable, read-only) or when `guard` keeps
        what the key holds (counted in `stats.writes_skipped_foreign`)."""
        ...

    def delete(self, key: str) -> None: ...

    def keys(self) -> list[str]: ...

    def nbytes(self) -> int:
        """Bytes of values currently held."""
        ...

    def describe(self) -> dict:
        """What an operator needs to see (root, capacity, server, entries left alone)."""
        ...

    def mtime(self, key: str) -> float | None:
        """When `key` was written (seconds since the epoch), or None when the tier cannot say."""
        ...

    def reclaim_expired(self) -> int:
        """Drop entries past their TTL now; how many went."""
        ...

    def ttls(self, keys: list[str]) -> list[float | None]:
        """Seconds each key has left (None: no TTL); only tiers with `retention_by_ttl`."""
        ...

    def set_ttl(self, key: str, ttl_s: float) -> bool:
        """Give `key` a TTL; only tiers with `retention_by_ttl`."""
        ...

    def problems(self, force: bool = False) -> list[str]:
        """What breaks the tier's guarantees right now (checked live, at most every so often unless
        `force`); [] when nothing does."""
        ...


class TierBase:
    """Defaults for the optional parts of `Tier`: no TTL-kept retention, nothing to describe, write
    times unknown, nothing to reclaim (a tier overrides what it can do)."""

    retention_by_ttl: ClassVar[bool] = False
    read_only: str = ""

    def describe(self) -> dict:
        return {}

    def mtime(self, key: str) -> float | None:
        return None

    def reclaim_expired(self) -> int:
        return 0

    def ttls(self, keys: list[str]) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} keeps no per-record TTLs")

    def set_ttl(self, key: str, ttl_s: float) -> bool:
        raise NotImplementedError(f"{type(self).__name__} keeps no per-record TTLs")

    def problems(self, force: bool = False) -> list[str]:
        return []


def refuse_read_only(tier) -> bool:
    """False, the write counted as refused by a read-only tier."""
    tier.stats.refused += 1
    tier.stats.refused_read_only += 1
    return False


def now() -> float:
    """Wall-clock seconds; one place so tests can reason about expiry."""
    return time.time()
