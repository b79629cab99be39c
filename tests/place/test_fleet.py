"""A fleet sharing one store, against real redis-servers: a machine with another secret can neither
use nor erase the fleet's KV, secrets rotate without losing it, and a Redis that starts evicting
under a running store is noticed and stops global writes."""

import json
import time

import pytest
import torch

from kvstrata.cli import main
from kvstrata.place import KVStore, StoreConfig
from kvstrata.place.records import secret_id

FLEET = "ab" * 32
LAPTOP = "cd" * 32
BLOCK = {"k": torch.arange(64, dtype=torch.uint8).reshape(4, 16)}


def config(tmp_path, url: str, name: str = "store", **settings) -> str:
    lines = [f"root = '{tmp_path / name}'", f"redis_url = '{url}'", "redis_timeout_seconds = 1.0"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path = tmp_path / f"{name}.toml"
    path.write_text("[store]\n" + "\n".join(lines) + "\n")
    return str(path)


def cli(argv, capsys) -> tuple[int, dict | str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, (json.loads(out) if code == 0 else err)


def open_store(path: str) -> KVStore:
    return KVStore.from_config(StoreConfig.load(path, env={}))


def test_a_shared_tier_needs_an_explicit_fleet_secret(redis_server, tmp_path, capsys):
    code, err = cli(["store", "stats", "--config", config(tmp_path, redis_server.url)], capsys)
    assert code == 2 and "needs the fleet's secret" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "store" / ".kvstrata-secret").exists()  # no machine-local secret was made
    assert redis_server.client().dbsize() == 0  # and nothing was written to the shared tier
    env = {"KVSTRATA_STORE_SECRET": FLEET}
    store = KVStore.from_config(StoreConfig.load(config(tmp_path, redis_server.url), env=env))
    assert store.secret == bytes.fromhex(FLEET)


def test_another_secret_can_neither_use_nor_erase_the_fleets_records(redis_server, tmp_path, capsys):
    fleet = open_store(config(tmp_path, redis_server.url, "fleet", secret=FLEET))
    for i in range(10):
        assert fleet.put_global(f"b{i}", BLOCK, {"i": str(i)})
    laptop_cfg = config(tmp_path, redis_server.url, "laptop", secret=LAPTOP)
    laptop = open_store(laptop_cfg)
    assert all(laptop.get_global(f"b{i}") is None for i in range(10))  # never served ...
    assert laptop.global_tier.stats.unverifiable == 10 and laptop.global_tier.stats.corrupt == 0
    fleet_id = secret_id(bytes.fromhex(FLEET)).hex()
    for action in ("verify", "gc"):  # ... and never erased by the admin commands
        code, out = cli(["store", action, "--config", laptop_cfg], capsys)
        assert code == 0 and out["unverifiable"] == {fleet_id: 10} and out["corrupt_removed"] == 0
        assert out["foreign_removed"] == 0 and redis_server.client().dbsize() == 10
    assert all(fleet.get_global(f"b{i}")[1]["i"] == str(i) for i in range(10))  # the fleet still hits
    code, err = cli(["store", "verify", "--config", laptop_cfg, "--delete-foreign", "not-an-id"], capsys)
    assert code == 2 and "not a secret id" in err and redis_server.client().dbsize() == 10
    other = secret_id(b"z" * 32).hex()
    code, out = cli(["store", "verify", "--config", laptop_cfg, "--delete-foreign", other], capsys)
    assert code == 0 and out["foreign_removed"] == 0 and redis_server.client().dbsize() == 10
    code, out = cli(["store", "verify", "--config", laptop_cfg, "--delete-foreign", fleet_id], capsys)
    assert code == 0 and out["foreign_removed"] == 10 and redis_server.client().dbsize() == 0


def test_secrets_rotate_without_losing_the_fleets_kv(redis_server, tmp_path, capsys):
    old = open_store(config(tmp_path, redis_server.url, "old", secret=FLEET))
    assert old.put_global("b0", BLOCK, {"by": "old"})
    rotated_cfg = config(tmp_path, redis_server.url, "new", secret=LAPTOP, previous_secrets=FLEET)
    rotated = open_store(rotated_cfg)
    assert rotated.get_global("b0")[1] == {"by": "old"}  # the previous secret still verifies
    assert rotated.put_global("b1", BLOCK, {"by": "new"})  # and the new one signs
    assert old.get_global("b1") is None and old.global_tier.stats.unverifiable == 1
    code, out = cli(["store", "stats", "--config", rotated_cfg], capsys)
    ids = [secret_id(bytes.fromhex(s)).hex() for s in (LAPTOP, FLEET)]
    assert code == 0 and out["global"]["secret_id"] == ids[0] and out["global"]["verifies"] == ids
    code, out = cli(["store", "verify", "--config", rotated_cfg], capsys)
    assert code == 0 and out["checked"] == 2 and out["unverifiable"] == {} and out["corrupt_removed"] == 0
    code, err = cli(["store", "stats", "--config", config(tmp_path, redis_server.url, "bad", secret=FLEET,
                                                          previous_secrets="xyz")], capsys)
    assert code == 2 and "previous_secrets" in err


def test_a_policy_switched_to_evicting_while_running_stops_global_writes(start_redis, tmp_path, capsys):
    server = start_redis("--maxmemory", "4mb")
    path = config(tmp_path, server.url, secret=FLEET, redis_check_seconds=0.05)
    store = open_store(path)
    assert store.put_global("b0", BLOCK, {}) and store.problems() == []
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    time.sleep(0.1)
    assert store.put_global("b1", BLOCK, {}) is False  # refused, counted, said
    assert store.global_tier.stats.extra["refused_retention_broken"] == 1
    stats = store.stats()["global"]
    assert stats["maxmemory_policy"] == "allkeys-lru" and stats["retention_guaranteed"] is False
    assert "allkeys-lru" in store.problems()[0]
    code, out = cli(["store", "stats", "--config", path], capsys)  # a new process: refused at connect
    assert code == 2 and "maxmemory-policy allkeys-lru" in out
    filler = server.client()
    for i in range(400):  # evict: the server's evicted_keys grows, and the store says so
        filler.set(f"other:{i}", b"x" * 20_000)
    time.sleep(0.1)
    assert any("evicted" in p for p in store.problems()) and store.global_tier.stats.evicted > 0
    server.client().config_set("maxmemory-policy", "noeviction")
    filler.flushdb()
    time.sleep(0.1)
    assert any("evicted" in p for p in store.problems(force=True))  # the loss is reported once ...
    assert store.problems(force=True) == []  # ... then writes resume once the server is fixed
    assert store.put_global("b2", BLOCK, {}) and store.stats()["global"]["retention_guaranteed"] is True


def test_verify_rechecks_redis_at_once_when_a_listed_record_is_gone(start_redis, tmp_path):
    server = start_redis()
    store = open_store(config(tmp_path, server.url, secret=FLEET, redis_check_seconds=3600))
    assert store.put_global("b0", BLOCK, {})
    server.client().config_set("maxmemory-policy", "volatile-lru")
    keys = store.global_tier.keys()
    server.client().flushdb()  # listed, then gone before it is read
    store.global_tier.keys = lambda: keys  # the listing as it was a moment before
    out = store.verify()
    assert out["gone"] == 1 and "volatile-lru" in out["problems"][0]
    assert store.put_global("b1", BLOCK, {}) is False


@pytest.mark.parametrize("flip", ["secret id", "signature"])
def test_a_damaged_record_of_this_fleet_is_still_never_served(redis_server, tmp_path, flip):
    store = open_store(config(tmp_path, redis_server.url, secret=FLEET))
    assert store.put_global("b0", BLOCK, {})
    key = store.global_tier._key("b0")
    blob = bytearray(redis_server.client().get(key))
    blob[10 if flip == "secret id" else -3] ^= 0x01
    redis_server.client().set(key, bytes(blob))
    assert store.get_global("b0") is None
    stats = store.global_tier.stats
    assert (stats.unverifiable, stats.corrupt) == ((1, 0) if flip == "secret id" else (0, 1))
