"""Self-describing records: one value per cached block, no pickle.

Layout: MAGIC (4 B) | version (u16 LE) | payload length (u64 LE) | SHA-256 of payload (32 B) |
payload, where the payload is a safetensors blob (its own JSON header names every tensor's shape
and dtype; string metadata carries the codec spec and block facts). A record that is truncated,
has another magic or version, or fails its checksum raises `RecordError`: the caller treats it
as a miss, counts it and removes it.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

MAGIC = b"KVSR"
VERSION = 1
_HEAD = struct.Struct("<4sHQ32s")


class RecordError(ValueError):
    """The bytes are not one whole, intact record of a known version."""


def encode_record(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    payload = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={k: str(v) for k, v in meta.items()})
    return _HEAD.pack(MAGIC, VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_record(blob: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if len(blob) < _HEAD.size:
        raise RecordError(f"truncated record: {len(blob)} bytes, header needs {_HEAD.size}")
    magic, version, length, digest = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise RecordError("not a kvstrata record (bad magic)")
    if version != VERSION:
        raise RecordError(f"unknown record version {version} (this build reads {VERSION})")
    payload = blob[_HEAD.size :]
    if len(payload) != length:
        raise RecordError(f"truncated record: payload {len(payload)} of {length} bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise RecordError("record checksum mismatch")
    tensors = st_load(payload)
    header_len = struct.unpack_from("<Q", payload)[0]
    meta = json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
    return tensors, meta
