"""`kvstrata serve-batch-bench`: what batching buys `kvstrata serve`, measured from real `openai` clients.

Per method, two servers on 127.0.0.1 (store off: distinct prompts, so the numbers are the worker's,
not the store's): the batched worker and the unbatched one (`--no-batching`, one request per
forward, as the server ran before). On each, N streams (N in `streams`) each send `requests`
streamed greedy completions of distinct `prompt_tokens`-token prompts one after another:
aggregate generated tokens/s (every token over the wall time of the level, prefills included) and
time per output token (TPOT, per request: after its first token) p50 / p99. A probe prompt of
`probe_tokens` tokens is timed on the idle server, then again arriving while 8 streams decode.
Then the batched server under a KV budget that holds `budget_sequences` bf16 sequences at their
longest, with `budget_streams` streams: how many sequences run at once (sampled from /metrics) and
each request's decode rate. With a `peer` (llama.cpp's `llama-server`, continuous batching on the
GGUF our model is converted from), the same levels against it, a server per level with one slot
per stream (`-np`), in the same run: our batched tokens/s over its.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from kvstrata.hf import linear
from kvstrata.models import check_method, load_config, load_tokenizer
from kvstrata.serve.scheduler import kv_rate
from kvstrata.settings import DTYPES
from kvstrata_lab.serve_bench.agents import Scripts
from kvstrata_lab.serve_bench.bench import _stream
from kvstrata_lab.serve_bench.config import BatchBenchConfig
from kvstrata_lab.serve_bench.peers import check_peer, peer_server
from kvstrata_lab.serve_bench.process import ServerProcess

SLACK_TOKENS = 16  # a prompt's text may re-tokenize a few tokens longer than it was cut to


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class _Prompts:
    def __init__(self, cfg: BatchBenchConfig):
        self.scripts = Scripts(load_tokenizer(cfg.model), cfg.prompt_tokens, 1, 0, cfg.seed)
        self.cfg, self.n, self.lock = cfg, 0, threading.Lock()

    def next(self, tokens: int | None = None) -> str:
        with self.lock:
            self.n += 1
            key = f"batch-{self.n}"
        return self.scripts.document(key, tokens or self.cfg.prompt_tokens)


def _level(server: ServerProcess, prompts: _Prompts, streams: int, requests: int, max_tokens: int) -> dict:
    """`streams` clients, `requests` sequential requests each; aggregate rate and per-request TPOT."""
    import openai  # optional dependency (the serve extra)

    records: list[dict] = []
    lock = threading.Lock()

    def client() -> None:
        oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=3600)
        for _ in range(requests):
            rec = _stream(oa, server.name, max_tokens, prompt=prompts.next())
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return _summary(records, wall) | {"streams": streams}


def _summary(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if not r["error"]]
    tpot = [
        (r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
        for r in ok
        if r["completion_tokens"] > 1
    ]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tpot_p50_s": _pct(tpot, 0.5),
        "tpot_p99_s": _pct(tpot, 0.99),
        "ttft_p50_s": _pct([r["ttft_s"] for r in ok], 0.5),
        "decode_rate_p50": _pct([1 / t for t in tpot if t > 0], 0.5),
    }


def _probe(server: ServerProcess, prompts: _Prompts, cfg: BatchBenchConfig) -> dict:
    """The probe prompt's TTFT on the idle server, then arriving while `probe_streams` streams decode."""
    import openai  # optional dependency (the serve extra)

    oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=3600)
    idle = _stream(oa, server.name, 1, prompt=prompts.next(cfg.probe_tokens))
    busy: dict = {}

    def late() -> None:
        while server.metric("kvstrata_requests_active") < cfg.probe_streams:
            time.sleep(0.05)
        time.sleep(1.0)  # the streams are decoding
        busy.update(_stream(oa, server.name, 1, prompt=prompts.next(cfg.probe_tokens)))

    prober = threading.Thread(target=late)
    prober.start()
    load = _level(server, prompts, cfg.probe_streams, 2, cfg.max_tokens * 2)
    prober.join()
    step = load["tpot_p50_s"] or 0.0
    bound = 1.5 * idle["ttft_s"] + step
    return {
        "idle_ttft_s": idle["ttft_s"],
        "loaded_ttft_s": busy.get("ttft_s"),
        "step_s": step,
        "bound_s": bound,
        "met": busy.get("ttft_s") is not None and busy["ttft_s"] <= bound,
        "streams": cfg.probe_streams,
    }


def _budget(server: ServerProcess, prompts: _Prompts, cfg: BatchBenchConfig) -> dict:
    """Sequences running at once under the KV budget (sampled), and each request's decode rate."""
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(server.metric("kvstrata_requests_active"))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    load = _level(server, prompts, cfg.budget_streams, cfg.requests, cfg.max_tokens)
    stop.set()
    sampler.join()
    busy = [s for s in samples if s > 0]
    return load | {
        "running_max": max(samples, default=0),
        "running_mean": statistics.fmean(busy) if busy else 0,
    }


