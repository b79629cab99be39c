"""Every string field of every request schema is checked for encodability where the body is parsed:
a lone UTF-16 surrogate (valid JSON, `"\\ud800"`, no valid UTF-8) anywhere is a 400 naming the field,
never a 500 from a tokenizer or a store key, and nothing reaches the server's log as a traceback.
Fuzzed with hypothesis through a real server: surrogates, NULs, huge and deeply nested values."""

import json
import typing

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.serve.errors import APIError
from kvstrata.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    Message,
    StreamOptions,
    Text,
    TextPart,
    parse,
)

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
#: every string a request carries, as a path into a valid body (int: a list index)
STRING_FIELDS = {
    "/completions": [("model",), ("prompt",), ("prompt", 0), ("stop",), ("stop", 0), ("user",),
                     ("cache_salt",), ("prompt_cache_key",), ("prompt_cache_retention",)],
    "/chat/completions": [("model",), ("messages", 0, "content"), ("messages", 0, "content", 0, "text"),
                          ("messages", 0, "content", 0, "type"), ("messages", 0, "name"),
                          ("messages", 0, "role"), ("stop",), ("stop", 0), ("user",), ("cache_salt",),
                          ("prompt_cache_key",)],
}
SCHEMAS = (CompletionRequest, ChatRequest, Message, TextPart, StreamOptions)


def put(body: dict, path: tuple, value) -> dict:
    """`body` with `value` at `path`, building the lists and objects on the way (`content` as parts)."""
    body = json.loads(json.dumps(body))
    node = body
    for here, nxt in zip(path, path[1:]):
        want = [] if isinstance(nxt, int) else {}
        if isinstance(here, int):
            while len(node) <= here:
                node.append({"type": "text", "text": "x"} if path[-1] in ("text", "type") else want)
            node = node[here]
        else:
            if not isinstance(node.get(here), type(want)):
                node[here] = want
            node = node[here]
    if isinstance(path[-1], int):
        node[:] = [value]
    else:
        node[path[-1]] = value
    return body


def _strings(annotation) -> list:
    """The `str` types in an annotation, each as found: `Text` (checked) or a bare `str`."""
    if annotation is str:
        return [str]
    if typing.get_origin(annotation) is typing.Annotated:
        return [Text] if annotation == Text else _strings(typing.get_args(annotation)[0])
    return [t for arg in typing.get_args(annotation) for t in _strings(arg)]


def test_every_string_field_of_every_schema_is_checked_text():
    checks = typing.get_args(Text)[1:]
    for schema in SCHEMAS:
        for name, info in schema.model_fields.items():
            if info.annotation is str:  # pydantic unwraps a field's own `Annotated` into its metadata
                assert all(c in info.metadata for c in checks), f"{schema.__name__}.{name} is a bare str"
            else:
                assert str not in _strings(info.annotation), f"{schema.__name__}.{name} is a bare str"


@pytest.mark.parametrize("path", [(p, f) for p, fs in STRING_FIELDS.items() for f in fs],
                         ids=lambda x: x[0] + ":" + ".".join(map(str, x[1])))
def test_a_lone_surrogate_in_any_string_field_is_a_400_naming_it(path):
    route, field = path
    base, schema = (CHAT, ChatRequest) if route == "/chat/completions" else (COMPLETION, CompletionRequest)
    raw = json.dumps(put(base, field, "ok \ud800 ok")).encode()  # JSON's \ud800 escape: valid JSON
    with pytest.raises(APIError) as e:
        parse(raw, schema)
    assert e.value.status == 400 and e.value.param == ".".join(map(str, field))
    json.dumps(e.value.body(), ensure_ascii=False).encode()  # the error itself is encodable


surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
words = st.text(st.characters(codec="utf-8"), max_size=8)
bad_text = st.one_of(
    st.builds(lambda a, s, b: a + s + b, words, surrogate, words),  # a lone surrogate inside text
    st.builds(lambda n, s: "\0" * 3 + "x" * n + s, st.integers(0, 2_000_000), surrogate),  # huge, NULs
)
DEEP = "<deep>"  # stands for a nested value, written into the raw body (too deep for json.dumps)
deep = st.integers(2, 5000)  # past the JSON parser's depth limit or not


@st.composite
def bad_bodies(draw):
    route = draw(st.sampled_from(sorted(STRING_FIELDS)))
    base = CHAT if route == "/chat/completions" else COMPLETION
    field = draw(st.sampled_from(STRING_FIELDS[route]))
    value = draw(st.one_of(bad_text, deep))
    body = put(base, field, DEEP if isinstance(value, int) else value)
    if draw(st.booleans()):  # NULs in another string of the same body change nothing
        body = {**body, "user": "\0nul\0"} if field != ("user",) else body
    raw = json.dumps(body)  # ensure_ascii: surrogates travel as \ud800 escapes
    if isinstance(value, int):
        raw = raw.replace(json.dumps(DEEP), "[" * value + "]" * value)
    return route, raw.encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_bodies())
def test_fuzzed_bodies_are_4xx_with_one_line_and_a_clean_log(gemma_server, case):
    route, raw = case
    r = httpx.post(gemma_server.base_url + route, content=raw, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text[:300]
    message = r.json()["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in r.text


@pytest.mark.parametrize("field", [("prompt",), ("stop",), ("cache_salt",), ("user",)])
def test_nuls_are_text_and_served(gemma_server, field):
    r = httpx.post(gemma_server.base_url + "/completions", json=put(COMPLETION, field, "a\0b"), timeout=120)
    assert r.status_code == 200, r.text[:300]


def test_the_log_stays_clean(gemma_server):
    """Run after the fuzz (same module, same server): no traceback, no 500."""
    log = gemma_server.log_tail(1 << 22)
    assert "Traceback" not in log and "unexpected error" not in log
    assert gemma_server.metric("kvstrata_http_requests_total", status="500") == 0
