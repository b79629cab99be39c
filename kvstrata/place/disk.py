"""Local-disk tier: one file per key, written atomically, surviving restarts.

Invariant: a reader never sees a partial file. A value is written to a temp file in the same
directory, fsynced, then renamed over the final name (atomic on POSIX); the directory is fsynced
too. Temp files left by a killed writer are never read and are removed on open. Each file starts
with an 8-byte expiry (float64 LE, 0 = none). The index is rebuilt from the files on open.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

from kvstrata.place import tier as _tier
from kvstrata.place.tier import TierStats

_EXP = struct.Struct("<d")
_SUFFIX = ".kv"


def _safe(key: str) -> str:
    if not key or key.startswith(".") or any(not (c.isascii() and (c.isalnum() or c in "-_.")) for c in key):
        raise ValueError(f"disk tier keys must be [A-Za-z0-9-_.] and not start with '.', got {key!r}")
    return key


class DiskTier:
    def __init__(self, root: str | Path, capacity_bytes: int, evict: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self.evict = evict
        self.stats = TierStats()
        for tmp in self.root.glob(".tmp-*"):  # left by a writer that died mid-write
            tmp.unlink(missing_ok=True)
        self._sizes = {p.name[: -len(_SUFFIX)]: p.stat().st_size for p in self.root.glob(f"*{_SUFFIX}")}

    def _path(self, key: str) -> Path:
        return self.root / (_safe(key) + _SUFFIX)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        if len(blob) < _EXP.size:
            self.stats.corrupt += 1
            self.delete(key)
            self.stats.misses += 1
            return None
        (expiry,) = _EXP.unpack_from(blob)
        if expiry and expiry <= _tier.now():
            self.delete(key)
            self.stats.expired += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return blob[_EXP.size :]

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        name = _safe(key)
        size = len(value) + _EXP.size
        held = self.nbytes() - self._sizes.get(name, 0)
        if held + size > self.capacity:
            self.stats.refused += 1
            return False
        expiry = 0.0 if ttl_s is None else _tier.now() + ttl_s
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_EXP.pack(expiry))
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._sizes[name] = size
        self.stats.writes += 1
        return True

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        self._sizes.pop(_safe(key), None)

    def mtime(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def keys(self) -> list[str]:
        return [p.name[: -len(_SUFFIX)] for p in self.root.glob(f"*{_SUFFIX}")]

    def nbytes(self) -> int:
        return sum(self._sizes.values())
