"""`kvstrata sparse-recall` on the tiny random Gemma-3: a read that keeps everything recalls all of
attention; every number is a share; the needle flag follows the positions the selection read; and
the benchmark's tag for a failure whose needle no selection held."""

import pytest
import torch

from kvstrata.methods import parse_method
from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.needles import (
    SELECTION_MISSED,
    PickLog,
    answer_spans,
    holds,
    selected_share,
    selection_cause,
)
from kvstrata_lab.bench.sparse_recall import _scores, measure, needle_prompt, read_config, summarise
from kvstrata_lab.bench.tasks import Question

SHARES = ("recall", "mass", "needle_attention")


@pytest.fixture(scope="module")
def prompt():
    return needle_prompt(byte_tokenizer(), "single", 400, 0)


def test_the_prompt_places_the_answer_where_its_spans_say(prompt):
    tok = byte_tokenizer()
    (spans,) = prompt.spans
    assert len(spans) == 2  # the pass key's needle states it twice
    answer = tok.decode(prompt.ids[0, spans[0]])
    assert answer == tok.decode(prompt.ids[0, spans[1]]) and len(answer) == 5 and answer.isdigit()
    assert prompt.ids.shape[1] <= 400 and prompt.queries == 6  # " " + 5 digits, teacher-forced


def test_a_read_of_everything_recalls_everything(tiny_gemma, prompt):
    cfg = read_config(f"topk:k={prompt.ids.shape[1]},schedule=F1,indexer=lowrank,rank=16")
    records, trace = measure(tiny_gemma, prompt, cfg, chunk=128)
    assert records and {r["layer"] for r in records} == {2}  # the tiny Gemma's one full-attention layer
    assert all(r["recall"] == 1.0 and r["mass"] == pytest.approx(1.0, abs=1e-5) for r in records)
    assert all(r["needle_selected"] and r["needle_in_true_top"] for r in records)
    assert set(trace) == {2}


def test_a_small_k_gives_shares_in_0_1(tiny_gemma, prompt):
    cfg = read_config("topk:k=16,schedule=F1,indexer=lowrank,rank=16,window=8")
    records, _ = measure(tiny_gemma, prompt, cfg)
    assert len(records) == prompt.queries * 2  # queries x KV heads
    assert all(0.0 <= r[s] <= 1.0 for r in records for s in SHARES)
    assert all(r["k"] == 16 for r in records)
    summary = summarise([dict(r, length=400) for r in records])
    assert [(s["length"], s["layer"], s["n"]) for s in summary] == [(400, 2, len(records))]
    assert summary[0]["recall_min"] <= summary[0]["recall_mean"] <= 1.0


def test_the_needle_flag_follows_the_selection():
    cfg = read_config("topk:k=4,sinks=1,window=2")
    spans = [[[10, 11]]]
    attn = torch.full((1, 2, 20), 1 / 20)
    # head 0 reads the planted needle (positions 10 and 11), head 1 only half of it
    idx = torch.tensor([[[0, 3, 10, 11, 12, 18, 19], [0, 3, 5, 11, 12, 18, 19]]])
    got = _scores(cfg, idx, attn, spans, 20, 0, 5, "F")
    assert [r["needle_selected"] for r in got] == [True, False]
    assert all(r["needle_attention"] == pytest.approx(2 / 20) for r in got)
    assert all(r["mass"] == pytest.approx(7 / 20) for r in got)
    assert holds(idx, [[11], [3, 5]]).tolist() == [[True, True]]  # either occurrence will do


def test_the_method_must_be_a_plain_topk_read():
    for bad in ("bf16", "nvfp4+topk:k=64", "streaming:keep=0.5+topk:k=64"):
        with pytest.raises(ValueError, match="top-k read over the bf16 store"):
            read_config(bad)


def test_answer_spans_are_token_positions():
    tok = byte_tokenizer()
    spans = answer_spans(tok, "ab 123 cd 123", ["123", "77"])
    assert spans == [[[3, 4, 5], [10, 11, 12]], []]


def test_the_bench_tags_a_failure_whose_needle_no_selection_held(tiny_gemma):
    tok = byte_tokenizer()
    log = PickLog()
    log[2] = torch.tensor([[[0, 1, 2], [0, 3, 4]]])
    log[2] = torch.tensor([[[0, 1, 2], [0, 1, 2]]])
    assert list(log) == [2] and len(log.steps) == 2
    assert selected_share(log.steps, [[[3, 4]], [[9]]]) == [0.25, 0.0]
    assert selected_share([], [[[3]]]) is None
    assert selection_cause("retrieval", "12", ["12", "34"], [0.5, 0.0]) == SELECTION_MISSED
    assert selection_cause("retrieval", "34", ["12", "34"], [0.5, 0.0]) is None  # the held one was lost
    assert selection_cause("reasoning", "", ["12"], [0.0]) is None
    assert selection_cause("retrieval", "", ["12"], None) is None
    # through the bench's own question path: a top-k read reports what its selections held
    context = "The pass key is 12345. " + "noise " * 60
    pre = protocol.prefill(tiny_gemma, tok(context, return_tensors="pt").input_ids, chunk=64)
    q = Question("\nThe pass key is", ("12345",), max_new_tokens=4)
    res = protocol.ask(tiny_gemma, tok, pre, parse_method("topk:k=8,window=4"), q, context=context)
    assert res["needle_selected"] is None or 0.0 <= res["needle_selected"][0] <= 1.0
    dense = protocol.ask(tiny_gemma, tok, pre, parse_method("bf16"), q, context=context)
    assert "needle_selected" not in dense
