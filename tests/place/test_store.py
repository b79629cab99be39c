import pytest
import torch

from kvstrata.place import records, tier
from kvstrata.place import store as store_module
from kvstrata.place.config import StoreConfig
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_keys import block_hashes, namespace
from kvstrata.place.redis_tier import RedisTier
from kvstrata.place.store import KVStore
from kvstrata.place.tier import Tier

NS = namespace("m", "nvfp4", "float32")
BLOCK = {"k": torch.zeros(4, 16, dtype=torch.uint8)}


def keys(tokens, salt=b"t1", ns=NS):
    return [h.hex() for h in block_hashes(tokens, 4, ns, salt)]


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path):
    if request.param == "disk":
        g = DiskTier(tmp_path, 1 << 20)
    else:
        server = request.getfixturevalue("redis_server")
        g = RedisTier(server.url, prefix="s")
    return KVStore(g, MemoryTier(1 << 20), swa_ttl_s=60)


def test_lookup_hit_replay_miss(store, monkeypatch):
    t = [0.0]
    monkeypatch.setattr(tier, "now", lambda: t[0])
    ks = keys(list(range(16)))
    for k in ks[:3]:
        store.put_global(k, BLOCK, {"tokens": 4})
    store.put_swa(ks[2], BLOCK, {})
    assert store.lookup(ks).global_blocks == 3 and store.lookup(ks).kind == "hit"
    t[0] += 61  # the SWA state expires, global KV stays
    assert store.lookup(ks).kind == "replay"
    assert store.lookup(keys([99] * 16)).kind == "miss"


def test_other_tenant_or_namespace_never_hits(store):
    ks = keys(list(range(8)))
    for k in ks:
        store.put_global(k, BLOCK, {})
    assert store.lookup(keys(list(range(8)), salt=b"t2")).kind == "miss"
    assert store.lookup(keys(list(range(8)), ns=namespace("m", "fp8", "float32"))).kind == "miss"


def test_corrupt_record_is_a_counted_miss_and_removed(tmp_path):
    g = DiskTier(tmp_path, 1 << 20)
    s = KVStore(g, MemoryTier(1 << 20))
    k = keys(list(range(4)))[0]
    s.put_global(k, BLOCK, {})
    path = tmp_path / f"{k}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert s.get_global(k) is None and g.stats.corrupt == 1 and k not in g.keys()
    s.put_global(k, BLOCK, {})
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    assert s.lookup([k]).kind == "miss" and g.stats.corrupt == 2


def test_corrupt_record_in_redis_is_removed(redis_server):
    import redis

    g = RedisTier(redis_server.url, prefix="s")
    s = KVStore(g, MemoryTier(1 << 20))
    s.put_global("abc", BLOCK, {})
    raw = redis.Redis(port=redis_server.port)
    name = g._key("abc")
    blob = bytearray(raw.get(name))
    blob[-1] ^= 0x01
    raw.set(name, bytes(blob))
    assert s.get_global("abc") is None and raw.get(name) is None and g.stats.corrupt == 1


def test_full_global_tier_refuses_and_never_evicts(tmp_path):
    g = DiskTier(tmp_path, 2000)
    s = KVStore(g, MemoryTier(1 << 20))
    accepted = [s.put_global(f"k{i}", BLOCK, {}) for i in range(20)]
    assert not all(accepted) and g.stats.refused == accepted.count(False)
    assert all(s.get_global(f"k{i}") is not None for i, ok in enumerate(accepted) if ok)


def test_gc_removes_only_past_retention(tmp_path):
    import os

    g = DiskTier(tmp_path, 1 << 20)
    s = KVStore(g, MemoryTier(1 << 20), retention_s=3600)
    s.put_global("old", BLOCK, {})
    s.put_global("new", BLOCK, {})
    old = tmp_path / "old.kv"
    os.utime(old, (old.stat().st_atime - 7200, old.stat().st_mtime - 7200))
    report = s.gc()
    assert report["removed_past_retention"] == 1 and g.keys() == ["new"]


