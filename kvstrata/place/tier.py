"""The tier contract: bytes in, bytes out, by key, with an optional time to live."""

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
    extra: dict = field(default_factory=dict)


class StoreUnavailable(RuntimeError):
    """A tier cannot be reached or refuses us (server down, authentication): said, never a silent
    empty answer."""


class Tier(Protocol):
    """Everything the store calls on a tier (`TierBase` supplies the optional parts' defaults)."""

    stats: TierStats
    #: the store keeps global retention as a TTL on each record (Redis) rather than by age scans
    retention_by_ttl: ClassVar[bool]

    def get(self, key: str) -> bytes | None:
        """The stored value, or None (missing, expired, or unreachable: a miss either way)."""
        ...

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        """Store `value`; False when the tier declined (full, unreachable)."""
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


def now() -> float:
    """Wall-clock seconds; one place so tests can reason about expiry."""
    return time.time()
