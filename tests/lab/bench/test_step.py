"""`kvstrata step-bench` on the tiny model: both row counts timed, the profile taken, files written."""

import json

from kvstrata.models import loader
from kvstrata_lab.bench import step


def test_step_bench_times_both_row_counts_and_profiles_the_batched_step(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(step, "load", lambda *a: loaded.append(loader.load(*a)) or loaded[-1])
    md = step.run("tiny-llama", ["bf16", "nvfp4"], rows=3, prompt=20, rounds=2, steps=2, out=tmp_path,
                  python_encode=True, torch_linear=True)
    rows = json.loads((tmp_path / "tiny-llama.json").read_text())
    assert [r["method"] for r in rows] == ["bf16", "nvfp4", "nvfp4 (PyTorch encode)", "bf16 (torch linear)",
                                           "nvfp4 (torch linear)"]
    for r in rows:
        assert len(r["rounds"]["1"]) == len(r["rounds"]["3"]) == 2
        assert r["ms_1"] > 0 and r["ms_3"] > 0
        assert abs(r["tokens_per_s_ratio"] - 3 * r["ms_1"] / r["ms_3"]) < 1e-9
        assert "function calls" in r["profile"] and "tottime" in r["profile"]
    text = md.read_text()
    assert "| `nvfp4` |" in text and "3-row step's profile" in text
    from kvstrata.codecs import nvfp4

    assert nvfp4._native.__name__ == "_native"  # the C++ encode is back after the PyTorch-encode cell
    from kvstrata.hf import linear

    if linear.kernel() is not None:  # and the kernel's linears after the torch-linear cells
        model, _ = loaded[0]
        installed = [m for m in model.modules() if isinstance(m, linear.RowsLinear)]
        assert installed and all(m._rows for m in installed)
