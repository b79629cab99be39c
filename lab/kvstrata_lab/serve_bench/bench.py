"""`kvstrata serve-bench`: the server under agent load, measured from real `openai` clients.

1. probe (one client, one long prompt): TTFT of a cold turn (miss), warm turns (hit) and a turn
   after the SWA state expired (replay), and the HTTP + queueing overhead per request: the
   client's TTFT minus the server's own.
2. load, store on: `clients` threads each replay multi-turn agent conversations (streamed chat
   completions, greedy) for at most `duration_s`; TTFT, kind, cached tokens per request.
3. load, store off (`--no-store`): the same conversations, every turn a full prefill; then a
   sample of phase 2's answers is re-asked of this server and compared (cached vs uncached greedy).
Each phase runs its own server process on 127.0.0.1 with a fresh store.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from kvstrata.models import check_method, load_config, load_tokenizer
from kvstrata.models.loader import refuse_encoder_decoder
from kvstrata_lab.serve_bench.agents import Scripts
from kvstrata_lab.serve_bench.config import ServeBenchConfig
from kvstrata_lab.serve_bench.peers import check_peer, peer_server, store_bytes
from kvstrata_lab.serve_bench.process import ServerProcess
from kvstrata_lab.serve_bench.report import summarize, write_outputs


def _stream(oa, model: str, max_tokens: int, messages: list | None = None, prompt: str | None = None) -> dict:
    """One streamed, greedy request; the client's TTFT is the time to the first chunk."""
    import openai  # optional dependency (the serve extra)

    kw = dict(
        model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    t0 = time.perf_counter()
    first, pieces, last = None, [], None
    try:
        chunks = (
            oa.chat.completions.create(messages=messages, **kw)
            if messages is not None
            else oa.completions.create(prompt=prompt, **kw)
        )
        for chunk in chunks:
            if chunk.choices:
                first = first if first is not None else time.perf_counter() - t0
                c = chunk.choices[0]
                pieces.append((c.delta.content or "") if messages is not None else c.text)
            last = chunk
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {str(e)[:200]}", "latency_s": time.perf_counter() - t0}
    kv = getattr(last, "kvstrata", None) or {}  # our server's own fields (a peer has none)
    u = last.usage
    details = u.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return {
        "error": None, "ttft_s": first, "latency_s": time.perf_counter() - t0, "text": "".join(pieces),
        # a peer says no kind: a prompt it reused a prefix of counts as its hit
        "kind": kv.get("kind") or ("hit" if cached else "miss"), "server_ttft_s": kv.get("ttft_s"),
        "queue_s": kv.get("queue_s"), "prompt_tokens": u.prompt_tokens, "cached_tokens": cached,
        "completion_tokens": u.completion_tokens,
    }


class _Load:
    """Clients replaying agent conversations against one server until done or out of time."""

    def __init__(self, cfg: ServeBenchConfig, scripts: Scripts, chat: bool, retries: int = 0,
                 timeout_s: float | None = None):
        self.cfg, self.scripts, self.chat = cfg, scripts, chat
        self.retries = retries  # a failed turn is asked again once the server answers (a restart)
        self.timeout_s = timeout_s or cfg.duration_s + 600  # a request past it is a hang
        self.records: list[dict] = []
        self.asked: list[tuple[dict, dict]] = []  # (request, record), for the answer check
        self._lock = threading.Lock()

    def run(self, server: ServerProcess) -> float:
        self.t0 = time.monotonic()
        end = self.t0 + self.cfg.duration_s
        threads = [
            threading.Thread(target=self._client, args=(server, c, end)) for c in range(self.cfg.clients)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    def _client(self, server: ServerProcess, cid: int, end: float) -> None:
        import openai  # optional dependency (the serve extra)

        oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=self.timeout_s)
        for conv in range(self.cfg.conversations):
            script, answers = self.scripts.script(cid, conv), []
            messages = [{"role": "system", "content": script.system}]
            for turn, text in enumerate(script.turns):
                if time.monotonic() >= end:
                    return
                messages.append({"role": "user", "content": text})
                request = (
                    {"messages": list(messages)}
                    if self.chat
                    else {"prompt": script.transcript(answers, turn)}
                )
                rec = self._ask(oa, server, request)
                rec.update(client=cid, conversation=conv, turn=turn + 1, at_s=time.monotonic() - self.t0)
                with self._lock:
                    self.records.append(rec)
                    if not rec["error"]:
                        self.asked.append((request, rec))
                if rec["error"]:
                    break  # this conversation cannot go on without its answer
                answers.append(rec["text"])
                messages.append({"role": "assistant", "content": rec["text"]})


    def _ask(self, oa, server: ServerProcess, request: dict) -> dict:
        """One turn, asked again (up to `retries` times) once the server answers /health after a failure."""
        for attempt in range(self.retries + 1):
            rec = _stream(oa, server.name, self.cfg.max_tokens, **request)
            rec["attempts"] = attempt + 1
            if not rec["error"] or attempt == self.retries:
                return rec
            server.wait_healthy(self.timeout_s)
        return rec


def _server(
    cfg: ServeBenchConfig, root: Path, name: str, *args: str, env: dict | None = None
) -> ServerProcess:
    env = {
        "KVSTRATA_STORE_ROOT": str(root / name), "KVSTRATA_STORE_BLOCK_SIZE": str(cfg.block_size),
        **(env or {}),
    }
    return ServerProcess(
        cfg.model, "--method", cfg.method, "--max-active", str(cfg.clients), "--max-queue",
        str(cfg.clients), "--request-timeout", str(cfg.duration_s + 600), *args, env=env,
        log_path=root / f"{name}.log", name=cfg.model,
    )


def _probe(cfg: ServeBenchConfig, scripts: Scripts, root: Path) -> dict:
    """Single client, one long prompt: cold, warm x N (each turn extends the last), then a replay
    after the SWA TTL."""
    import openai  # optional dependency (the serve extra)

    doc = scripts.probe_document(cfg.probe_tokens)
    with _server(
        cfg, root, "probe", env={"KVSTRATA_STORE_SWA_TTL_SECONDS": str(cfg.probe_swa_ttl_s)}
    ) as server:
        oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=3600)
        rows, prompt = [], doc
        for i in range(cfg.probe_warm_turns + 2):  # one conversation: every turn extends the last
            if i == cfg.probe_warm_turns + 1:
                time.sleep(cfg.probe_swa_ttl_s + 1)  # the SWA state expires: the last turn is a replay
            rows.append(
                dict(
                    _stream(oa, server.name, 1, prompt=prompt), turn=i + 1,
                    phase="cold" if i == 0 else "replay" if i > cfg.probe_warm_turns else "warm",
                )
            )
            prompt += f"\nQuestion {i + 1}: what comes next?"
    for r in rows:
        r.pop("text", None)
    return {"rows": rows, "swa_ttl_s": cfg.probe_swa_ttl_s}


