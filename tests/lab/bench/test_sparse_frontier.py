"""The sparse-read frontier section and the report's same-instance reference rows, on hand-made rows."""

from kvstrata_lab.bench import sparse_frontier
from kvstrata_lab.bench.report import markdown
from kvstrata_lab.bench.results import ReportInput, summarise


def row(method, index, score, read, task="single", family=None, length=8192):
    fam = family or ("reference" if method == "bf16" else "sparse-read")
    return {
        "model": "m", "length": length, "task": task, "index": index, "method": method, "family": fam,
        "score": score, "bytes_read_per_step": read, "kv_bytes_per_token": 100.0, "compression": 1.0,
        "failure": None, "prefill_s": 1.0, "compress_s": 0.0, "decode_s_per_token": 0.1, "peak_rss_mb": 1.0,
        "kind": "retrieval",
    }


ROWS = (
    [row("bf16", i, 1.0, 1000.0) for i in range(5)]
    + [row("topk:k=512,schedule=F1", i, 1.0, 200.0) for i in range(3)]
    + [row("topk:k=64,schedule=F1,indexer=lowrank,rank=16", i, 1.0, 80.0) for i in range(3)]
    + [row("topk:k=512,schedule=F1U3", i, 0.0, 90.0) for i in range(3)]
)


def test_points_compare_on_the_same_instances_and_find_the_frontier(tmp_path):
    pts = {p["method"]: p for p in sparse_frontier.points(ROWS)[("m", 8192)]}
    assert pts["topk:k=512,schedule=F1"]["read"] == 0.2 and pts["topk:k=512,schedule=F1"]["n"] == 3
    assert pts["topk:k=64,schedule=F1,indexer=lowrank,rank=16"]["indexer"] == "lowrank r=16"
    assert [m for m, p in pts.items() if p["frontier"]] == ["topk:k=64,schedule=F1,indexer=lowrank,rank=16"]
    md = sparse_frontier.report_section(ReportInput(tmp_path, ROWS))
    assert "target met: `topk:k=64,schedule=F1,indexer=lowrank,rank=16` (8.0% read)" in md
    assert (tmp_path / "sparse_m_8192.png").stat().st_size > 1000


def test_verdict_names_the_least_read_within_one_point_when_the_target_is_missed():
    rows = [r for r in ROWS if "lowrank" not in r["method"]]
    pts = sparse_frontier.points(rows)[("m", 8192)]
    assert (
        sparse_frontier.verdict(pts, 8192)
        == "target not met: the least read within 1 point of bf16 is `topk:k=512,schedule=F1` at 20.0%."
    )
    assert sparse_frontier.report_section(ReportInput(None, [r for r in ROWS if r["method"] == "bf16"])) == ""


def test_methods_on_fewer_instances_get_the_reference_on_those_instances():
    rows = [row("bf16", i, float(i < 3), 1000.0, family="reference") for i in range(5)] + [
        row("nvfp4", i, 1.0, 300.0, family="quantization") for i in range(3)
    ]
    s = summarise(rows)[("m", 8192)]
    assert s["methods"]["bf16"]["n"] == 5 and s["methods"]["bf16"]["retrieval"] == 0.6
    assert s["methods"]["bf16 (first 3)"]["n"] == 3 and s["methods"]["bf16 (first 3)"]["retrieval"] == 1.0
    assert s["methods"]["nvfp4"]["n"] == 3
    assert "| `bf16 (first 3)` | reference | 3 |" in markdown(summarise(rows))
