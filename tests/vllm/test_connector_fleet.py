"""The kvstrata connector in real vLLM engines (CPU backend, SmolLM2-135M, bf16) sharing one disk root
with other engines: one whose store has another secret misses on the fleet's records and never
replaces them (its writes skipped, counted); one on a read-only store starts, serves the fleet's
records and writes nothing; each says in vLLM's log what it runs with and, at shutdown, its counters.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_connector_engine import CHUNK, DRIVER, request, vllm_python

from kvstrata.place.records import secret_id
from kvstrata_lab.serve_bench.vllm_bench import engine_env

pytestmark = pytest.mark.integration
FLEET, OTHER = "ab" * 32, "cd" * 32


def drive_logged(tmp: Path, name: str, req: dict) -> tuple[list[dict], str]:
    """The driver's step results and everything the engine logged (vLLM's log goes to stdout)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(req))
    proc = subprocess.run([str(vllm_python()), str(DRIVER), str(path)], capture_output=True, text=True,
                          timeout=900, env=engine_env())
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        pytest.fail(f"the vLLM engine driver exited with {proc.returncode}")
    lines = proc.stdout.splitlines()
    return [json.loads(x) for x in lines if x.startswith("{")], proc.stdout + proc.stderr


def signers(root: Path) -> dict[str, str]:
    """Each record file's signer id (after the disk entry's 24-byte header: magic, version, class, 0)."""
    return {p.name: p.read_bytes()[24 + 8:24 + 16].hex() for p in sorted(root.glob("*.kv"))}


def store_file(tmp: Path, name: str, secret: str, **extra) -> Path:
    path = tmp / f"{name}.toml"
    lines = [f'root = "{tmp / "root"}"', f"block_size = {CHUNK}", f'secret = "{secret}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    path.write_text("[store]\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_and_prompt):
    model, prompt = model_and_prompt
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    gen = {"op": "generate", "prompt": prompt, "max_tokens": 12}
    other_prompt = list(reversed(prompt))
    first, _ = drive_logged(tmp, "fleet", request(model, store_file(tmp, "fleet", FLEET), [
        gen, {"op": "wait_records", "prompt": prompt, "chunks": 4}, {"op": "stats"}]))
    written = signers(tmp / "root")
    wrong, wrong_log = drive_logged(tmp, "wrong", request(model, store_file(tmp, "wrong", OTHER), [
        gen, {"op": "stats"}]))
    after_wrong = signers(tmp / "root")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp / "root").iterdir()}
    reader, reader_log = drive_logged(tmp, "reader", request(model, store_file(
        tmp, "reader", FLEET, read_only=True), [gen, {**gen, "prompt": other_prompt}, {"op": "stats"}]))
    after_reader = {p.name: p.stat().st_mtime_ns for p in (tmp / "root").iterdir()}
    return {"first": first, "written": written, "wrong": wrong, "wrong_log": wrong_log,
            "after_wrong": after_wrong, "reader": reader, "reader_log": reader_log,
            "unchanged": before == after_reader}


def test_another_secret_never_replaces_the_fleets_records(fleet):
    cold, _, first_stats = fleet["first"]
    fleet_id = secret_id(bytes.fromhex(FLEET)).hex()
    assert len(fleet["written"]) == 4 and set(fleet["written"].values()) == {fleet_id}
    miss, stats = fleet["wrong"]
    assert miss["cached"] == 0 and miss["tokens"] == cold["tokens"]  # unverifiable: recomputed
    assert fleet["after_wrong"] == fleet["written"]  # every record still the fleet's, none added
    totals = stats["totals"]
    assert totals["writes_skipped_foreign"] == 4 and totals["saved_chunks"] == 0
    assert totals["write_failures"] == 0 and first_stats["totals"]["writes_skipped_foreign"] == 0


def test_a_read_only_store_starts_serves_hits_and_writes_nothing(fleet):
    (cold, *_), (hit, other, stats) = fleet["first"], fleet["reader"]
    assert hit["cached"] == 4 * CHUNK and hit["tokens"] == cold["tokens"]
    assert other["cached"] == 0 and fleet["unchanged"]  # not a file of the root touched
    totals = stats["totals"]
    assert totals["saved_chunks"] == 0 and totals["writes_refused_read_only"] >= 4
    assert totals["write_failures"] == 0


def test_the_connector_logs_through_vllm(fleet):
    other_id = secret_id(bytes.fromhex(OTHER)).hex()
    log = fleet["wrong_log"]
    start = [line for line in log.splitlines() if "kvstrata connector (WORKER): store disk" in line]
    assert start and f"secret id {other_id}" in start[0] and "method bf16" in start[0]
    assert "[connector.py" in start[0] or "connector.py:" in start[0]  # vLLM's format, vLLM's handler
    shutdown = [line for line in log.splitlines() if "kvstrata connector (WORKER) shutting down" in line]
    assert shutdown and "'writes_skipped_foreign': 4" in shutdown[0]
    assert "read-only: read_only = true" in fleet["reader_log"]
    assert "Traceback" not in log and "Traceback" not in fleet["reader_log"]
