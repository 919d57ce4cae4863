"""`dflash-mlx serve`: an OpenAI-compatible HTTP server over one loaded pair.

One model: requests wait in arrival order and run one at a time on the main
thread, where the model was loaded; the HTTP server (Starlette on uvicorn) runs in
a thread of its own. A request's text travels to its async handler through an
asyncio queue. A client that disconnects cancels its request at the next cycle:
the engine closes the generator, which abandons the cycle in flight, so the
caches stay valid and the next request reuses the prompt they hold.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import mlx.core as mx

from .caches import make_cache
from .chat_template import has_chat_template, render
from .distributed import from_main, from_main_bytes
from .errors import DFlashError
from .generate import GenerationResult, check_context, encode_prompt, stream_generate
from .sampling import Sampling
from .stops import stop_list

MAX_BODY_BYTES = 4 * 2**20
# Parameters that would change the answer and that we do not implement: refused, never ignored.
UNSUPPORTED = {
    "logprobs": lambda v: bool(v), "top_logprobs": lambda v: v is not None, "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"), "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"), "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0), "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "response_format": lambda v: v not in (None, {"type": "text"}), "best_of": lambda v: v not in (None, 1),
    "echo": lambda v: bool(v), "suffix": lambda v: v not in (None, ""), "n": lambda v: v not in (None, 1),
}


class APIError(Exception):
    """An OpenAI-style error: HTTP status and the ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Completion:
    """A validated request, tokenized."""

    ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool


def _number(body: dict, name: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise APIError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    if not low <= value <= high:
        raise APIError(400, f"{name} must be between {low} and {high}, got {value}", name)
    return kind(value)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where} must be a string or a list of text parts", where)


def parse(body: Any, chat: bool, tokenizer: Any, target: Any) -> Completion:
    """Check a request body the way the OpenAI API does; tokenize its prompt."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, refused in UNSUPPORTED.items():
        if name in body and refused(body[name]):
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"messages[{i}] needs a role of system, user or assistant", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            turns.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
        if not has_chat_template(tokenizer):
            raise APIError(400, "this model has no chat template: use /v1/completions, or start the server with "
                                "--chat-template FILE", "messages")
        ids = _checked(lambda: render(tokenizer, turns), "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < target.vocab_size for t in prompt):  # the embedding's rows: added tokens included
                raise APIError(400, f"prompt token ids must be from 0 to {target.vocab_size - 1}", "prompt")
        elif not isinstance(prompt, str) or not prompt:
            raise APIError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
        ids = encode_prompt(tokenizer, prompt)
    where = "messages" if chat else "prompt"
    limit = target.max_positions or 2**31
    _checked(lambda: check_context(limit, len(ids), 1), where, "context_length_exceeded")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", min(4096, limit - len(ids)), int, 1,
                         limit - len(ids))
    stop = _checked(lambda: list(stop_list(body.get("stop"))), "stop")
    if len(stop) > 4:
        raise APIError(400, "stop takes up to 4 strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    sampling = {
        "temperature": _number(body, "temperature", 1.0, float, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, float, 0.0, 1.0),
        "top_k": _number(body, "top_k", 0, int, 0, 2**31),
        "min_p": _number(body, "min_p", 0.0, float, 0.0, 1.0),
        "seed": body.get("seed"),
    }
    if sampling["top_p"] == 0.0:
        raise APIError(400, "top_p must be above 0", "top_p")
    _checked(lambda: Sampling(**sampling), "seed")  # the one check that _number does not make
    return Completion(ids, max_tokens, sampling, stop, stream, bool(options.get("include_usage")), chat)


def _checked(make: Callable[[], Any], param: str, code: Optional[str] = None) -> Any:
    """``make()``, with the library's one-line DFlashError as an HTTP 400 naming ``param``."""
    try:
        return make()
    except DFlashError as e:
        raise APIError(400, str(e), param, code) from None


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


