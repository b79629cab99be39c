"""Disk faults as counts, not tracebacks: a full disk, a read-only file system or an I/O error on
the store's tier turns a write into a refusal and a read into a miss (the request is served
without the cache); each kind is counted and logged once per interval with how many it was."""

from __future__ import annotations

import errno
import logging
import threading
import time

from kvstrata.place.tier import TierStats

log = logging.getLogger("kvstrata.store")
LOG_INTERVAL_S = 60.0


class FaultLog:
    def __init__(self, stats: TierStats, where: str, interval_s: float = LOG_INTERVAL_S):
        self.stats, self.where, self.interval_s = stats, where, interval_s
        self._counts: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, op: str, exc: OSError) -> None:
        """Count one failed `op` (read | write | delete) and log it unless this kind was logged lately."""
        kind = f"{op}_{errno.errorcode.get(exc.errno or 0, 'EUNKNOWN')}"
        with self._lock:
            self.stats.errors += 1
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
            now = time.monotonic()
            if now - self._logged_at.get(kind, -self.interval_s) < self.interval_s:
                return
            self._logged_at[kind], n = now, self._unlogged.pop(kind)
        log.warning("%s: %d %s failure(s) (%s) in the last %.0f s; served without the cache",
                    self.where, n, op, exc.strerror or exc, self.interval_s)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))
