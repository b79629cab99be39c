"""The HTTP API (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics. Routes validate, tokenize and hand a `Job` to the model worker; answers come
back whole or as server-sent events in OpenAI's chunk format."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvstrata.names import Retention
from kvstrata.serve.auth import APIKeys, tenant_salt
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.errors import APIError, error_body
from kvstrata.serve.metrics import Metrics
from kvstrata.serve.prompts import Prompts
from kvstrata.serve.sampling import Sampling
from kvstrata.serve.schemas import ChatRequest, CompletionRequest, parse
from kvstrata.serve.worker import Event, Failed, Finished, Job, Outcome, TextDelta, Worker
from kvstrata.serve.write_behind import WriteBehindStore

log = logging.getLogger("kvstrata.serve")


@dataclass
class Runtime:
    """Everything the routes use, built once at startup (`kvstrata.serve.server.build`)."""

    cfg: ServeConfig
    prompts: Prompts
    worker: Worker
    metrics: Metrics
    keys: APIKeys
    store: WriteBehindStore | None
    fingerprint: str  # system_fingerprint: the store namespace (model, method, dtype, layout)
    started: int


class _CountResponses:
    """ASGI middleware: counts every response by endpoint and status (it never alters one)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.request(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def create_app(rt: Runtime) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        rt.worker.start()
        yield
        rt.worker.stop()
        if rt.store is not None:
            rt.store.close()

    app = FastAPI(title="kvstrata serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_CountResponses, metrics=rt.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return JSONResponse(
            error_body(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(ClientDisconnect)
    async def _hung_up(request, e: ClientDisconnect):
        # the client left before its body arrived: nothing to answer, nothing went wrong here
        log.info("%s: the client hung up before its request body arrived", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        log.exception("unexpected error")
        return JSONResponse(error_body(500, "internal error (logged by the server)"), status_code=500)

    @app.get("/health")
    async def health():
        waiting, active = rt.worker.load()
        pending = rt.store.pending if rt.store is not None else 0
        problems = rt.store.problems() if rt.store is not None else []
        read_only = rt.store.read_only if rt.store is not None else ""
        return {
            "status": "degraded" if problems else "ok", "model": rt.cfg.name, "store": rt.store is not None,
            "pending_writes": pending, "waiting": waiting, "active": active,
            **({"store_problems": problems} if problems else {}),
            **({"store_read_only": read_only} if read_only else {}),  # hits served, writes refused
        }

    @app.get("/metrics")
    async def metrics():
        body, content_type = rt.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        rt.keys.check(request.headers.get("authorization"))
        return {
            "object": "list",
            "data": [
                {
                    "id": rt.cfg.name, "object": "model", "created": rt.started, "owned_by": "kvstrata",
                    "max_model_len": rt.prompts.context,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(rt, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(rt, request, chat=True)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this server accepts at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _generate(rt: Runtime, request: Request, chat: bool):
    arrived = time.monotonic()
    key = rt.keys.check(request.headers.get("authorization"))
    req = parse(await _read_body(request, rt.cfg.max_body_bytes), ChatRequest if chat else CompletionRequest)
    if req.model != rt.cfg.name:
        raise APIError(
            404, f"the model {req.model!r} does not exist; this server serves {rt.cfg.name!r}",
            param="model", code="model_not_found",
        )
    ids = await run_in_threadpool(
        rt.prompts.chat_ids if chat else rt.prompts.completion_ids, req.messages if chat else req.prompt
    )
    max_tokens = rt.prompts.max_tokens(
        len(ids), req.limit if chat else req.max_tokens, rt.cfg.default_max_tokens
    )
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: Event):
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody to tell
            pass

    job = Job(
        ids=ids, max_tokens=max_tokens,
        sampling=Sampling(req.temperature or 0.0, req.top_p if req.top_p is not None else 1.0, req.seed),
        stops=req.stops, tenant=tenant_salt(key, req.cache_salt),
        retention=Retention(req.prompt_cache_retention or rt.cfg.default_retention),
        deadline=arrived + rt.cfg.request_timeout_s, emit=emit, arrived=arrived,
    )
    rt.worker.submit(job)
    shape = _Shape(rt, chat)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _sse(job, events, shape, usage), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    while True:
        try:
            event = await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return Response(status_code=499)  # nobody is listening
            continue
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Finished):
            return shape.whole(event.outcome)


class _Shape:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, rt: Runtime, chat: bool):
        self.chat, self.model, self.fp = chat, rt.cfg.name, rt.fingerprint
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "system_fingerprint": self.fp,
        }

    @staticmethod
    def usage(o: Outcome) -> dict:
        return {
            "prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
        }

    def whole(self, o: Outcome) -> dict:
        if self.chat:
            choice = {
                "index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                "finish_reason": o.finish_reason,
            }
        else:
            choice = {"index": 0, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
        return {
            **self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
            "usage": self.usage(o), "kvstrata": o.kvstrata(),
        }

    def usage_chunk(self, o: Outcome) -> dict:
        """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
            "usage": self.usage(o), "kvstrata": o.kvstrata(),
        }

    def chunk(self, text: str | None, first: bool = False, finish: str | None = None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice],
        }


def _data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse(job: Job, events: asyncio.Queue, shape: _Shape, include_usage: bool):
    """Server-sent events: one chunk per text delta, a last chunk with `finish_reason` and the
    `kvstrata` object, the usage chunk if asked, then `[DONE]`. Leaving early cancels the job."""
    first = True
    try:
        while True:
            event = await events.get()
            if isinstance(event, TextDelta):
                yield _data(shape.chunk(event.text, first=first))
                first = False
            elif isinstance(event, Finished):
                o: Outcome = event.outcome
                yield _data(
                    {**shape.chunk(None, first=first, finish=o.finish_reason), "kvstrata": o.kvstrata()}
                )
                if include_usage:
                    yield _data(shape.usage_chunk(o))
                yield "data: [DONE]\n\n"
                return
            else:
                e: APIError = event.error
                yield _data(e.body())
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancelled.set()  # no effect once done; stops the generation if the client went away
