"""The text families: calibration and report stay apart (sources, phrasings, key words, seeds), each
instance holds its target among distractors at a drawn length, and the Transfer section's numbers."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench import corpus, families, sources, transfer
from kvstrata_lab.bench.families import CALIB, LOW, REPORT
from kvstrata_lab.bench.tasks import KNOWN, make_instance

TOK = byte_tokenizer()
REPORT_SOURCES = {f.source for f in REPORT}
CALIB_TASKS = [t for t in KNOWN if not t.startswith("report")]  # all a tuner or a screening may read


def fixed_parts(template: str) -> list[str]:
    """A template's own words: the text between its fields, 8+ characters long."""
    parts = template.replace("{answer}", "\0").replace("{key}", "\0").split("\0")
    return [p.strip() for p in parts if len(p.strip()) >= 8]


REPORT_PHRASES = {p for f in REPORT for t in f.needles + f.questions + (f.head,) for p in fixed_parts(t)}
REPORT_WORDS = {w for f in REPORT for w in f.modifiers + f.nouns}
REPORT_KEYS = {f"{m} {n}" for f in REPORT for m in f.modifiers for n in f.nouns}


def test_splits_share_no_source_phrasing_or_key_word():
    assert not {f.source for f in CALIB} & REPORT_SOURCES
    calib_phrases = {p for f in CALIB for t in f.needles + f.questions + (f.head,) for p in fixed_parts(t)}
    assert not calib_phrases & REPORT_PHRASES
    assert not {w for f in CALIB for w in f.modifiers + f.nouns} & REPORT_WORDS
    assert len(families.FAMILIES) == len(CALIB) + len(REPORT)


def test_report_text_is_not_calibration_text():
    """No piece of a report source occurs in a calibration source (docstrings copied into the
    calibration code, or the language reference, are dropped)."""
    calib_text = "".join(corpus.units("natural", 0)) + "".join(sources.pieces("code-am", 0))
    calib_pieces = {p for k in ("code-am", "unicode-table") for p in sources.pieces(k, 0)}
    for kind in REPORT_SOURCES:
        got = sources.pieces(kind, 0)
        assert got and not set(got) & calib_pieces
        if kind == "docstrings":
            assert not any(p.strip() in calib_text for p in got)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(task=st.sampled_from(CALIB_TASKS), index=st.integers(0, 500), seed=st.integers(0, 50),
       length=st.integers(900, 1600))
def test_a_calibration_run_never_reaches_report_text_phrasing_or_seed(monkeypatch, task, index, seed, length):
    read, streams = [], []
    real_units, real_random = corpus.units, random.Random
    monkeypatch.setattr(corpus, "units", lambda kind, s=0: read.append(kind) or real_units(kind, s))
    monkeypatch.setattr(families.random, "Random", lambda x=None: streams.append(x) or real_random(x))
    inst = make_instance(task, TOK, length, index, seed)
    assert not set(read) & REPORT_SOURCES
    assert all(not str(s).startswith("report/") for s in streams)
    text = inst.context + "".join(q.text for q in inst.questions)
    assert not [p for p in REPORT_PHRASES if p in text]
    assert not [k for k in REPORT_KEYS if k in text.lower()]  # (a single word like "outer" is prose)


@pytest.mark.parametrize("split", families.SPLITS)
def test_instances_hold_their_target_among_distractors_at_a_drawn_length(split):
    seen, lengths, alike = set(), set(), set()
    for i in range(16):
        inst = make_instance(split, TOK, 1500, i)
        fam = families.FAMILIES[inst.meta["text_family"]]
        assert fam.split == split and inst.meta["source"] == fam.source
        (answer,) = inst.questions[0].answers
        assert inst.context.count(answer) == 1
        assert LOW * 1500 <= inst.meta["tokens"] <= 1500
        seen.add(fam.name)
        lengths.add(inst.meta["tokens"])
        alike.add(inst.meta["lookalike"])
    assert seen == {f.name for f in families.of_split(split)}
    assert len(lengths) > 8 and alike == {True, False}


def test_a_question_leads_into_the_needle_it_asks_about():
    assert families.ask("\nWhen?\nThe {key} is on", "Everyone met on the {key} at {answer}. ") == \
        "\nWhen?\nEveryone met on the {key} at"
    assert families.ask("\nWho?\nOwner of {key}:", "{answer} holds the {key}.") == "\nWho?\nOwner of {key}:"


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="unknown family split 'heldout'"):
        families.of_split("heldout")


def _rows(method, scores, compression=2.0):
    fams = [f.name for f in REPORT]
    return [{"model": "m", "length": 4096, "task": "report", "index": i, "method": method,
             "text_family": fams[i % 4], "score": s, "compression": compression, "kv_bytes_per_token": 1.0,
             "context_tokens": 3000 + i} for i, s in enumerate(scores)]


def test_transfer_counts_per_family_and_names_the_worst():
    ref = _rows("bf16", [1.0] * 16, 1.0)
    same = _rows("same", [1.0] * 16)
    loses = _rows("loses", [0.0 if i % 4 == 2 else 1.0 for i in range(16)])
    found = transfer.comparisons(ref + same + loses)
    by = {c["method"]: c for c in found[("m", 4096, "report")]}
    assert by["same"]["holds"] and by["same"]["lost"] == 0 and by["same"]["pooled"].mean == 0
    lost = by["loses"]
    assert lost["lost"] == 4 and lost["gained"] == 0 and lost["worst"] == REPORT[2].name
    assert not lost["holds"] and lost["per_family"][REPORT[2].name].mean == -1.0
    assert lost["pooled"].mean == pytest.approx(-0.25) and lost["compression"] == 2.0
    md = transfer.markdown(found)
    assert "`report` families, n = 16" in md and "| `loses` | 2.00× | 12 (16) | 4 / 0 |" in md


def test_holds_needs_the_answer_likelihood_where_it_was_measured():
    """Same accuracy as bf16 everywhere, but the answers' likelihood drops: not *holds*; rows without
    the measure (older runs) are judged on accuracy alone."""
    ref = _rows("bf16", [1.0] * 16, 1.0)
    fits, drifts = _rows("fits", [1.0] * 16), _rows("drifts", [1.0] * 16)
    for r in fits:
        r.update(answer_dll=0.0, answer_kl=[0.001, 0.002], answer_tokens=2, answer_same_top=1.0)
    for r in drifts:
        r.update(answer_dll=-0.4 - 0.01 * r["index"], answer_kl=[0.3, 0.5], answer_tokens=2,
                 answer_same_top=0.5)
    found = transfer.comparisons(ref + fits + drifts + _rows("older", [1.0] * 16))
    by = {c["method"]: c for c in found[("m", 4096, "report")]}
    assert by["fits"]["holds"] and by["fits"]["holds_likelihood"] and by["fits"]["kl_mean"] == 0.0015
    assert by["drifts"]["holds_accuracy"] and not by["drifts"]["holds_likelihood"]
    assert not by["drifts"]["holds"] and by["drifts"]["dll"].hi < -0.3 and by["drifts"]["same_top"] == 0.5
    assert by["older"]["holds"] and "dll" not in by["older"]
    md = transfer.markdown(found)
    assert "| 0.0015 / 0.002 | 100% | yes |" in md and "| – | – | – | yes |" in md