class Engine:
    """The loaded pair, its caches across requests, and the loop that runs requests one at a time.

    ``run`` is called on the main thread (the HTTP server runs in another): MLX work
    stays on the thread that loaded the model, and Ctrl-C lands in the generation
    it interrupts, which abandons its cycle as any interrupted generation does.
    """

    def __init__(self, target: Any, drafter: Any, tokenizer: Any, name: str, window: Optional[int] = None,
                 sinks: int = 0, block_size: Optional[int] = None, prefill_step_size: Optional[int] = None):
        self.target, self.drafter, self.tokenizer, self.name = target, drafter, tokenizer, name
        self.options = dict(window=window, sinks=sinks, block_size=block_size, prefill_step_size=prefill_step_size)
        self.cache = make_cache(target, drafter, window, sinks, block_size)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.cancelled = 0  # requests whose client left before they finished

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

    def follow(self) -> None:
        """Ranks > 0 of a sharded target: run the requests rank 0 hands over, until it stops."""
        while (completion := self._mirror(None)) is not None:
            self._answer(Job(completion, None))

    def _mirror(self, completion: Optional[Completion]) -> Optional[Completion]:
        """Rank 0's next request (None: stop), on every rank of a sharded target; a no-op on one machine.

        Only what decides the tokens travels: the prompt ids, the budget, sampling and stop strings.
        """
        if self.target.group is None:
            return completion
        fields = ("ids", "max_tokens", "sampling", "stop")
        data = b"" if completion is None else json.dumps({k: getattr(completion, k) for k in fields}).encode()
        received = from_main_bytes(data, self.target.group)
        if not received:
            return None
        shared = json.loads(received)
        return Completion(**shared, stream=False, include_usage=False, chat=False)

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

        responses = stream_generate(
            self.target, self.drafter, self.tokenizer, c.ids, max_tokens=c.max_tokens, cache=self.cache, stop=c.stop,
            prompt_progress_callback=prefilling, **self.options, **c.sampling,
        )
        seen = []
        try:
            for r in responses:
                seen.append(r)
                if r.text:
                    job.report("text", r.text)
                if r.finish_reason:
                    break
                if self._cancelled(job):
                    raise _ClientLeft
        except _ClientLeft:
            self.cancelled += 1
        finally:
            responses.close()  # leaves the caches holding the committed history
        if not seen or not seen[-1].finish_reason:
            job.report("done", None)
            return
        run = GenerationResult.from_responses(seen)
        usage = {
            "prompt_tokens": run.prompt_tokens, "completion_tokens": len(run.tokens),
            "total_tokens": run.prompt_tokens + len(run.tokens),
            "prompt_tokens_details": {"cached_tokens": run.prompt_cached},
            "dflash": {"cycles": run.cycles, "tau": run.tau, "acceptance_rate": run.acceptance_rate},
        }
        job.report("done", {"finish_reason": run.finish_reason, "usage": usage})


class _ClientLeft(Exception):
    """Raised inside a generation (prefill included) whose client is gone: the generator abandons its cycle."""


def create_app(engine: Engine, api_key: Optional[str] = None, max_body: int = MAX_BODY_BYTES) -> Any:
    """The Starlette application over ``engine``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def authorize(request: Request) -> None:
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key",
                               kind="authentication_error")

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

    async def completions(request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            completion = parse(body, chat, engine.tokenizer, engine.target)
        except APIError as e:
            return error(e)
        job = Job(completion, asyncio.get_running_loop())
        engine.jobs.put(job)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        head = {"id": ident, "created": created, "model": engine.name}
        if completion.stream:
            return StreamingResponse(_stream(job, head, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces: list[str] = []
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancelled.set()
                        return Response(status_code=499)
                    continue
                if kind == "text":
                    pieces.append(value)
                elif kind == "error":
                    return error(value)
                else:
                    break
        finally:
            job.cancelled.set()  # a no-op once done; stops the work if this handler was cancelled
        text, reason, usage = "".join(pieces), value["finish_reason"], value["usage"]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                   "logprobs": None} if chat else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage})

    async def _stream(job: Job, head: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        kind_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: Optional[str], reason: Optional[str] = None, role: bool = False) -> str:
            if chat:
                d = ({"role": "assistant", "content": ""} if role else {}) | ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            body = {**head, "object": kind_name, "choices": [choice]}
            if job.completion.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield chunk(value)
                elif kind == "error":
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:
                    if value is not None:
                        yield chunk(None, value["finish_reason"])
                        if job.completion.include_usage:
                            yield f"data: {json.dumps({**head, 'object': kind_name, 'choices': [], 'usage': value['usage']})}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # the client left (or the stream ended): the worker stops at its next cycle

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except APIError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": 0, "owned_by": "dflash-mlx"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": engine.name, "waiting": engine.jobs.qsize(),
                             "cancelled": engine.cancelled,
                             "active_memory_bytes": mx.get_active_memory(),
                             "cache_memory_bytes": mx.get_cache_memory(), "cached_tokens": len(engine.cache.tokens)})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error(APIError(exc.status_code, exc.detail or "not found", code="not_found"))

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )


def serve(engine: Engine, host: str, port: int, api_key: Optional[str] = None,
          on_ready: Callable[[], None] = lambda: None) -> None:
    """Listen on ``host:port`` in a thread and answer requests on this one, until Ctrl-C.

    ``on_ready`` runs once the port is bound. A port in use (or an address that is
    not this machine's) is a one-line DFlashError; Ctrl-C stops cleanly.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key=api_key), host=host, port=port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="dflash-mlx http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:  # uvicorn logs why (the port is taken, no such address) and gives up
        raise DFlashError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")
    on_ready()
    try:
        engine.run(serving=http.is_alive)
    except KeyboardInterrupt:  # the way to stop a server: not an error
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
