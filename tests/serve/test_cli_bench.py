"""`kvstrata serve` refuses bad settings before loading anything; `kvstrata serve-bench` runs end to
end on a tiny model (two real server processes, store on and off) and writes its results."""

import json

import pytest

from kvstrata.cli import main


@pytest.mark.parametrize("argv, words", [
    (["--model", "/nonexistent/model"], "neither a known model"),
    (["--model", "smollm2-135m", "--method", "fp5"], "unknown method 'fp5'"),
    (["--model", "smollm2-135m", "--port", "0"], "port must be in 1..65535"),
    (["--model", "smollm2-135m", "--max-active", "0"], "max_active must be >= 1"),
    (["--model", "smollm2-135m", "--api-key-file", "/nonexistent/keys"], "/nonexistent/keys"),
])
def test_serve_refuses_bad_settings_with_exit_2(capsys, argv, words):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstrata: error:") and words in err and "Traceback" not in err


def test_serve_refuses_an_api_key_file_without_keys(tmp_path, capsys):
    (tmp_path / "keys").write_text("# nothing yet\n\n")
    assert main(["serve", "--model", "smollm2-135m", "--api-key-file", str(tmp_path / "keys")]) == 2
    assert "holds no keys" in capsys.readouterr().err


def test_serve_bench_on_a_tiny_model(model_dirs, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["serve-bench", "--model", model_dirs["gemma"], "--clients", "2", "--turns", "3", "--context", "64",
                 "--tool-tokens", "24", "--max-tokens", "4", "--probe-tokens", "0", "--check", "2", "--block-size", "16",
                 "--duration", "120", "--out", str(out)]) == 0
    result = json.loads((out / "serve_bench.json").read_text())
    on, off = (result["phases"][p]["records"] for p in ("store", "no_store"))
    assert len(on) == len(off) == 6 and not any(r["error"] for r in on + off)
    assert [r["kind"] for r in on if r["turn"] == 1] == ["miss", "miss"]
    assert all(r["kind"] == "hit" and r["cached_tokens"] > 0 for r in on if r["turn"] > 1)
    assert all(r["kind"] == "miss" and r["cached_tokens"] == 0 for r in off)
    s = result["summary"]
    assert s["check"] == {"checked": 2, "differ": 0} and s["targets"]["0 errors"] is True
    assert s["phases"]["store"]["hit_rate_later_turns"] == 1.0
    assert (out / "serve_bench.png").stat().st_size > 0 and "| store |" in (out / "serve_bench.md").read_text()
