"""What one step of the model worker runs: which waiting requests start, and which rows share the forward.

Continuous batching as serving engines do it: every running request that is decoding adds one
token; waiting prefills add chunks (at most `prefill_chunk` tokens each, cut where the prompt alone
decides) in admission order while the step's token budget `max_batched_tokens` lasts -- at least
one chunk per step, so a prompt always advances. Admission is first come, first served: a request
starts when a running slot is free and, with a KV budget, when the bytes its cache will hold at
its longest (prompt + `max_tokens`, from the method's own byte accounting) fit beside what the
running requests reserved; until then it waits -- the head of the queue is never skipped. With
`batching` off a step runs one request's row (a prefill chunk first, else the next decoding request
in turn): the unbatched worker `serve-bench` compares with.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.accounting import account_hf
from kvstrata.hf.cache import layer_classes
from kvstrata.settings import Limits  # declared with the settings the CLI reads without torch


@dataclass(frozen=True)
class KVRate:
    """Bytes a request's cache holds after `tokens` tokens, at most: `fixed + per_token * tokens`
    (sliding windows and sinks are in `fixed`: an upper bound for short contexts)."""

    per_token: float
    fixed: float

    def bytes(self, tokens: int) -> int:
        return int(self.fixed + self.per_token * tokens)


def kv_rate(config, method: str) -> KVRate:
    """The method's `KVRate` on this model, from two byte accountings of the cache itself (past every
    sliding window, where growth is linear)."""
    windows = [w for c, w in layer_classes(config) if c == "sliding"]
    t1 = max([1024, *windows])
    b1 = account_hf(config, method, t1)["total_bytes"]
    b2 = account_hf(config, method, 2 * t1)["total_bytes"]
    per_token = (b2 - b1) / t1
    return KVRate(per_token=per_token, fixed=max(0.0, b1 - per_token * t1))


def admit(waiting_needs: list[int], running: int, reserved: int, limits: Limits) -> int:
    """How many at the head of the queue start now, first come first served: `waiting_needs` are
    their KV reservations (bytes), `reserved` what the running requests hold reserved."""
    n = 0
    for need in waiting_needs:
        if running + n >= limits.max_running:
            break
        if limits.kv_budget_bytes and reserved + need > limits.kv_budget_bytes and running + n > 0:
            break
        reserved += need
        n += 1
    return n


def plan(decoding: list[int], prefilling: list[tuple[int, int]], limits: Limits, turn: int) -> list[int]:
    """The requests (indices) whose rows run this step. `decoding`: requests with a token to decode;
    `prefilling`: (request, tokens of its next chunk), in admission order; `turn`: a counter that
    rotates the unbatched worker over its decoding requests."""
    if not limits.batching:
        if prefilling:
            return [prefilling[0][0]]
        return [decoding[turn % len(decoding)]] if decoding else []
    rows = list(decoding)
    tokens = len(rows)
    for i, n in prefilling:
        if tokens + n > limits.max_batched_tokens and len(rows) > len(decoding):
            break
        rows.append(i)
        tokens += n
    return rows
