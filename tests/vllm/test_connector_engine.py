"""The kvstrata connector inside a real vLLM engine (CPU backend, eager, SmolLM2-135M in bf16), run in
vLLM's own environment (`make vllm-env`; `make test` builds it) by the lab's `vllm_driver.py`.

Two engine lifetimes over one disk store: the second serves the prompt's prefix from disk and
answers as the cold engine did; another tenant's salt never hits; a record put under another
chunk's key, or with one flipped byte, is a miss there and the rest is recomputed with the same
answer. A third engine stores on Redis, which is killed mid-run: recompute, no crash. A bad
connector config fails at engine start with one line.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis_helpers import RedisServer

from kvstrata.models.loader import load_tokenizer, resolve
from kvstrata_lab.serve_bench import vllm_bench
from kvstrata_lab.serve_bench.vllm_bench import engine_env

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "lab" / "kvstrata_lab" / "serve_bench" / "vllm_driver.py"
CHUNK = 64


def vllm_python() -> Path:
    try:
        return vllm_bench.vllm_python()
    except FileNotFoundError as exc:  # a missing environment is a failure here, never a skip
        pytest.fail(str(exc))


def drive(tmp: Path, name: str, request: dict) -> list[dict]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(request))
    proc = subprocess.run([str(vllm_python()), str(DRIVER), str(path)], capture_output=True, text=True,
                          timeout=900, env=engine_env())
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        pytest.fail(f"the vLLM engine driver exited with {proc.returncode}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def request(model: str, store: Path, steps: list[dict], method: str = "lossless") -> dict:
    extra = {"method": method, "store": str(store), "chunk_tokens": CHUNK}
    return {"model": model, "connector": {"name": "KvstrataConnector", "extra": extra}, "steps": steps}


@pytest.fixture(scope="module")
def lifetimes(tmp_path_factory, model_and_prompt):
    model, prompt = model_and_prompt
    tmp = tmp_path_factory.mktemp("vllm-disk")
    store = tmp / "store.toml"
    store.write_text(f'[store]\nroot = "{tmp / "root"}"\nblock_size = {CHUNK}\n')
    gen = {"op": "generate", "prompt": prompt, "max_tokens": 12}
    # cold, then vLLM's own prefix cache holding the same 4 chunks (its answer at that split)
    first = drive(tmp, "first", request(model, store, [
        gen, {"op": "reset"}, {**gen, "prompt": prompt[: 4 * CHUNK + 1], "max_tokens": 1}, gen]))
    second = drive(tmp, "second", request(model, store, [
        gen,
        {**gen, "salt": "tenant-b"},
        {"op": "reset"},
        {"op": "tamper", "prompt": prompt, "chunk": 1, "how": "copy_from", "source": 0},
        gen,
        {"op": "wait_records", "prompt": prompt, "chunks": 4},
        {"op": "reset"},
        {"op": "tamper", "prompt": prompt, "chunk": 2, "how": "flip"},
        gen,
        {"op": "wait_records", "prompt": prompt, "chunks": 4},
        {"op": "reset"},
        {"op": "forge", "prompt": prompt, "chunk": 3},
        gen,
        {"op": "stats"},
    ]))
    cold, _, local = [s for s in first if s["op"] == "generate"]
    return (cold, local), [s for s in second if s["op"] in ("generate", "stats")]


def test_second_lifetime_hits_from_disk_and_answers_identically(lifetimes):
    """Lossless records restore the very bits vLLM held: the answer equals the one vLLM gives from its
    own prefix cache at the same split, logprob for logprob (a cold prefill of the whole prompt sums
    in another order: same tokens, logprobs within bf16 rounding)."""
    (cold, local), (warm, *_) = lifetimes
    assert cold["cached"] == 0 and local["cached"] == 4 * CHUNK
    assert warm["cached"] == 4 * CHUNK  # every whole chunk but the one holding the prompt's last token
    assert warm["tokens"] == cold["tokens"] == local["tokens"]
    assert warm["logprobs"] == local["logprobs"]


def test_another_salt_never_hits(lifetimes):
    (cold, _), (_, salted, *_) = lifetimes
    assert salted["cached"] == 0
    assert salted["tokens"] == cold["tokens"]


def test_damaged_records_are_misses_and_recomputed(lifetimes):
    (cold, _), (*_, copied, flipped, forged, stats) = lifetimes
    assert copied["cached"] == 1 * CHUNK  # chunk 1 holds chunk 0's record: the hit stops before it
    assert flipped["cached"] == 2 * CHUNK  # chunk 2's payload has a flipped byte
    for got in (copied, flipped, forged):
        assert got["tokens"] == cold["tokens"]
    # chunk 3 signed and keyed right but no chunk: it passes the lookup, fails to unpack at the load
    # (and is removed); the request's load is reported failed, vLLM schedules it again, and the new
    # lookup hits the 3 chunks before it
    totals = stats["totals"]
    assert totals["load_errors"] == 1
    # warm, after the copy, after the flip, the forged run (3 before the failure, 3 on the retry)
    assert totals["loaded_chunks"] == 4 + 1 + 2 + 3 + 3
    assert totals["loaded_tokens"] == (4 + 1 + 2 + 3 + 3) * CHUNK
    assert forged["cached"] == 3 * CHUNK


def test_bad_config_and_redis_killed_mid_run(tmp_path, model_and_prompt):
    model, prompt = model_and_prompt
    server = RedisServer().start()
    try:
        store = tmp_path / "store.toml"
        store.write_text(f'[store]\nredis_url = "{server.url}"\nsecret = "{"ab" * 32}"\n'
                         f'root = "{tmp_path / "root"}"\nblock_size = {CHUNK}\n')
        gen = {"op": "generate", "prompt": prompt, "max_tokens": 12}
        steps = drive(tmp_path, "redis", request(model, store, [
            {"op": "start", "extra": {"method": "bogus4"}},
            {"op": "start", "extra": {"store": str(tmp_path / "missing.toml")}},
            {"op": "start", "extra": {"colour": "red"}},
            gen,
            {"op": "wait_records", "prompt": prompt, "chunks": 4},
            {"op": "reset"},
            gen,
            {"op": "kill", "pid": server.proc.pid},
            {"op": "reset"},
            gen,
            gen,
        ]))
    finally:
        server.stop()
    bogus, missing, unknown = (s["result"] for s in steps[:3])
    assert "kvstrata connector: method 'bogus4'" in bogus and "\n" not in bogus
    assert "kvstrata connector: store config" in missing and "missing.toml" in missing
    assert "unknown kv_connector_extra_config keys ['colour']" in unknown
    gens = [s for s in steps if s["op"] == "generate"]
    assert steps[4]["result"] is True
    # cold; from Redis; Redis gone: recomputed; then vLLM's own prefix cache (whole 32-token blocks)
    assert [g["cached"] for g in gens] == [0, 4 * CHUNK, 0, len(prompt) // 32 * 32]
    assert all(g["tokens"] == gens[0]["tokens"] for g in gens)


def test_hybrid_model_keeps_sliding_layers_in_the_pool(tmp_path):
    """Gemma-3 (sliding-window layers with a 512-token window, and global ones) on a 700-token prompt,
    vLLM's hybrid allocator on: the global layers' chunks go to disk, the sliding layers' to the store's
    SWA pool. Within the engine's life a hit restores both, logprob for logprob what vLLM's own prefix
    cache gives at the same split; after a restart the pool is empty and vLLM replays no window for
    these layers, so there is no hit: recomputed, the same answer."""
    model = str(resolve("gemma3-270m"))
    prompt = load_tokenizer(model)((ROOT / "docs" / "architecture.md").read_text()[:4000])["input_ids"][:700]
    assert len(prompt) == 700
    store = tmp_path / "store.toml"
    store.write_text(f'[store]\nroot = "{tmp_path / "root"}"\nblock_size = {CHUNK}\n')
    gen = {"op": "generate", "prompt": prompt, "max_tokens": 8}
    first = drive(tmp_path, "first", request(model, store, [
        gen, {"op": "reset"}, {**gen, "prompt": prompt[: 10 * CHUNK + 1], "max_tokens": 1}, gen,
        {"op": "reset"}, gen, {"op": "stats"}]))
    second = drive(tmp_path, "second", request(model, store, [gen, {"op": "stats"}]))
    cold, split, local, warm = [s for s in first if s["op"] == "generate"]
    stats = first[-1]
    layers = json.loads((Path(model) / "config.json").read_text())["layer_types"]
    assert stats["layers"]["persistent"] == [i for i, t in enumerate(layers) if t == "full_attention"]
    assert stats["layers"]["pooled"] == [i for i, t in enumerate(layers) if t == "sliding_attention"]
    assert split["cached"] == local["cached"] == warm["cached"] == 10 * CHUNK
    # the very bits vLLM's own prefix cache gives at this split (a whole-prompt prefill sums in another
    # order: on Gemma-3 in bf16 its 7th token already differs, for vLLM's own cache as for the store)
    assert warm["tokens"] == local["tokens"] and warm["logprobs"] == local["logprobs"]
    totals = stats["totals"]
    # 11 chunks of the cold run's prompt and answer, then chunk 10 again by each later request computing it
    assert totals["saved_chunks"] == totals["pool_chunks"] == 11 + 1 + 1 and totals["write_failures"] == 0
    # 10 chunks loaded twice; the pool's records only where the window at the hit (640) keeps blocks: 128..640
    assert totals["loaded_chunks"] == 20 and totals["pool_loaded"] == 2 * 8 and totals["load_errors"] == 0
    restarted, restarted_stats = second
    assert restarted["cached"] == 0 and restarted["tokens"] == cold["tokens"]
    assert restarted_stats["totals"]["loaded_chunks"] == 0
