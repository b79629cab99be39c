"""The single model worker: one thread owns the model and runs every request in batched steps.

Each step is one forward (`kvstrata.hf.batch.batched_forward`) over a row per request that the
scheduler (`kvstrata.serve.scheduler`) picked: one token for each request that is decoding, and
chunks of waiting prefills within the step's token budget (chunked prefill: a long new prompt does
not stall the running streams). Every request keeps its own `CompressedCache` and its own store
state (hit, replay or miss, records written when its prompt has run); the linear layers run once
over the batch and attention runs per row over that row's codes. At most `max_running` requests
run at once (and, with a KV budget, only as many as their caches fit at their longest); at most
`max_queue` more wait; one beyond that is refused at once (429 with `Retry-After`).

Each request checks, between steps, whether its client went away (generation stops) and whether
its deadline passed (before the first token: 504; after: it ends as if `max_tokens` were reached).
A request whose row fails (an exception in its cache) fails alone with a 500; the other rows of
the step are unaffected. Results go back through the request's `emit` as events (`TextDelta`,
`Finished`, `Failed`), which is safe to call from this thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstrata.hf.batch import Row, batched_forward
from kvstrata.hf.topk_attention import read_state
from kvstrata.names import FinishReason, Retention, ServeKind
from kvstrata.place.prefix_server import Prefill, Served
from kvstrata.serve.errors import APIError
from kvstrata.serve.sampling import Sampler, Sampling
from kvstrata.serve.scheduler import Limits, admit, kv_rate, plan
from kvstrata.serve.streaming import TextStream

log = logging.getLogger("kvstrata.serve")


@dataclass(frozen=True)
class TextDelta:
    """More of the answer's text (may be empty: the first token came, its text is held back)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The request is done."""

    outcome: "Outcome"


@dataclass(frozen=True)
class Failed:
    """The request failed (its HTTP status and body are the error's)."""

    error: APIError


Event = TextDelta | Finished | Failed


