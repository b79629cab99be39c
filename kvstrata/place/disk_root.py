"""What a disk store root is and what in it belongs to the store.

Invariant: the store reads, replaces or deletes only what it created. A root is a directory holding
the marker file `.kvstrata-store`; a missing or empty directory becomes one, a non-empty directory
without the marker is refused (so `root = ""` can never reach the files of the current directory).
Inside, the store owns the marker, its ledger (lock file and journal) and secret, its temp files
and the entries its ledger lists (`<key>.kv`); everything else is skipped and reported, never
followed, read, replaced or deleted -- whatever bytes it starts with.

Temp files carry their writer's identity, `.kvstrata-tmp-<pid>-<random>-<host>`, and are reaped
only when stale: their writer (on this host) is gone, or they are older than `TEMP_MAX_AGE_S`.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import socket
import stat
import time
from pathlib import Path

MARKER = ".kvstrata-store"
MARKER_TEXT = (
    "kvstrata store root v1: entries <key>.kv are managed by kvstrata; do not put other files here\n"
)
LEDGER = ".kvstrata-ledger"  # the lock file
OWNED = ".kvstrata-owned"  # the ledger's journal: the entries the store wrote
SECRET = ".kvstrata-secret"
SUFFIX = ".kv"
TEMP_PREFIX = ".kvstrata-tmp-"
TEMP_MAX_AGE_S = 3600.0
_TEMP = re.compile(r"\.kvstrata-tmp-(\d{1,10})-([0-9a-f]{12})-([A-Za-z0-9.\-]{1,64})")
_KEY = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}")
OWN_FILES = (MARKER, LEDGER, OWNED, SECRET)


class StoreRootError(ValueError):
    """The directory cannot serve as a store root (not ours, not a directory, not writable)."""


class RootNotWritable(StoreRootError):
    """A store root (marked) this process cannot write: the disk tier then serves it read-only."""


def valid_key(key: str) -> bool:
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def open_root(root: str | Path, read_only: bool = False) -> Path:
    """Check (or make) `root` a writable store root; returns it. Raises StoreRootError, `RootNotWritable`
    when it is a store root this process cannot write. `read_only`: only check that `root` is a store
    root (nothing created or written)."""
    path = Path(root).expanduser()
    shown = str(path) if str(root) else f"'' (the current directory, {Path.cwd()})"
    if read_only:
        if not path.is_dir() or not (path / MARKER).is_file() or (path / MARKER).is_symlink():
            raise StoreRootError(f"store root {shown} (read-only) is not a store root: no {MARKER} marker in "
                                 "a directory (a read-only store serves a root a writer filled)")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StoreRootError(f"store root {shown} exists and is not a directory") from None
    except OSError as exc:
        raise StoreRootError(f"cannot create store root {shown}: {exc.strerror or exc}") from None
    if not path.is_dir():
        raise StoreRootError(f"store root {shown} is not a directory")
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise StoreRootError(f"cannot list store root {shown}: {exc.strerror or exc}") from None
    if MARKER in names:
        if not stat.S_ISREG(os.lstat(path / MARKER).st_mode):
            raise StoreRootError(f"store root {shown}: {MARKER} is not a regular file")
    elif names:
        raise StoreRootError(
            f"store root {shown} is not empty and has no {MARKER} marker: refusing to use a directory "
            "kvstrata did not create (choose an empty or new directory)"
        )
    _probe_writable(path, shown, marked=MARKER in names)
    if MARKER not in names:
        _publish(path / MARKER, MARKER_TEXT.encode())
    return path


def _probe_writable(path: Path, shown: str, marked: bool) -> None:
    try:
        fd, tmp = new_temp(path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise (RootNotWritable if marked else StoreRootError)(
            f"store root {shown} is not writable: {exc.strerror or exc}") from None


def _publish(path: Path, data: bytes) -> None:
    """Create `path` with `data` unless it exists (atomic: a complete temp file, linked)."""
    fd, tmp = new_temp(path.parent)
    try:
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.\-]", "-", socket.gethostname())[:64] or "host"


def new_temp(directory: Path) -> tuple[int, str]:
    """A new temp file (0600) named with this writer's identity: (fd, path)."""
    name = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}-{_host()}"
    path = os.path.join(directory, name)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), path


def stale_temp(name: str, st: os.stat_result, now: float | None = None) -> bool:
    """True for our temp file whose writer on this host is gone, or that is older than the bound."""
    m = _TEMP.fullmatch(name)
    if m is None or not stat.S_ISREG(st.st_mode):
        return False
    if (now or time.time()) - st.st_mtime > TEMP_MAX_AGE_S:
        return True
    return m.group(3) == _host() and not _alive(int(m.group(1)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:
        return exc.errno == errno.EPERM  # exists, owned by someone else
    return True


def classify(name: str, st: os.stat_result) -> str | None:
    """None for a name the store may manage as an entry, else why it is skipped (not read, never deleted)."""
    if name in OWN_FILES or _TEMP.fullmatch(name):
        return "own"
    if not name.endswith(SUFFIX) or not valid_key(name[: -len(SUFFIX)]):
        return "name is not <key>.kv"
    if stat.S_ISLNK(st.st_mode):
        return "symbolic link (not followed)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return None
