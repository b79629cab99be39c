"""`serve-bench --peer`: the same agent workload against llama.cpp's llama-server and `vllm serve`, on a
tiny Llama (real servers). The llama-server test skips until it is built (`make llamacpp`; CI builds
it); `vllm serve` runs from `.venv-vllm`, which `make test` builds."""

import json

import pytest

from kvstrata.cli import main
from kvstrata_lab.bench.peers.llamacpp_build import built
from kvstrata_lab.serve_bench.config import BatchBenchConfig, ServeBenchConfig

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


@pytest.mark.skipif(built() is None,
                    reason="llama-server is not built: `make llamacpp` (~5 min once; CI builds it)")
def test_batch_bench_runs_its_levels_against_llama_server_in_the_same_run(tmp_path):
    """`serve-batch-bench --peer llama-server`: each level against a llama-server with one slot per
    stream, beside our batched and unbatched workers; our tokens/s over its, per level."""
    assert main(["serve-batch-bench", "--model", "tiny-llama", "--methods", "bf16", "--streams", "1,3",
                 "--requests", "1", "--level-requests", "3", "--prompt-tokens", "40", "--max-tokens", "6",
                 "--probe-tokens", "60", "--budget-sequences", "2", "--budget-streams", "2",
                 "--peer", "llama-server", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tiny-llama.json").read_text())
    levels = result["peer"]["levels"]
    assert [x["streams"] for x in levels] == [1, 3] and "error" not in result["peer"]
    assert all(x["requests"] == 3 and x["errors"] == 0 and x["tokens"] > 0 for x in levels)
    ratios = result["summary"]["bf16"]["vs_peer"]
    ours = {x["streams"]: x["tokens_per_s"] for x in result["methods"]["bf16"]["batched"]["levels"]}
    assert ratios == {str(n): ours[n] / x["tokens_per_s"] for n, x in zip((1, 3), levels)}
    assert "| llama-server | 3 |" in (tmp_path / "tiny-llama.md").read_text()


def test_unknown_peer_is_refused_by_the_config():
    with pytest.raises(ValueError, match="unknown serve-bench peer 'sglang'"):
        ServeBenchConfig(peer="sglang")
    with pytest.raises(ValueError, match="unknown serve-batch-bench peer 'vllm'"):
        BatchBenchConfig(peer="vllm")
    with pytest.raises(ValueError, match="dtype must be one of float32, bf16, got 'fp16'"):
        BatchBenchConfig(dtype="fp16")
