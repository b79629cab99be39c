"""`kvstrata serve-bench` end to end on a tiny model with a chat template (two real server processes,
store on and off): its results. Bad flags of `serve` / `serve-bench` are rows of tests/test_cli_inputs.py."""

import json

from kvstrata.cli import main


def test_serve_bench_on_a_tiny_model(model_dirs, tmp_path, capsys):
    out = tmp_path / "results"
    assert (
        main(
            [
                "serve-bench", "--model", model_dirs["gemma"], "--clients", "2", "--turns", "3",
                "--context", "64", "--tool-tokens", "24", "--max-tokens", "4", "--probe-tokens", "0",
                "--check", "2", "--block-size", "16", "--duration", "120", "--out", str(out),
            ]
        )
        == 0
    )
    result = json.loads((out / "serve_bench.json").read_text())
    on, off = (result["phases"][p]["records"] for p in ("store", "no_store"))
    assert len(on) == len(off) == 6 and not any(r["error"] for r in on + off)
    assert [r["kind"] for r in on if r["turn"] == 1] == ["miss", "miss"]
    assert all(r["kind"] == "hit" and r["cached_tokens"] > 0 for r in on if r["turn"] > 1)
    assert all(r["kind"] == "miss" and r["cached_tokens"] == 0 for r in off)
    s = result["summary"]
    assert s["check"] == {"checked": 2, "differ": 0} and s["targets"]["0 errors"] is True
    assert s["phases"]["store"]["hit_rate_later_turns"] == 1.0
    assert (out / "serve_bench.png").stat().st_size > 0 and "| store |" in (
        out / "serve_bench.md"
    ).read_text()
