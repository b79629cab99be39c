"""bf16-weight answers paired with float32's (lab/kvstrata_lab/bench/dtype_compare.py)."""

from __future__ import annotations

import json

import pytest

from kvstrata_lab.bench.dtype_compare import compare, main, render


def _row(dtype, index, method, score, output, ll, task="report"):
    return {"dtype": dtype, "task": task, "index": index, "method": method, "score": score, "output": output,
            "answer_ll": ll}


def test_pairs_rows_by_task_instance_and_method():
    a = [_row("bf16", 0, "bf16", 1.0, " June 13.", -0.01), _row("bf16", 1, "bf16", 0.0, " 7", -0.5),
         _row("bf16", 2, "bf16", 1.0, " x", -0.1)]  # instance 2 has no float32 twin: not paired
    b = [_row("float32", 0, "bf16", 1.0, " June 13.", -0.02), _row("float32", 1, "bf16", 1.0, " 8", -0.2)]
    (s,) = compare(a, b)
    assert (s["n"], s["right_bf16"], s["right_float32"], s["same_output"]) == (2, 1.0, 2.0, 1)
    assert s["flips"] == ["report#1: 0 -> 1"]
    assert s["dll_mean"] == pytest.approx((-0.01 + 0.3) / 2) and s["dll_min"] == pytest.approx(-0.01)
    assert "report#1: 0 -> 1" in render([s])


def test_rows_of_the_other_dtype_are_not_paired(tmp_path, capsys):
    rows = [_row("float32", 0, "bf16", 1.0, "a", -0.1)]
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path / "x"), str(tmp_path / "y")]) == 2  # both float32: nothing to compare
    assert "no (task, instance, method)" in capsys.readouterr().err
