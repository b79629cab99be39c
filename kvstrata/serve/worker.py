"""The single model worker: one thread owns the model and interleaves requests step by step.

Scheduling: up to `max_active` requests run at once, one step at a time: a new request's prefill
through the store (the whole prompt at once) goes first, then the running requests take one decode
token each in turn -- so a new request's first token waits for the step in flight and the prefills
queued before it, never for other requests' whole answers. Steps are not batched into one forward:
each request has its own `CompressedCache` (its own length, segments and replay state) and the
transformers cache holds one sequence length per layer, so batching would need a ragged, batched
compressed cache. The price is throughput under concurrency (a decode step reads the weights once
per request, not once per batch); `serve-bench` measures it. At most `max_queue` more requests
wait; one beyond that is refused at once (429 with `Retry-After`).

Each request checks, between steps, whether its client went away (generation stops) and whether
its deadline passed (before the first token: 504; after: it ends as if `max_tokens` were reached).
Results go back through the request's `emit` as events (`TextDelta`, `Finished`, `Failed`), which
is safe to call from this thread.
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

from kvstrata.hf.run import forward
from kvstrata.hf.topk_attention import reading
from kvstrata.names import FinishReason, Retention, ServeKind
from kvstrata.serve.errors import APIError
from kvstrata.serve.sampling import Sampler, Sampling
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
    """One active request: its cache, sampler, text so far."""

    def __init__(self, job: Job, decode: Callable[[list[int]], str]):
        self.job = job
        self.served = None
        self.sampler = Sampler(job.sampling)
        self.text = TextStream(decode, job.stops)
        self.tokens = 0
        self.last = -1
        self.started = 0.0
        self.ttft = 0.0


class Worker:
    def __init__(
        self, model, sessions, decode: Callable[[list[int]], str], eos_ids: set[int], context: int, metrics,
        max_active: int = 4, max_queue: int = 16,
    ):
        self.model, self.sessions, self.decode, self.eos, self.context = (
            model, sessions, decode, eos_ids, context,
        )
        self.metrics, self.max_active, self.max_queue = metrics, max_active, max_queue
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

    def submit(self, job: Job) -> None:
        """Queue `job`, or refuse it: 429 when full, 503 when shutting down."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down")
            if len(self._waiting) + self._active >= self.max_active + self.max_queue:
                wait = math.ceil(self._service_s * (len(self._waiting) + 1) / self.max_active)
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
        turn = 0  # round-robin position among the requests that are decoding
        while True:
            with self._cond:
                while not self._waiting and not active and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                while self._waiting and len(active) < self.max_active:
                    active.append(_Run(self._waiting.popleft(), self.decode))
                self._active = len(active)
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.active.set(self._active)
            # prefill first: a new request waits for at most the step in flight, not a round of them
            i = next((j for j, r in enumerate(active) if r.served is None), None)
            if i is None:
                i = turn = turn % len(active)
                turn += 1
            if self._step(active[i]):
                del active[i]
                turn -= i < turn
            with self._cond:
                self._active = len(active)
        for run in active + list(self._waiting):  # shutting down
            job = run.job if isinstance(run, _Run) else run
            job.emit(Failed(APIError(503, "the server is shutting down")))

    # --- one step of one request --------------------------------------------------------------
    def _step(self, run: _Run) -> bool:
        """Advance `run` by one step; True when it has ended."""
        job = run.job
        if job.cancelled.is_set():
            return self._end(run, FinishReason.CANCELLED)
        if time.monotonic() > job.deadline:
            if run.served is None:
                job.emit(Failed(APIError(504, "the request passed its deadline before its first token")))
                self.metrics.finished.labels("deadline").inc()
                return True
            return self._end(run, FinishReason.LENGTH, timed_out=True)
        try:
            if run.served is None:
                run.started = time.monotonic()
                run.served = self.sessions.serve(job.ids, job.tenant, job.retention)
                return self._take(run, run.served.logits)
            with reading(self.model, run.served.cache, self.sessions.spec):
                logits = forward(self.model, torch.tensor([[run.last]]), run.served.cache)[:, -1]
            return self._take(run, logits)
        except Exception:  # a bug of ours, not the client's: log it, answer 500 without a traceback
            log.exception("request failed in the model worker")
            job.emit(Failed(APIError(500, "internal error while generating (logged by the server)")))
            self.metrics.finished.labels("error").inc()
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
