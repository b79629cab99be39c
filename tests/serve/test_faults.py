"""Faults through real server processes, each ending in correct answers (equal to `kvstrata
generate`'s greedy answer for the same prompt): Redis killed mid-session, a corrupted disk record,
the server SIGKILLed and restarted on the same disk, the SWA pool emptied by its TTL."""

import subprocess
import time
from pathlib import Path

import pytest
from redis_helpers import RedisServer
from serve_helpers import client, greedy_reference, replay_start, start_server, text_of

from kvstrata.place.config import StoreConfig
from kvstrata.place.store import KVStore

TOKENS = 6
FLEET = "ab" * 32


def ask(oa, prompt: str):
    return oa.completions.create(model="tiny", prompt=prompt, max_tokens=TOKENS, temperature=0)


@pytest.fixture
def reference(loaded):
    model, tok = loaded["gemma"]
    return lambda prompt: greedy_reference(model, tok, tok(prompt).input_ids, TOKENS)


def test_redis_killed_mid_session_serves_misses_counted_in_metrics(model_dirs, tmp_path, reference):
    redis = RedisServer().start()
    server = start_server(model_dirs["gemma"], tmp_path, env={"KVSTRATA_STORE_REDIS_URL": redis.url,
                                                              "KVSTRATA_STORE_SECRET": FLEET,
                                                              "KVSTRATA_STORE_REDIS_TIMEOUT_SECONDS": "0.3"})
    try:
        oa, turns = client(server), [text_of(50, seed=20)]
        turns += [turns[-1] + " next turn", turns[-1] + " next turn and another"]
        assert ask(oa, turns[0]).kvstrata["kind"] == "miss"
        assert ask(oa, turns[1]).kvstrata["kind"] == "hit"  # global KV from Redis
        server.wait_written()
        assert server.metric("kvstrata_store_errors_total", tier="global") == 0
        redis.stop()
        got = ask(oa, turns[2])
        assert got.kvstrata["kind"] == "miss" and got.choices[0].text == reference(turns[2])
        server.wait_written()
        assert server.metric("kvstrata_store_errors_total", tier="global") >= 1
        assert server.metric("kvstrata_prompts_total", kind="miss") == 2
        redis.start()  # back, empty: misses again, then hits
        assert ask(oa, turns[2]).kvstrata["kind"] == "miss"
        server.wait_written()
        assert ask(oa, turns[2]).kvstrata["kind"] == "hit"
    finally:
        server.stop()
        redis.stop()


