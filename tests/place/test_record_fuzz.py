"""Record fuzzing that holds the secret: every mutation is re-signed (a valid HMAC), so only the
record's own checks stand between it and the caller. Each case must end as a counted miss with the
record removed -- in get_global, verify, gc and PrefixServer.serve alike."""

import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load

from kvstrata.place import records
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.records import encode_record, seal
from kvstrata.place.store import KVStore

SECRET = b"f" * 32
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[
                    HealthCheck.function_scoped_fixture])
BLOCK = {"k": torch.arange(64, dtype=torch.uint8).reshape(4, 16)}


def store() -> KVStore:
    return KVStore(MemoryTier(1 << 24), MemoryTier(1 << 24), secret=SECRET)


def assert_counted_miss_and_removed(s: KVStore, key: str, before: int) -> None:
    assert s.get_global(key) is None
    assert s.global_tier.stats.corrupt == before + 1 and key not in s.global_tier.keys()


def parses(payload: bytes) -> bool:
    try:
        st_load(payload)
        return True
    except Exception:
        return False


@SETTINGS
@given(payload=st.binary(max_size=4096))
def test_resigned_garbage_payload_is_a_counted_miss(payload):
    assume(not parses(payload))
    s = store()
    s.global_tier.put("k1", seal(payload, key="k1", secret=SECRET))
    assert_counted_miss_and_removed(s, "k1", 0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@SETTINGS
@given(meta=st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=4), top=st.booleans())
def test_resigned_metadata_of_wrong_types_is_a_counted_miss(meta, top):
    assume(not all(isinstance(v, str) for v in meta.values()))
    tensor = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}
    header = json.dumps(meta if top else {"k": tensor, "__metadata__": meta}).encode()
    payload = struct.pack("<Q", len(header)) + header + (b"" if top else bytes(4))
    s = store()
    s.global_tier.put("k1", seal(payload, key="k1", secret=SECRET))
    assert_counted_miss_and_removed(s, "k1", 0)


@SETTINGS
@given(keys=st.lists(st.from_regex(r"[a-f0-9]{1,16}", fullmatch=True), min_size=2, max_size=2, unique=True))
def test_swapped_keys_are_a_counted_miss(keys):
    a, b = keys
    s = store()
    s.put_global(a, BLOCK, {"n": "a"})
    s.put_global(b, BLOCK, {"n": "b"})
    s.global_tier.put(b, s.global_tier.get(a))  # a whole, validly signed record under another key
    assert_counted_miss_and_removed(s, b, 0)
    assert s.get_global(a)[1] == {"n": "a"}


def test_file_copied_over_another_key_on_disk_is_caught_by_get_verify_and_gc(tmp_path):
    s = KVStore(DiskTier(tmp_path, 1 << 20), MemoryTier(1 << 20), secret=SECRET)
    for k in ("b0", "b1", "b2", "b3"):
        s.put_global(k, BLOCK, {"block": k})
    shutil.copyfile(tmp_path / "b0.kv", tmp_path / "b2.kv")
    assert (
        s.get_global("b2") is None and s.global_tier.stats.corrupt == 1 and not (tmp_path / "b2.kv").exists()
    )
    shutil.copyfile(tmp_path / "b0.kv", tmp_path / "b3.kv")
    assert s.verify()["corrupt_removed"] == 1
    shutil.copyfile(tmp_path / "b0.kv", tmp_path / "b1.kv")
    assert s.gc()["corrupt_removed"] == 1
    assert sorted(s.global_tier.keys()) == ["b0"]


@pytest.mark.parametrize("admin", ["verify", "gc"])
def test_resigned_unparseable_payload_is_counted_by_verify_and_gc_not_raised(tmp_path, admin):
    s = KVStore(DiskTier(tmp_path, 1 << 20), MemoryTier(1 << 20), secret=SECRET)
    s.put_global("good", BLOCK, {})
    s.global_tier.put(
        "bad", seal(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", key="bad", secret=SECRET)
    )
    assert getattr(s, admin)()["corrupt_removed"] == 1
    assert s.global_tier.keys() == ["good"]


def test_another_stores_secret_cannot_forge_a_record(tmp_path):
    mine = KVStore(DiskTier(tmp_path, 1 << 20), MemoryTier(1 << 20), secret=SECRET)
    forger = KVStore(MemoryTier(1 << 20), MemoryTier(1 << 20), secret=os.urandom(32))
    forged = encode_record(BLOCK, {"codec": "bf16"}, key="k1", secret=forger.secret)
    mine.global_tier.put("k1", forged)  # the forger can write to the tier, but does not hold the secret
    # signed by a secret this store does not hold: never served, counted apart, left for its owner
    assert mine.get_global("k1") is None and mine.global_tier.stats.unverifiable == 1
    assert mine.global_tier.keys() == ["k1"] and mine.global_tier.stats.corrupt == 0
    # the same forgery naming this store's (public) secret id fails the signature: corrupt, removed
    as_mine = bytearray(forged)
    as_mine[8:16] = records.secret_id(SECRET)
    mine.global_tier.put("k1", bytes(as_mine))
    assert mine.get_global("k1") is None and mine.global_tier.stats.corrupt == 1
    assert mine.global_tier.keys() == []
