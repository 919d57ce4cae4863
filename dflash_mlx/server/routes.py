"""The HTTP handlers over one engine: each dialect's completion route, count_tokens, models, health and metrics.

A completion is parsed off the event loop (``run_in_threadpool``), queued for the
engine, and answered whole or as server-sent events; each request logs one line.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

import mlx.core as mx
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic_api, openai_api
from .engine import Engine
from .jobs import Job
from .request import APIError, Dialect, read_body, sse

log = logging.getLogger("dflash_mlx.serve")


class Routes:
    """The handlers, sharing the engine and the server's settings (key, body limit, keep-alive interval)."""

    def __init__(self, engine: Engine, dialects: tuple[Dialect, ...], api_key: Optional[str], max_body: int,
                 keepalive: float) -> None:
        self.engine, self.dialects, self.api_key = engine, dialects, api_key
        self.max_body, self.keepalive = max_body, keepalive

    def table(self) -> list[Route]:
        routes = [Route(path, self.completion(d), methods=["POST"]) for d in self.dialects for path in d.paths]
        return routes + [
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    def authorize(self, request: Request) -> None:
        """``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""
        if self.api_key is None:
            return
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                           code="invalid_api_key", kind="authentication_error")

    async def read_json(self, request: Request) -> Any:
        self.authorize(request)
        length = request.headers.get("content-length")
        too_large = APIError(413, f"request body above {self.max_body} bytes", code="request_too_large")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                raise too_large
        return read_body(bytes(raw))

    def logged(self, request: Request, status: int, started: float, done: Optional[dict[str, Any]] = None,
               reason: str = "") -> None:
        """One line per request (with why it was refused), and the request counter."""
        self.engine.metrics.requests.labels(request.url.path, str(status)).inc()
        figures = f": {reason}" if reason else ""
        if done:
            speed = f" @ {done['decode_tps']:.1f} tok/s" if done["completion_tokens"] > 1 else ""
            figures = (f" prompt {done['prompt_tokens']} tok ({done['cached_tokens']} cached) -> "
                       f"{done['completion_tokens']} tok{speed}, tau {done['dflash']['tau']:.2f}, "
                       f"{done['finish_reason']}")
        log.info("%s %s %d%s in %.2f s", request.method, request.url.path, status, figures,
                 time.perf_counter() - started)

    @staticmethod
    async def events(request: Request, job: Job, idle: float) -> AsyncIterator[tuple[str, Any]]:
        """The engine's reports for ``job``, and ("idle", None) after each ``idle`` seconds of silence.

        A client that leaves cancels the job at once, whatever its answer is doing (a whole answer's pieces keep
        coming while it decodes, and nothing is written to the client that could fail), and when the stream is
        closed.
        """
        watcher = asyncio.create_task(_cancel_when_gone(request, job))
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=idle)
                except asyncio.TimeoutError:
                    yield "idle", None
                    continue
                yield kind, value
                if kind in ("done", "error"):
                    return
        finally:
            watcher.cancel()
            job.cancelled.set()  # a no-op once done; stops the work if the client left

    @staticmethod
    def refusal(dialect: Dialect, e: APIError) -> JSONResponse:
        return JSONResponse(dialect.error_body(e), status_code=e.status)

    def completion(self, dialect: Dialect) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            """Parse, queue, and answer whole or as server-sent events."""
            started = time.perf_counter()
            body: Any = None
            try:
                body = await self.read_json(request)
                completion = await run_in_threadpool(parse, dialect.parse, body, self.engine, request.url.path)
            except APIError as e:
                self.logged(request, e.status, started, reason=e.message)
                streamed = isinstance(body, dict) and body.get("stream") is True
                if dialect.refuse_in_stream is not None and streamed and e.status == 400:
                    refused = dialect.refuse_in_stream(e, self.engine)
                    return StreamingResponse(iter([sse(event) for event in refused]), media_type="text/event-stream")
                return self.refusal(dialect, e)
            job = Job(completion, asyncio.get_running_loop())
            self.engine.jobs.put(job)
            answer = dialect.answer(completion, self.engine)
            if completion.stream:
                return StreamingResponse(self.stream(request, dialect, job, answer, started),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return await self.whole(request, dialect, job, answer, started)

        return handle

    async def whole(self, request: Request, dialect: Dialect, job: Job, answer: Any, started: float) -> Response:
        async for kind, value in self.events(request, job, idle=0.5):
            if kind == "piece":
                answer.add(value)
            elif kind == "error":
                self.logged(request, value.status, started, reason=value.message)
                return self.refusal(dialect, value)
            elif kind == "done" and value is not None:
                self.logged(request, 200, started, value)
                return JSONResponse(answer.whole(value))
            elif kind == "done":
                break
        self.logged(request, 499, started, reason="the client left")
        return Response(status_code=499)  # the client left

    async def stream(self, request: Request, dialect: Dialect, job: Job, answer: Any,
                     started: float) -> AsyncIterator[str]:
        status, done, reason = 200, None, ""
        try:
            async for kind, value in self.events(request, job, idle=self.keepalive):
                if kind == "idle":
                    yield dialect.keepalive
                    continue
                if kind == "start":
                    out = answer.start(value["prompt_tokens"], value["cached_tokens"])
                elif kind == "piece":
                    out = answer.add(value)
                elif kind == "error":
                    status, reason = value.status, value.message
                    out = answer.failed(value)
                elif value is not None:
                    done, out = value, answer.last(value)
                else:
                    status, reason, out = 499, "the client left", []
                for event in out:
                    yield sse(event)
            if dialect.done is not None and status != 499:
                yield f"data: {dialect.done}\n\n"
        finally:
            if status == 200 and done is None:
                status, reason = 499, "the client left"
            self.logged(request, status, started, done, reason)

    async def count_tokens(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await self.read_json(request)
            ids, _ = await run_in_threadpool(parse, anthropic_api.prompt, body, self.engine, request.url.path)
        except APIError as e:
            self.logged(request, e.status, started, reason=e.message)
            return self.refusal(anthropic_api.MESSAGES, e)
        self.logged(request, 200, started)
        return JSONResponse({"input_tokens": len(ids)})

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except APIError as e:
            return self.refusal(openai_api.CHAT, e)
        return JSONResponse({"object": "list", "data": [
            {"id": self.engine.name, "object": "model", "created": 0, "owned_by": "dflash-mlx",
             "context_length": self.engine.target.max_positions}]})

    async def health(self, request: Request) -> Response:
        """Liveness for anyone (load balancers, supervisors); the figures only with the key, when there is one."""
        try:
            self.authorize(request)
        except APIError:
            return JSONResponse({"status": "ok"})
        engine = self.engine
        return JSONResponse({"status": "ok", "model": engine.name, "waiting": engine.jobs.qsize(),
                             "cancelled": engine.cancelled,
                             "active_memory_bytes": mx.get_active_memory(),
                             "cache_memory_bytes": mx.get_cache_memory(), "cached_tokens": engine.store.newest,
                             "prompt_cache": engine.store.stats(),
                             "batch": engine.runner.describe() if engine.runner else {"max": engine.max_batch}})

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            self.authorize(request)
        except APIError as e:
            return self.refusal(openai_api.CHAT, e)
        return Response(self.engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """No such route, or not with this method: in the error shape of the API the path belongs to."""
        dialect = next((d for d in self.dialects if request.url.path in d.paths), openai_api.CHAT)
        if request.url.path.startswith("/v1/messages"):
            dialect = anthropic_api.MESSAGES
        code = "method_not_allowed" if exc.status_code == 405 else "not_found"
        return self.refusal(dialect, APIError(exc.status_code, exc.detail or "not found", code=code))


async def _cancel_when_gone(request: Request, job: Job) -> None:
    """Cancel ``job`` as soon as its client disconnects (the body is read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()


def parse(read: Callable[[Any, Engine], Any], body: Any, engine: Engine, path: str) -> Any:
    """``read(body, engine)``, a route's parsing; a shape its checks did not foresee is the body's fault, so a 400
    too (logged, to be given a check of its own)."""
    try:
        return read(body, engine)
    except APIError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as e:
        log.warning("%s: a body its checks let through: %s: %s", path, type(e).__name__, e)
        raise APIError(400, f"the request body could not be read ({type(e).__name__}: {e})") from None
