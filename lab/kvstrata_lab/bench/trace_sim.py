"""Multi-turn agent trace simulator: does an SWA pool of a share of RAM with a minutes-scale TTL
hold the live SWA state of an agent workload?

Sessions alternate user and tool-call turns separated by think times; each turn appends tokens
to the session's prefix. Global KV is persistent (every complete block stays), so a turn's
outcome depends on its SWA state: still live in the pool (hit), expired or evicted (bounded
replay), or a brand-new session (miss). The pool is the real `MemoryTier` run on a simulated
clock; TTFT comes from a per-token cost model measured on the real model (`store-bench`).
"""

from __future__ import annotations

import contextlib
import heapq
import random
from dataclasses import asdict, dataclass

from kvstrata.place import tier
from kvstrata.place.memory import MemoryTier


@dataclass(frozen=True)
class TraceConfig:
    sessions: int = 2000
    turns: int = 12
    arrival_span_s: float = 3600.0  # sessions start uniformly over this span
    think_user_s: float = 60.0  # mean think time before a user turn (exponential)
    think_tool_s: float = 4.0  # mean tool latency before a tool-result turn
    user_tokens: int = 150
    tool_tokens: int = 1200
    system_tokens: int = 4000
    swa_state_bytes: int = 2_000_000  # one session's SWA window state, all sliding layers
    global_bytes_per_token: float = 890.0
    pool_bytes: int = int(0.10 * 24 * 2**30)
    ttl_s: float = 300.0
    prefill_s_per_token: float = 0.004
    replay_tokens: int = 1024
    load_s_per_token: float = 0.00005
    seed: int = 0


@contextlib.contextmanager
def simulated_clock(box: list[float]):
    real = tier.now
    tier.now = lambda: box[0]
    try:
        yield
    finally:
        tier.now = real


def simulate(cfg: TraceConfig) -> dict:
    rng = random.Random(cfg.seed)
    clock = [0.0]
    pool = MemoryTier(cfg.pool_bytes)
    events = [(rng.uniform(0, cfg.arrival_span_s), s, 0, cfg.system_tokens + cfg.user_tokens)
               for s in range(cfg.sessions)]
    heapq.heapify(events)
    outcomes = {"hit": 0, "replay": 0, "miss": 0}
    ttft, global_tokens, peak_pool, last_reclaim = [], 0, 0, 0.0
    with simulated_clock(clock):
        while events:
            t, s, turn, tokens = heapq.heappop(events)
            clock[0] = t
            if t - last_reclaim >= 10.0:  # expired states are reclaimed at once (every 10 simulated s)
                pool.reclaim_expired()
                last_reclaim = t
            key = f"s{s}"
            new = cfg.system_tokens + \
                cfg.user_tokens if turn == 0 else (cfg.tool_tokens if turn % 2 else cfg.user_tokens)
            prefix = tokens - new
            if turn == 0:
                kind, cost = "miss", tokens * cfg.prefill_s_per_token
            elif pool.get(key) is not None:
                kind, cost = "hit", prefix * cfg.load_s_per_token + new * cfg.prefill_s_per_token
            else:
                kind = "replay"
                cost = prefix * cfg.load_s_per_token + \
                    (min(cfg.replay_tokens, prefix) + new) * cfg.prefill_s_per_token
            outcomes[kind] += 1
            ttft.append(cost)
            global_tokens += new
            _put(pool, key, cfg)
            peak_pool = max(peak_pool, pool.nbytes())
            if turn + 1 < cfg.turns:
                think = rng.expovariate(1 / (cfg.think_tool_s if turn % 2 == 0 else cfg.think_user_s))
                nxt = cfg.tool_tokens if turn % 2 == 0 else cfg.user_tokens
                heapq.heappush(events, (t + cost + think, s, turn + 1, tokens + nxt))
    ttft.sort()
    pct = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))]  # noqa: E731
    later = outcomes["hit"] + outcomes["replay"]
    return {
        "config": asdict(cfg),
        "turns": len(ttft), "outcomes": outcomes,
        "swa_hit_rate_after_first_turn": outcomes["hit"] / later if later else None,
        "swa_evicted_for_capacity": pool.stats.evicted, "swa_expired": pool.stats.expired,
        "peak_swa_pool_bytes": peak_pool, "pool_bytes": cfg.pool_bytes,
        "global_bytes": global_tokens * cfg.global_bytes_per_token,
        "ttft_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "mean": sum(ttft) / len(ttft)},
    }


def _put(pool: MemoryTier, key: str, cfg: TraceConfig) -> None:
    """The session's SWA state after its turn: `swa_state_bytes`, live for the TTL."""
    pool.put(key, bytes(cfg.swa_state_bytes), ttl_s=cfg.ttl_s)
