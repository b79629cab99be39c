"""Isolation and limits on one real server (tiny Llama, no chat template): API keys (401), tenant
isolation across keys, the bounded queue (429 + Retry-After), the per-request deadline, and a
client that disconnects mid-stream."""

import socket
import threading

import httpx
import openai
import pytest
from serve_helpers import client, start_server, text_of

KEYS = ("key-alpha-0001", "key-bravo-0002")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    (tmp / "keys.txt").write_text(f"# tenants\n{KEYS[0]}\n\n{KEYS[1]}\n")
    s = start_server(model_dirs["llama"], tmp, "--api-key-file", str(tmp / "keys.txt"), "--max-active", "1",
                     "--max-queue", "1", "--request-timeout", "2")
    yield s
    s.stop()


def test_requests_without_a_valid_key_get_401(server):
    for key in ("none", "key-alpha-0001x"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(server, key).completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/models").status_code == 401
    assert server.health()["status"] == "ok"  # health and metrics stay open
    assert client(server, KEYS[0]).models.list().data[0].id == "tiny"


def test_one_key_never_hits_another_keys_entries(server):
    a, b = client(server, KEYS[0]), client(server, KEYS[1])
    kw = dict(model="tiny", prompt=text_of(60, seed=11), max_tokens=2,
              extra_body={"cache_salt": "shared-salt"})

    def cached(c, **extra):
        return c.completions.create(**{**kw, **extra}).usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0 and cached(a) == 48  # miss, then A's own hit
    assert cached(b) == 0  # same prompt and cache_salt, other key: a miss
    assert cached(b) == 48  # B's own entries from now on
    assert cached(a, extra_body={"cache_salt": "other-salt"}) == 0  # same key, other salt: isolated too


def test_chat_on_a_model_without_a_chat_template_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server, KEYS[0]).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
    assert "no chat template" in e.value.message and e.value.body["code"] == "no_chat_template"


def test_full_queue_answers_429_and_deadline_ends_long_requests(server):
    results = []

    def call():
        r = httpx.post(
            server.base_url + "/completions", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60,
            json={"model": "tiny", "prompt": "long", "max_tokens": 4000},
        )
        results.append(r)

    threads = [threading.Thread(target=call) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status = sorted(r.status_code for r in results)
    refused = [r for r in results if r.status_code == 429]
    assert len(refused) >= 3 and all(
        int(r.headers["Retry-After"]) >= 1 for r in refused
    )  # 1 running + 1 waiting
    assert refused[0].json()["error"]["code"] == "queue_full"
    done = [r.json() for r in results if r.status_code == 200]
    assert done and all(
        d["kvstrata"]["timed_out"] and d["choices"][0]["finish_reason"] == "length" for d in done
    )
    assert all(d["usage"]["completion_tokens"] < 4000 for d in done)
    assert set(status) <= {200, 429, 504}  # the waiting one may pass its deadline before it starts
    assert client(server, KEYS[0]).completions.create(model="tiny", prompt="still here", max_tokens=2).usage


def test_disconnected_client_stops_its_generation(server):
    before = server.metric("kvstrata_requests_finished_total", reason="cancelled")
    generated = server.metric("kvstrata_generated_tokens_total")
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 4000, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {KEYS[1]}"},
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk, then hang up
    for _ in range(200):
        if server.metric("kvstrata_requests_finished_total", reason="cancelled") > before:
            break
        threading.Event().wait(0.05)
    assert server.metric("kvstrata_requests_finished_total", reason="cancelled") == before + 1
    assert server.metric("kvstrata_generated_tokens_total") - generated < 4000
    assert server.health()["active"] == 0


def test_a_client_hanging_up_mid_body_is_quiet(server):
    """Content-Length 1000, 10 bytes, then the socket closes: no traceback in the server's log, no 500."""

    def answered() -> tuple[float, float]:
        return tuple(server.metric("kvstrata_http_requests_total", status=s) for s in ("499", "500"))

    before = answered()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head.encode() + b'{"model": ')
    for _ in range(200):  # until the server has handled it (a 499 now; a 500 and two tracebacks before)
        if sum(answered()) > sum(before):
            break
        threading.Event().wait(0.05)
    threading.Event().wait(0.5)  # anything it logs after the answer, too
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "unexpected error" not in log and "ClientDisconnect" not in log
    assert answered() == (before[0] + 1, before[1])
    assert server.health()["status"] == "ok"
