"""Prefix-chained block keys for cached KV.

Invariant: two blocks get the same key only if everything that determines their bytes is equal:
the namespace (model weights + config, method spec, dtype, layout version), the tenant salt, every
token from the start of the prompt to the end of the block, and the extra keys. The tenant salt
enters the first block only, and every later key chains through it, so one tenant can never hit
another tenant's entries (no prompt-cache timing side channel). Only SHA-256 over fixed
little-endian encodings is used: stable across processes and machines (no `hash()`, no seeds).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

LAYOUT_VERSION = 1


def namespace(model_fingerprint: str, method: str, dtype: str,
              layout_version: int | str = LAYOUT_VERSION) -> bytes:
    """32-byte namespace of everything that changes stored bytes besides the tokens."""
    doc = json.dumps({"model": model_fingerprint, "method": method, "dtype": dtype, "layout": layout_version},
                     sort_keys=True)
    return hashlib.sha256(b"kvstrata-ns\0" + doc.encode()).digest()


def model_fingerprint(config_dict: dict, weights_digest: str) -> str:
    """Fingerprint of a model: its config and a digest of its weights."""
    doc = json.dumps(config_dict, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode() + b"\0" + weights_digest.encode()).hexdigest()


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Key of one block: SHA-256(parent || n || tokens as uint32 LE || len(extra) || extra)."""
    if any(t < 0 or t >= 2**32 for t in tokens):
        raise ValueError("token ids must be in [0, 2^32)")
    h = hashlib.sha256()
    h.update(parent)
    h.update(struct.pack("<I", len(tokens)))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def root(ns: bytes, tenant_salt: bytes = b"") -> bytes:
    """The parent of a prompt's first block: namespace + tenant salt."""
    return hashlib.sha256(
        b"kvstrata-root\0" + ns + struct.pack("<I", len(tenant_salt)) + tenant_salt
    ).digest()


def block_hashes(
    tokens: Sequence[int], block_size: int, ns: bytes, tenant_salt: bytes = b"", extra: bytes = b""
) -> list[bytes]:
    """Keys of every complete block of `tokens` (a trailing partial block has no key)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = root(ns, tenant_salt)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], extra)
        out.append(parent)
    return out
