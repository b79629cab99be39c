"""Redis told as it is, against real redis-servers: authentication, a killed server, a full server
with noeviction, an evicting policy refused for global KV, retention as Redis TTLs."""

import json

import pytest
import torch

from kvstrata.cli import main
from kvstrata.place import KVStore, StoreConfig, StoreUnavailable
from kvstrata.place.memory import MemoryTier
from kvstrata.place.redis_tier import EvictionPolicyError, RedisTier

SECRET = "ab" * 32
BLOCK = {"k": torch.zeros(4, 16, dtype=torch.uint8)}


def config(tmp_path, url: str, **extra) -> str:
    lines = [f"root = '{tmp_path / 'root'}'", f"redis_url = '{url}'",
        "redis_timeout_seconds = 0.3", f"secret = '{SECRET}'"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    path = tmp_path / "store.toml"
    path.write_text("[store]\n" + "\n".join(lines) + "\n")
    return str(path)


def cli(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err, out


@pytest.mark.parametrize("userinfo, words", [
    ("", "refused authentication"),  # no password
    (":wrong@", "refused authentication"),
    ("nosuchuser:pw@", "refused authentication"),
])
@pytest.mark.parametrize("action", ["stats", "verify", "gc"])
def test_wrong_or_missing_password_is_an_error_not_an_empty_store(
    start_redis, tmp_path, capsys, userinfo, words, action
):
    server = start_redis(password="right-pw")
    url = f"redis://{userinfo}127.0.0.1:{server.port}/0"
    code, err, _ = cli(["store", action, "--config", config(tmp_path, url)], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1
    assert ":wrong@" not in err and "nosuchuser:pw" not in err  # credentials are never printed
    good = f"redis://:right-pw@127.0.0.1:{server.port}/0"
    assert cli(["store", action, "--config", config(tmp_path, good)], capsys)[0] == 0


def test_killed_server_is_an_error_for_admin_and_a_miss_for_serving(start_redis, tmp_path, capsys):
    server = start_redis()
    cfg = config(tmp_path, server.url)
    store = KVStore.from_config(StoreConfig.load(cfg, env={}))
    assert store.put_global("a1", BLOCK, {}) and store.get_global("a1") is not None
    server.proc.kill()
    server.proc.wait()
    assert store.get_global("a1") is None and store.global_tier.stats.errors > 0  # serving: a counted miss
    assert store.put_global("a2", BLOCK, {}) is False
    for admin in (store.stats, store.verify, store.gc):
        with pytest.raises(StoreUnavailable, match="cannot be reached"):
            admin()
    for action in ("stats", "verify", "gc"):
        code, err, _ = cli(["store", action, "--config", cfg], capsys)
        assert code == 2 and "cannot be reached" in err


def test_full_noeviction_server_refuses_and_counts(start_redis, tmp_path):
    server = start_redis("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    store = KVStore.from_config(StoreConfig.load(config(tmp_path, server.url), env={}))
    big = {
        "k": torch.randint(
            0, 255, (256 * 1024,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
    }
    accepted = [store.put_global(f"b{i}", big, {}) for i in range(24)]  # never raises
    tier = store.global_tier
    assert not all(accepted) and tier.stats.refused == accepted.count(False)
    assert tier.stats.extra["refused_out_of_memory"] == accepted.count(False)
    assert all(
        store.get_global(f"b{i}") is not None for i, ok in enumerate(accepted) if ok
    )  # nothing evicted
    assert not tier.put_many(
        [("m1", b"x" * 400_000), ("m2", b"y" * 400_000)]
    ) and tier.stats.refused > accepted.count(False)


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "allkeys-random"])
def test_evicting_policy_is_refused_for_global_kv_unless_opted_in(start_redis, tmp_path, capsys, policy):
    server = start_redis("--maxmemory", "8mb", "--maxmemory-policy", policy)
    cfg = config(tmp_path, server.url)
    with pytest.raises(EvictionPolicyError, match=f"maxmemory-policy {policy}"):
        KVStore.from_config(StoreConfig.load(cfg, env={}))
    code, err, _ = cli(["store", "stats", "--config", cfg], capsys)
    assert code == 2 and "redis_allow_eviction" in err
    opted = config(tmp_path, server.url, redis_allow_eviction=True)
    code, _, out = cli(["store", "stats", "--config", opted], capsys)
    shown = json.loads(out)["global"]
    assert code == 0
    assert shown["maxmemory_policy"] == policy and shown["eviction_allowed"] is True
    assert shown["retention_guaranteed"] is False


def test_retention_is_a_redis_ttl_and_gc_reports_it(start_redis, tmp_path):
    server = start_redis()
    store = KVStore.from_config(StoreConfig.load(config(tmp_path, server.url, retention_hours=2.0), env={}))
    store.put_global("g1", BLOCK, {})
    raw = server.client()
    assert 7100 < raw.pttl(store.global_tier._key("g1")) / 1000 <= 7200
    raw.persist(store.global_tier._key("g1"))  # as if written by an older build: no TTL
    report = store.gc()["ttl"]
    assert report["ttl_set_now"] == 1 and report["retention_s"] == 7200
    assert raw.pttl(store.global_tier._key("g1")) > 0
    assert store.gc()["ttl"]["with_ttl"] == 1


def test_redis_cluster_string_false_is_refused_not_truthy(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('[store]\nredis_cluster = "false"\n')
    with pytest.raises(ValueError, match="redis_cluster: expected true or false"):
        StoreConfig.load(cfg, env={})
    assert StoreConfig.load(None, env={"KVSTRATA_STORE_REDIS_CLUSTER": "false"}).redis_cluster is False
    with pytest.raises(ValueError, match="KVSTRATA_STORE_REDIS_CLUSTER"):
        StoreConfig.load(None, env={"KVSTRATA_STORE_REDIS_CLUSTER": "maybe"})


def test_swa_pool_in_memory_keeps_serving_while_redis_refuses(start_redis, tmp_path):
    server = start_redis(password="pw")
    tier = RedisTier(f"redis://127.0.0.1:{server.port}/0", prefix="x", socket_timeout=0.3)
    store = KVStore(tier, MemoryTier(1 << 20))
    assert store.get_global("a") is None and tier.stats.errors == 1  # NOAUTH: a counted miss while serving
    assert store.put_swa("s", BLOCK, {}) and store.get_swa("s") is not None


def test_redis_copy_of_one_key_onto_another_is_a_counted_miss(start_redis, tmp_path):
    server = start_redis()
    store = KVStore.from_config(StoreConfig.load(config(tmp_path, server.url), env={}))
    store.put_global("b0", BLOCK, {"block": "0"})
    store.put_global("b2", BLOCK, {"block": "2"})
    key = store.global_tier._key
    server.client().copy(key("b0"), key("b2"), replace=True)  # a whole, validly signed record, wrong key
    assert store.get_global("b2") is None and store.global_tier.stats.corrupt == 1
    assert server.client().exists(key("b2")) == 0 and store.get_global("b0")[1] == {"block": "0"}
    assert store.verify() == {"checked": 1, "corrupt_removed": 0, "gone": 0, "foreign_removed": 0,
                              "unverifiable": {}, "skipped": {}}
