"""The reasoning families: each instance holds the facts its step needs (in order, for a track), asks
one probe per needed fact, keeps calibration and report apart, and tags a wrong answer from its probes."""

import pytest

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench import reasoning
from kvstrata_lab.bench.families import LOW
from kvstrata_lab.bench.tasks import make_instance, tag_failure

TOK = byte_tokenizer()


@pytest.mark.parametrize("split", reasoning.SPLITS)
def test_instances_hold_the_facts_their_step_needs(split):
    kinds = set()
    for i in range(12):
        inst = make_instance(split, TOK, 1400, i)
        kind = inst.meta["reason_kind"]
        kinds.add(kind)
        main, *probes = inst.questions
        assert main.role == "main" and [p.role for p in probes] == ["probe", "probe"]
        assert LOW * 1400 <= inst.meta["tokens"] <= 1400
        for p in probes:  # every probe's answer is written in the context
            assert p.answers[0] in inst.context
        a, b = (int(p.answers[0]) if p.answers[0].isdigit() else None for p in probes)
        if kind == "sum":
            assert int(main.answers[0]) == a + b
        if kind == "larger":
            assert int(main.answers[0]) == max(a, b)
        if kind == "two-hop":
            assert main.answers == probes[1].answers and probes[0].answers[0] in probes[1].text
        if kind == "track":  # first value, then the copy, then the reassignment: in this order
            var = probes[1].answers[0]
            copy = main.text.rsplit("\n", 1)[1].removesuffix(" ==")
            first = inst.context.index(f"{var} = {main.answers[0]}")
            assert first < inst.context.index(f"{copy} = {var}") < inst.context.rindex(f"{var} = ")
    assert kinds == set(reasoning.KINDS)
    again = make_instance(split, TOK, 1400, 5)
    assert again.context == make_instance(split, TOK, 1400, 5).context  # deterministic


def test_splits_share_no_words_or_sources():
    calib, report = reasoning.WORDS["calib-reason"], reasoning.WORDS["report-reason"]
    for field in ("things", "people", "places", "variables"):
        assert not set(getattr(calib, field)) & set(getattr(report, field)), field
    assert not set(calib.sources) & set(report.sources) and calib.head != report.head


def test_a_wrong_answer_is_tagged_from_its_probes():
    assert tag_failure(1.0, [0.0, 1.0], "report-reason") is None
    assert tag_failure(0.0, [1.0, 1.0], "report-reason") == "reasoning"
    assert tag_failure(0.0, [1.0, 0.0], "calib-reason") == "retrieval"
    with pytest.raises(ValueError, match="unknown reasoning split"):
        reasoning.draw("report", 1000, 0)


def test_the_report_counts_a_kind_only_where_bf16_answers_it():
    from kvstrata_lab.bench import reason_report

    def rows(method, right):  # 8 instances per kind; `right(kind, i)` -> (score, failure)
        out = []
        for k, kind in enumerate(reasoning.KINDS):
            for i in range(8):
                score, failure = right(kind, i)
                out.append({"model": "m", "length": 4096, "task": "report-reason", "index": 4 * i + k,
                            "reason_kind": kind, "method": method, "score": score, "failure": failure})
        return out

    # bf16: every kind but `sum` (2 of 8 right: below 60 %)
    ref = rows("bf16", lambda kind, i: (1.0, None) if kind != "sum" or i < 2 else (0.0, "reasoning"))
    lossy = rows("lossy", lambda kind, i: (0.0, "retrieval") if kind == "two-hop" and i < 4 else
                 (1.0, None) if kind != "sum" else (0.0, "reasoning"))
    found = reason_report.tables(ref + lossy)[("m", 4096, "report-reason")]
    assert found["counts"] == {"two-hop": True, "larger": True, "sum": False, "track": True}
    by = {m["method"]: m for m in found["methods"]}
    assert by["lossy"]["retrieval"] == 4 and by["lossy"]["reasoning"] == 8
    assert by["lossy"]["delta"].mean == pytest.approx(-0.5 / 3) and by["lossy"]["delta"].n == 24
    md = reason_report.markdown({("m", 4096, "report-reason"): found})
    assert "counting: two-hop, larger, track" in md
    assert "| `lossy` | 32 | 50% | 100% | (0%) | 100% | 4 / 8 |" in md
