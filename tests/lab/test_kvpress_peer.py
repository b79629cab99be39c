"""kvpress in its own environment (created on first use), fed our instances through the CLI."""

import json

import pytest

from kvstrata.cli import main

pytestmark = pytest.mark.integration


def test_kvpress_presses_run_on_our_instances(tmp_path):
    rc = main(
        [
            "bench", "--model", "smollm2-135m", "--lengths", "1024", "--n", "1", "--tasks",
            "single,fidelity", "--methods", "bf16", "--peers",
            "kvpress:streaming:cr=0.5,kvpress:knorm:cr=0.75", "--out", str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by = {(r["task"], r["method"]): r for r in rows}
    assert len(by) == 6 and not any(r.get("error") for r in rows)
    for task in ("single", "fidelity"):
        ref = by[(task, "bf16")]
        for method, keep in (("kvpress:streaming:cr=0.5", 0.5), ("kvpress:knorm:cr=0.75", 0.25)):
            r = by[(task, method)]
            assert r["peer"].startswith("kvpress 0.5.5 (transformers 5.2.0)")
            assert r["context_tokens"] == ref["context_tokens"]
            assert r["dtype"] == ref["dtype"] == "float32"  # the worker runs the model as the bench's rows do
            # 30 layers x 3 KV heads, each keeping int(n * keep) positions; bytes counted from what is held
            assert r["kv_entries_held"] == 30 * 3 * int(r["context_tokens"] * keep)
            assert r["kv_bytes"] == r["kv_entries_held"] * 64 * 2 * 2
    assert 0 <= by[("fidelity", "kvpress:knorm:cr=0.75")]["top1"] <= 1
    assert by[("fidelity", "kvpress:knorm:cr=0.75")]["kl"] > by[("fidelity", "bf16")]["kl"]
    assert "## Peers, same instances" in (tmp_path / "report.md").read_text()
