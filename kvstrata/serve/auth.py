"""API keys and the tenant salt that isolates each caller's cache entries.

Invariant: two requests can share cached KV only if they carry the same API key *and* the same
`cache_salt`. The salt is a SHA-256 over both, length-prefixed (no concatenation ambiguity), and
enters the first block key of every prompt (`place.prefix_keys.root`), so one key can never hit
another key's entries -- not even with the same `cache_salt` and prompt -- and `cached_tokens`
only ever reports the caller's own hits (no prompt-cache timing side channel across tenants).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

from kvstrata.serve.errors import APIError
from kvstrata.user_files import read_text_file

KEY_FILE_MAX_BYTES = 1 << 20


def tenant_salt(api_key: str, cache_salt: str | None) -> bytes:
    """32-byte tenant salt of (API key, cache_salt); the anonymous tenant has key ''."""
    h = hashlib.sha256(b"kvstrata-tenant\0")
    for part in (api_key.encode(), (cache_salt or "").encode()):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


class APIKeys:
    """Keys from a file (one per line; blank lines and `#` comments ignored), or none: open access."""

    def __init__(self, keys: list[str] | None = None):
        self.keys = [k.encode() for k in keys or []]

    @classmethod
    def from_file(cls, path: str | Path | None) -> "APIKeys":
        if not path:
            return cls()

        lines = [line.strip() for line in read_text_file(
            path, "--api-key-file", KEY_FILE_MAX_BYTES).splitlines()]
        keys = [line for line in lines if line and not line.startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file: {path} holds no keys")
        if any(len(k) < 8 or any(c.isspace() for c in k) for k in keys):
            raise ValueError(f"--api-key-file: {path}: keys must be at least 8 characters, without spaces")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str:
        """The caller's key from `Authorization: Bearer <key>` ('' when keys are not required);
        401 when keys are required and this one is missing or unknown (compared in constant time)."""
        if not self.required:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = token.strip().encode()
        if not any([hmac.compare_digest(given, k) for k in self.keys]):  # every key compared: no early exit
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return given.decode()