@dataclass(kw_only=True)
class Job:
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]
    tenant: bytes
    retention: Retention
    deadline: float  # time.monotonic() by which the request must be done
    emit: Callable[[Event], None]
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(kw_only=True)
class Outcome:
    text: str
    finish_reason: FinishReason  # stop | length
    prompt_tokens: int
    completion_tokens: int
    kind: ServeKind
    reused_tokens: int
    computed_tokens: int
    ttft_s: float
    queue_s: float
    write_s: float = 0.0  # of ttft_s: snapshotting and encoding new blocks before handing them to the writer
    timed_out: bool = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens that did not run through the model (OpenAI's `cached_tokens`)."""
        return self.prompt_tokens - self.computed_tokens

    def kvstrata(self) -> dict:
        return {
            "kind": self.kind, "reused_tokens": self.reused_tokens, "computed_tokens": self.computed_tokens,
            "ttft_s": round(self.ttft_s, 6), "queue_s": round(self.queue_s, 6),
            "write_s": round(self.write_s, 6), "timed_out": self.timed_out,
        }


class _Run:
    """One admitted request: its prompt on its way in, then its cache, sampler and text so far."""

    def __init__(self, job: Job, decode: Callable[[list[int]], str], need: int):
        self.job = job
        self.need = need  # KV bytes reserved for it
        self.prefill: Prefill | None = None
        self.served: Served | None = None
        self.read = None  # its top-k read state, when the method reads sparsely
        self.chunk: list[int] = []  # what its row feeds this step
        self.sampler = Sampler(job.sampling)
        self.text = TextStream(decode, job.stops)
        self.tokens = 0
        self.last = -1
        self.started = 0.0
        self.ttft = 0.0
        self.ended = False


class Worker:
    def __init__(
        self, model, sessions, decode: Callable[[list[int]], str], eos_ids: set[int], context: int, metrics,
        limits: Limits | None = None,
    ):
        self.model, self.sessions, self.decode, self.eos, self.context = (
            model, sessions, decode, eos_ids, context,
        )
        self.metrics, self.limits = metrics, limits or Limits()
        self.rate = kv_rate(model.config, sessions.method) if self.limits.kv_budget_bytes else None
        self._waiting: deque[Job] = deque()
        self._active = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._service_s = 1.0  # moving average of a request's time in the worker (for Retry-After)
        self._thread = threading.Thread(target=self._loop, name="kvstrata-model-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def load(self) -> tuple[int, int]:
        """(requests waiting, requests running)."""
        with self._cond:
            return len(self._waiting), self._active

    def need(self, job: Job) -> int:
        """KV bytes `job`'s cache holds at its longest (0 without a KV budget)."""
        if self.rate is None:
            return 0
        return self.rate.bytes(min(len(job.ids) + job.max_tokens, self.context))

    def submit(self, job: Job) -> None:
        """Queue `job`, or refuse it: 400 when its KV alone exceeds the budget, 429 when full, 503 when
        shutting down."""
        need, budget = self.need(job), self.limits.kv_budget_bytes
        if budget and need > budget:
            raise APIError(400, f"prompt + max_tokens ({len(job.ids)} + {job.max_tokens} tokens) needs "
                                f"{need / 2**20:.1f} MiB of KV; the server's KV budget is "
                                f"{budget / 2**20:.1f} MiB",
                           code="context_length_exceeded")
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down")
            running = self.limits.max_running
            if len(self._waiting) + self._active >= running + self.limits.max_queue:
                wait = math.ceil(self._service_s * (len(self._waiting) + 1) / running)
                raise APIError(
                    429,
                    f"the server is busy ({self._active} running, {len(self._waiting)} waiting); retry later",
                    code="queue_full", headers={"Retry-After": str(min(max(wait, 1), 60))},
                )
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def _loop(self) -> None:
        active: list[_Run] = []  # in admission order
        turn = 0  # rotates the unbatched worker over its decoding requests
        while True:
            with self._cond:
                while not self._waiting and not active and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                reserved = sum(r.need for r in active)
                needs = [self.need(job) for job in list(self._waiting)[: self.limits.max_running]]
                for need in needs[: admit(needs, len(active), reserved, self.limits)]:
                    active.append(_Run(self._waiting.popleft(), self.decode, need))
                self._active = len(active)
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.active.set(self._active)
            active = [r for r in active if not self._check(r)]
            if active:
                self._step(active, turn)
                turn += 1
                active = [r for r in active if not r.ended]
            with self._cond:
                self._active = len(active)
        for run in active + list(self._waiting):  # shutting down
            job = run.job if isinstance(run, _Run) else run
            job.emit(Failed(APIError(503, "the server is shutting down")))

    # --- one batched step ---------------------------------------------------------------------
    def _check(self, run: _Run) -> bool:
        """Between steps: True when `run` ended (cancelled, past its deadline, or its prompt failed)."""
        job = run.job
        if job.cancelled.is_set():
            return self._end(run, FinishReason.CANCELLED)
        if time.monotonic() > job.deadline:
            if run.served is None:
                job.emit(Failed(APIError(504, "the request passed its deadline before its first token")))
                self.metrics.finished.labels("deadline").inc()
                return True
            return self._end(run, FinishReason.LENGTH, timed_out=True)
        if run.prefill is None and run.served is None:
            try:
                run.started = time.monotonic()
                run.prefill = self.sessions.begin(job.ids, job.tenant, job.retention)
                run.read = read_state(self.model, run.prefill.cache, self.sessions.spec)
            except Exception:  # a bug of ours, not the client's: log it, answer 500 without a traceback
                return self._fail(run)
        return False

    def _step(self, active: list[_Run], turn: int) -> None:
        decoding = [i for i, r in enumerate(active) if r.served is not None]
        prefilling = []
        for i, r in enumerate(active):
            if r.served is None:
                r.chunk = r.prefill.next_chunk(self.limits.prefill_chunk)
                prefilling.append((i, len(r.chunk)))
        runs = [active[i] for i in plan(decoding, prefilling, self.limits, turn)]
        rows = [Row(cache=(r.served or r.prefill).cache, ids=[r.last] if r.served else r.chunk, read=r.read)
                for r in runs]
        try:
            logits = batched_forward(self.model, rows)
        except Exception:  # the batch itself failed (not one row): every request in it fails
            for r in runs:
                self._fail(r)
            return
        for i, (r, row) in enumerate(zip(runs, rows)):
            if row.error is not None:
                log.error("request failed in the model worker", exc_info=row.error)
                self._fail(r, logged=True)
                continue
            try:
                if r.served is None:
                    r.prefill.fed(len(row.ids))
                    if not r.prefill.done:
                        continue
                    r.served, r.prefill = r.prefill.finish(logits[i:i + 1]), None
                self._take(r, logits[i:i + 1])
            except Exception:
                self._fail(r)

    def _fail(self, run: _Run, logged: bool = False) -> bool:
        if not logged:
            log.exception("request failed in the model worker")
        run.job.emit(Failed(APIError(500, "internal error while generating (logged by the server)")))
        self.metrics.finished.labels("error").inc()
        run.ended = True
        return True

    def _take(self, run: _Run, logits: torch.Tensor) -> bool:
        token = run.sampler(logits)
        first = run.tokens == 0 and not run.ttft
        if first:
            run.ttft = time.monotonic() - run.started
        if token in self.eos:
            return self._end(run, FinishReason.STOP)
        run.tokens += 1
        run.last = token
        delta, stopped = run.text.push(token)
        if delta or first:
            run.job.emit(TextDelta(delta))
        if stopped:
            return self._end(run, FinishReason.STOP)
        if run.tokens >= run.job.max_tokens or len(run.job.ids) + run.tokens >= self.context:
            return self._end(run, FinishReason.LENGTH)
        return False

    def _end(self, run: _Run, reason: FinishReason, timed_out: bool = False) -> bool:
        job, served = run.job, run.served
        run.ended = True
        self.metrics.finished.labels("deadline" if timed_out else reason).inc()
        if served is None:  # cancelled while waiting
            return True
        rest = run.text.finish() if reason is not FinishReason.CANCELLED else ""
        if rest:
            job.emit(TextDelta(rest))
        queue_s = run.started - job.arrived
        out = Outcome(
            text=run.text.text, finish_reason=reason, prompt_tokens=len(job.ids),
            completion_tokens=run.tokens,
            kind=served.kind, reused_tokens=served.reused_tokens, computed_tokens=served.computed_tokens,
            ttft_s=run.ttft, queue_s=queue_s, write_s=served.write_s, timed_out=timed_out,
        )
        self.metrics.prompt(
            out.kind, out.prompt_tokens, out.cached_tokens, out.computed_tokens, out.ttft_s, queue_s
        )
        self.metrics.generated_tokens.inc(run.tokens)
        self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - run.started)
        job.emit(Finished(out))
        return True
