"""Peers: spec parsing, counting what a peer's cache holds, QuantizedCache rows, the report's section."""

import json

import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.peers import DEFAULT_PEERS, parse_peer
from kvstrata_lab.bench.peers.compare import head_to_head, tier
from kvstrata_lab.bench.peers.held import held_bytes
from kvstrata_lab.bench.report import summarise, write_report
from kvstrata_lab.bench.runner import BenchConfig, family, run


def test_parse_peer_canonical_and_defaults():
    assert parse_peer("kvpress:snapkv:cr=0.720").spec == "kvpress:snapkv:cr=0.72"
    assert parse_peer("qcache:hqq:int2").params == {"bits": 2}
    assert family("kvpress:tova:cr=0.5") == "peer"
    assert all(parse_peer(p).spec == p for p in DEFAULT_PEERS)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("kvpress:nope:cr=0.5", "unknown press"), ("kvpress:snapkv:cr=1.5", "0 <= ratio < 1"),
        ("kvpress:snapkv:keep=0.5", "cr=<ratio>"), ("qcache:fp8:int4", "unknown QuantizedCache backend"),
        ("qcache:quanto:int3", "int2 or int4"), ("vllm:x:y", "unknown peer project"),
        ("kvpress:snapkv", "expected"),
    ],
)
def test_parse_peer_errors_name_the_problem(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_peer(spec)


def test_held_bytes_counts_elements_at_16_bits_and_storages_as_held():
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), layer)
    held = held_bytes(cache)
    assert held == {"bytes": 2 * 2 * 160 * 2, "in_memory": 2 * 2 * 160 * 4, "entries": 2 * 2 * 10}
    cache.layers[0].keys = cache.layers[0].keys[:, :, :5]  # a slice: fewer entries, same storage held
    after = held_bytes(cache)
    assert after["bytes"] == held["bytes"] - 80 * 2 and after["in_memory"] == held["in_memory"]
    assert after["entries"] == held["entries"] - 2 * 5


@pytest.mark.parametrize("backend", ["hqq", "quanto"])
def test_held_bytes_reaches_quantized_parts(tiny_llama, backend):
    cache = QuantizedCache(backend, tiny_llama.config, nbits=4)
    text = tiny_llama.config
    shape = (1, text.num_key_value_heads, 128, text.head_dim)
    for layer in range(text.num_hidden_layers):
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    held = held_bytes(cache)
    dense = 2 * text.num_hidden_layers * torch.Size(shape).numel() * 2
    # 4-bit codes plus one 16-bit scale and zero per 64 values: 4.5 bits per value
    assert held["bytes"] == pytest.approx(dense * 4.5 / 16, rel=0.02)
    assert held["in_memory"] > held["bytes"]  # scales are float32 in this process


@pytest.fixture(scope="module")
def qcache_dir(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("peers")
    cfg = BenchConfig(
        models=("tiny-llama",), lengths=(256,), n=1, tasks=("single", "fidelity"), methods=("bf16",),
        peers=("qcache:hqq:int4", "qcache:quanto:int2"), out=out,
    )
    run(cfg, load_model=lambda name: (tiny_llama, byte_tokenizer()))
    return out


def test_qcache_rows_share_the_instances_and_count_held_bytes(qcache_dir):
    rows = [json.loads(line) for line in (qcache_dir / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"bf16", "qcache:hqq:int4", "qcache:quanto:int2"}
    by = {(r["task"], r["method"]): r for r in rows}
    for task in ("single", "fidelity"):
        ref = by[(task, "bf16")]
        int4, int2 = by[(task, "qcache:hqq:int4")], by[(task, "qcache:quanto:int2")]
        assert int4["family"] == "peer" and "QuantizedCache(hqq" in int4["peer"]
        assert int4["context_tokens"] == ref["context_tokens"]  # the same instance, same tokens
        assert ref["kv_bytes"] > int4["kv_bytes"] > int2["kv_bytes"] > 0
    assert by[("fidelity", "qcache:hqq:int4")]["kl"] >= 0


def test_peer_failure_is_a_reported_row(tmp_path, tiny_gemma):
    cfg = BenchConfig(
        models=("tiny-gemma",), lengths=(256,), n=1, tasks=("single",), methods=("bf16",),
        peers=("qcache:hqq:int4",), out=tmp_path,
    )
    run(cfg, load_model=lambda name: (tiny_gemma, byte_tokenizer()))
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    bad = [r for r in rows if r["method"] == "qcache:hqq:int4"]
    assert len(bad) == 1 and "only full attention" in bad[0]["error"] and bad[0]["score"] is None
    assert set(summarise(rows)[("tiny-gemma", 256)]["methods"]) == {"bf16"}
    md = write_report(tmp_path).read_text()
    assert "### How peers failed" in md and "only full attention" in md


def _rows(method, family, bpt, **scores):
    """(method, (scored rows, summary entry)): `task=[score per instance]`."""
    rows = [{"model": "m", "length": 4096, "task": t, "index": i, "method": method, "score": v}
            for t, vs in scores.items() for i, v in enumerate(vs)]
    return method, (rows, {"family": family, "kv_bytes_per_token": bpt,
                           "per_task": {t: sum(vs) / len(vs) for t, vs in scores.items()}})


def test_head_to_head_pairs_inside_a_bytes_tier_with_an_interval():
    got = dict([
        _rows("bf16", "reference", 1000, single=[1.0] * 10, fidelity=[1.0] * 10),
        _rows("nvfp4", "quantization", 280, single=[1.0] * 9 + [0.0], fidelity=[0.95] * 10),
        _rows("snapkv:keep=0.28", "eviction", 280, single=[0.0] * 10, fidelity=[0.5] * 10),
        # the peer ran 6 instances: both sides are scored on those 6 only
        _rows("kvpress:snapkv:cr=0.72", "peer", 290, single=[0.0, 1.0] * 3, fidelity=[0.97, 0.93] * 3),
        _rows("qcache:hqq:int2", "peer", 190, single=[0.0] * 10, fidelity=[0.3] * 10),  # alone in its tier
    ])
    rows = [r for rs, _ in got.values() for r in rs]
    summary = {("m", 4096): {"tasks": ["single", "fidelity"], "usable": {"single": True},
                             "methods": {m: s for m, (_, s) in got.items()}}}
    md = head_to_head(summary, rows)
    # nvfp4 answers all 6 shared instances, the peer 3: +50 points, an interval that excludes 0
    line = next(x for x in md.splitlines() if "| single |" in x)
    assert "`nvfp4` 1.00 | `kvpress:snapkv:cr=0.72` 0.50 | +50 [" in line and "(n=6)" in line
    assert line.endswith("**kvstrata** |")
    # top-1 0.95 against 0.95 on average, differing per instance: no side is ahead
    line = next(x for x in md.splitlines() if "fidelity (top-1)" in x)
    assert "`nvfp4` 0.95 | `kvpress:snapkv:cr=0.72` 0.95 | +0 [" in line
    assert line.endswith("**not distinguishable** |")
    assert "≤ 1/5" not in md
    assert tier(0.5) == "≈ 1/2 of bf16" and tier(0.9) is None
