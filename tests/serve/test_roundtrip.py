"""Completions, chat and streaming through a real server process (tiny Gemma-3, disk store) with
the official `openai` client: cached tokens on a conversation's later turns, greedy answers equal
to `kvstrata generate`'s, seeded sampling, stop sequences, retention classes."""

import pytest
from serve_helpers import chat_ids, client, greedy_reference, text_of


@pytest.fixture(scope="module")
def server(gemma_server):
    return gemma_server


@pytest.fixture(scope="module")
def oa(server):
    return client(server)


def test_models_and_health(server, oa):
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    h = server.health()
    assert h["status"] == "ok" and h["store"] is True


def test_completion_then_longer_prompt_reuses_the_first(oa, loaded):
    prompt = text_of(70, seed=1)
    first = oa.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert first.object == "text_completion" and first.usage.prompt_tokens == 70  # one token per byte
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.kvstrata["kind"] == "miss"
    # 4 new blocks snapshotted, then handed off
    assert 0 < first.kvstrata["write_s"] < first.kvstrata["ttft_s"]
    again = oa.completions.create(model="tiny", prompt=prompt + \
                                  " and a follow-up", max_tokens=6, temperature=0)
    assert again.kvstrata["kind"] == "hit" and again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.kvstrata["reused_tokens"] == 64 and again.kvstrata["computed_tokens"] == 86 - 64
    assert again.kvstrata["ttft_s"] > 0 and first.choices[0].finish_reason in ("length", "stop")


def test_chat_second_turn_is_cached(oa):
    messages = [{"role": "system", "content": text_of(60, seed=2)}, {
                                                      "role": "user", "content": "first question"}]
    one = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert one.object == "chat.completion" and one.choices[0].message.role == "assistant"
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "second question"}]
    two = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert two.usage.prompt_tokens_details.cached_tokens > 0 and two.kvstrata["kind"] == "hit"
    assert two.usage.prompt_tokens_details.cached_tokens == two.usage.prompt_tokens - \
        two.kvstrata["computed_tokens"]


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_matches_the_whole_answer(oa, chat):
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"cache_salt": f"stream-{chat}"})
    if chat:
        kw["messages"] = [{"role": "user", "content": text_of(40, seed=3)}]
        whole = oa.chat.completions.create(**kw)
        stream = oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        pieces, expected = [], whole.choices[0].message.content
    else:
        kw["prompt"] = text_of(40, seed=3)
        whole = oa.completions.create(**kw)
        stream = oa.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        pieces, expected = [], whole.choices[0].text
    chunks = list(stream)
    for c in chunks:
        if c.choices:
            pieces.append((c.choices[0].delta.content or "") if chat else c.choices[0].text)
    assert "".join(pieces) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, second time
    assert chunks[-1].kvstrata["kind"] == "hit"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_greedy_answer_equals_kvstrata_generate(oa, loaded):
    model, tok = loaded["gemma"]
    prompt = text_of(90, seed=4)
    ref = greedy_reference(model, tok, tok(prompt).input_ids, 10)
    for turn in range(2):  # a miss, then a hit from the store
        got = oa.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"cache_salt": "greedy"})
        assert got.kvstrata["kind"] == ("miss", "hit")[turn]
        assert got.choices[0].text == ref
    messages = [{"role": "user", "content": text_of(50, seed=5)}]
    chat = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == greedy_reference(model, tok, chat_ids(tok, messages), 8)


def test_seeded_sampling_repeats_and_seeds_differ(oa):
    kw = dict(model="tiny", prompt=text_of(30, seed=6), max_tokens=16, temperature=1.0, top_p=0.9)
    a, b = (oa.completions.create(**kw, seed=7).choices[0].text for _ in range(2))
    c = oa.completions.create(**kw, seed=8).choices[0].text
    assert a == b and a != c


def test_stop_sequence_ends_the_answer_before_it(oa):
    kw = dict(model="tiny", prompt=text_of(30, seed=9), temperature=0)
    full = oa.completions.create(**kw, max_tokens=16).choices[0].text
    stop = full[5:7]
    cut = oa.completions.create(**kw, max_tokens=16, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in oa.completions.create(
        **kw, max_tokens=16, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


def test_in_memory_retention_keeps_global_kv_out_of_the_persistent_tier(server, oa):
    writes = lambda tier: server.metric("kvstrata_store_writes_total", tier=tier)  # noqa: E731
    server.wait_written()
    disk, ram = writes("global"), writes("memory_global")
    prompt = text_of(80, seed=10)
    kw = dict(model="tiny", prompt=prompt, max_tokens=2, extra_body={"prompt_cache_retention": "in_memory"})
    assert oa.completions.create(**kw).kvstrata["kind"] == "miss"
    server.wait_written()
    assert writes("global") == disk and writes("memory_global") == ram + \
                  4  # 80 tokens: 4 whole blocks before the last token
    assert oa.completions.create(**kw).kvstrata["kind"] == "hit"
    kw["extra_body"] = {"prompt_cache_retention": "24h"}  # hits RAM blocks, promotes them to disk
    assert oa.completions.create(**kw).kvstrata["kind"] == "hit"
    server.wait_written()
    assert writes("global") == disk + 4


def test_metrics_count_outcomes_and_tokens(server):
    assert server.metric("kvstrata_prompts_total", kind="hit") >= 3
    assert server.metric("kvstrata_prompts_total", kind="miss") >= 3
    assert server.metric("kvstrata_cached_tokens_total") >= 64
    assert server.metric("kvstrata_ttft_seconds_count") == server.metric("kvstrata_prompts_total")
    assert server.metric("kvstrata_http_requests_total", endpoint="/v1/completions", status="200") >= 5
