"""A read-only store (`read_only = true`, or a disk root found not writable at start) serves what a
writer filled and writes nothing: hits served, writes refused and counted, damaged records counted and
left in place, not a file of the root touched -- on disk, on Redis, and under `kvstrata chat`."""

import io
import json
import subprocess

import pytest
import torch
from test_disk_faults import small_fs

from kvstrata.models.tiny import byte_tokenizer
from kvstrata.place import KVStore, StoreConfig
from kvstrata.place.chat import chat
from kvstrata.place.prefix_server import PrefixServer

BLOCK = {"k": torch.arange(64, dtype=torch.uint8).reshape(4, 16)}
FLEET = "ab" * 32


def snapshot(root) -> dict:
    """Every file of a root with its size and modification time."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir()}


def open_store(**settings) -> KVStore:
    return KVStore.from_config(StoreConfig(**settings))


def test_read_only_serves_hits_and_writes_nothing(tmp_path):
    root = tmp_path / "root"
    writer = open_store(root=str(root))
    for i in range(3):
        assert writer.put_global(f"b{i}", BLOCK, {"i": str(i)})
    path = root / "b2.kv"
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 1  # damaged: a reader that may write would remove it
    path.write_bytes(bytes(blob))
    before = snapshot(root)
    reader = open_store(root=str(root), read_only=True)
    assert reader.read_only == "read_only = true"
    assert [reader.get_global(f"b{i}")[1] for i in range(2)] == [{"i": "0"}, {"i": "1"}]
    assert reader.get_global("b2") is None and reader.global_tier.stats.corrupt == 1
    assert reader.put_global("b3", BLOCK, {}) is False and reader.put_global("b0", BLOCK, {}) is False
    reader.global_tier.delete("b0")
    report = reader.gc()
    stats = reader.stats()["global"]
    assert stats["refused_read_only"] == stats["refused"] == 2 and stats["read_only"] == "read_only = true"
    assert report["removed_past_retention"] == 0 and snapshot(root) == before  # not a byte changed
    assert reader.put_swa("s0", BLOCK, {}) and reader.get_swa("s0") is not None  # the SWA pool is memory


def test_a_read_only_store_never_makes_up_a_secret(tmp_path):
    root = tmp_path / "root"
    open_store(root=str(root), secret=FLEET)  # a root filled by a writer given its secret explicitly
    with pytest.raises(ValueError, match="does not exist: a read-only store never makes up a secret"):
        open_store(root=str(root), read_only=True)
    assert not (root / ".kvstrata-secret").exists()
    with pytest.raises(ValueError, match="not a store root"):
        open_store(root=str(tmp_path / "nothing"), read_only=True, secret=FLEET)
    assert not (tmp_path / "nothing").exists()


def test_a_root_on_a_read_only_file_system_is_served_read_only(tmp_path, caplog):
    with small_fs(tmp_path / "fs", 512) as root:
        writer = open_store(root=str(root))
        assert writer.put_global("b0", BLOCK, {"by": "writer"})
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        reader = open_store(root=str(root))  # detected at start: no error, no write tried
        assert "is not writable" in reader.read_only and "served read-only" in caplog.text
        assert reader.get_global("b0")[1] == {"by": "writer"}
        assert reader.put_global("b1", BLOCK, {}) is False
        stats = reader.stats()["global"]
        assert stats["refused_read_only"] == 1 and "is not writable" in stats["read_only"]
        assert stats["faults"] == {}  # refused before the disk was asked, not an EROFS fault per write


def test_read_only_on_redis_sends_no_write(redis_server, tmp_path):
    writer = open_store(root=str(tmp_path / "w"), redis_url=redis_server.url, secret=FLEET)
    assert writer.put_global("b0", BLOCK, {"by": "writer"})
    reader = open_store(root=str(tmp_path / "r"), redis_url=redis_server.url, secret=FLEET, read_only=True)
    assert reader.get_global("b0")[1] == {"by": "writer"}
    assert reader.put_global("b1", BLOCK, {}) is False and reader.verify()["checked"] == 1
    assert redis_server.client().dbsize() == 1
    assert reader.stats()["global"]["refused_read_only"] == 1


def test_chat_over_a_read_only_store(tiny_gemma, tmp_path):
    root = tmp_path / "root"
    turns = ["the first question is long enough to fill blocks", "a follow-up"]
    tok = byte_tokenizer()

    def run(turns, **settings):
        store = open_store(root=str(root), block_size=8, **settings)
        server = PrefixServer(tiny_gemma, store, "nvfp4;sliding=fp8", block_size=8)
        return store, chat(tiny_gemma, tok, server, turns, max_new_tokens=4, out=io.StringIO())

    _, written = run(turns)
    before = snapshot(root)
    new = "and a new question the writer never saw, several blocks long"
    store, again = run([*turns, new], read_only=True)
    assert written[0]["kind"] == "miss" and again[0]["reused"] > 0  # the writer's blocks serve it
    assert [r["reply"] for r in again[:2]] == [r["reply"] for r in written]
    assert store.global_tier.stats.refused_read_only > 0 and snapshot(root) == before
    assert json.dumps(store.stats())  # stats stay printable