def test_corrupt_record_restart_and_swa_expiry(model_dirs, tmp_path, reference):
    root = tmp_path / "store" / "global"
    env = {"KVSTRATA_STORE_ROOT": str(root)}
    a = start_server(model_dirs["gemma"], tmp_path / "a", env=env)
    try:
        oa = client(a)
        x = text_of(70, seed=21)
        first = ask(oa, x)
        a.wait_written()
        written = sorted(root.glob("*.kv"))
        assert len(written) == 4  # 70 tokens: 4 blocks of 16
        for path in written:  # flip bytes in the middle of every record of this prompt
            blob = bytearray(path.read_bytes())
            blob[len(blob) // 2] ^= 0xFF
            path.write_bytes(bytes(blob))
        again = ask(oa, x)
        assert again.kvstrata["kind"] == "miss" and again.choices[0].text == first.choices[
            0
        ].text == reference(x)
        a.wait_written()
        assert a.metric("kvstrata_store_corrupt_total", tier="global") >= 1  # counted, removed, written anew
        assert _intact(root) == len(written)
        y = text_of(150, seed=22)  # prefix 144 tokens > the 45 replayed on an SWA miss: not all of it
        answer_y = ask(oa, y).choices[0].text
        a.wait_written()
    finally:
        a.kill()  # SIGKILL: nothing flushed at exit, the SWA pool (RAM) is gone
    b = start_server(model_dirs["gemma"], tmp_path / "b", env={**env, "KVSTRATA_STORE_SWA_TTL_SECONDS": "3"})
    try:
        oa = client(b)
        after = ask(oa, y)  # global KV from disk, SWA state lost with the old process: a replay
        assert after.kvstrata["kind"] == "replay" and after.kvstrata["reused_tokens"] == 144
        assert after.kvstrata["computed_tokens"] == 150 - replay_start(144)
        assert after.choices[0].text == answer_y == reference(y)
        assert ask(oa, x).kvstrata["reused_tokens"] == 64  # the rewritten records read back from disk too
        b.wait_written()
        time.sleep(4)  # past the SWA TTL: the pool drops the state the replay rebuilt
        later = ask(oa, y + " more")
        assert later.kvstrata["kind"] == "replay" and later.choices[0].text == reference(y + " more")
        assert later.usage.prompt_tokens_details.cached_tokens == replay_start(144)
        assert b.metric("kvstrata_store_expired_total", tier="swa") >= 1
    finally:
        b.stop()


def _intact(root: Path) -> int:
    """Records under `root` that read back whole and signed with the store's persistent secret (opened
    after the server has written everything)."""
    store = KVStore.from_config(StoreConfig(root=str(root)))
    return sum(store.get_global(p.stem) is not None for p in root.glob("*.kv"))


def test_a_redis_turned_evicting_under_the_server_is_degraded_health_not_wrong_answers(
    model_dirs, tmp_path, reference
):
    redis = RedisServer().start()
    server = start_server(model_dirs["gemma"], tmp_path, env={
        "KVSTRATA_STORE_REDIS_URL": redis.url, "KVSTRATA_STORE_SECRET": FLEET,
        "KVSTRATA_STORE_REDIS_CHECK_SECONDS": "0.05"})
    try:
        oa, x = client(server), text_of(50, seed=23)
        assert ask(oa, x).kvstrata["kind"] == "miss" and server.health()["status"] == "ok"
        server.wait_written()
        assert server.metric("kvstrata_store_retention_ok") == 1
        redis.client().config_set("maxmemory-policy", "allkeys-lru")
        time.sleep(0.2)
        y = text_of(70, seed=24)
        got = ask(oa, y)  # still answered right; its blocks are refused, not written
        assert got.choices[0].text == reference(y) and ask(oa, x).kvstrata["kind"] == "hit"  # reads go on
        server.wait_written()
        health = server.health()
        assert health["status"] == "degraded" and "allkeys-lru" in health["store_problems"][0]
        assert server.metric("kvstrata_store_retention_ok") == 0
        assert ask(oa, y).kvstrata["kind"] == "miss"  # nothing of y was written under the evicting policy
        assert "Traceback" not in server.log_tail(20000)
    finally:
        server.stop()
        redis.stop()


def test_a_full_disk_under_the_server_answers_right_and_logs_once(model_dirs, tmp_path, reference):
    fs = tmp_path / "fs"
    fs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(fs)],
                             capture_output=True)
    assert mounted.returncode == 0, f"cannot mount a test tmpfs: {mounted.stderr.decode().strip()}"
    server = start_server(model_dirs["gemma"], tmp_path / "srv", env={"KVSTRATA_STORE_ROOT": str(fs / "kv")})
    try:
        oa = client(server)
        prompts = [text_of(120, seed=30 + i) for i in range(4)]
        assert all(ask(oa, p).choices[0].text == reference(p) for p in prompts)
        server.wait_written()
        log = server.log_tail(50000)
        assert "Traceback" not in log and log.count("write failure") == 1
        assert server.health()["status"] == "ok"  # a full disk is a refusal, not a broken guarantee
    finally:
        server.stop()
        subprocess.run(["umount", "-l", str(fs)], check=False)


def test_a_read_only_store_serves_hits_refuses_writes_and_says_so(model_dirs, tmp_path, reference):
    """One server fills a disk store; a second one on the same root with `read_only = true` serves its
    blocks, answers new prompts without writing them (counted), and says it is read-only in /health and
    /metrics -- not a file of the root changes."""
    root = tmp_path / "root"
    env = {"KVSTRATA_STORE_ROOT": str(root)}
    x, y = text_of(70, seed=25), text_of(50, seed=26)
    writer = start_server(model_dirs["gemma"], tmp_path / "writer", env=env)
    try:
        assert ask(client(writer), x).kvstrata["kind"] == "miss"
        writer.wait_written()
    finally:
        writer.stop()
    before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    reader = start_server(model_dirs["gemma"], tmp_path / "reader",
                          env={**env, "KVSTRATA_STORE_READ_ONLY": "1"})
    try:
        oa = client(reader)
        got = ask(oa, x)  # the global KV from the writer's records (the SWA pool died with the writer)
        assert got.kvstrata["reused_tokens"] == 64 and got.choices[0].text == reference(x)
        assert ask(oa, y).choices[0].text == reference(y)
        reader.wait_written()
        health = reader.health()
        assert health["status"] == "ok" and health["store_read_only"] == "read_only = true"
        assert reader.metric("kvstrata_store_read_only") == 1
        assert reader.metric("kvstrata_store_refused_read_only_total", tier="global") >= 3  # y's blocks
        assert "Traceback" not in reader.log_tail(20000)
    finally:
        reader.stop()
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before
