"""`serve-bench --peer`: the same agent workload against llama.cpp's llama-server and `vllm serve`, on a
tiny Llama (real servers). The llama-server test skips until it is built (`make llamacpp`; CI builds
it); `vllm serve` runs from `.venv-vllm`, which `make test` builds."""

import json

import pytest

from kvstrata.cli import main
from kvstrata_lab.bench.peers.llamacpp_build import built
from kvstrata_lab.serve_bench.config import ServeBenchConfig

ARGS = ["serve-bench", "--model", "tiny-llama", "--clients", "2", "--turns", "3", "--context", "200",
        "--tool-tokens", "24", "--max-tokens", "4", "--probe-tokens", "0", "--check", "1", "--block-size",
        "32", "--duration", "300"]


def _run(peer: str, out) -> dict:
    assert main([*ARGS, "--peer", peer, "--out", str(out)]) == 0
    return json.loads((out / "serve_bench.json").read_text())


def _same_workload(result: dict) -> None:
    ours, theirs = (result["phases"][p]["records"] for p in ("store", "peer"))
    assert len(theirs) == len(ours) == 6 and not any(r["error"] for r in theirs)
    # the same conversations: each turn's prompt is as long as ours, the first turns a miss for both
    first = [{r["client"]: r["prompt_tokens"] for r in rs if r["turn"] == 1} for rs in (ours, theirs)]
    assert first[0] == first[1] and len(first[0]) == 2
    assert all(r["kind"] == "miss" for r in theirs if r["turn"] == 1)
    assert any(r["cached_tokens"] > 0 for r in theirs if r["turn"] > 1)  # its own prefix reuse
    s = result["summary"]["peer"]
    assert s["ttft_p50_later_turns"] > 0 and s["requests_per_s"] > 0


@pytest.mark.skipif(built() is None,
                    reason="llama-server is not built: `make llamacpp` (~5 min once; CI builds it)")
def test_llama_server_peer_runs_the_same_workload_and_saves_its_slots(tmp_path):
    result = _run("llama-server", tmp_path)
    _same_workload(result)
    persist = result["peer"]["persist"]
    # f16 KV of 4 layers x 2 heads x 32 dims: 1,024 B a token, plus the slot file's small header
    assert persist["slot_files"] == 2 and persist["tokens"] > 0
    assert 1024 <= persist["bytes_per_token"] < 1024 * 1.2
    ours = result["store_bytes"]
    assert ours["records"] > 0 and ours["bytes_per_token"] > 0
    md = (tmp_path / "serve_bench.md").read_text()
    assert "| peer |" in md and "Its slot files:" in md and "slot files | " in md


def test_vllm_peer_runs_the_same_workload(tmp_path):
    result = _run("vllm", tmp_path)
    _same_workload(result)
    assert result["peer"]["persist"] == {}


def test_unknown_peer_is_refused_by_the_config():
    with pytest.raises(ValueError, match="unknown serve-bench peer 'sglang'"):
        ServeBenchConfig(peer="sglang")