def test_swa_pool_ttl_and_capacity(monkeypatch):
    t = [0.0]
    monkeypatch.setattr(tier, "now", lambda: t[0])
    swa = MemoryTier(1000)
    s = KVStore(MemoryTier(1 << 20, evict=False), swa, swa_ttl_s=120)
    for i in range(10):
        s.put_swa(f"s{i}", BLOCK, {})
    assert swa.nbytes() <= 1000 and swa.stats.evicted > 0  # capped; oldest live states go first
    assert s.get_swa("s9") is not None
    t[0] += 121
    assert s.get_swa("s9") is None


def test_config_defaults_file_and_env(tmp_path):
    c = StoreConfig()
    assert c.retention_hours == 72 and c.swa_ram_share == 0.10 and 60 <= c.swa_ttl_seconds <= 900
    f = tmp_path / "store.toml"
    f.write_text("[store]\nblock_size = 64\nswa_ttl_seconds = 120\n")
    c = StoreConfig.load(f, env={"KVSTRATA_STORE_SWA_TTL_SECONDS": "90",
                         "KVSTRATA_STORE_REDIS_CLUSTER": "true"})
    assert c.block_size == 64 and c.swa_ttl_seconds == 90 and c.redis_cluster is True
    f.write_text("[store]\nblok_size = 3\n")
    with pytest.raises(ValueError, match="blok_size"):
        StoreConfig.load(f, env={})
    with pytest.raises(ValueError):
        StoreConfig(swa_ram_share=2)


def test_store_cli(tmp_path, capsys):
    import json

    from kvstrata.cli import main

    cfg = tmp_path / "s.toml"
    cfg.write_text(f"[store]\nroot = '{tmp_path / 'kv'}'\n")
    s = KVStore.from_config(StoreConfig.load(cfg, env={}))
    s.put_global("a1", BLOCK, {})
    s.put_global("a2", BLOCK, {})
    damaged = bytearray((tmp_path / "kv" / "a2.kv").read_bytes())
    damaged[-1] ^= 1
    (tmp_path / "kv" / "a2.kv").write_bytes(bytes(damaged))
    (tmp_path / "kv" / "a3.kv").write_bytes(b"\0" * 12)  # not written by kvstrata: reported, left alone
    assert main(["store", "verify", "--config", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checked"] == 2 and out["corrupt_removed"] == 1 and "a3.kv" in out["skipped"]
    assert main(["store", "stats", "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["global"]["keys"] == 1
    assert (tmp_path / "kv" / "a3.kv").read_bytes() == b"\0" * 12


def test_lookup_verifies_records_without_parsing_tensors(tmp_path, monkeypatch):
    s = KVStore(DiskTier(tmp_path, 1 << 20), MemoryTier(1 << 20))
    ks = keys(list(range(8)))
    for k in ks[:2]:
        s.put_global(k, BLOCK, {"tokens": 4})
    s.put_swa(ks[1], BLOCK, {})

    def no_parsing(payload):
        raise AssertionError("lookup parsed a payload")

    monkeypatch.setattr(store_module, "parse_payload", no_parsing)
    found = s.lookup(ks)
    assert (found.global_blocks, found.kind, len(found.entries)) == (2, "hit", 2)
    monkeypatch.undo()
    tensors, meta = found.entries[0].open()
    assert torch.equal(tensors["k"], BLOCK["k"]) and meta == {"tokens": "4"}
    assert s.lookup(ks, swa=False).kind == "hit" and s.lookup(ks[2:], swa=False).kind == "miss"


def test_a_verified_record_that_does_not_parse_is_rejected_by_whoever_opens_it(tmp_path):
    g = DiskTier(tmp_path, 1 << 20)
    s = KVStore(g, MemoryTier(1 << 20))
    k = keys(list(range(4)))[0]
    g.put(k, records.seal(b"not safetensors", key=k, secret=s.secret, klass="global"))
    [entry] = s.lookup([k]).entries  # signed and bound to the key: present
    with pytest.raises(records.RecordError, match="does not parse"):
        entry.open()
    entry.reject()
    assert g.stats.corrupt == 1 and k not in g.keys() and s.get_global(k) is None


def test_every_tier_has_what_the_store_calls():
    members = [n for n in vars(Tier) if not n.startswith("_")] + list(Tier.__annotations__)
    for cls in (MemoryTier, DiskTier, RedisTier):
        assert all(hasattr(cls, n) for n in members if n != "stats"), cls.__name__
    assert RedisTier.retention_by_ttl and not DiskTier.retention_by_ttl