def _check(cfg: ServeBenchConfig, load: _Load, server: ServerProcess) -> dict:
    """Re-ask a spread sample of the store-on run's later turns of the store-off server; compare."""
    import openai  # optional dependency (the serve extra)

    later = [(q, r) for q, r in load.asked if r["turn"] > 1]
    step = max(1, len(later) // max(cfg.check, 1))
    sample = later[::step][: cfg.check]
    oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=3600)
    rows = []
    for request, rec in sample:
        again = _stream(oa, server.name, cfg.max_tokens, **request)
        rows.append(
            {
                "client": rec["client"], "turn": rec["turn"], "kind": rec["kind"],
                "same": again.get("text") == rec["text"], "error": again["error"],
            }
        )
    return {"checked": len(rows), "differ": sum(not r["same"] for r in rows), "rows": rows}


TURN_OVERHEAD = 128  # tokens a turn adds beyond its tool text and answer (question, role markers), generously


def conversation_tokens(cfg: ServeBenchConfig) -> int:
    """About the tokens a conversation grows to (every turn at its generous overhead)."""
    return cfg.context + (cfg.turns // 2) * cfg.tool_tokens + cfg.turns * (cfg.max_tokens + TURN_OVERHEAD)


def check_fits(cfg: ServeBenchConfig) -> None:
    """Refuse, before any server starts, conversations or a probe that would outgrow the model's context."""

    text = load_config(cfg.model).get_text_config()
    limit = int(getattr(text, "max_position_embeddings", 0) or 0) or 1 << 62
    longest = conversation_tokens(cfg)
    if longest > limit:
        raise ValueError(
            f"--context {cfg.context:,} + --turns {cfg.turns} x (--max-tokens {cfg.max_tokens:,} + "
            f"{TURN_OVERHEAD}) + {cfg.turns // 2} x --tool-tokens {cfg.tool_tokens:,}: a conversation grows "
            f"to about {longest:,} tokens, past the model's context of {limit:,}"
        )
    probe = cfg.probe_tokens + (cfg.probe_warm_turns + 2) * TURN_OVERHEAD
    if cfg.probe_tokens and probe > limit:
        raise ValueError(
            f"--probe-tokens {cfg.probe_tokens:,}: the probe grows to {probe:,} tokens, past the model's "
            f"context of {limit:,}"
        )


def run(cfg: ServeBenchConfig) -> dict:

    check_method(cfg.model, cfg.method, store=True)  # refused here, not by the first server's exit
    refuse_encoder_decoder(cfg.model, "kvstrata serve-bench (it runs kvstrata serve)")
    check_fits(cfg)
    if cfg.peer:
        check_peer(cfg.peer, cfg.model)  # a missing build or environment: refused before any phase runs
    tok = load_tokenizer(cfg.model)
    scripts = Scripts(tok, cfg.context, cfg.turns, cfg.tool_tokens, cfg.seed)
    chat = bool(getattr(tok, "chat_template", None))
    root = Path(tempfile.mkdtemp(prefix="kvstrata-serve-bench-"))
    result: dict = {"config": asdict(cfg), "endpoint": "chat" if chat else "completions"}
    try:
        if cfg.probe_tokens:
            result["probe"] = _probe(cfg, scripts, root)
        phases = {}
        for name, args in (("store", ()), ("no_store", ("--no-store",))):
            load = _Load(cfg, scripts, chat)
            with _server(cfg, root, name, *args) as server:
                wall = load.run(server)
                if name == "no_store" and cfg.check:
                    result["check"] = _check(cfg, phases["store"]["load"], server)
                if name == "store":
                    server.wait_written()
                    result["store_bytes"] = store_bytes(root / name, cfg.block_size)
            phases[name] = {"load": load, "wall_s": wall}
        if cfg.peer:
            load = _Load(cfg, scripts, chat)
            peer = peer_server(cfg.peer, cfg.model, cfg.clients, conversation_tokens(cfg) + 512, root)
            try:
                with peer as server:
                    phases["peer"] = {"load": load, "wall_s": load.run(server)}
                    result["peer"] = {"name": cfg.peer, "describe": peer.describe,
                                      "persist": server.persist()}
            except RuntimeError as exc:  # the peer cannot serve this model: a result, reported
                result["peer"] = {"name": cfg.peer, "describe": peer.describe,
                                  "error": str(exc).splitlines()[0]}
        result["phases"] = {
            n: {
                "wall_s": p["wall_s"],
                "records": [{k: v for k, v in r.items() if k != "text"} for r in p["load"].records],
            }
            for n, p in phases.items()
        }
    except BaseException:  # keep the servers' logs for the post-mortem
        logs = Path(cfg.out) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for log in root.glob("*.log"):
            shutil.copy(log, logs / log.name)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["summary"] = summarize(result)
    write_outputs(result, Path(cfg.out))
    return result
