"""`kvstrata serve-soak`: the agent workload of `serve-bench` against one server whose store is a
3-master Redis Cluster with a replica each, on loopback, while faults are injected on a schedule:
a master SIGKILLed (its replica promoted), the server SIGKILLed and restarted on the same store,
the masters filled (`maxmemory` set to what they hold: every write refused, the in-RAM analogue of
a full disk) for a while. Then every answer given within a minute after a fault, and a spread
sample of the rest, is re-asked of a store-off server and compared. Reported: wrong answers,
requests that failed after their retries or hung past the timeout, the server's RSS over time
against a stated bound, and the store's counters summed over both server lifetimes.
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kvstrata.hf.cache import CompressedCache
from kvstrata.hf.run import forward
from kvstrata.models import check_method, load, load_tokenizer
from kvstrata.models.loader import refuse_encoder_decoder
from kvstrata.place import KVStore, StoreConfig
from kvstrata_lab.serve_bench.agents import Scripts
from kvstrata_lab.serve_bench.bench import _Load, _server, _stream, check_fits
from kvstrata_lab.serve_bench.cluster import LoopbackCluster
from kvstrata_lab.serve_bench.config import ServeBenchConfig, SoakConfig
from kvstrata_lab.serve_bench.process import ServerProcess

TIE_LOGITS = 0.1  # a cold run whose two candidate tokens are this close has no single right answer
COUNTERS = ("writes", "refused", "errors", "corrupt", "unverifiable", "hits", "misses")
AFTER_FAULT_S = 60.0  # answers this close after a fault are all checked


class _Faults(threading.Thread):
    """Runs the fault schedule against the cluster and the server; samples the server's RSS."""

    def __init__(self, cfg: SoakConfig, cluster: LoopbackCluster, server: ServerProcess):
        super().__init__(daemon=True)
        self.cfg, self.cluster, self.server = cfg, cluster, server
        self.events: list[dict] = []
        self.rss: list[tuple[float, int]] = []
        self.before_restart: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        d = self.cfg.load.duration_s
        c = self.cfg
        plan = sorted([(c.master_kill_at * d, self._kill_master), (c.server_kill_at * d, self._restart),
                       (c.fill_at * d, self._fill), ((c.fill_at + c.fill_for) * d, self._unfill)],
                      key=lambda p: p[0])
        t0 = time.monotonic()
        while not self.done.is_set():
            now = time.monotonic() - t0
            while plan and plan[0][0] <= now:
                _, action = plan.pop(0)
                started = time.monotonic()
                detail = action()
                self.events.append({"at_s": round(now, 1), "event": action.__name__.strip("_"),
                                    "took_s": round(time.monotonic() - started, 2), **detail})
            self.rss.append((round(now, 1), _rss(self.server)))
            self.done.wait(5.0)

    def _kill_master(self) -> dict:
        return {"port": self.cluster.kill_master()}

    def _restart(self) -> dict:
        self.before_restart = store_counters(self.server)
        self.server.kill()
        self.server.start()
        return {}

    def _fill(self) -> dict:
        used = self.cluster.used_memory()
        for port, n in used.items():
            self.cluster.client(port).config_set("maxmemory", str(n + (64 << 10)))
        return {"used_bytes": used}

    def _unfill(self) -> dict:
        self.cluster.set_all("maxmemory", "0")
        return {}


def _rss(server: ServerProcess) -> int:
    try:
        for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def store_counters(server: ServerProcess) -> dict[str, float]:
    """The global tier's counters as the server's /metrics shows them."""
    return {n: server.metric(f"kvstrata_store_{n}_total", tier="global") for n in COUNTERS}


