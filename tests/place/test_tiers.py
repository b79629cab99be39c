import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvstrata.place import tier
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.records import decode_record, encode_record, seal, write_guard
from kvstrata.place.redis_tier import RedisTier

SECRET = b"k" * 32


@pytest.fixture
def clock(monkeypatch):
    t = [1000.0]
    monkeypatch.setattr(tier, "now", lambda: t[0])
    return t


def test_memory_lru_and_capacity():
    m = MemoryTier(100)
    assert m.put("a", b"x" * 40) and m.put("b", b"y" * 40)
    m.get("a")  # a is now most recent
    assert m.put("c", b"z" * 40)
    assert m.get("b") is None and m.get("a") and m.get("c")
    assert m.stats.evicted == 1 and m.nbytes() == 80


def test_memory_ttl_reclaims_expired_first(clock):
    m = MemoryTier(100)
    m.put("old", b"x" * 60, ttl_s=10)
    m.put("live", b"y" * 30, ttl_s=1000)
    clock[0] += 11
    assert m.put("new", b"z" * 60, ttl_s=10)  # the expired entry goes, the live one stays
    assert m.get("live") is not None and m.stats.expired == 1 and m.stats.evicted == 0


def test_memory_refuses_when_eviction_disabled():
    m = MemoryTier(100, evict=False)
    assert m.put("a", b"x" * 80)
    assert not m.put("b", b"y" * 80)
    assert m.get("a") and m.stats.refused == 1


def test_disk_survives_restart_and_expires(tmp_path, clock):
    d = DiskTier(tmp_path, 10_000)
    d.put("k1", b"hello")
    d.put("k2", b"bye", ttl_s=5)
    again = DiskTier(tmp_path, 10_000)
    assert again.get("k1") == b"hello" and again.nbytes() == d.nbytes()
    clock[0] += 6
    assert again.get("k2") is None and "k2" not in again.keys()


def test_disk_refuses_when_full(tmp_path):
    d = DiskTier(tmp_path, 120)  # an entry is its value + a 24-byte header
    assert d.put("a", b"x" * 80)
    assert not d.put("b", b"y" * 80) and d.stats.refused == 1
    assert d.put("a", b"z" * 80)  # overwriting the same key fits


def test_disk_rejects_path_tricks(tmp_path):
    d = DiskTier(tmp_path, 100)
    for bad in ("../x", "a/b", "", ".tmp-x"):
        with pytest.raises(ValueError):
            d.put(bad, b"v")


WRITER = """
import os, sys, time
from kvstrata.place.disk import DiskTier
import kvstrata.place.disk as disk
real_replace = os.replace
def slow_replace(a, b):
    print("written", flush=True)
    time.sleep(float(sys.argv[3]))
    real_replace(a, b)
disk.os.replace = slow_replace
DiskTier(sys.argv[1], 1 << 30).put("key", bytes([int(sys.argv[2])]) * 2_000_000)
"""


def test_process_killed_mid_write_leaves_no_partial_record(tmp_path):
    d = DiskTier(tmp_path, 1 << 30)
    d.put("key", encode_record({"v": torch.zeros(10)}, {}, key="key", secret=SECRET))
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path),
                         "7", "30"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "written"  # temp file complete, rename pending
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    tensors, _ = decode_record(DiskTier(tmp_path, 1 << 30).get("key"), key="key",
                               secret=SECRET)  # still the old, whole record
    assert torch.equal(tensors["v"], torch.zeros(10))
    assert not list(tmp_path.glob(".kvstrata-tmp-*"))  # reopening reaped the orphan: its writer is gone


def test_two_writers_same_key_reader_sees_one_whole_value(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(b), "0"], stdout=subprocess.DEVNULL
        )
        for b in (1, 2)
    ]
    seen = set()
    d = DiskTier(tmp_path, 1 << 30)
    while any(p.poll() is None for p in procs):
        v = d.get("key")
        if v is not None:
            assert len(v) == 2_000_000 and len(set(v)) == 1
            seen.add(v[0])
    v = d.get("key")
    assert len(v) == 2_000_000 and v[0] in (1, 2) and len(set(v)) == 1


def test_redis_round_trip_ttl_and_pipelines(redis_server):
    r = RedisTier(redis_server.url, prefix="t")
    assert r.put("a", b"1") and r.get("a") == b"1"
    assert r.put_many([("b", b"2"), ("c", b"3")], group="chain")
    assert r.get_many(["b", "c", "zz"], group="chain") == [b"2", b"3", None]
    r.put("short", b"x", ttl_s=0.2)
    time.sleep(0.4)
    assert r.get("short") is None
    assert set(r.keys()) >= {"a", "b", "c"} and r.nbytes() > 0


def test_redis_keys_carry_hash_tags(redis_server):
    r = RedisTier(redis_server.url, prefix="t")
    assert r._key("abcdef", group="chain1") == "t:{chain1}:abcdef"


def test_redis_stopped_mid_run_is_a_miss_not_an_error(redis_server):
    r = RedisTier(redis_server.url, prefix="t", socket_timeout=0.3)
    r.put("a", b"1")
    redis_server.stop()
    assert r.get("a") is None and r.put("b", b"2") is False
    assert r.get_many(["a", "b"]) == [None, None]
    assert r.stats.errors >= 3


def test_redis_slow_server_times_out_to_a_miss(redis_server):
    import redis

    r = RedisTier(redis_server.url, prefix="t", socket_timeout=0.2, retries=0)
    r.put("a", b"1")
    blocker = threading.Thread(
        target=lambda: redis.Redis(port=redis_server.port).execute_command("DEBUG", "SLEEP", "1")
    )
    blocker.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    assert r.get("a") is None
    assert time.perf_counter() - t0 < 0.9 and r.stats.errors == 1
    blocker.join()
    assert r.get("a") == b"1"  # recovered once the server answers again


def test_redis_cluster_with_hash_tags(redis_cluster):
    r = RedisTier(redis_cluster, prefix="c", cluster=True, socket_timeout=2)
    chain = [(f"block{i}", bytes([i]) * 100) for i in range(8)]
    assert r.put_many(chain, group="prefix-1")  # one hash tag: one slot, one pipelined round trip
    assert r.get_many([k for k, _ in chain], group="prefix-1") == [v for _, v in chain]
    slots = {r.client.keyslot(r._key(k, "prefix-1")) for k, _ in chain}
    assert len(slots) == 1
    assert r.put("solo", b"x", ttl_s=60) and r.get("solo") == b"x"
    # a guarded write (one Lua script, one slot) keeps another secret's record, alone or pipelined
    foreign, guard = seal(b"theirs", key="held", secret=b"t" * 32), write_guard([b"s" * 32])
    assert r.put("held", foreign) and r.put("held", b"mine", guard=guard) is False
    assert r.get("held") == foreign
    assert r.put("held", foreign, group="prefix-1")
    assert r.put_many([("free", b"mine"), ("held", b"mine")], group="prefix-1", guard=guard) is False
    assert r.get_many(["free", "held"], group="prefix-1") == [b"mine", foreign]
    assert r.stats.writes_skipped_foreign == 2
