"""The depth-sharing ablation: bench rows carry the probe's head decisions, the report section
renders each knob, and the frontier picks the most compressed method within the slack."""

import json

import pytest

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench import depth_ablation
from kvstrata_lab.bench.report import write_report
from kvstrata_lab.bench.runner import run

METHODS = ("bf16", "depth:g=2,f=1,mode=shared", "depth:g=2,f=1,r=0.05,tol=0.3", "depth:g=4,f=1,mode=exact")


@pytest.fixture(scope="module")
def ablation_dir(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("ablation")
    cfg = depth_ablation.config("tiny-llama", 256, 1, out, METHODS)
    run(cfg, load_model=lambda name: (tiny_llama, byte_tokenizer()))
    return out


def _rows(out):
    return [
        json.loads(line) for line in (out / depth_ablation.SUBDIR / "results.jsonl").read_text().splitlines()
    ]


def test_rows_carry_head_modes(ablation_dir, tiny_llama):
    rows = _rows(ablation_dir)
    assert {r["task"] for r in rows} == set(depth_ablation.TASKS)
    heads = tiny_llama.config.num_key_value_heads
    groups_g2 = tiny_llama.config.num_hidden_layers // 2
    by = {(r["method"], r["task"]): r for r in rows}
    shared = by[("depth:g=2,f=1,mode=shared", "single")]
    assert shared["head_modes"] == {"shared": heads * groups_g2}
    assert by[("depth:g=4,f=1,mode=exact", "fidelity")]["head_modes"] == {"exact": heads}
    probed = by[("depth:g=2,f=1,r=0.05,tol=0.3", "single")]["head_modes"]
    assert sum(probed.values()) == heads * groups_g2
    groups = by[("depth:g=2,f=1,mode=shared", "fidelity")]["head_mode_map"]
    assert groups == [
        {"layers": [0, 1], "modes": ["shared"] * heads}, {"layers": [2, 3], "modes": ["shared"] * heads},
    ]
    assert "head_modes" not in by[("bf16", "single")]
    # sharing 2 layers in 1 (bf16 coefficients) holds about half of bf16's bytes; exact holds them all
    assert shared["kv_bytes"] < 0.6 * by[("bf16", "single")]["kv_bytes"]
    assert by[("depth:g=4,f=1,mode=exact", "single")]["kv_bytes"] >= by[("bf16", "single")]["kv_bytes"]


def test_report_section(ablation_dir):
    md = write_report_of(ablation_dir)
    assert "## FreqDepthKV ablation" in md
    section = md.split("## FreqDepthKV ablation")[1]
    line = next(x for x in section.splitlines() if x.startswith("| `depth:g=2,f=1,mode=shared`"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:8] == ["2", "1", "–", "–", "–", "shared", "bf16"]
    assert cells[-1] == "4 / 0 / 0"  # 2 heads x 2 groups, all shared
    png = out_png(ablation_dir)
    assert png.stat().st_size > 1000 and f"({depth_ablation.SUBDIR}/{png.name})" in md
    assert (
        "Most compressed method that shares depth (some head not exact) with single-needle retrieval "
        "within 1 point(s) of bf16"
        in md
    )
    assert "Most compressed method here with single-needle retrieval within 2 point(s) of bf16" in md


def out_png(out):
    return out / depth_ablation.SUBDIR / "head_modes_tiny-llama_256.png"


def write_report_of(out):
    # the section renders inside the main report when a bench ran into the same directory
    (out / "results.jsonl").write_text((out / depth_ablation.SUBDIR / "results.jsonl").read_text())
    return write_report(out).read_text()


def test_frontier_picks_most_compressed_within_slack():
    ref = {"per_task": {"single": 1.0}, "compression": 1.0}
    methods = {
        "bf16": ref, "a": {"per_task": {"single": 1.0}, "compression": 2.0},
        "b": {"per_task": {"single": 0.995}, "compression": 3.0},
        "c": {"per_task": {"single": 0.5}, "compression": 8.0}, "d": {"per_task": {}, "compression": 9.0},
    }
    assert depth_ablation.frontier(methods, ref, 0.01)[0] == "b"
    assert depth_ablation.frontier(methods, ref, 0.0)[0] == "a"
    assert depth_ablation.frontier({"bf16": ref, "c": methods["c"]}, ref, 0.01) is None