def _sample(records: list[tuple[dict, dict]], events: list[dict], n: int) -> list[tuple[dict, dict]]:
    """Every later turn answered within a minute after a fault, plus a spread of `n` others."""
    later = [(q, r) for q, r in records if r["turn"] > 1]
    near = [(q, r) for q, r in later
            if any(0 <= r["at_s"] - e["at_s"] <= AFTER_FAULT_S + e["took_s"] for e in events)]
    rest = [x for x in later if x not in near]
    return near + rest[:: max(1, len(rest) // max(n, 1))][:n]


def run(cfg: SoakConfig, command: str = "kvstrata serve-soak") -> dict:
    lc = cfg.load
    check_method(lc.model, lc.method, store=True)
    refuse_encoder_decoder(lc.model, command)
    check_fits(lc)
    tok = load_tokenizer(lc.model)
    scripts = Scripts(tok, lc.context, lc.turns, lc.tool_tokens, lc.seed)
    chat = bool(getattr(tok, "chat_template", None))
    root = Path(tempfile.mkdtemp(prefix="kvstrata-soak-"))
    secret = secrets.token_hex(32)
    result: dict = {"config": asdict(cfg), "command": command}
    cluster = LoopbackCluster(root / "cluster", masters=3, replicas=1).start()
    try:
        env = {"KVSTRATA_STORE_REDIS_URL": cluster.url, "KVSTRATA_STORE_REDIS_CLUSTER": "true",
               "KVSTRATA_STORE_SECRET": secret, "KVSTRATA_STORE_REDIS_CHECK_SECONDS": "5"}
        load = _Load(lc, scripts, chat, retries=cfg.retries, timeout_s=cfg.request_timeout_s)
        with _server(lc, root, "soak", *cfg.server_args, env=env) as server:
            faults = _Faults(cfg, cluster, server)
            faults.start()
            wall = load.run(server)
            faults.done.set()
            faults.join()
            server.wait_written()
            after = store_counters(server)
        store = KVStore.from_config(StoreConfig(root=str(root / "probe"), redis_url=cluster.url,
                                                redis_cluster=True, secret=secret))
        result["store_at_end"] = store.verify()
        result["counters"] = {n: faults.before_restart.get(n, 0) + after[n] for n in COUNTERS}
        with _server(lc, root, "no_store", *cfg.server_args, "--no-store") as reference:
            result["check"] = _compare(_sample(load.asked, faults.events, lc.check), reference, lc)
        rss = _rss_report(faults.rss, lc.duration_s, cfg.rss_bound)
        result.update(events=faults.events, wall_s=wall, rss=rss,
                      requests=_requests(load.records, cfg.request_timeout_s))
    finally:  # the servers' logs are part of the evidence
        logs = Path(lc.out) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for log in root.glob("*.log"):
            shutil.copy(log, logs / log.name)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    write(result, Path(lc.out))
    return result


def _compare(sample: list[tuple[dict, dict]], server: ServerProcess, lc: ServeBenchConfig) -> dict:
    """Re-ask each sampled request of the store-off server; an answer that differs is a *tie* when,
    in a cold in-process run, the two answers' first differing tokens are within `TIE_LOGITS`
    (floating-point order decides such a tie), else *wrong*."""
    import openai  # optional dependency (the serve extra)

    oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=3600)
    differ, judge = [], None
    for request, rec in sample:
        again = _stream(oa, server.name, lc.max_tokens, **request)
        if again.get("text") != rec["text"]:
            judge = judge or _ColdJudge(lc)
            gap = judge.gap(request, rec["text"], again.get("text") or "")
            differ.append({**{k: rec[k] for k in ("client", "turn", "at_s", "kind")}, "logit_gap": gap})
    ties = sum(r["logit_gap"] is not None and r["logit_gap"] <= TIE_LOGITS for r in differ)
    return {"checked": len(sample), "differ": len(differ), "ties": ties, "wrong": len(differ) - ties,
            "tie_logits": TIE_LOGITS, "rows": differ}


class _ColdJudge:
    """The model in this process, for the cold logits at the point where two answers part."""

    def __init__(self, lc: ServeBenchConfig):
        self.model, self.tok = load(lc.model)
        self.method = lc.method

    def ids(self, request: dict) -> list[int]:
        if "messages" in request:
            text = self.tok.apply_chat_template(request["messages"], tokenize=False,
                                                add_generation_prompt=True)
            return self.tok(text, add_special_tokens=False).input_ids
        return self.tok(request["prompt"]).input_ids

    def gap(self, request: dict, on: str, off: str) -> float | None:
        """|logit(on's token) - logit(off's token)| at their first differing token, in a cold run fed
        the shared part; None when the texts do not part at a token (tokenization)."""
        a, b = (self.tok(t, add_special_tokens=False).input_ids for t in (on, off))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None:
            return None
        with torch.no_grad():
            logits = forward(self.model, torch.tensor([self.ids(request) + a[:n]]),
                             CompressedCache(self.model.config, self.method))[0, -1].float()
        return abs(float(logits[a[n]] - logits[b[n]]))


def _requests(records: list[dict], timeout_s: float) -> dict:
    failed = [r for r in records if r["error"]]
    return {
        "total": len(records), "failed_after_retries": len(failed),
        "hangs": sum("Timeout" in r["error"] for r in failed),
        "retried": sum(r["attempts"] > 1 for r in records), "timeout_s": timeout_s,
        "kinds": {k: sum(r.get("kind") == k for r in records) for k in ("hit", "replay", "miss")},
        "errors": sorted({r["error"][:120] for r in failed}),
    }


def _rss_report(samples: list[tuple[float, int]], duration_s: float, bound: float) -> dict:
    """RSS once warm (the first sample past 10 % of the run) and its peak after; within the bound?"""
    warm = next((b for t, b in samples if t >= 0.1 * duration_s and b), 0)
    peak = max((b for t, b in samples if t >= 0.1 * duration_s), default=0)
    growth = (peak - warm) / warm if warm else None
    return {"warm_bytes": warm, "peak_bytes": peak, "growth": growth, "bound": bound,
            "within": growth is not None and growth <= bound, "samples": samples}


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    rq, ck, rss, c = result["requests"], result["check"], result["rss"], result["counters"]
    lines = [
        "# Soak under faults", "", f"Command: `{result.get('command', 'kvstrata serve-soak')}`", "",
        "| what | result |", "|---|---|",
        f"| requests | {rq['total']} ({rq['kinds']}) |",
        f"| answers differing from a store-off server's | {ck['differ']} of {ck['checked']} checked: "
        f"{ck['ties']} ties (cold logits within {ck['tie_logits']}), **{ck['wrong']} wrong** |",
        f"| failed after {result['config']['retries']} retries / hung past {rq['timeout_s']:.0f} s | "
        f"{rq['failed_after_retries']} / {rq['hangs']} (retried: {rq['retried']}) |",
        f"| server RSS warm → peak | {rss['warm_bytes'] / 2**20:.0f} → {rss['peak_bytes'] / 2**20:.0f} MiB "
        f"(growth {100 * (rss['growth'] or 0):.0f} %, bound {100 * rss['bound']:.0f} %: "
        f"{'within' if rss['within'] else 'OVER'}) |",
        f"| global records written / refused / transport errors | {c['writes']:.0f} / {c['refused']:.0f} / "
        f"{c['errors']:.0f} |",
        f"| corrupt / unverifiable records met | {c['corrupt']:.0f} / {c['unverifiable']:.0f} |",
        f"| records in the cluster at the end (verified) | {result['store_at_end']['checked']} checked, "
        f"{result['store_at_end']['corrupt_removed']} corrupt |",
        "", "Faults:", "",
        *[f"- {e['at_s']:.0f} s: {e['event'].replace('_', ' ')} (took {e['took_s']} s)"
          for e in result["events"]],
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
