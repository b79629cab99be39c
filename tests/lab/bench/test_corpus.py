"""Every text source returns exactly the tokens asked, over lengths and seeds, under the real
SmolLM2 and Gemma-3 tokenizers (integration: they come from the converted models) and the tiny
models' byte-level tokenizer (which splits curly quotes into several tokens: cuts inside them)."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.corpus import (
    KINDS,
    TextShortfall,
    count,
    exact_prefix,
    haystack,
    natural_ids,
    prose_and_continuation,
)
from kvstrata_lab.bench.haystack import fed_tokens, place
from kvstrata_lab.bench.passkey import passkey_prompt
from kvstrata_lab.bench.tasks import CONTINUATION, TASKS, make_instance

REAL = ("smollm2-135m", "gemma3-270m")
TOKENIZERS = ["byte", *(pytest.param(name, marks=pytest.mark.integration) for name in REAL)]
SEEDS = st.integers(0, 10_000)
EXAMPLES = settings(max_examples=12, deadline=None)


@pytest.fixture(scope="session")
def tokenizers():
    """Tokenizers loaded once per session (the real ones without their weights)."""
    cache = {}

    def get(name):
        if name not in cache:
            from kvstrata.models import KNOWN_MODELS, load_tokenizer

            if name in KNOWN_MODELS and not KNOWN_MODELS[name].installed():
                pytest.fail(f"{name} missing: {KNOWN_MODELS[name].install_command}")
            cache[name] = byte_tokenizer() if name == "byte" else load_tokenizer(name)
        return cache[name]

    return get


@pytest.mark.parametrize("name", TOKENIZERS)
@EXAMPLES
@given(n=st.integers(0, 20_000), seed=SEEDS, kind=st.sampled_from(KINDS))
def test_haystack_is_exactly_n_tokens(tokenizers, name, n, seed, kind):
    tok = tokenizers(name)
    assert count(tok, "".join(haystack(kind, tok, n, seed))) == n


@pytest.mark.parametrize("name", TOKENIZERS)
@EXAMPLES
@given(n=st.integers(0, 20_000), seed=SEEDS)
def test_natural_ids_are_exactly_n_fed_ids(tokenizers, name, n, seed):
    tok = tokenizers(name)
    ids = natural_ids(tok, n, seed)
    assert len(ids) == n
    assert ids == tok("".join(haystack("natural", tok, n + 64, seed))).input_ids[:n]  # a prefix of the prose


@pytest.mark.parametrize("name", TOKENIZERS)
@EXAMPLES
@given(n=st.integers(1, 12_000), k=st.integers(1, 128), seed=SEEDS)
def test_prose_and_its_continuation_are_exact(tokenizers, name, n, k, seed):
    tok = tokenizers(name)
    head, tail = prose_and_continuation(tok, n, k, seed)
    assert (count(tok, head), count(tok, tail)) == (n, k)


@pytest.mark.parametrize("name", TOKENIZERS)
@EXAMPLES
@given(length=st.integers(600, 9_000), index=st.integers(0, 19), seed=SEEDS, task=st.sampled_from(TASKS),
       kind=st.sampled_from(KINDS))
@example(length=2850, index=10, seed=1, task="multikey", kind="code-am")  # no budget alone reached it
def test_task_instances_fill_their_length_exactly(tokenizers, name, length, index, seed, task, kind):
    """Question tasks: context (as fed) + longest question = the length; fidelity: the context is the
    length in text tokens and its continuation 64 tokens."""
    tok = tokenizers(name)
    inst = make_instance(task, tok, length, index, seed, kind)
    if task == "fidelity":
        assert count(tok, inst.context) == length and count(tok, inst.continuation) == CONTINUATION
    else:
        assert fed_tokens(tok, inst.context) + inst.question_tokens == length


@pytest.mark.parametrize("name", TOKENIZERS)
@EXAMPLES
@given(n=st.integers(300, 9_000), depth=st.floats(0, 1), seed=SEEDS)
def test_passkey_prompt_is_exactly_n_fed_tokens(tokenizers, name, n, depth, seed):
    tok = tokenizers(name)
    p = passkey_prompt(tok, n, depth, seed)
    assert fed_tokens(tok, p.context + p.question) == n and p.answer in p.context


@EXAMPLES
@given(seq_len=st.integers(4, 160), pairs=st.integers(1, 8), n=st.integers(1, 6), seed=SEEDS)
def test_v41_training_sequences_are_exactly_seq_len(seq_len, pairs, n, seed):
    from kvstrata_lab.v41_train import TrainConfig, _text_ids, batch

    if seq_len < 4 * pairs:
        with pytest.raises(ValueError, match="at least 4 x pairs"):
            TrainConfig(seq_len=seq_len, pairs=pairs)
        return
    cfg = TrainConfig(seq_len=seq_len, pairs=pairs)
    ids, ask = batch(cfg, random.Random(seed), _text_ids(), n)
    assert ids.shape == ask.shape == (n, seq_len)
    assert (ask.sum(1) == pairs).all()  # every pair asked once


def test_a_cut_inside_a_multibyte_character_drops_that_character():
    tok = byte_tokenizer()  # "’" is three byte tokens: no prefix of "ab’cd" has exactly 3 tokens
    text, used = exact_prefix(tok, "ab’cd", 3, "test")
    assert (text, used) == ("abc", 4)


def test_too_short_a_text_is_a_clear_error():
    with pytest.raises(TextShortfall, match="test: asked for 10 tokens, got 3: the text given is too short"):
        exact_prefix(byte_tokenizer(), "abc", 10, "test")


def test_a_context_too_short_for_its_needles_is_refused():
    with pytest.raises(ValueError, match="cannot hold even the fixed text"):
        place(byte_tokenizer(), 50, "a head of forty-odd bytes, which is long", ["needle one. "], [0.5])
