"""Local-disk tier: one file per key, written atomically, surviving restarts.

Invariants:
- a reader never sees a partial entry: a value goes to a temp file in the same directory
  (named with its writer's identity), fsynced, renamed over `<key>.kv` (atomic on POSIX), and the
  directory fsynced;
- the tier touches only what it created (`disk_root`): other names, links, FIFOs, directories and
  files without the entry header are skipped and reported, never followed, read or deleted;
- an entry's size is checked against its header before its value is read;
- the bytes held stay within the capacity across processes (`ledger`: writes and deletes run under
  one file lock; the total is recounted on open).
Entry layout: MAGIC `KVSD` | version (u16) | 0 (u16) | expiry (float64 LE, 0 = none) | value
length (u64 LE) | value.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

from kvstrata.place import tier as _tier
from kvstrata.place.disk_root import SUFFIX, classify, new_temp, open_root, stale_temp, valid_key
from kvstrata.place.ledger import Ledger
from kvstrata.place.tier import TierBase, TierStats

MAGIC = b"KVSD"
VERSION = 1
_HEAD = struct.Struct("<4sHHdQ")
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _safe(key: str) -> str:
    if not valid_key(key):
        raise ValueError("disk tier keys must be 1-200 of [A-Za-z0-9-_.] and not start with '.', got "
                         f"{key!r}")
    return key


class DiskTier(TierBase):
    """Global KV on local disk. A full tier refuses new writes (counted); it never evicts."""

    def __init__(self, root: str | Path, capacity_bytes: int, evict: bool = False):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.root = open_root(root)
        self.capacity = capacity_bytes
        self.evict = evict
        self.stats = TierStats()
        self.skipped: dict[str, str] = {}  # entry name -> why it was left alone
        self.ledger = Ledger(self.root)
        with self.ledger.locked():  # no writer is mid-write while we hold it
            self._reap_stale_temps()
            self.ledger.write(sum(self._scan().values()))

    def _path(self, key: str) -> Path:
        return self.root / (_safe(key) + SUFFIX)

    # --- reading ---------------------------------------------------------------------------------
    def _state(self, st: os.stat_result, head: bytes) -> tuple[str, str]:
        """(ours | damaged | foreign, why) of an entry from its stat and first header bytes."""
        if not stat.S_ISREG(st.st_mode):
            return "foreign", "not a regular file"
        if head[:4] != MAGIC:
            return "foreign", "not written by kvstrata (no entry header)"
        if len(head) < _HEAD.size:
            return "damaged", "truncated header"
        _, version, _, _, length = _HEAD.unpack(head)
        if version != VERSION:
            return "foreign", f"entry version {version} is unknown to this build"
        if _HEAD.size + length != st.st_size or length > self.capacity:
            return "damaged", f"size {st.st_size} does not match its header ({length} + {_HEAD.size})"
        return "ours", ""

    def _open(self, path: Path):
        """(file, stat, header bytes) of an entry, or (None, None, why) when it cannot be opened as one."""
        try:
            fd = os.open(path, _OPEN)
        except FileNotFoundError:
            return None, None, None
        except OSError as exc:
            return None, None, "symbolic link (not followed)" if exc.errno == errno.ELOOP else exc.strerror
        st = os.fstat(fd)
        f = os.fdopen(fd, "rb", buffering=0, closefd=True) if stat.S_ISREG(st.st_mode) else _Closed(fd)
        return f, st, f.read(_HEAD.size) if stat.S_ISREG(st.st_mode) else b""

    def get(self, key: str) -> bytes | None:
        name = _safe(key)
        f, st, head = self._open(self._path(key))
        if f is None:
            if head is not None:
                self._skip(name + SUFFIX, head)
            self.stats.misses += 1
            return None
        with f:
            state, why = self._state(st, head)
            if state == "ours":
                _, _, _, expiry, length = _HEAD.unpack(head)
                if expiry and expiry <= _tier.now():
                    self._remove(key)
                    self.stats.expired += 1
                    self.stats.misses += 1
                    return None
                value = _read_exactly(f, length)
                if value is not None:
                    self.stats.hits += 1
                    return value
                state = "damaged"
        if state == "foreign":
            self._skip(name + SUFFIX, why)
        else:
            self.stats.corrupt += 1
            self._remove(key)
        self.stats.misses += 1
        return None

    def _skip(self, name: str, why: str) -> None:
        self.stats.skipped += 1
        self.skipped[name] = why

    # --- writing ---------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        path = self._path(key)
        size = _HEAD.size + len(value)
        if size > self.capacity:
            self.stats.refused += 1
            return False
        expiry = 0.0 if ttl_s is None else _tier.now() + ttl_s
        with self.ledger.locked():
            old = self._held(path)
            if old is None:  # something we did not create sits under this name: never overwrite it
                self.stats.refused += 1
                return False
            used = self.ledger.read() - old + size
            if used > self.capacity:
                self.stats.refused += 1
                return False
            fd, tmp = new_temp(self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_HEAD.pack(MAGIC, VERSION, 0, expiry, len(value)))
                    f.write(value)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self.ledger.write(used)
        _fsync_dir(self.root)
        self.stats.writes += 1
        return True

    def _held(self, path: Path, count: bool = True) -> int | None:
        """Bytes the entry at `path` holds (0 when absent), or None when it is not ours (noted in
        `skipped`, and counted in `stats.skipped` when `count`)."""
        f, st, head = self._open(path)
        if f is None:
            why = head
        else:
            with f:
                why = self._state(st, head)
            why = why[1] if why[0] == "foreign" else None
        if why is None:
            return st.st_size if f is not None else 0
        if count:
            self._skip(path.name, why)
        else:
            self.skipped[path.name] = why
        return None

    def _remove(self, key: str) -> None:
        path = self._path(key)
        with self.ledger.locked():
            held = self._held(path)
            if held:
                path.unlink(missing_ok=True)
                self.ledger.write(self.ledger.read() - held)

    def delete(self, key: str) -> None:
        """Remove the entry of `key` if it is ours; anything else under its name is left alone."""
        self._remove(key)

    # --- listing ---------------------------------------------------------------------------------
    def _scan(self) -> dict[str, int]:
        """{key: bytes} of every entry the tier manages; fills `skipped` with the rest."""
        found, self.skipped = {}, {}
        with os.scandir(self.root) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                why = classify(entry.name, st)
                if why == "own":
                    continue
                if why is None:
                    held = self._held(self.root / entry.name, count=False)
                    if held is None:
                        continue
                    found[entry.name[: -len(SUFFIX)]] = held
                else:
                    self.skipped[entry.name] = why
        return found

    def _reap_stale_temps(self) -> None:
        with os.scandir(self.root) as it:
            for entry in it:
                try:
                    if stale_temp(entry.name, entry.stat(follow_symlinks=False)):
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue

    def mtime(self, key: str) -> float | None:
        try:
            st = os.lstat(self._path(key))
        except FileNotFoundError:
            return None
        return st.st_mtime if stat.S_ISREG(st.st_mode) else None

    def keys(self) -> list[str]:
        return list(self._scan())

    def nbytes(self) -> int:
        return self.ledger.read()

    def describe(self) -> dict:
        """What an operator needs to see: the root, capacity and every entry left alone, with why."""
        self._scan()
        return {
            "root": str(self.root), "capacity_bytes": self.capacity,
            "skipped": dict(sorted(self.skipped.items())),
        }


class _Closed:
    """A non-regular entry's descriptor: closed on exit, never read."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _read_exactly(f, n: int) -> bytes | None:
    """`n` bytes from `f` (unbuffered), or None if the file ends first."""
    parts, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _fsync_dir(root: Path) -> None:
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
