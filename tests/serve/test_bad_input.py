"""Whatever a client sends, the server answers with a 4xx and OpenAI's error object -- never a
traceback or a 500 -- and keeps serving."""

import httpx
import pytest
from serve_helpers import client

from kvstrata.models.tiny import tiny_config

# characters = tokens (byte tokenizer), past the context
PAST = tiny_config("gemma3").max_position_embeddings + 100

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (name, method, path, body: dict -> JSON / bytes -> raw, status, param the error names)
CASES = [
    ("malformed JSON", "POST", "/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not UTF-8", "POST", "/completions", b"\xff\xfe\x00garbage", 400, None),
    ("body is a list", "POST", "/completions", b"[1, 2]", 400, None),
    ("nested too deep", "POST", "/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("empty body", "POST", "/chat/completions", b"", 400, None),
    ("no prompt", "POST", "/completions", {"model": "tiny"}, 400, "prompt"),
    ("unknown model", "POST", "/completions", {**OK, "model": "gpt-7"}, 404, "model"),
    ("model not a string", "POST", "/completions", {**OK, "model": 3}, 400, "model"),
    ("max_tokens a string", "POST", "/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens zero", "POST", "/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens past context", "POST", "/completions", {**OK, "max_tokens": 10**12}, 400, "max_tokens"),
    ("prompt longer than context", "POST", "/completions", {**OK, "prompt": "a" * PAST}, 400, "prompt"),
    ("token id outside vocab", "POST", "/completions", {**OK, "prompt": [1, 2, 999999]}, 400, "prompt"),
    ("negative token id", "POST", "/completions", {**OK, "prompt": [-1]}, 400, "prompt"),
    ("two prompts", "POST", "/completions", {**OK, "prompt": ["a", "b"]}, 400, "prompt"),
    ("empty prompt", "POST", "/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("temperature negative", "POST", "/completions", {**OK, "temperature": -1}, 400, "temperature"),
    (
        "temperature NaN", "POST", "/completions", b'{"model":"tiny","prompt":"x","temperature":NaN}', 400,
        "temperature",
    ),
    ("top_p zero", "POST", "/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("seed too large", "POST", "/completions", {**OK, "seed": 2**70}, 400, "seed"),
    (
        "integer of 5000 digits", "POST", "/completions",
        b'{"model":"tiny","prompt":"x","seed":' + b"9" * 5000 + b"}", 400, None,
    ),
    ("prompt of megabytes", "POST", "/completions", {**OK, "prompt": "z " * 1_000_000}, 400, "prompt"),
    ("stream not a bool", "POST", "/completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("five stops", "POST", "/completions", {**OK, "stop": list("abcde")}, 400, "stop"),
    ("empty stop", "POST", "/completions", {**OK, "stop": [""]}, 400, "stop"),
    ("n > 1", "POST", "/completions", {**OK, "n": 2}, 400, "n"),
    ("echo", "POST", "/completions", {**OK, "echo": True}, 400, "echo"),
    ("tools", "POST", "/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    (
        "bad retention", "POST", "/completions", {**OK, "prompt_cache_retention": "1h"}, 400,
        "prompt_cache_retention",
    ),
    ("empty cache_salt", "POST", "/completions", {**OK, "cache_salt": ""}, 400, "cache_salt"),
    ("messages missing", "POST", "/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("messages empty", "POST", "/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    (
        "unknown role", "POST", "/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
    ),
    (
        "image content", "POST", "/chat/completions",
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        400,
        "messages.0.content.0.type",
    ),
    (
        "chat prompt past context", "POST", "/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "b" * PAST}]}, 400, "messages",
    ),
    (
        "body over the size limit", "POST", "/completions", b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413,
        None,
    ),
    ("key given twice", "POST", "/completions", b'{"model": "tiny", "model": "other", "prompt": "x"}', 400,
     "model"),
    (
        "nested key given twice", "POST", "/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a", "content": "b"}]}', 400,
        "messages.0.content",
    ),
    ("GET on a POST route", "GET", "/completions", None, 405, None),
    ("unknown path", "POST", "/embeddings", OK, 404, None),
]


@pytest.mark.parametrize("name, method, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_4xx(gemma_server, name, method, path, body, status, param):
    kw = {"json": body} if isinstance(body, dict) else {"content": body} if body is not None else {}
    if isinstance(body, bytes):
        kw["headers"] = {"Content-Type": "application/json"}
    r = httpx.request(method, gemma_server.base_url + path, timeout=60, **kw)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert "Traceback" not in r.text


def test_server_keeps_serving_after_the_table(gemma_server):
    assert gemma_server.health()["status"] == "ok"
    got = client(gemma_server).completions.create(**OK)
    assert got.usage.completion_tokens >= 1 or got.choices[0].finish_reason == "stop"
    assert gemma_server.metric("kvstrata_http_requests_total", status="500") == 0
    assert gemma_server.metric("kvstrata_http_requests_total", status="400") >= len(
        [c for c in CASES if c[4] == 400]
    )
