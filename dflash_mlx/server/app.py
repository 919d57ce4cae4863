"""The HTTP side of ``serve``: every dialect's routes over one engine, streams that never go silent, and the lifecycle.

Starlette on uvicorn runs in a thread of its own; requests are parsed there (off the
event loop, so ``count_tokens``, ``/v1/models`` and keep-alives answer while a long prompt
is tokenized) and queued for the engine on the main thread. A streamed answer carries
the dialect's keep-alive whenever it would otherwise be silent for ``keepalive`` seconds:
clients drop a stream that says nothing for 300 s (Claude Code, Codex), some for 120 s,
and a long prefill or a wait in the queue can take that long on a laptop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

import mlx.core as mx

from ..errors import DFlashError
from . import anthropic_api, openai_api, responses_api
from .engine import Engine, Job
from .request import APIError, Dialect, read_body, sse

MAX_BODY_BYTES = 16 * 2**20  # agents send 50-80 kB; long conversations with tool output grow to megabytes
KEEPALIVE_SECONDS = 15.0
DIALECTS: tuple[Dialect, ...] = (openai_api.CHAT, openai_api.TEXT, anthropic_api.MESSAGES, responses_api.RESPONSES)
log = logging.getLogger("dflash_mlx.serve")


def create_app(engine: Engine, api_key: Optional[str] = None, max_body: int = MAX_BODY_BYTES,
               allowed_origins: tuple[str, ...] = (), keepalive: float = KEEPALIVE_SECONDS) -> Any:
    """The Starlette application over ``engine``: each dialect's routes, count_tokens, models, health and metrics."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def authorize(request: Request) -> None:
        """``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""
        if api_key is None:
            return
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                           code="invalid_api_key", kind="authentication_error")

    async def read_json(request: Request) -> Any:
        authorize(request)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            raise APIError(413, f"request body above {max_body} bytes", code="request_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body:
                raise APIError(413, f"request body above {max_body} bytes", code="request_too_large")
        return read_body(bytes(raw))

    def logged(request: Request, status: int, started: float, done: Optional[dict[str, Any]] = None,
               reason: str = "") -> None:
        """One line per request (with why it was refused), and the request counter."""
        engine.metrics.requests.labels(request.url.path, str(status)).inc()
        figures = f": {reason}" if reason else ""
        if done:
            speed = f" @ {done['decode_tps']:.1f} tok/s" if done["completion_tokens"] > 1 else ""
            figures = (f" prompt {done['prompt_tokens']} tok ({done['cached_tokens']} cached) -> "
                       f"{done['completion_tokens']} tok{speed}, tau {done['dflash']['tau']:.2f}, "
                       f"{done['finish_reason']}")
        log.info("%s %s %d%s in %.2f s", request.method, request.url.path, status, figures,
                 time.perf_counter() - started)

    async def events(request: Request, job: Job, idle: float) -> AsyncIterator[tuple[str, Any]]:
        """The engine's reports for ``job``, and ("idle", None) after each ``idle`` seconds of silence.

        A client that leaves cancels the job (checked at each silence, and when the stream is closed).
        """
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=idle)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    yield "idle", None
                    continue
                yield kind, value
                if kind in ("done", "error"):
                    return
        finally:
            job.cancelled.set()  # a no-op once done; stops the work if the client left

    def refusal(dialect: Dialect, e: APIError) -> JSONResponse:
        return JSONResponse(dialect.error_body(e), status_code=e.status)

    def route(dialect: Dialect) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            """Parse, queue, and answer whole or as server-sent events."""
            started = time.perf_counter()
            body: Any = None
            try:
                body = await read_json(request)
                completion = await run_in_threadpool(dialect.parse, body, engine)
            except APIError as e:
                logged(request, e.status, started, reason=e.message)
                streamed = isinstance(body, dict) and body.get("stream") is True
                if dialect.refuse_in_stream is not None and streamed and e.status == 400:
                    refused = dialect.refuse_in_stream(e, engine)
                    return StreamingResponse(iter([sse(event) for event in refused]), media_type="text/event-stream")
                return refusal(dialect, e)
            job = Job(completion, asyncio.get_running_loop())
            engine.jobs.put(job)
            answer = dialect.answer(completion, engine)
            if completion.stream:
                return StreamingResponse(stream(request, dialect, job, answer, started),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            async for kind, value in events(request, job, idle=0.5):
                if kind == "piece":
                    answer.add(value)
                elif kind == "error":
                    logged(request, value.status, started, reason=value.message)
                    return refusal(dialect, value)
                elif kind == "done" and value is not None:
                    logged(request, 200, started, value)
                    return JSONResponse(answer.whole(value))
                elif kind == "done":
                    break
            logged(request, 499, started, reason="the client left")
            return Response(status_code=499)  # the client left

        return handle

    async def stream(request: Request, dialect: Dialect, job: Job, answer: Any, started: float) -> AsyncIterator[str]:
        status, done, reason = 200, None, ""
        try:
            async for kind, value in events(request, job, idle=keepalive):
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
            logged(request, status, started, done, reason)

    async def count_tokens(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await read_json(request)
            ids, _ = await run_in_threadpool(anthropic_api.prompt, body, engine.tokenizer)
        except APIError as e:
            logged(request, e.status, started, reason=e.message)
            return refusal(anthropic_api.MESSAGES, e)
        logged(request, 200, started)
        return JSONResponse({"input_tokens": len(ids)})

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except APIError as e:
            return refusal(openai_api.CHAT, e)
        return JSONResponse({"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": 0, "owned_by": "dflash-mlx",
             "context_length": engine.target.max_positions}]})

    async def health(request: Request) -> Response:
        """Liveness for anyone (load balancers, supervisors); the figures only with the key, when there is one."""
        try:
            authorize(request)
        except APIError:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "model": engine.name, "waiting": engine.jobs.qsize(),
                             "cancelled": engine.cancelled,
                             "active_memory_bytes": mx.get_active_memory(),
                             "cache_memory_bytes": mx.get_cache_memory(), "cached_tokens": len(engine.cache.tokens),
                             "prompt_cache": engine.store.stats()})

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            authorize(request)
        except APIError as e:
            return refusal(openai_api.CHAT, e)
        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        dialect = next((d for d in DIALECTS if request.url.path in d.paths), openai_api.CHAT)
        if request.url.path.startswith("/v1/messages"):
            dialect = anthropic_api.MESSAGES
        return refusal(dialect, APIError(exc.status_code, exc.detail or "not found", code="not_found"))

    middleware = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                             allow_headers=["*"])] if allowed_origins else []
    routes = [Route(path, route(d), methods=["POST"]) for d in DIALECTS for path in d.paths]
    routes += [
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: http_error})


def serve(engine: Engine, host: str, port: int, api_key: Optional[str] = None,
          on_ready: Callable[[], None] = lambda: None, allowed_origins: tuple[str, ...] = (),
          log_level: str = "info", keepalive: float = KEEPALIVE_SECONDS) -> None:
    """Listen on ``host:port`` in a thread and answer requests on this one, until Ctrl-C or SIGTERM.

    ``on_ready`` runs once the port is bound. A port in use (or an address that is
    not this machine's) is a one-line DFlashError; Ctrl-C stops cleanly, and so does
    SIGTERM (what launchd, systemd and `kill` send; a job a shell starts in the
    background ignores Ctrl-C's SIGINT), the prompt cache's pending writes finished.
    Each request logs one line on stderr at ``log_level`` info (and below).
    """
    import uvicorn

    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(log_level.upper())
    app = create_app(engine, api_key=api_key, allowed_origins=allowed_origins, keepalive=keepalive)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="dflash-mlx http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:  # uvicorn logs why (the port is taken, no such address) and gives up
        raise DFlashError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")
    on_ready()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine.run(serving=http.is_alive)
    except KeyboardInterrupt:  # the way to stop a server: not an error
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
