import pytest

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.tasks import (
    KNOWN,
    PHRASINGS,
    SIDES,
    THINGS,
    check_fed,
    make_instance,
    score_answer,
    tag_failure,
)

TOK = byte_tokenizer()


def n_tokens(text):
    return len(TOK(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", KNOWN)
def test_deterministic_and_seeded(task):
    a = make_instance(task, TOK, 1200, 3, seed=0)
    assert a == make_instance(task, TOK, 1200, 3, seed=0)
    assert a != make_instance(task, TOK, 1200, 4, seed=0)
    assert a != make_instance(task, TOK, 1200, 3, seed=1)


@pytest.mark.parametrize("task", KNOWN)
@pytest.mark.parametrize("length", [800, 2000])
def test_context_and_question_fill_the_length_exactly(task, length):
    inst = make_instance(task, TOK, length, 0)
    drawn = inst.meta.get("tokens", length)  # a family instance draws its length at or below the cell's
    assert 5 * length // 8 <= drawn <= length
    assert n_tokens(inst.context) + inst.question_tokens == drawn
    assert inst.question_tokens == max((n_tokens(q.text) for q in inst.questions), default=0)
    check_fed(inst, length, n_tokens(inst.context))  # what the runner checks before a row is written


def test_a_context_of_the_wrong_length_is_refused():
    inst = make_instance("single", TOK, 800, 0)
    with pytest.raises(ValueError, match=r"single-0 at length 800: the context fed is 700 tokens, \+100"):
        check_fed(inst, 800, 700)
    check_fed(make_instance("fidelity", TOK, 800, 0), 800, 800)
    with pytest.raises(ValueError, match="more than its question and special tokens"):
        check_fed(make_instance("fidelity", TOK, 800, 0), 800, 801)


@pytest.mark.parametrize("task", ["single", "multikey", "vartrack"])
def test_a_length_too_short_for_the_needles_is_a_clear_error(task):
    with pytest.raises(ValueError, match=f"{task} #0 at 200 tokens .* cannot hold even the fixed text"):
        make_instance(task, TOK, 200, 0)


@pytest.mark.parametrize("task", ["single", "multikey", "multivalue", "multiquery", "lookalike"])
def test_needles_are_in_context_and_answers_parse(task):
    for i in range(5):
        inst = make_instance(task, TOK, 1500, i)
        q = inst.questions[0]
        assert q.answers and all(a.isdigit() and a in inst.context for a in q.answers)
        assert all(0.0 <= d <= 1.0 for d in inst.meta["depths"])


def test_needle_depth_spread():
    depths = [make_instance("single", TOK, 1500, i).meta["depths"][0] for i in range(30)]
    assert min(depths) < 0.2 and max(depths) > 0.8


def test_multikey_has_distractors():
    inst = make_instance("multikey", TOK, 1500, 0)
    assert inst.context.count("special magic number for") == 4


def test_vartrack_chain_and_probes():
    for i in range(4):
        inst = make_instance("vartrack", TOK, 1500, i)
        hops = inst.meta["hops"]
        assert hops == 1 + i
        main, *probes = inst.questions
        assert main.role == "main" and len(probes) == hops + 1 and all(p.role == "probe" for p in probes)
        value = main.answers[0]
        assert probes[0].answers == (value,)
        # links appear in chain order in the context
        names = [probes[0].text.split("VAR ")[1].split(" ")[0]] + \
                                      [p.text.split("VAR ")[1].split(" ")[0] for p in probes[1:]]
        positions = [inst.context.index(f"VAR {n} =") for n in names]
        assert positions == sorted(positions)


def test_fidelity_has_a_continuation():
    inst = make_instance("fidelity", TOK, 600, 0)
    assert 50 <= n_tokens(inst.continuation) <= 70 and not inst.questions


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task"):
        make_instance("haystack-soup", TOK, 100, 0)


def test_scoring():
    assert score_answer(" 12345.", ("12345",)) == 1.0
    assert score_answer(" 1234.", ("12345",)) == 0.0
    assert score_answer("11111, 22222", ("11111", "22222", "33333")) == pytest.approx(2 / 3)


def test_failure_tags_on_hand_made_cases():
    assert tag_failure(1.0, [0.0, 1.0], "vartrack") is None
    assert tag_failure(0.0, [1.0, 1.0, 1.0], "vartrack") == "reasoning"
    assert tag_failure(0.0, [1.0, 0.0, 1.0], "vartrack") == "retrieval"
    assert tag_failure(0.0, [], "single") == "retrieval"
    assert tag_failure(0.5, [], "multivalue") == "retrieval"


def test_lookalike_phrasings_and_distractors():
    seen = set()
    for i in range(8):
        inst = make_instance("lookalike", TOK, 1500, i, haystack="natural")
        q = inst.questions[0]
        target = q.text.split("combination opens the ")[1].split("?")[0]
        side, thing = target.split()
        facts = [line for line in PHRASINGS if line.format(obj=target, n=q.answers[0]) in inst.context]
        assert len(facts) == 1 and "magic number" not in inst.context  # one phrasing, not the other tasks'
        seen.add(PHRASINGS.index(facts[0]))
        assert inst.meta["distractors"] == 2
        # every distractor shares a word with the target and has its own number
        text = inst.context.replace(",", " ").replace(".", " ")
        names = [f"{a} {b}" for a in SIDES for b in THINGS]
        others = [n for n in names if n != target and f"{n} " in text]
        assert len(others) == 2 and all(side in o or thing in o for o in others)
    assert seen == set(range(len(PHRASINGS)))
