"""A tiny-model end-to-end bench run: rows, resumability, costs and the report."""

import json

import pytest

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.report import write_report
from kvstrata_lab.bench.runner import BenchConfig, family, run

METHODS = ("dynamic", "static", "bf16", "nvfp4", "int2:r=8,group=8", "streaming:keep=0.5",
           "snapkv:keep=0.3+fp8")


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory, tiny_gemma):
    out = tmp_path_factory.mktemp("bench")
    cfg = BenchConfig(models=("tiny-gemma",), lengths=(448,), n=2, methods=METHODS, out=out)
    run(cfg, load_model=lambda name: (tiny_gemma, byte_tokenizer()))
    return out, cfg


def rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_one_row_per_cell_and_method(bench_dir):
    out, cfg = bench_dir
    rs = rows(out)
    assert len(rs) == len(cfg.tasks) * cfg.n * len(METHODS)
    for r in rs:
        assert r["kv_bytes"] > 0 and r["prefill_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["linear"] == "torch"  # tiny_gemma's linears were not installed on the kernel
        assert r["compression"] == pytest.approx(r["bf16_bytes_per_token"] / r["kv_bytes_per_token"])
        if r["task"] == "fidelity":
            assert 0 <= r["top1"] <= 1 and r["kl"] >= -1e-6
        else:
            assert r["failure"] in (None, "retrieval", "reasoning")
    bf16 = [r for r in rs if r["method"] == "bf16" and r["task"] == "fidelity"]
    assert all(r["kl"] < 1e-3 for r in bf16)
    # the stock row: transformers' DynamicCache at the model's dtype (float32 here: 2x bf16's bytes)
    dyn = [r for r in rs if r["method"] == "dynamic"]
    assert all(r["compression"] == pytest.approx(0.5) for r in dyn)
    assert all(r["kl"] == 0 and r["top1"] == 1 for r in dyn if r["task"] == "fidelity")
    assert all(r["decode_s_per_token"] > 0 for r in dyn if r["task"] == "single")
    # the fast stock row (StaticCache, preallocated; tiny Gemma-3's sliding layers passed their
    # 16-token window) answers as the DynamicCache does
    static = {(r["task"], r["index"]): r for r in rs if r["method"] == "static"}
    assert len(static) == len(dyn)
    for r in dyn:
        s = static[(r["task"], r["index"])]
        assert s["family"] == "reference" and s["kv_bytes"] >= r["kv_bytes"]  # its room is held too
        if r["task"] == "fidelity":
            assert s["top1"] == 1 and s["kl"] < 1e-6
        else:
            assert s["output"] == r["output"]
    evict = [r for r in rs if r["method"] == "streaming:keep=0.5" and r["task"] == "single"]
    ref = [r for r in rs if r["method"] == "bf16" and r["task"] == "single"]
    assert evict[0]["kv_bytes"] < ref[0]["kv_bytes"]


def test_rows_of_one_run_of_a_cell_share_a_run_id_and_other_cells_do_not(bench_dir):
    out, cfg = bench_dir
    by_cell = {}
    for r in rows(out):
        by_cell.setdefault((r["task"], r["index"]), set()).add(r["run"])
    assert all(len(ids) == 1 for ids in by_cell.values())  # one prefill: every method's timing pairs
    assert len(set().union(*by_cell.values())) == len(by_cell)  # never across cells


def test_resume_skips_finished_cells(bench_dir, tiny_gemma):
    out, cfg = bench_dir
    before = (out / "results.jsonl").read_text()
    calls = []
    run(cfg, load_model=lambda name: calls.append(name) or (tiny_gemma, byte_tokenizer()))
    assert (out / "results.jsonl").read_text() == before and calls == []


def test_report_outputs(bench_dir):
    out, _ = bench_dir
    md = write_report(out).read_text()
    assert "| `nvfp4` |" in md and "tiny-gemma" in md
    assert "## Quality per byte" in md and (out / "frontier_tiny-gemma_448.png").exists()
    assert "## Decode speed" in md and "| `dynamic` |" in md
    assert (out / "plot_tiny-gemma_448.png").stat().st_size > 1000
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "data:image/png;base64," in html


def test_families():
    assert family("bf16") == "reference" and family("dynamic") == "reference"
    assert family("int2") == "quantization"
    assert family("snapkv:keep=0.3") == "eviction"
    assert family("streaming:keep=0.3+nvfp4") == "eviction+quant"
    assert family("depth:g=4+nvfp4") == "depth"


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, tiny_gemma):
    out = tmp_path_factory.mktemp("families")
    cfg = BenchConfig(models=("tiny-gemma",), lengths=(640,), n=4, tasks=("report", "report-reason"),
                      methods=("dynamic", "static", "bf16", "int2:r=8,group=8"), out=out)
    run(cfg, load_model=lambda name: (tiny_gemma, byte_tokenizer()))
    return out


def test_family_rows_carry_the_answer_likelihood_against_bf16(family_dir, bench_dir):
    """Every family row of ours and the stock rows: the reference answer's log-likelihood paired with
    bf16's cache of the same context; bf16 against itself is exactly nothing, a lossy cache is not.
    The RULER rows (the quick bench's) do without: they stay as fast as they were."""
    qs = rows(family_dir)
    assert {r["task"] for r in qs} == {"report", "report-reason"} and len(qs) == 2 * 4 * 4
    for r in qs:
        assert r["answer_tokens"] == len(r["answer_kl"]) >= 1
        assert r["answer_dll"] == pytest.approx((r["answer_ll"] - r["answer_ll_bf16"]) / r["answer_tokens"])
        assert min(r["answer_kl"]) >= 0 and 0 <= r["answer_same_top"] <= 1
        if r["method"] == "bf16":
            assert r["answer_dll"] == 0 and r["answer_kl_mean"] == 0 and r["answer_same_top"] == 1
    lossy = [r["answer_kl_mean"] for r in qs if r["method"] == "int2:r=8,group=8"]
    assert min(lossy) > 0  # 2-bit codes move the answer's distributions (a tiny random model: barely)
    dense = {(r["task"], r["index"]): r["answer_ll"] for r in qs if r["method"] == "dynamic"}
    static = {(r["task"], r["index"]): r["answer_ll"] for r in qs if r["method"] == "static"}
    assert dense.keys() == static.keys() and all(
        abs(dense[k] - static[k]) < 1e-3 for k in dense)  # the two stock caches hold the same K/V
    assert not any("answer_dll" in r for r in rows(bench_dir[0]))


def test_likelihood_compare_on_planted_distributions():
    import torch

    from kvstrata_lab.bench.likelihood import compare

    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]]), -1)
    target = torch.tensor([0, 1])
    same = compare((ref, target), (ref.clone(), target))
    assert same["answer_dll"] == 0 and same["answer_kl_mean"] == 0 and same["answer_same_top"] == 1
    flat = torch.log_softmax(torch.zeros(2, 3), -1)  # uniform: log 3 per token
    d = compare((ref, target), (flat, target))
    assert d["answer_ll"] == pytest.approx(2 * -torch.log(torch.tensor(3.0)).item())
    assert d["answer_dll"] == pytest.approx((d["answer_ll"] - ref[[0, 1], [0, 1]].sum().item()) / 2)
    assert d["answer_kl_mean"] > 0 and d["answer_same_top"] == 0.5  # uniform's top: token 0, as row 0's
