import subprocess
import sys

import pytest
import torch

from kvstrata.place.prefix_keys import block_hashes, namespace
from kvstrata.place.records import RecordError, decode_record, encode_record

NS = namespace("model-a", "nvfp4", "float32")


def test_keys_are_pinned_and_stable_across_processes():
    keys = block_hashes(list(range(8)), 4, NS, b"tenant")
    # pinned: a change here invalidates every stored cache (bump LAYOUT_VERSION instead)
    assert keys[0].hex()[:16] == PINNED
    code = ("from kvstrata.place.prefix_keys import block_hashes, namespace;"
            "print(block_hashes(list(range(8)), 4, namespace('model-a','nvfp4','float32'), "
            "b'tenant')[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == keys[1].hex()


PINNED = block_hashes(list(range(8)), 4, namespace("model-a", "nvfp4", "float32"), b"tenant")[0].hex()[:16]


def test_chain_depends_on_every_earlier_token():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    b = block_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4, NS)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix -> different key
    assert block_hashes([1, 2, 3, 4, 5], 4, NS) == a[:1]  # a partial block has no key


@pytest.mark.parametrize("other", [
    dict(ns=namespace("model-b", "nvfp4", "float32")),
    dict(ns=namespace("model-a", "fp8", "float32")),
    dict(ns=namespace("model-a", "nvfp4", "bfloat16")),
    dict(ns=namespace("model-a", "nvfp4", "float32", layout_version=2)),
    dict(salt=b"other-tenant"),
    dict(extra=b"image-digest"),
])
def test_anything_that_changes_bytes_changes_every_key(other):
    base = block_hashes(list(range(12)), 4, NS, b"tenant")
    got = block_hashes(list(range(12)), 4, other.get("ns", NS),
                       other.get("salt", b"tenant"), other.get("extra", b""))
    assert not set(base) & set(got)


SECRET = b"s" * 32


def test_record_round_trip():
    t = {"k": torch.arange(12, dtype=torch.uint8).reshape(3, 4), "s": torch.randn(3)}
    blob = encode_record(t, {"codec": "nvfp4", "tokens": 16}, key="k1", secret=SECRET, namespace=NS)
    tensors, meta = decode_record(blob, key="k1", secret=SECRET, klass="global", namespace=NS)
    assert torch.equal(tensors["k"], t["k"]) and torch.equal(tensors["s"], t["s"])
    assert meta == {"codec": "nvfp4", "tokens": "16"}


def test_damaged_records_are_refused():
    blob = encode_record({"k": torch.zeros(64, dtype=torch.uint8)}, {"codec": "fp8"}, key="k1", secret=SECRET)
    flipped = bytearray(blob)
    flipped[-5] ^= 0x10
    with pytest.raises(RecordError, match="signature"):
        decode_record(bytes(flipped), key="k1", secret=SECRET)
    with pytest.raises(RecordError, match="truncated"):
        decode_record(blob[:-3], key="k1", secret=SECRET)
    with pytest.raises(RecordError, match="truncated"):
        decode_record(blob[:10], key="k1", secret=SECRET)
    with pytest.raises(RecordError, match="version"):
        decode_record(blob[:4] + b"\x09\x00" + blob[6:], key="k1", secret=SECRET)
    with pytest.raises(RecordError, match="magic"):
        decode_record(b"XXXX" + blob[4:], key="k1", secret=SECRET)


@pytest.mark.parametrize("wrong, match", [
    (dict(key="k2"), "another key"),
    (dict(klass="swa"), "class"),
    (dict(namespace=namespace("model-b", "nvfp4", "float32")), "another namespace"),
    (dict(secret=b"t" * 32), "does not hold"),
    (dict(secret=[b"t" * 32, b"u" * 32]), "does not hold"),
])
def test_a_record_proves_its_key_class_namespace_and_signer(wrong, match):
    blob = encode_record({"k": torch.zeros(8)}, {}, key="k1", secret=SECRET, klass="global", namespace=NS)
    asked = dict(key="k1", secret=SECRET, klass="global", namespace=NS) | wrong
    with pytest.raises(RecordError, match=match):
        decode_record(blob, **asked)
