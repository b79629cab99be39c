"""The ledger of a disk store root: which entries the store wrote, and their sizes.

Invariants:
- ownership is the ledger's word alone: an entry is the store's only if the ledger lists it, so a
  file someone else put under a `<key>.kv` name -- whatever bytes it starts with -- is never read
  as a record, replaced or deleted;
- the bytes held by the listed entries never exceed the capacity, whichever processes write.
The ledger is an append-only journal (`.kvstrata-owned`: `+<key> <bytes>` when an entry is written
or replaced, `-<key>` when it goes), read by every process under one exclusive `flock` on the lock
file (`.kvstrata-ledger`) plus a thread lock (`flock` is per open file description); a process
picks up the others' lines each time it takes the lock, and the journal is compacted (rewritten
atomically; readers notice the new file) when it has grown well past what it lists. A writer
lists an entry before publishing it, so a crash leaves at worst a listed entry that is missing or
damaged -- the store's own, so reconciled on the next open, never a stray file taken for ours.
A read-only ledger (a root this process cannot write) reads the journal and changes nothing on disk:
it locks when the lock file can be opened, and a root without a journal is adopted in memory only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from pathlib import Path

from kvstrata.place.disk_root import LEDGER, OWNED, StoreRootError, new_temp

_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class Ledger:
    _fd = -1  # so a ledger that failed to open closes quietly

    def __init__(self, root: Path, read_only: bool = False):
        self.path = root / LEDGER
        self.journal = root / OWNED
        self.read_only = read_only
        self._thread = threading.Lock()
        self.owned: dict[str, int] = {}
        self.total = 0
        self._seen: tuple[int, int] = (-1, 0)  # (inode, bytes) of the journal read so far
        self._lines = 0
        self.fresh = False  # no journal existed at the first read: the root predates this ledger
        try:  # a lock only
            self._fd = os.open(self.path, os.O_RDONLY | (0 if read_only else os.O_CREAT) | _FLAGS, 0o600)
        except OSError as exc:
            if read_only and isinstance(exc, FileNotFoundError):
                return  # nothing to lock: nobody has written this root with a ledger
            raise StoreRootError(
                f"cannot open the capacity ledger {self.path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            self.close()
            raise StoreRootError(f"{self.path} is not a regular file")

    @contextlib.contextmanager
    def locked(self):
        """Exclusive hold of the root's entries (and this ledger), with the others' changes read in."""
        with self._thread:
            if self._fd < 0:  # read-only, no lock file: nobody writes this root
                self._catch_up()
                yield self
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._catch_up()
                yield self
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def size(self, key: str) -> int | None:
        """Bytes of `key`'s entry if the ledger lists it (as last read), else None."""
        return self.owned.get(key)

    def claim(self, key: str, nbytes: int) -> None:
        """List `key` as the store's, holding `nbytes` (before its file is published); under `locked`."""
        self._append(f"+{key} {nbytes}\n")
        self._apply(key, nbytes)

    def release(self, key: str) -> None:
        """Unlist `key` (after its file is gone); under `locked`."""
        if key in self.owned:
            self._append(f"-{key}\n")
            self._apply(key, None)

    def adopt(self, found: dict[str, int]) -> None:
        """Start the journal of a root that predates it with the entries `found` there (read-only: in
        memory only); under `locked`."""
        if not self.read_only:
            self._append("".join(f"+{k} {n}\n" for k, n in found.items()))
        for key, n in found.items():
            self._apply(key, n)
        self.fresh = False

    def compact(self) -> None:
        """Rewrite the journal as just what it lists, when it has grown well past that; under `locked`."""
        if self.read_only or self._lines <= 2 * len(self.owned) + 1024:
            return
        fd, tmp = new_temp(self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(f"+{k} {n}\n" for k, n in self.owned.items())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.journal)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return  # a full disk: the long journal still says the truth
        self._seen, self._lines = (-1, 0), 0
        self._catch_up()

    # --- the journal ---------------------------------------------------------------------------------
    def _apply(self, key: str, nbytes: int | None) -> None:
        self.total -= self.owned.pop(key, 0)
        if nbytes is not None:
            self.owned[key] = nbytes
            self.total += nbytes

    def _append(self, line: str) -> None:
        if self.read_only:
            raise StoreRootError(f"the ledger of {self.path.parent} is read-only")
        fd = os.open(self.journal, os.O_RDWR | os.O_APPEND | os.O_CREAT | _FLAGS, 0o600)
        try:
            data = line.encode()
            end = os.fstat(fd).st_size
            if end and os.pread(fd, 1, end - 1) != b"\n":  # a torn last line (a crash mid-append) ends first
                data = b"\n" + data
            if data:
                os.write(fd, data)
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self._seen = (st.st_ino, st.st_size)
        self._lines += line.count("\n")

    def _catch_up(self) -> None:
        try:
            fd = os.open(self.journal, os.O_RDONLY | _FLAGS)
        except FileNotFoundError:
            self.fresh = self._seen[0] == -1 and not self.owned
            return
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise StoreRootError(f"{self.journal} is not a regular file")
            ino, seen = self._seen
            if st.st_ino != ino or st.st_size < seen:  # compacted by another process: read it whole
                self.owned, self.total, self._lines, seen = {}, 0, 0, 0
            if st.st_size == seen:
                self._seen = (st.st_ino, seen)
                return
            f.seek(seen)
            chunk = f.read(st.st_size - seen)
        self._seen = (st.st_ino, seen + len(chunk))
        for raw in chunk.split(b"\n"):
            self._replay(raw)

    def _replay(self, raw: bytes) -> None:
        """Apply one journal line; a torn or foreign line is skipped."""
        text = raw.decode("ascii", "replace")
        self._lines += bool(text)
        if text.startswith("-"):
            self._apply(text[1:], None)
            return
        key, _, n = text[1:].partition(" ")
        if text.startswith("+") and n.isdigit():
            self._apply(key, int(n))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()
