"""A fleet sharing one store, against real redis-servers (and one disk root): a machine with another
secret can neither use nor erase the fleet's KV -- not by its admin commands, not by writing the same
keys --, a shared store never makes up a secret, secrets rotate without losing the KV, and a Redis
that starts evicting under a running store is noticed (its counter reset included) and stops global
writes."""

import json
import time

import pytest
import torch

from kvstrata.cli import main
from kvstrata.place import KVStore, StoreConfig
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
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


# --- a wrong secret never replaces the fleet's records (issue 65) ----------------------------------
def _signer(blob: bytes) -> str:
    return blob[8:16].hex()  # records.py: magic, version, class, 0, then the signer's id


def _thrash(fleet: KVStore, laptop: KVStore, read_raw) -> None:
    """The fleet writes 6 records; a member with another secret misses each and writes it back (as
    serving does on a miss), three rounds: its writes are skipped and counted, the fleet hits throughout
    and every record is still the fleet's."""
    fleet_id = secret_id(bytes.fromhex(FLEET)).hex()
    for i in range(6):
        assert fleet.put_global(f"b{i}", BLOCK, {"i": str(i)})
    for _ in range(3):
        for i in range(6):
            assert laptop.get_global(f"b{i}") is None  # unverifiable: a miss ...
            assert laptop.put_global(f"b{i}", BLOCK, {"by": "laptop"}) is False  # ... its write skipped
            assert fleet.get_global(f"b{i}")[1] == {"i": str(i)}  # the fleet still hits
    assert all(_signer(read_raw(f"b{i}")) == fleet_id for i in range(6))
    stats = laptop.global_tier.stats
    assert stats.writes_skipped_foreign == 18 and stats.writes == 0 and stats.refused == 0
    assert laptop.stats()["global"]["writes_skipped_foreign"] == 18
    assert laptop.put_global("mine", BLOCK, {"by": "laptop"})  # a key the fleet has not written: written
    assert fleet.get_global("mine") is None and laptop.get_global("mine")[1] == {"by": "laptop"}
    assert fleet.put_global("mine", BLOCK, {}) is False  # and the fleet does not erase the laptop's either


def test_a_wrong_secret_never_replaces_the_fleets_records_on_redis(redis_server, tmp_path, capsys):
    fleet = open_store(config(tmp_path, redis_server.url, "fleet", secret=FLEET))
    laptop_cfg = config(tmp_path, redis_server.url, "laptop", secret=LAPTOP)
    laptop = open_store(laptop_cfg)
    _thrash(fleet, laptop, lambda k: redis_server.client().get(fleet.global_tier._key(k)))
    code, out = cli(["store", "stats", "--config", laptop_cfg], capsys)  # a new process counts its own
    assert code == 0 and out["global"]["writes_skipped_foreign"] == 0  # the counter is in stats


def test_a_wrong_secret_never_replaces_the_fleets_records_on_disk(tmp_path):
    root = tmp_path / "root"
    fleet = KVStore(DiskTier(root, 1 << 24), MemoryTier(1 << 20), secret=bytes.fromhex(FLEET))
    laptop = KVStore(DiskTier(root, 1 << 24), MemoryTier(1 << 20), secret=bytes.fromhex(LAPTOP))
    _thrash(fleet, laptop, lambda k: (root / f"{k}.kv").read_bytes()[24:])  # the entry header is 24 bytes


def test_what_a_write_may_replace(redis_server, tmp_path):
    """Rotation replaces a previous secret's record; a cut record, junk or an expired foreign record is
    replaced; another record version is kept."""
    store = open_store(config(tmp_path, redis_server.url, secret=LAPTOP, previous_secrets=FLEET))
    old = open_store(config(tmp_path, redis_server.url, "old", secret=FLEET))
    assert old.put_global("rotated", BLOCK, {}) and store.put_global("rotated", BLOCK, {"by": "new"})
    tier, client = store.global_tier, redis_server.client()
    client.set(tier._key("junk"), b"KVSR" + b"\0" * 10)  # too short to be a record: replaced
    client.set(tier._key("other-version"), b"KVSR\x03\x00" + b"\0" * 200)  # kept
    third = open_store(config(tmp_path, redis_server.url, "third", secret="ef" * 32))
    assert third.put_global("expiring", BLOCK, {}) and client.pexpire(tier._key("expiring"), 50)
    time.sleep(0.1)
    assert store.put_global("junk", BLOCK, {}) and store.put_global("expiring", BLOCK, {})
    assert store.put_global("other-version", BLOCK, {}) is False
    assert client.get(tier._key("other-version"))[4:6] == b"\x03\x00"
    assert tier.stats.writes_skipped_foreign == 1 and store.get_global("rotated")[1] == {"by": "new"}


def test_a_missing_secret_file_on_a_shared_tier_refuses_to_start(redis_server, tmp_path, capsys):
    missing = tmp_path / "secrets" / "fleet.hex"
    path = config(tmp_path, redis_server.url, secret_file=str(missing))
    code, err = cli(["store", "stats", "--config", path], capsys)
    assert code == 2 and "does not exist" in err and str(missing) in err
    assert len(err.strip().splitlines()) == 1
    assert not missing.exists() and redis_server.client().dbsize() == 0  # no secret made up, nothing written


def test_evictions_after_a_counter_reset_are_still_reported(start_redis, tmp_path):
    """A server that evicted before the store connected, then `CONFIG RESETSTAT`: the counter goes below
    the store's baseline; the check says losses are unknown, counts again from there, and reports the
    next evictions."""
    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    filler = server.client()
    for i in range(400):
        filler.set(f"before:{i}", b"x" * 20_000)
    assert int(filler.info("stats")["evicted_keys"]) > 100
    filler.config_set("maxmemory-policy", "noeviction")
    store = open_store(config(tmp_path, server.url, secret=FLEET, redis_check_seconds=3600))
    assert store.problems(force=True) == []
    filler.config_resetstat()
    assert any("went down" in p for p in store.problems(force=True))  # said once ...
    assert store.problems(force=True) == []  # ... then counted again from zero
    filler.config_set("maxmemory-policy", "allkeys-lru")
    for i in range(30):
        filler.set(f"after:{i}", b"x" * 20_000)
    evicted = int(filler.info("stats")["evicted_keys"])
    filler.config_set("maxmemory-policy", "noeviction")  # fixed before the next check
    assert 0 < evicted < 100
    assert any(f"evicted {evicted} keys" in p for p in store.problems(force=True))
    assert store.global_tier.stats.evicted == evicted


def test_kvstore_stats_forces_the_live_check(start_redis, tmp_path):
    server = start_redis()
    store = open_store(config(tmp_path, server.url, secret=FLEET, redis_check_seconds=3600))
    assert store.stats()["global"]["retention_guaranteed"] is True
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    stats = store.stats()["global"]
    assert stats["retention_guaranteed"] is False and "allkeys-lru" in stats["problems"][0]
    assert store.put_global("b0", BLOCK, {}) is False  # and writes stop at once, not a check interval later
