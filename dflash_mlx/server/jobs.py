"""A request as the engine holds it: queued (``Job``), then taken (``Active``) until it is finished.

The HTTP server runs in a thread of its own and hands each request over as a ``Job``; the engine
reports into the job's asyncio queue: ``start`` when it takes the request (with how much of the
prompt the caches already held), then ``piece`` after piece (text, tokens and, if asked, logprobs),
then ``done`` (with the run's figures; None for a request whose client left) or ``error``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

from ..decode.cycle import Emitted
from ..decode.generate import Request
from ..decode.responses import GenerationResponse, GenerationResult
from ..errors import DFlashError
from .request import APIError, Completion


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


@dataclass(eq=False)
class Active:
    """A request the engine has taken: prefilling (``steps``) or decoding."""

    job: Job
    request: Request
    steps: Optional[Iterator[Optional[mx.array]]]  # the prefill's chunks; None once the row decodes
    left: int  # prompt tokens still to prefill
    handback: Callable[[], None] = lambda: None  # what the row's policy learned, back to the shared one
    origin: Any = None  # the prompt-cache entry its caches were restored from (dropped if the request fails)
    started: float = field(default_factory=time.perf_counter)
    seen: list[GenerationResponse] = field(default_factory=list)
    ttft: float = 0.0
    client_left: bool = False  # as of this turn (with a sharded target, rank 0's word)
    leaving: bool = False  # ended while in a cycle in flight: it leaves when that cycle is read

    def answer(self, cycle: Emitted) -> bool:
        """Report one cycle's piece; whether the request is finished."""
        response = self.request.responder.respond(cycle)
        if not self.seen:
            self.ttft = time.perf_counter() - self.started
        self.seen.append(response)
        self.job.report("piece", {"text": response.text, "tokens": response.tokens, "logprobs": response.logprobs,
                                  "top": response.top_logprobs})
        return response.finish_reason is not None

    @property
    def finished(self) -> bool:
        return bool(self.seen) and self.seen[-1].finish_reason is not None


def figures(run: GenerationResult) -> dict[str, Any]:
    """What ``done`` reports of a finished request (the dialects' usage and the log line read it)."""
    return {
        "finish_reason": run.finish_reason, "stop_sequence": run.stop_sequence,
        "prompt_tokens": run.prompt_tokens, "cached_tokens": run.prompt_cached, "completion_tokens": len(run.tokens),
        "dflash": {"cycles": run.cycles, "tau": run.tau, "acceptance_rate": run.acceptance_rate,
                   "sources": run.by_source},
        "decode_tps": run.generation_tps,
    }


def failure(e: Exception) -> APIError:
    """A request's failure as its client sees it: a 400 for what it asked (DFlashError), else a 500."""
    if isinstance(e, DFlashError):
        return APIError(400, str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
