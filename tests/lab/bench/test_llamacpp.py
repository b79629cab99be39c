"""llama.cpp as a peer: the spec grammar, its bytes per token, a missing toolchain, the GGUF written for
a tiny Llama, and real llama-server rows on the benchmark's instances.

The tests that run llama-server skip until it is built (`make llamacpp`, ~5 min once); CI builds it
first (`.ci/run`), so there they run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kvstrata.models import load_config
from kvstrata.models.loader import load
from kvstrata_lab.bench.peers import parse_peer
from kvstrata_lab.bench.peers.llamacpp import bytes_per_token, server_args
from kvstrata_lab.bench.peers.llamacpp_build import LlamaCppUnavailable, built, ensure
from kvstrata_lab.bench.peers.llamacpp_gguf import gguf_for, weights
from kvstrata_lab.bench.peers.llamacpp_server import LlamaServer
from kvstrata_lab.bench.report import write_report
from kvstrata_lab.bench.runner import BenchConfig, family, run

needs_server = pytest.mark.skipif(
    built() is None and not os.environ.get("KVSTRATA_LLAMA_SERVER"),
    reason="llama-server is not built: `make llamacpp` (~5 min once; CI builds it)",
)


def test_spec_grammar_canonical_and_errors():
    assert parse_peer("llamacpp:q4_0").spec == "llamacpp:q4_0"
    assert parse_peer("llamacpp:q8_0:v=q8_0").spec == "llamacpp:q8_0"
    mixed = parse_peer("llamacpp:q8_0:v=iq4_nl")
    assert (mixed.name, mixed.params, mixed.spec) == ("q8_0", {"v": "iq4_nl"}, "llamacpp:q8_0:v=iq4_nl")
    assert family("llamacpp:q4_0") == "peer"
    for bad, words in (("llamacpp:q3_k", "unknown llama.cpp KV cache type 'q3_k'"),
                       ("llamacpp:q8_0:k=q4_0", "expected llamacpp:<type>"),
                       ("llamacpp:q8_0:v=fp4", "unknown llama.cpp KV cache type 'fp4'"),
                       ("llamacpp", "expected")):
        with pytest.raises(ValueError, match=words):
            parse_peer(bad)


def test_bytes_per_token_count_the_block_layout():
    llama = load_config("tiny-llama")  # 4 layers x 2 KV heads x 32: 1,024 B per token in bf16
    assert bytes_per_token(parse_peer("llamacpp:f16"), llama, 300) == 1024
    assert bytes_per_token(parse_peer("llamacpp:q4_0"), llama, 300) == 1024 * 18 / 64  # 18 B per 32 values
    assert bytes_per_token(parse_peer("llamacpp:q8_0:v=q4_0"), llama, 300) == 512 * 34 / 64 + 512 * 18 / 64
    gemma = load_config("tiny-gemma3")  # 3 of 4 layers slide over 16 tokens: they hold 15
    assert bytes_per_token(parse_peer("llamacpp:q4_1"), gemma, 150) == pytest.approx(
        256 * (150 + 3 * 15) / 150 * 20 / 64)  # 20 B per 32 values where bf16 takes 64
    assert server_args(parse_peer("llamacpp:q5_1:v=q4_0"), 4608)[:8] == [
        "-c", "4608", "-np", "1", "--cache-type-k", "q5_1", "--cache-type-v", "q4_0"]


def test_missing_toolchain_or_binary_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_LLAMACPP_DIR", str(tmp_path))
    monkeypatch.delenv("KVSTRATA_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LlamaCppUnavailable, match=r"needs cmake and a C\+\+ compiler"):
        ensure()
    monkeypatch.setenv("KVSTRATA_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(LlamaCppUnavailable, match="is not an executable file"):
        ensure()


def test_bench_cli_without_a_toolchain_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), KVSTRATA_LLAMACPP_DIR=str(tmp_path / "build"),
               HF_HUB_OFFLINE="1")
    env.pop("KVSTRATA_LLAMA_SERVER", None)
    cmd = [sys.executable, "-c", "import sys; from kvstrata.cli import main; sys.exit(main())", "bench",
           "--model", "tiny-llama", "--lengths", "512", "--tasks", "single", "--n", "1", "--methods", "none",
           "--peers", "llamacpp:q4_0", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstrata: error: building llama.cpp's llama-server needs cmake")
    assert "Traceback" not in proc.stderr


def test_gguf_of_a_tiny_llama_is_written_once_and_not_for_others(tmp_path):
    path = gguf_for("tiny-llama")
    assert weights(path) == "F32" and gguf_for("tiny-llama") == path
    with pytest.raises(ValueError, match="no GGUF for 'tiny-gemma3'"):
        gguf_for("tiny-gemma3")


@needs_server
def test_llama_server_greedy_equals_transformers_on_the_written_gguf(tmp_path):
    """The GGUF we write (rotary rows reordered, byte vocabulary) is the same model to llama.cpp:
    its greedy tokens from the ids we send equal transformers' where transformers' choice is clear."""
    model, _ = load("tiny-llama")
    g = torch.Generator().manual_seed(0)
    with LlamaServer(ensure(), gguf_for("tiny-llama"), *server_args(parse_peer("llamacpp:f16"), 1024),
                     log_path=tmp_path / "server.log") as server:
        clear = 0
        for _ in range(8):
            ids = [256] + torch.randint(0, 256, (40,), generator=g).tolist()
            with torch.no_grad():
                top = model(torch.tensor([ids])).logits[0, -1].topk(2)
            if float(top.values[0] - top.values[1]) < 0.02:
                continue
            clear += 1
            assert server.complete(ids, 1)["tokens"] == [int(top.indices[0])]
    assert clear >= 4


@needs_server
def test_bench_rows_share_the_instances_and_count_llamacpp_bytes(tmp_path):
    cfg = BenchConfig(models=("tiny-llama",), lengths=(512,), n=2, tasks=("single", "fidelity"),
                      methods=("bf16",), peers=("llamacpp:f16", "llamacpp:q4_0"), out=tmp_path)
    run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    by = {(r["task"], r["index"], r["method"]): r for r in rows}
    assert len(rows) == 2 * 2 * 3
    for i in range(2):
        ref, f16, q4 = (by[("single", i, m)] for m in ("bf16", "llamacpp:f16", "llamacpp:q4_0"))
        assert f16["context_tokens"] == q4["context_tokens"] == ref["context_tokens"]
        assert f16["family"] == "peer" and "llama-server, GGUF F32 weights" in f16["peer"]
        assert f16["kv_bytes_per_token"] == ref["kv_bytes_per_token"]
        assert q4["kv_bytes_per_token"] == ref["kv_bytes_per_token"] * 18 / 64
        assert q4["score"] is not None and q4["decode_s_per_token"] > 0 and q4["prefill_s"] > 0
        assert "teacher-forced" in by[("fidelity", i, "llamacpp:q4_0")]["error"]
    run(cfg)  # resumable: nothing is asked twice
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(rows)
    md = write_report(tmp_path).read_text()
    assert "### Each system against its own uncompressed row" in md and "`llamacpp:q4_0`" in md


@needs_server
def test_a_server_that_cannot_load_the_model_is_one_clear_line(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(RuntimeError, match="llama-server exited with|llama-server died of"):
        LlamaServer(ensure(), bad, "-c", "256", log_path=tmp_path / "server.log").start(timeout_s=60)
