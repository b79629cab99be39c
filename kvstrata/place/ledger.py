"""Cross-process capacity ledger of a disk store root.

Invariant: the bytes held by a root's entries never exceed the capacity, whichever processes
write. One file (`.kvstrata-ledger`, a u64 LE byte count) is the shared total; every change to
the root's entries (write, replace, delete) and its reconciliation on open happen under an
exclusive `flock` on that file (plus a thread lock: `flock` is per open file description).
A process killed while holding the lock releases it; the next open recounts the total.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
import threading
from pathlib import Path

from kvstrata.place.disk_root import LEDGER, StoreRootError

_U64 = struct.Struct("<Q")


class Ledger:
    def __init__(self, root: Path):
        self.path = root / LEDGER
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StoreRootError(
                f"cannot open the capacity ledger {self.path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise StoreRootError(f"{self.path} is not a regular file")
        self._thread = threading.Lock()

    @contextlib.contextmanager
    def locked(self):
        """Exclusive hold of the root's entries (and this ledger) across threads and processes."""
        with self._thread:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self) -> int:
        raw = os.pread(self._fd, _U64.size, 0)
        return _U64.unpack(raw)[0] if len(raw) == _U64.size else 0

    def write(self, used: int) -> None:
        os.pwrite(self._fd, _U64.pack(max(0, used)), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()
