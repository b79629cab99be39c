"""What the report derives from rows: bytes and ×smaller from the same rows, speed only within a run."""

import pytest

from kvstrata_lab.bench import frontier
from kvstrata_lab.bench.results import ReportInput, summarise
from kvstrata_lab.bench.speed import headline, ratios

BF16 = 23040.0


def row(method, task, index, bytes_per_token=BF16, decode=None, run=None, prefill=1.0, score=1.0):
    r = {
        "model": "m", "length": 4096, "task": task, "index": index, "method": method, "family": "x",
        "context_tokens": 4096, "kv_bytes_per_token": bytes_per_token, "compression": BF16 / bytes_per_token,
        "score": score, "failure": None, "prefill_s": prefill, "compress_s": 0.0,
        "decode_s_per_token": decode, "bytes_read_per_step": bytes_per_token * 4096, "peak_rss_mb": 1.0,
    }
    if task == "fidelity":
        r.update(kl=0.01, top1=0.9, ppl=2.0, ref_ppl=2.0)
    if run is not None:
        r["run"] = run
    return r


def test_bytes_and_times_smaller_come_from_the_same_rows():
    # a method holding more per token on the question rows (its newest tokens wait in bf16) than on
    # the fidelity rows: both columns must describe the question rows
    rows = [row("bf16", t, i) for t in ("single", "fidelity") for i in range(2)]
    rows += [row("kivi", "single", i, 7000.0) for i in range(2)]
    rows += [row("kivi", "fidelity", i, 6480.0) for i in range(2)]
    s = summarise(rows)[("m", 4096)]["methods"]["kivi"]
    assert s["kv_bytes_per_token"] == pytest.approx(7000.0)
    assert s["compression"] == pytest.approx(BF16 / 7000.0)
    # a method that ran only fidelity rows is costed on those
    only = summarise([row("bf16", "fidelity", 0), row("fp8", "fidelity", 0, 12240.0)])
    assert only[("m", 4096)]["methods"]["fp8"]["compression"] == pytest.approx(BF16 / 12240.0)


def test_speed_divides_times_of_one_run_only():
    rows = [
        # cell 0: one run holds both -> paired
        row("dynamic", "single", 0, decode=0.10, run="a"), row("x", "single", 0, decode=0.20, run="a"),
        # cell 1: x was added later, in another run -> not paired with that dynamic row
        row("dynamic", "single", 1, decode=0.10, run="b"), row("x", "single", 1, decode=0.90, run="c"),
    ]
    e = ratios(rows)[("m", 4096)]["x"]
    assert e["n"] == 2 and e["n dynamic"] == 1
    assert e["dynamic"] == pytest.approx(2.0)
    # only another run's reference: no ratio at all
    assert ratios(rows[2:])[("m", 4096)]["x"]["dynamic"] is None


def test_the_fastest_stock_row_is_the_bar_cell_by_cell():
    rows = [
        # cell 0: static beats dynamic; cell 1: only dynamic ran
        row("dynamic", "single", 0, decode=0.10, run="a"), row("static", "single", 0, decode=0.08, run="a"),
        row("x", "single", 0, decode=0.12, run="a"),
        row("dynamic", "single", 1, decode=0.10, run="b"), row("x", "single", 1, decode=0.05, run="b"),
    ]
    table = ratios(rows)[("m", 4096)]
    assert "stock" not in table  # a reference, not a row
    assert table["x"]["n stock"] == 2 and table["x"]["stock"] == pytest.approx((0.12 + 0.05) / (0.08 + 0.10))
    assert table["static"]["stock"] == pytest.approx(1.0)
    assert table["dynamic"]["stock"] == pytest.approx(0.20 / 0.18)


