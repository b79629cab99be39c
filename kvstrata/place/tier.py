"""The tier contract: bytes in, bytes out, by key, with an optional time to live."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol


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
    skipped: int = 0  # entries the tier did not create, left alone (disk: other files, links, FIFOs)
    extra: dict = field(default_factory=dict)


class StoreUnavailable(RuntimeError):
    """A tier cannot be reached or refuses us (server down, authentication): said, never a silent empty answer."""


class Tier(Protocol):
    stats: TierStats

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


def now() -> float:
    """Wall-clock seconds; one place so tests can reason about expiry."""
    return time.time()
