"""Local-disk tier: one file per key, written atomically, surviving restarts.

Invariants:
- a reader never sees a partial entry: a value goes to a temp file in the same directory
  (named with its writer's identity), fsynced, renamed over `<key>.kv` (atomic on POSIX), and the
  directory fsynced;
- the tier touches only what its ledger lists (`ledger`): other names, links, FIFOs, directories
  and unlisted files -- whatever bytes they start with -- are skipped and reported, never followed,
  read, replaced or deleted;
- an entry's size is checked against its header before its value is read;
- the bytes held stay within the capacity across processes (`ledger`: writes and deletes run under
  one file lock; listed entries that are gone or damaged are reconciled on open);
- a full disk, a read-only file system or an I/O error is a counted refusal or miss
  (`faults`), logged once per interval with a count: the request is served without the cache;
- a write never replaces a listed entry whose value its `WriteGuard` keeps (another secret's record),
  checked under the ledger's lock;
- a read-only tier (`read_only`, or a store root found not writable at start) serves what its ledger
  lists and changes nothing on disk: writes are counted refusals, damaged or expired entries counted
  misses left in place.
Entry layout: MAGIC `KVSD` | version (u16) | 0 (u16) | expiry (float64 LE, 0 = none) | value
length (u64 LE) | value.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from pathlib import Path

from kvstrata.place import tier as _tier
from kvstrata.place.disk_root import (
    SUFFIX,
    RootNotWritable,
    StoreRootError,
    classify,
    new_temp,
    open_root,
    stale_temp,
    valid_key,
)
from kvstrata.place.faults import FaultLog
from kvstrata.place.ledger import Ledger
from kvstrata.place.tier import TierBase, TierStats, WriteGuard, refuse_read_only

log = logging.getLogger("kvstrata.store")

NOT_LISTED = "not written by this store (its ledger does not list it)"

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
    """Global KV on local disk. A full tier refuses new writes (counted); it never evicts. A disk
    fault (full, read-only, I/O error) is a counted refusal or miss, logged once per interval.
    `read_only`: serve the root's entries, write nothing (also chosen when the root is not writable)."""

    def __init__(self, root: str | Path, capacity_bytes: int, evict: bool = False, read_only: bool = False):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.read_only = "read_only = true" if read_only else ""
        found = ""  # why a root we were to write is not writable
        try:
            self.root = open_root(root, read_only=read_only)
        except RootNotWritable as exc:
            self.root, found = open_root(root, read_only=True), str(exc)
            self.read_only = f"{found}: served read-only"
        self.capacity = capacity_bytes
        self.evict = evict
        self.stats = TierStats()
        self.faults = FaultLog(self.stats, f"disk store {self.root}")
        self.skipped: dict[str, str] = {}  # entry name -> why it was left alone
        try:
            self.ledger = Ledger(self.root, read_only=bool(self.read_only))
        except StoreRootError as exc:
            raise StoreRootError(f"{found}, nor served read-only: {exc}" if found else str(exc)) from None
        if found:
            log.warning("kvstrata: %s (hits served, writes refused and counted)", self.read_only)
        with self.ledger.locked():  # no writer is mid-write while we hold it
            if not self.read_only:
                self._reap_stale_temps()
            if self.ledger.fresh:  # a root from before the ledger listed entries: adopt whole ones
                self.ledger.adopt(self._legacy_entries())
            if not self.read_only:
                self._reconcile()
                self.ledger.compact()

    def _path(self, key: str) -> Path:
        return self.root / (_safe(key) + SUFFIX)

    # --- reading ---------------------------------------------------------------------------------
    def _state(self, st: os.stat_result, head: bytes, listed: int | None) -> str:
        """'ours' | 'damaged' (listed, but not the entry written) | 'foreign' (not listed, or not a file)."""
        if listed is None or not stat.S_ISREG(st.st_mode):
            return "foreign"
        if len(head) < _HEAD.size or head[:4] != MAGIC:
            return "damaged"
        _, version, _, _, length = _HEAD.unpack(head)
        if version != VERSION or _HEAD.size + length != st.st_size or length > self.capacity:
            return "damaged"
        return "ours"

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

    def _listed(self, key: str) -> int | None:
        """The ledger's size of `key` (others' latest changes read in when it is not known here)."""
        size = self.ledger.size(key)
        if size is None:
            with self.ledger.locked():
                size = self.ledger.size(key)
        return size

    def get(self, key: str) -> bytes | None:
        name = _safe(key)
        self.stats.misses += 1  # taken back on a hit
        try:
            f, st, head = self._open(self._path(key))
            if f is None:
                if head is not None:
                    self._skip(name + SUFFIX, head)
                return None
            with f:
                state = self._state(st, head, self._listed(key))
                if state == "ours":
                    _, _, _, expiry, length = _HEAD.unpack(head)
                    if expiry and expiry <= _tier.now():
                        self._remove(key)
                        self.stats.expired += 1
                        return None
                    value = _read_exactly(f, length)
                    if value is not None:
                        self.stats.misses -= 1
                        self.stats.hits += 1
                        return value
                    state = "damaged"
        except OSError as exc:  # EIO and the like: a miss, counted and logged once per interval
            self.faults.note("read", exc)
            return None
        if state == "foreign":
            self._skip(name + SUFFIX, NOT_LISTED if stat.S_ISREG(st.st_mode) else "not a regular file")
        else:
            self.stats.corrupt += 1
            self._remove(key)
        return None

    def _skip(self, name: str, why: str) -> None:
        self.stats.skipped += 1
        self.skipped[name] = why

    # --- writing ---------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, ttl_s: float | None = None,
            guard: WriteGuard | None = None) -> bool:
        path = self._path(key)
        size = _HEAD.size + len(value)
        if self.read_only:
            return refuse_read_only(self)
        if size > self.capacity:
            self.stats.refused += 1
            return False
        expiry = 0.0 if ttl_s is None else _tier.now() + ttl_s
        try:
            with self.ledger.locked():
                if guard is not None and self._kept(key, guard):
                    self.stats.writes_skipped_foreign += 1
                    return False
                head = _HEAD.pack(MAGIC, VERSION, 0, expiry, len(value))
                if not self._publish(key, path, size, head, value):
                    self.stats.refused += 1
                    return False
            _fsync_dir(self.root)
        except OSError as exc:  # disk full, read-only, I/O error: a counted refusal, never a raise
            self.faults.note("write", exc)
            self.stats.refused += 1
            return False
        self.stats.writes += 1
        return True

    def _kept(self, key: str, guard: WriteGuard) -> bool:
        """Whether `key`'s listed, live entry holds a value `guard` keeps (under the ledger lock)."""
        listed = self.ledger.size(key)
        f, st, head = self._open(self._path(key)) if listed is not None else (None, None, None)
        if f is None:
            return False
        with f:
            if self._state(st, head, listed) != "ours":
                return False
            _, _, _, expiry, length = _HEAD.unpack(head)
            return not (expiry and expiry <= _tier.now()) and guard.keeps(f.read(guard.head_bytes), length)

    def _publish(self, key: str, path: Path, size: int, head: bytes, value: bytes) -> bool:
        """Write `key`'s entry in place of ours (under the ledger lock); False when it may not."""
        old = self.ledger.size(key)
        if old is None and os.path.lexists(path):  # a file we did not write sits there: never replace it
            self._skip(path.name, NOT_LISTED)
            return False
        if self.ledger.total - (old or 0) + size > self.capacity:
            return False
        fd, tmp = new_temp(self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            self.ledger.claim(key, size)  # listed before it is published: a crash leaves ours, not a stray
            try:
                os.replace(tmp, path)
            except OSError:
                if old is None:
                    self.ledger.release(key)
                else:
                    self.ledger.claim(key, old)
                raise
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def _remove(self, key: str) -> None:
        if self.read_only:  # counted by the caller, left in place
            return
        path = self._path(key)
        try:
            with self.ledger.locked():
                if self.ledger.size(key) is not None:
                    path.unlink(missing_ok=True)
                    self.ledger.release(key)
                elif os.path.lexists(path):
                    self._skip(path.name, NOT_LISTED)
        except OSError as exc:
            self.faults.note("delete", exc)

    def delete(self, key: str) -> None:
        """Remove the entry of `key` if the ledger lists it; anything else under its name is left alone."""
        self._remove(key)

    # --- listing ---------------------------------------------------------------------------------
    def _names(self) -> dict[str, os.stat_result]:
        """{key: stat} of every `<key>.kv` regular file; fills `skipped` with the rest."""
        found, self.skipped = {}, {}
        with os.scandir(self.root) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                why = classify(entry.name, st)
                if why is None:
                    found[entry.name[: -len(SUFFIX)]] = st
                elif why != "own":
                    self.skipped[entry.name] = why
        return found

    def _scan(self) -> dict[str, int]:
        """{key: bytes} of every entry the ledger lists and that is there; the rest goes to `skipped`."""
        with self.ledger.locked():
            listed = dict(self.ledger.owned)
        found = {}
        for key, st in self._names().items():
            if key in listed:
                found[key] = listed[key]
            else:
                self.skipped[key + SUFFIX] = NOT_LISTED
        return found

    def _legacy_entries(self) -> dict[str, int]:
        """Entries of a root written before the ledger listed them: whole files with the entry header."""
        adopted = {}
        for key, st in self._names().items():
            f, st, head = self._open(self._path(key))
            if f is not None:
                with f:
                    if self._state(st, head, st.st_size) == "ours":
                        adopted[key] = st.st_size
        return adopted

    def _reconcile(self) -> None:
        """Unlist entries that are gone; remove listed ones that are damaged (a writer's crash)."""
        for key, size in list(self.ledger.owned.items()):
            f, st, head = self._open(self._path(key))
            if f is None:
                if head is None:
                    self.ledger.release(key)
                continue
            with f:
                state = self._state(st, head, size)
            if state == "damaged":
                self._path(key).unlink(missing_ok=True)
                self.ledger.release(key)
                self.stats.corrupt += 1
            elif st.st_size != size:  # a writer died between listing a new value and publishing it
                self.ledger.claim(key, st.st_size)

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
        with self.ledger.locked():
            return self.ledger.total

    def describe(self) -> dict:
        """What an operator needs to see: the root, capacity, every entry left alone (with why), and
        the disk faults met."""
        self._scan()
        return {
            "root": str(self.root), "capacity_bytes": self.capacity,
            **({"read_only": self.read_only} if self.read_only else {}),
            "skipped": dict(sorted(self.skipped.items())), "faults": self.faults.counts(),
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