def test_the_headline_times_decode_against_the_fastest_stock_row_of_its_speed_run():
    # quality from the big run (no static row there), times from a speed run that ran static beside dynamic
    big = [row(m, "single", i, b, decode=d, run="q") for i in range(4)
           for m, b, d in (("dynamic", 2 * BF16, 0.10), ("bf16", BF16, 0.09), ("nvfp4", BF16 / 4, 0.20))]
    fast = [row(m, "single", i, decode=d, run=f"s{i}") for i in range(2)
            for m, d in (("dynamic", 0.10), ("static", 0.05), ("bf16", 0.06), ("nvfp4", 0.07))]
    summary, key = summarise(big), ("m", 4096)
    own = headline(summary, big, [key])
    assert "decode ×fastest stock" in own
    assert "| `nvfp4` | 4.00 / 1.00 / 2.00 |" in own  # only dynamic ran there
    timed = headline(summary, big, [key], decode_rows=fast)
    assert "| `nvfp4` | 4.00 / 1.00 / 1.40 |" in timed and "| `dynamic` | 0.50 / 1.00 / 2.00 |" in timed
    assert "`static`" not in timed  # a speed-only row has no quality here: not a headline row
    # a speed run that never timed a method leaves its decode cell empty, not borrowed from elsewhere
    assert "| `nvfp4` | 4.00 / 1.00 / – |" in headline(summary, big, [key], decode_rows=fast[:3])


def test_rows_without_run_ids_pair_by_their_shared_prefill():
    # rows written before run ids: one run of a cell shares its prefill time, another run does not
    rows = [
        row("dynamic", "single", 0, decode=0.10, prefill=5.25),
        row("x", "single", 0, decode=0.30, prefill=5.25),
        row("x", "single", 1, decode=0.05, prefill=6.5),
        row("dynamic", "single", 1, decode=0.10, prefill=7.0),
    ]
    e = ratios(rows)[("m", 4096)]["x"]
    assert e["n dynamic"] == 1 and e["dynamic"] == pytest.approx(3.0)


def test_the_frontier_ranks_only_rows_scored_on_every_reference_question(tmp_path):
    rows = [row("bf16", "single", i, score=float(i % 4 != 0)) for i in range(8)]  # 0.75
    # on 2 of the 8 instances only, both answered: retrieval 1.00 at few bytes, yet not comparable
    rows += [row("lucky", "single", i, 3000.0, score=1.0) for i in (1, 2)]
    rows += [row("full", "single", i, 6000.0, score=float(i % 4 != 0)) for i in range(8)]
    given = ReportInput(tmp_path, rows, summarise(rows))
    pts = {p["method"]: p for p in frontier.points(given)[("m", 4096)]}
    assert pts["full"]["ranked"] and pts["full"]["frontier"]
    assert not pts["lucky"]["ranked"] and not pts["lucky"]["frontier"]
    assert pts["lucky"]["delta"].n == 2  # still paired with bf16 on its own instances
    # the 6x target (<= 3,840 B/token) holds only the unranked row: nothing is judged there; 8x holds
    # nothing at all
    lines = frontier.target_lines(list(pts.values()))
    assert any(line.startswith("- 6×") and "not judged" in line and "(1, `n ≠`)" in line for line in lines)
    assert any(line.startswith("- 8×") and "no method measured" in line for line in lines)
    md = frontier.report_section(given)
    assert "| `lucky` |" in md and "| n ≠ |" in md and (tmp_path / "frontier_m_4096.png").exists()


def test_a_row_on_more_instances_than_the_reference_is_not_ranked(tmp_path):
    # its retrieval would average questions bf16 never answered
    rows = [row("bf16", "single", i, score=1.0) for i in range(2)]
    rows += [row("more", "single", i, 6000.0, score=1.0) for i in range(4)]
    pts = {p["method"]: p for p in frontier.points(ReportInput(tmp_path, rows, summarise(rows)))[("m", 4096)]}
    assert not pts["more"]["ranked"] and pts["more"]["delta"].n == 2


def test_a_row_one_byte_over_a_target_does_not_meet_it(tmp_path):
    # 6x on bf16's 23,040 B/token is 3,840 B/token: a perfect row 1 B/token over is not at those bytes
    def six_line(rows):
        pts = frontier.points(ReportInput(tmp_path, rows, summarise(rows)))[("m", 4096)]
        [line] = [line for line in frontier.target_lines(pts) if line.startswith("- 6×")]
        return line

    rows = [row("bf16", "single", i) for i in range(4)]
    rows += [row("over", "single", i, 3841.0) for i in range(4)]
    assert "no method measured" in six_line(rows)
    rows += [row("at", "single", i, 3840.0) for i in range(4)]
    assert "met by `at`" in six_line(rows)