def _server(cfg: BatchBenchConfig, root: Path, name: str, method: str, *args: str) -> ServerProcess:
    return ServerProcess(
        cfg.model,
        "--method",
        method,
        "--no-store",
        "--max-queue",
        "256",
        "--request-timeout",
        "3600",
        "--dtype",
        cfg.dtype,
        *args,
        env={"KVSTRATA_STORE_ROOT": str(root / name)},
        log_path=root / f"{name}.log",
        name=cfg.model,
    )


def per_stream(cfg: BatchBenchConfig, streams: int) -> int:
    """Requests each of `streams` streams sends at a level."""
    return max(cfg.requests, -(-cfg.level_requests // streams))


def budget_bytes(cfg: BatchBenchConfig) -> int:
    """The KV budget: `budget_sequences` bf16 sequences at their longest, by the server's own rule."""
    rate = kv_rate(load_config(cfg.model), "bf16")
    return cfg.budget_sequences * rate.bytes(cfg.prompt_tokens + SLACK_TOKENS + cfg.max_tokens)


def _peer(cfg: BatchBenchConfig, prompts: _Prompts, root: Path) -> dict:
    """The levels against the peer: a server per level, one slot per stream; an error is a result."""
    slot = cfg.prompt_tokens + SLACK_TOKENS + cfg.max_tokens + 64
    levels, describe = [], ""
    for n in cfg.streams:
        peer = peer_server(cfg.peer, cfg.model, n, slot, root)
        describe = peer.describe
        try:
            with peer as server:
                _level(server, prompts, 1, 1, 2)  # warm-up
                levels.append(_level(server, prompts, n, per_stream(cfg, n), cfg.max_tokens))
        except RuntimeError as exc:  # it cannot serve this model: reported, our rows kept
            error = str(exc).splitlines()[0]
            return {"name": cfg.peer, "describe": describe, "levels": levels, "error": error}
        print(f"{cfg.peer} {n}: {levels[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    return {"name": cfg.peer, "describe": describe, "levels": levels}


def run(cfg: BatchBenchConfig, command: str = "") -> dict:
    for method in cfg.methods:
        check_method(cfg.model, method, store=False)
    if cfg.peer:
        check_peer(cfg.peer, cfg.model)  # a missing build: refused before any phase runs
    prompts = _Prompts(cfg)
    root = Path(tempfile.mkdtemp(prefix="kvstrata-batch-bench-"))
    budget = budget_bytes(cfg)
    result: dict = {"config": asdict(cfg), "command": command, "budget_bytes": budget, "methods": {},
                    # the servers' linear layers (they load the model as this process would, same env)
                    "linear": "kernel" if linear.kernel() is not None else "torch"}
    top = max([*cfg.streams, cfg.probe_streams])
    try:
        for method in cfg.methods:
            rows: dict = {}
            for mode, args in (("batched", ()), ("unbatched", ("--no-batching",))):
                with _server(
                    cfg, root, f"{method}-{mode}", method, "--max-running", str(top), *args
                ) as server:
                    _level(server, prompts, 1, 1, 2)  # warm-up: kernel load, first-call costs
                    rows[mode] = {
                        "levels": [
                            _level(server, prompts, n, per_stream(cfg, n), cfg.max_tokens)
                            for n in cfg.streams
                        ]
                    }
                    rows[mode]["probe"] = _probe(server, prompts, cfg)
                print(
                    f"{method} {mode}: "
                    + ", ".join(
                        f"{lv['streams']}: {lv['tokens_per_s']:.1f} tok/s" for lv in rows[mode]["levels"]
                    ),
                    flush=True,
                )
            mb = f"{budget / 2**20:.4f}"
            with _server(
                cfg, root, f"{method}-budget", method, "--max-running", "256", "--kv-budget-mb", mb
            ) as server:
                _level(server, prompts, 1, 1, 2)
                rows["budget"] = _budget(server, prompts, cfg)
            result["methods"][method] = rows
        if cfg.peer:
            result["peer"] = _peer(cfg, prompts, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["summary"] = summarize(result)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(cfg.model).name  # a known model's name, or a model directory's last part (and the dtype)
    stem += "" if cfg.dtype == DTYPES[0] else f"-{cfg.dtype}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(render(result))
    return result


def summarize(result: dict) -> dict:
    """The issue's targets, per method: 8-stream aggregate over 1-stream (batched), batched over
    unbatched at each level, the late probe, and sequences held under the KV budget vs bf16's."""
    out = {}
    methods = result["methods"]
    peer = {x["streams"]: x for x in result.get("peer", {}).get("levels", [])}
    for method, rows in methods.items():
        lv = {x["streams"]: x for x in rows["batched"]["levels"]}
        un = {x["streams"]: x for x in rows["unbatched"]["levels"]}
        one = lv.get(1, {}).get("tokens_per_s") or None
        out[method] = {
            "scaling": {n: (x["tokens_per_s"] / one if one else None) for n, x in lv.items()},
            "vs_unbatched": {
                n: x["tokens_per_s"] / un[n]["tokens_per_s"]
                for n, x in lv.items()
                if n in un and un[n]["tokens_per_s"]
            },
            "probe_met": rows["batched"]["probe"]["met"],
            "budget_running_max": rows["budget"]["running_max"],
            "vs_peer": {
                n: x["tokens_per_s"] / peer[n]["tokens_per_s"]
                for n, x in lv.items()
                if n in peer and peer[n]["tokens_per_s"]
            },
        }
    if "bf16" in methods:
        base = methods["bf16"]["budget"]
        for method, rows in methods.items():
            b = rows["budget"]
            out[method]["budget_vs_bf16"] = (
                b["running_max"] / base["running_max"] if base["running_max"] else None
            )
            rate, ref = b["decode_rate_p50"], base["decode_rate_p50"]
            out[method]["rate_vs_bf16"] = rate / ref if rate and ref else None
    return out


def _f(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _peer_lines(result: dict) -> list[str]:
    """The peer's levels, and our batched tokens/s over its at each (same run)."""
    peer = result.get("peer")
    if not peer:
        return []
    lines = [
        "",
        f"Beside it, in the same run: {peer['name']} ({peer['describe']}), a server per level with one "
        "slot per stream (`-np`), the same prompts' kind and lengths."
        + (f" It failed: {peer['error']}" if peer.get("error") else ""),
        "",
        "| server | streams | tokens/s | TPOT p50 / p99 (s) | TTFT p50 (s) | "
        + " | ".join(f"`{m}` batched ÷ it" for m in result["methods"]) + " |",
        "|---|---|---|---|---|" + "---|" * len(result["methods"]),
    ]
    for x in peer["levels"]:
        ratios = [_f(result["summary"][m]["vs_peer"].get(x["streams"])) for m in result["methods"]]
        lines.append(
            f"| {peer['name']} | {x['streams']} | {x['tokens_per_s']:.1f} | {_f(x['tpot_p50_s'], '.3f')} / "
            f"{_f(x['tpot_p99_s'], '.3f')} | {_f(x['ttft_p50_s'], '.3f')} | " + " | ".join(ratios) + " |"
        )
    return lines


def render(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"# serve batching: {cfg['model']} ({cfg.get('dtype', 'float32')} weights)",
        "",
        f"`{result['command']}`" if result["command"] else "",
        "",
        (f"Linear layers: {result['linear']} (`kvstrata.hf.linear`). " if "linear" in result else "")
        + f"{cfg['requests']} requests per stream (at least {cfg.get('level_requests', 0)} per level), "
        f"{cfg['prompt_tokens']}-token prompts, {cfg['max_tokens']} "
        "tokens each, greedy, store off.",
        "",
        "| method | worker | streams | tokens/s | × 1 stream | × unbatched | TPOT p50 / p99 (s) "
        "| TTFT p50 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, rows in result["methods"].items():
        s = result["summary"][method]
        one = rows["batched"]["levels"][0]["tokens_per_s"]
        for mode in ("batched", "unbatched"):
            for x in rows[mode]["levels"]:
                vs = s["vs_unbatched"].get(x["streams"]) if mode == "batched" else None
                lines.append(
                    f"| `{method}` | {mode} | {x['streams']} | {x['tokens_per_s']:.1f} | "
                    f"{x['tokens_per_s'] / one:.2f} | {_f(vs)} | {_f(x['tpot_p50_s'], '.3f')} / "
                    f"{_f(x['tpot_p99_s'], '.3f')} | {_f(x['ttft_p50_s'], '.3f')} |"
                )
    lines += _peer_lines(result)
    lines += [
        "",
        "| method | worker | probe TTFT idle (s) | under load (s) | bound 1.5 × idle + one step (s) | met |",
        "|---|---|---|---|---|---|",
    ]
    for method, rows in result["methods"].items():
        for mode in ("batched", "unbatched"):
            p = rows[mode]["probe"]
            lines.append(
                f"| `{method}` | {mode} | {_f(p['idle_ttft_s'], '.3f')} | {_f(p['loaded_ttft_s'], '.3f')} | "
                f"{_f(p['bound_s'], '.3f')} | {'yes' if p['met'] else 'no'} |"
            )
    lines += [
        "",
        f"KV budget {result['budget_bytes'] / 2**20:.2f} MiB ({cfg['budget_sequences']} bf16 sequences "
        f"at their longest), {cfg['budget_streams']} streams:",
        "",
        "| method | running at once (max / mean) | × bf16 | decode tokens/s per request p50 | × bf16 "
        "| tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for method, rows in result["methods"].items():
        b, s = rows["budget"], result["summary"][method]
        lines.append(
            f"| `{method}` | {b['running_max']:.0f} / {b['running_mean']:.1f} | "
            f"{_f(s.get('budget_vs_bf16'))} | "
            f"{_f(b['decode_rate_p50'], '.1f')} | {_f(s.get('rate_vs_bf16'))} | {b['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"
