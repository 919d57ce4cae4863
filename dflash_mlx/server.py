"""`dflash-mlx serve`: OpenAI's and Anthropic's HTTP APIs over one loaded pair, for chat apps, editors and agents.

One model: requests wait in arrival order and run one at a time on the main thread,
where the model was loaded; the HTTP server (Starlette on uvicorn) runs in a thread of
its own. ``openai_api`` and ``anthropic_api`` turn each request into a ``Completion``;
the engine generates it and hands its pieces (text, tokens and, if asked, logprobs) to
the request's async handler through an asyncio queue, which shapes them for its API. A
client that disconnects cancels its request at the next cycle (or prefill chunk): the
engine closes the generator, which abandons the cycle in flight, so the caches stay
valid and the next request reuses the prompt they hold.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import mlx.core as mx

from . import anthropic_api, openai_api
from .api import APIError, Completion, Defaults
from .caches import make_cache
from .distributed import from_main, from_main_bytes
from .errors import DFlashError
from .generate import GenerationResponse, GenerationResult, stream_generate
from .prompt_cache import PromptCache, fingerprint

MAX_BODY_BYTES = 4 * 2**20
log = logging.getLogger("dflash_mlx.serve")


@dataclass
class Job:
    """One request in the queue; the worker reports into ``events`` on the handler's loop."""

    completion: Completion
    loop: Optional[asyncio.AbstractEventLoop]  # None: a rank > 0 of a sharded target, which answers nobody
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def report(self, kind: str, value: Any) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the server is shutting down and its loop is closed
            pass


