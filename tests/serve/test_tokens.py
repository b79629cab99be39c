"""`SegmentTokenizer` on the real tokenizers the server runs: a text's ids are the tokenizer's own,
whatever the text (property test), while a conversation's earlier turns are not tokenized again."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from kvstrata.models.loader import load_tokenizer, resolve
from kvstrata.serve.tokens import SegmentTokenizer

MODELS = ["smollm2-135m", "gemma3-270m"]


@pytest.fixture(scope="module", params=MODELS)
def tok(request):
    return load_tokenizer(resolve(request.param))


def texts(tok):
    """Text with the tokenizer's added tokens (specials, Gemma's newline runs) among words, spaces,
    newlines, digits and non-ASCII letters."""
    added = sorted(t.content for t in tok.added_tokens_decoder.values())
    bits = st.one_of(st.sampled_from(added[:40] + added[-40:]), st.text(" \n\t\r", max_size=4),
                     st.text("abcXYZ019 .,:;!?-_()'\"éüß中→", max_size=12),
                     st.sampled_from(["def f(x):\n    return x", "User:", "Assistant:", "  ", "\n\n"]))
    return st.lists(bits, max_size=30).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ids_are_the_tokenizers_own(tok, data):
    seg = SegmentTokenizer(tok)
    assert seg.enabled and seg.prefixed
    for _ in range(3):  # fresh pieces, then pieces the cache holds
        text = data.draw(texts(tok))
        assert seg.ids(text) == list(tok(text, add_special_tokens=False).input_ids)
        assert seg.ids_with_specials(text) == list(tok(text).input_ids)


def test_a_conversation_tokenizes_only_what_it_added(tok):
    seg = SegmentTokenizer(tok)
    convo = [{"role": "user", "content": "Here is the report.\n" + "The quarterly numbers rose. " * 200}]
    for turn in range(3):
        if tok.chat_template:
            text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
        else:  # a transcript, as clients of /v1/completions send one
            text = "".join(f"\n\n{m['role'].title()}: {m['content']}" for m in convo) + "\nAssistant:"
        before = dict(seg.stats)
        assert seg.ids(text) == list(tok(text, add_special_tokens=False).input_ids)
        assert seg.ids_with_specials(text) == list(tok(text).input_ids)
        new = seg.stats["tokenized"] - before["tokenized"]
        if turn:  # the earlier turns' pieces come from the cache: a handful of new pieces only
            assert 0 < new <= 6 and seg.stats["pieces"] - before["pieces"] > new
        convo += [{"role": "assistant", "content": f"Answer {turn}: up 4%."},
                  {"role": "user", "content": f"And in quarter {turn + 2}?"}]


def test_a_tokenizer_whose_pieces_are_not_independent_is_tokenized_whole():
    tok = load_tokenizer(resolve("smollm2-135m"))
    tok.add_tokens([AddedToken("<x>", lstrip=True)])  # swallows the whitespace before it
    seg = SegmentTokenizer(tok)
    assert not seg.enabled
    text = "a  <x> b\n\n<x>"
    assert seg.ids(text) == list(tok(text, add_special_tokens=False).input_ids)
    assert seg.stats["tokenized"] == 0


def test_the_cache_holds_at_most_its_capacity():
    tok = load_tokenizer(resolve("smollm2-135m"))
    seg = SegmentTokenizer(tok, capacity=200)
    for i in range(50):
        text = f"<|im_start|>user\nmessage number {i} " + "word " * 20 + "<|im_end|>"
        assert seg.ids(text) == list(tok(text, add_special_tokens=False).input_ids)
        assert seg._held <= 200 and len(seg._pieces) <= 10
