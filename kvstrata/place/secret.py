"""The per-store secret that signs records (HMAC key), and the fleet's secrets for a shared tier.

Given as hex (config `secret` / env `KVSTRATA_STORE_SECRET`) or read from a file, which is
created on first use: 32 random bytes as hex, mode 0600, published atomically (link of a complete
temp file, so two processes creating it at once agree on one secret). A file that is not a
regular file owned by this user with no group/other permissions is refused: whoever could replace
it could forge records.

A shared tier (Redis) holds many machines' records: each must sign with the same fleet secret, so
such a store never creates one of its own -- it needs an explicit secret (`secret`, the environment,
or `secret_file`, which must exist: a mistyped path never makes up a new secret), and `previous_secrets`
(verify only) lets a fleet rotate without losing its KV. A read-only store never creates one either: it
could verify nothing with it.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """The store secret cannot be read, created or trusted."""


def parse_hex(text: str, where: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"{where}: the store secret must be hex digits") from None
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"{where}: the store secret must be at least {MIN_SECRET_BYTES} bytes "
                          f"({2 * MIN_SECRET_BYTES} hex digits), got {len(raw)}")
    return raw


def load_or_create(path: str | Path) -> bytes:
    """The secret in `path`, creating it (0600) if absent."""
    path = Path(path)
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process published first: then theirs is the secret
        except FileExistsError:
            pass
    except OSError as exc:
        raise SecretError(f"cannot create the store secret {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def read_existing(path: str | Path, why: str) -> bytes:
    """The secret in `path`, which must exist (`why`: why it is never created here)."""
    try:
        return _read(Path(path))
    except FileNotFoundError:
        raise SecretError(f"secret_file {path} does not exist: {why}") from None


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SecretError(f"cannot read the store secret {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"the store secret {path} is not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SecretError(f"the store secret {path} must be owned by this user with mode 0600 "
                              f"(is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        text = f.read(4096)
    try:
        return parse_hex(text.decode("ascii"), str(path))
    except UnicodeDecodeError:
        raise SecretError(f"{path}: the store secret must be hex digits") from None


def parse_list(text: str, where: str) -> tuple[bytes, ...]:
    """Comma-separated hex secrets (rotation: the ones that still verify)."""
    return tuple(parse_hex(part, where) for part in text.split(",") if part.strip())


def fleet_secrets(cfg, default_file: Callable[[], Path]) -> tuple[bytes, tuple[bytes, ...]]:
    """(signing secret, secrets that only verify) of a store config; a local store creates its
    secret file on first use, a shared or read-only one refuses to run without an existing secret."""
    why = ("a store on Redis is shared by a fleet and never makes up a secret: put the fleet's secret there "
           "(hex, mode 0600), or set secret / KVSTRATA_STORE_SECRET" if cfg.redis_url else
           "a read-only store never makes up a secret (it could verify no record with it)")
    if cfg.secret:
        secret = parse_hex(cfg.secret, "secret")
    elif cfg.secret_file:
        shared = cfg.redis_url or cfg.read_only
        secret = read_existing(cfg.secret_file, why) if shared else load_or_create(cfg.secret_file)
    else:
        path = default_file()
        secret = read_existing(path, why) if cfg.read_only else load_or_create(path)
    return secret, parse_list(cfg.previous_secrets, "previous_secrets")