class Metrics:
    """What ``GET /metrics`` reports, in Prometheus' text format (a registry of this server's own)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(f"dflash_{name}", doc, labels, registry=self.registry)

        self.requests = counter("requests", "Requests answered, by endpoint and HTTP status", ("endpoint", "status"))
        self.prompt = counter("prompt_tokens", "Prompt tokens of the requests run")
        self.cached = counter("cached_prompt_tokens", "Prompt tokens reused from the cache, not prefilled")
        self.generated = counter("generated_tokens", "Tokens generated")
        self.drafted = counter("drafted_tokens", "Tokens proposed (by the drafter or copied from the context)")
        self.accepted = counter("accepted_tokens", "Drafted tokens the target accepted")
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Seconds from the start of a request's "
                              "generation to its first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.speed = Histogram("dflash_decode_tokens_per_second", "Decode speed of each request (tokens after the "
                               "first)", registry=self.registry,
                               buckets=(1, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000))

    def record(self, run: GenerationResult, ttft: float) -> None:
        self.prompt.inc(run.prompt_tokens)
        self.cached.inc(run.prompt_cached)
        self.generated.inc(len(run.tokens))
        self.drafted.inc(sum(run.drafted))
        self.accepted.inc(sum(run.acceptance))
        self.ttft.observe(ttft)
        if len(run.tokens) > 1:
            self.speed.observe(run.generation_tps)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Engine:
    """The loaded pair, its caches across requests, and the loop that runs requests one at a time.

    ``run`` is called on the main thread (the HTTP server runs in another): MLX work
    stays on the thread that loaded the model, and Ctrl-C lands in the generation
    it interrupts, which abandons its cycle as any interrupted generation does.
    """

    def __init__(self, target: Any, drafter: Any, tokenizer: Any, name: str, window: Optional[int] = None,
                 sinks: int = 0, block_size: Optional[int] = None, prefill_step_size: Optional[int] = None,
                 defaults: Defaults = Defaults(), cache_entries: int = 10, cache_bytes: Optional[int] = None,
                 cache_dir: Optional[Path] = None, cache_disk_bytes: Optional[int] = None, draft_source: str = "auto"):
        self.target, self.drafter, self.tokenizer, self.name = target, drafter, tokenizer, name
        self.options = dict(window=window, sinks=sinks, block_size=block_size, prefill_step_size=prefill_step_size,
                            draft_source=draft_source)
        self.defaults = defaults
        cache = make_cache(target, drafter, window, sinks, block_size)
        if target.group is not None and (cache_dir is not None or cache_bytes is not None):
            # Every rank must choose the same entry: by count alone (a rank's bytes are its share's).
            raise DFlashError("a sharded target keeps its prompt cache by entry count only: drop --prompt-cache-dir "
                              "and --prompt-cache-bytes under mlx.launch")
        print_ = fingerprint(target, drafter, window, sinks, cache.block_size) if cache_dir is not None else None
        self.store = PromptCache(cache, cache_entries, cache_bytes, cache_dir, cache_disk_bytes, print_)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.cancelled = 0  # requests whose client left before they finished
        self.metrics = Metrics()

    def run(self, serving: Callable[[], bool]) -> None:
        """Answer queued requests in order while ``serving()`` holds.

        With a sharded target this is rank 0, which hands each request to the other
        ranks (``follow``) before running it, and tells them to stop when it stops.
        """
        try:
            while serving():
                try:
                    job = self.jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                if job.cancelled.is_set():
                    self.cancelled += 1
                    job.report("done", None)
                    continue
                self._mirror(job.completion)
                self._answer(job)
        finally:
            self._mirror(None)
            self.store.close()  # what was kept is on disk before the process ends

    @property
    def cache(self) -> Any:
        """The caches requests generate with (the prompt cache restores entries into it)."""
        return self.store.cache

    def follow(self) -> None:
        """Ranks > 0 of a sharded target: run the requests rank 0 hands over, until it stops."""
        while (completion := self._mirror(None)) is not None:
            self._answer(Job(completion, None))

    def _mirror(self, completion: Optional[Completion]) -> Optional[Completion]:
        """Rank 0's next request (None: stop), on every rank of a sharded target; a no-op on one machine.

        Only what decides the tokens travels (``Completion.SHARED``).
        """
        if self.target.group is None:
            return completion
        received = from_main_bytes(b"" if completion is None else completion.shared(), self.target.group)
        return Completion.from_shared(received) if received else None

    def _answer(self, job: Job) -> None:
        try:
            self._run(job)
        except DFlashError as e:
            job.report("error", APIError(400, str(e)))
        except KeyboardInterrupt:
            job.report("error", APIError(503, "the server is shutting down", kind="server_error"))
            raise
        except Exception as e:  # a bug must not take the server down with it
            job.report("error", APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

    def _cancelled(self, job: Job) -> bool:
        """Whether the client left; with a sharded target rank 0's answer, so that every rank stops together."""
        if self.target.group is None:
            return job.cancelled.is_set()
        return from_main([float(job.cancelled.is_set())], self.target.group)[0] > 0

    def _run(self, job: Job) -> None:
        c = job.completion

        def prefilling(done: int, total: int) -> None:  # between prefill chunks: stop if the client left
            if self._cancelled(job):
                raise _ClientLeft
            if done == total:
                self.store.prompt_done()

        self.store.prepare(c.ids)
        started = time.perf_counter()
        responses = stream_generate(
            self.target, self.drafter, self.tokenizer, c.ids, max_tokens=c.max_tokens, cache=self.cache, stop=c.stop,
            logprobs=c.logprobs, prompt_progress_callback=prefilling, **self.options, **c.sampling,
        )
        seen: list[GenerationResponse] = []
        ttft = 0.0
        try:
            for r in responses:
                if not seen:
                    ttft = time.perf_counter() - started
                seen.append(r)
                job.report("piece", {"text": r.text, "tokens": r.tokens, "logprobs": r.logprobs, "top": r.top_logprobs})
                if r.finish_reason:
                    break
                if self._cancelled(job):
                    raise _ClientLeft
        except _ClientLeft:
            self.cancelled += 1
        finally:
            responses.close()  # leaves the caches holding the committed history
            self.store.keep()
        if not seen or not seen[-1].finish_reason:
            job.report("done", None)
            return
        run = GenerationResult.from_responses(seen)
        self.metrics.record(run, ttft)
        job.report("done", {
            "finish_reason": run.finish_reason, "stop_sequence": run.stop_sequence,
            "prompt_tokens": run.prompt_tokens, "cached_tokens": run.prompt_cached, "completion_tokens": len(run.tokens),
            "dflash": {"cycles": run.cycles, "tau": run.tau, "acceptance_rate": run.acceptance_rate,
                       "sources": run.by_source},
            "decode_tps": run.generation_tps,
        })


class _ClientLeft(Exception):
    """Raised inside a generation (prefill included) whose client is gone: the generator abandons its cycle."""


