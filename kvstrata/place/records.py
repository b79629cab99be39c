"""Signed, key-bound records: one value per cached block, no pickle. What the payload holds (a
block's KV as the cache held it) is `kvstrata.place.block_format`'s.

Layout (version 4): MAGIC (4 B) | version (u16 LE) | class (u8: 0 global, 1 swa) | 0 (u8) |
id of the signing secret (8 B) | SHA-256 of the key (32 B) | namespace (32 B, zeros when none) |
payload length (u64 LE) | HMAC-SHA256 over everything before it and the payload (32 B) | payload.

The payload is a safetensors blob (its JSON header names every tensor's shape and dtype; string
metadata carries the codec spec and block facts). Invariant: `decode_record` returns a value only
for a whole record that was written under this key, class and namespace by someone holding the
store's secret; anything else -- truncated, another magic or version, a bad HMAC, another key,
class or namespace, a payload or metadata that does not parse -- raises `RecordError`, which the
store answers as a counted miss and removes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvstrata.names import TierClass
from kvstrata.place.tier import WriteGuard

MAGIC = b"KVSR"
VERSION = 4  # 3: no secret id; 2: payloads of dense-decoded blocks re-encoded per record
CLASSES = tuple(TierClass)  # the class byte indexes this
NO_NAMESPACE = bytes(32)
_HEAD = struct.Struct("<4sHBB8s32s32sQ")
SECRET_ID_BYTES = 8
_MAC = 32
HEADER_BYTES = _HEAD.size + _MAC


class RecordError(ValueError):
    """The bytes are not one whole, intact, signed record of this key, class and namespace."""


class UnverifiableRecord(RecordError):
    """Signed by a secret this store does not hold, or of another record version: not ours to judge."""

    def __init__(self, why: str, secret_id: str = ""):
        super().__init__(why)
        self.secret_id = secret_id  # hex id of the signing secret; "" when the version is unknown


def secret_id(secret: bytes) -> bytes:
    """The public id of a signing secret (a record names the secret that signed it by this)."""
    return hashlib.sha256(b"kvstrata-secret-id\0" + secret).digest()[:SECRET_ID_BYTES]


def write_guard(secrets: Sequence[bytes]) -> WriteGuard:
    """The rule a store's writes follow: never replace a record that `verify_record` would call
    unverifiable with these secrets (another signer, another version; see `tier.WriteGuard`)."""
    if not secrets:
        raise ValueError("a write guard needs at least one secret")
    return WriteGuard(magic=MAGIC, version=struct.pack("<H", VERSION), id_at=8,
                      ids=frozenset(secret_id(s) for s in secrets), min_length=HEADER_BYTES)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(b"kvstrata-key\0" + key.encode()).digest()


def _namespace(ns: bytes) -> bytes:
    if len(ns) not in (0, 32):
        raise ValueError(f"a record namespace is 32 bytes (or empty), got {len(ns)}")
    return ns or NO_NAMESPACE


def encode_record(tensors: dict[str, torch.Tensor], meta: dict[str, str], *, key: str, secret: bytes,
                  klass: TierClass = TierClass.GLOBAL, namespace: bytes = b"") -> bytes:
    """Sign `tensors` + string `meta` as the record of `key` in `klass` (global | swa) and `namespace`."""
    payload = st_save({k: v.contiguous() for k, v in tensors.items()},
                      metadata={k: str(v) for k, v in meta.items()})
    return seal(payload, key=key, secret=secret, klass=klass, namespace=namespace)


def seal(payload: bytes, *, key: str, secret: bytes, klass: TierClass = TierClass.GLOBAL,
         namespace: bytes = b"") -> bytes:
    """Header + HMAC around raw `payload` bytes (`encode_record` seals a safetensors blob)."""
    klass = TierClass(klass)  # an unknown class is an error, not a default
    head = _HEAD.pack(MAGIC, VERSION, CLASSES.index(klass), 0, secret_id(secret),
                      key_digest(key), _namespace(namespace), len(payload))
    return head + hmac.new(secret, head + payload, hashlib.sha256).digest() + payload


Secrets = bytes | Sequence[bytes]


def decode_record(blob: bytes, *, key: str, secret: Secrets, klass: TierClass | None = None,
                  namespace: bytes | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Verify and parse one record; `klass` / `namespace` None accept any. Raises RecordError."""
    return parse_payload(verify_record(blob, key=key, secret=secret, klass=klass, namespace=namespace))


def verify_record(
    blob: bytes, *, key: str, secret: Secrets, klass: TierClass | None = None, namespace: bytes | None = None
) -> bytes:
    """The payload of a whole record signed with `secret` (or any of a list of secrets: rotation)
    under this key, class and namespace (checked without parsing a tensor); raises RecordError
    otherwise, `UnverifiableRecord` when no secret given signed it or its version is another."""
    klass = None if klass is None else TierClass(klass)
    if len(blob) < HEADER_BYTES:
        raise RecordError(f"truncated record: {len(blob)} bytes, header needs {HEADER_BYTES}")
    if blob[:4] != MAGIC:
        raise RecordError("not a kvstrata record (bad magic)")
    (version,) = struct.unpack_from("<H", blob, 4)
    if version != VERSION:
        raise UnverifiableRecord(f"record version {version} (this build reads {VERSION})")
    _, _, cls, _, sid, kd, ns, length = _HEAD.unpack_from(blob)
    if len(blob) - HEADER_BYTES != length:
        raise RecordError(f"truncated record: payload {len(blob) - HEADER_BYTES} of {length} bytes")
    signer = next((s for s in ([secret] if isinstance(secret, bytes) else secret) if secret_id(s) == sid),
                  None)
    if signer is None:
        raise UnverifiableRecord(f"record signed by secret {sid.hex()}, which this store does not hold",
                                 sid.hex())
    mac = hmac.new(signer, memoryview(blob)[: _HEAD.size], hashlib.sha256)
    mac.update(memoryview(blob)[HEADER_BYTES:])
    if not hmac.compare_digest(mac.digest(), blob[_HEAD.size : HEADER_BYTES]):
        raise RecordError("record signature mismatch (damaged, or not signed with this store's secret)")
    if not hmac.compare_digest(kd, key_digest(key)):
        raise RecordError("record belongs to another key")
    if cls >= len(CLASSES) or (klass is not None and CLASSES[cls] != klass):
        raise RecordError(f"record class {cls} is not {klass}")
    if namespace is not None and ns != _namespace(namespace):
        raise RecordError("record belongs to another namespace (model, method or dtype)")
    return bytes(memoryview(blob)[HEADER_BYTES:])


def parse_payload(payload: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors payload -> (tensors, flat str -> str metadata); any parse failure is a RecordError."""
    try:
        tensors = st_load(payload)
        (header_len,) = struct.unpack_from("<Q", payload)
        meta = json.loads(payload[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # safetensors, struct, JSON and UTF-8 errors alike: the bytes do not parse
        raise RecordError(f"record payload does not parse: {type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise RecordError("record metadata is not a flat map of strings")
    return tensors, meta