def create_app(engine: Engine, api_key: Optional[str] = None, max_body: int = MAX_BODY_BYTES,
               allowed_origins: tuple[str, ...] = ()) -> Any:
    """The Starlette application over ``engine``: OpenAI's and Anthropic's endpoints, health and metrics."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def refusal(e: APIError, anthropic: bool) -> JSONResponse:
        body = anthropic_api.error_body(e) if anthropic else e.body()
        return JSONResponse(body, status_code=e.status)

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
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None

    def logged(request: Request, status: int, started: float, done: Optional[dict[str, Any]] = None) -> None:
        """One line per request, and the request counter."""
        engine.metrics.requests.labels(request.url.path, str(status)).inc()
        figures = ""
        if done:
            figures = (f" prompt {done['prompt_tokens']} tok ({done['cached_tokens']} cached) -> "
                       f"{done['completion_tokens']} tok @ {done['decode_tps']:.1f} tok/s, tau "
                       f"{done['dflash']['tau']:.2f}, {done['finish_reason']}")
        log.info("%s %s %d%s in %.2f s", request.method, request.url.path, status, figures,
                 time.perf_counter() - started)

    async def events(request: Request, job: Job, stream: bool) -> AsyncIterator[tuple[str, Any]]:
        """The engine's reports for ``job``; a client that leaves a non-streamed request cancels it."""
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=None if stream else 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield kind, value
                if kind != "piece":
                    return
        finally:
            job.cancelled.set()  # a no-op once done; stops the work if the client left

    async def answer(request: Request, parse: Callable[[Any], Completion], make: Callable[[Completion], Any],
                     anthropic: bool = False) -> Response:
        """Parse, queue, and answer whole or as server-sent events, with the answer object ``make`` builds."""
        started = time.perf_counter()
        try:
            completion = parse(await read_json(request))
        except APIError as e:
            logged(request, e.status, started)
            return refusal(e, anthropic)
        job = Job(completion, asyncio.get_running_loop())
        engine.jobs.put(job)
        reply = make(completion)
        if completion.stream:
            return StreamingResponse(stream(request, job, reply, anthropic, started), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for kind, value in events(request, job, stream=False):
            if kind == "piece":
                reply.add(value)
            elif kind == "error":
                logged(request, value.status, started)
                return refusal(value, anthropic)
            elif value is not None:
                logged(request, 200, started, value)
                return JSONResponse(reply.whole(value))
        logged(request, 499, started)
        return Response(status_code=499)  # the client left

    async def stream(request: Request, job: Job, reply: Any, anthropic: bool, started: float) -> AsyncIterator[str]:
        def sse(data: dict[str, Any], event: Optional[str] = None) -> str:
            return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"

        status, done = 200, None
        try:
            if anthropic:
                for name, data in reply.start(len(job.completion.ids), 0):
                    yield sse(data, name)
            elif (first := reply.first()) is not None:
                yield sse(first)
            async for kind, value in events(request, job, stream=True):
                if kind == "piece":
                    for item in reply.add(value):
                        yield sse(item[1], item[0]) if anthropic else sse(item)
                elif kind == "error":
                    status = value.status
                    yield sse(anthropic_api.error_body(value), "error") if anthropic else sse(value.body())
                elif value is not None:
                    done = value
                    for item in reply.last(value):
                        yield sse(item[1], item[0]) if anthropic else sse(item)
                else:
                    status = 499
            if not anthropic:
                yield "data: [DONE]\n\n"
        finally:
            logged(request, status, started, done)

    def head(prefix: str) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": engine.name}

    async def chat_completions(request: Request) -> Response:
        return await answer(request, lambda body: openai_api.parse(body, True, engine.tokenizer, engine.target,
                                                                   engine.defaults),
                            lambda c: openai_api.ChatAnswer(head("chatcmpl"), c, engine.tokenizer))

    async def text_completions(request: Request) -> Response:
        return await answer(request, lambda body: openai_api.parse(body, False, engine.tokenizer, engine.target,
                                                                   engine.defaults),
                            lambda c: openai_api.TextAnswer(head("cmpl"), c, engine.tokenizer))

    async def messages(request: Request) -> Response:
        return await answer(request, lambda body: anthropic_api.parse(body, engine.tokenizer, engine.target,
                                                                      engine.defaults),
                            lambda c: anthropic_api.MessageAnswer(f"msg_{uuid.uuid4().hex[:24]}", engine.name, c,
                                                                  engine.tokenizer), anthropic=True)

    async def count_tokens(request: Request) -> Response:
        started = time.perf_counter()
        try:
            ids, _ = anthropic_api.prompt(await read_json(request), engine.tokenizer)
        except APIError as e:
            logged(request, e.status, started)
            return refusal(e, anthropic=True)
        logged(request, 200, started)
        return JSONResponse({"input_tokens": len(ids)})

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except APIError as e:
            return refusal(e, anthropic=False)
        return JSONResponse({"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": 0, "owned_by": "dflash-mlx"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": engine.name, "waiting": engine.jobs.qsize(),
                             "cancelled": engine.cancelled,
                             "active_memory_bytes": mx.get_active_memory(),
                             "cache_memory_bytes": mx.get_cache_memory(), "cached_tokens": len(engine.cache.tokens),
                             "prompt_cache": engine.store.stats()})

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        anthropic = request.url.path.startswith("/v1/messages")
        return refusal(APIError(exc.status_code, exc.detail or "not found", code="not_found"), anthropic)

    middleware = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                             allow_headers=["*"])] if allowed_origins else []
    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: http_error},
    )


def serve(engine: Engine, host: str, port: int, api_key: Optional[str] = None,
          on_ready: Callable[[], None] = lambda: None, allowed_origins: tuple[str, ...] = (),
          log_level: str = "info") -> None:
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
    server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key=api_key, allowed_origins=allowed_origins),
                                           host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
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
