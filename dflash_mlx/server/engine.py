"""The loaded pair, its caches across requests, and the loop that runs requests one at a time
(``--max-batch 1``, a target that does not batch, a sharded one; ``batching`` runs many together).

Requests wait in arrival order and run one at a time on the main thread, where the model
was loaded; the HTTP server runs in a thread of its own and hands each request over as a
``Job``. The engine reports into the job's asyncio queue: ``start`` when it takes the
request (with how much of the prompt the caches already hold), then ``piece`` after piece
(text, tokens and, if asked, logprobs), then ``done`` or ``error``. A client that
disconnects cancels its request at the next cycle (or prefill chunk): the engine closes
the generator, which abandons the cycle in flight, so the caches stay valid and the next
request reuses the prompt they hold.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..decode.batch import Batch, check_max_batch
from ..decode.cache_files import fingerprint
from ..decode.generate import run, setup
from ..decode.responses import GenerationResponse, GenerationResult
from ..decode.settings import DecodeSettings
from ..decode.transaction import DFlashCache
from ..distributed import from_main, from_main_bytes
from ..errors import DFlashError
from .metrics import Metrics
from .prompt_cache import CacheLimits, PromptCache
from .request import APIError, Completion, Defaults


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
    """The loaded pair, its caches across requests, and the loop that runs requests one at a time
(``--max-batch 1``, a target that does not batch, a sharded one; ``batching`` runs many together).

    ``run`` is called on the main thread (the HTTP server runs in another): MLX work
    stays on the thread that loaded the model, and Ctrl-C lands in the generation
    it interrupts, which abandons its cycle as any interrupted generation does.
    """

    def __init__(self, target: Any, drafter: Any, tokenizer: Any, name: str,
                 decoding: DecodeSettings = DecodeSettings(), defaults: Defaults = Defaults(),
                 limits: CacheLimits = CacheLimits(), max_batch: int = 1):
        self.target, self.drafter, self.tokenizer, self.name = target, drafter, tokenizer, name
        self.decoding, self.defaults = decoding, defaults
        cache = DFlashCache.empty(target, drafter, decoding.layout)
        if target.group is not None and (limits.directory is not None or limits.max_bytes is not None):
            # Every rank must choose the same entry: by count alone (a rank's bytes are its share's).
            raise DFlashError("a sharded target keeps its prompt cache by entry count only: drop --prompt-cache-dir "
                              "and --prompt-cache-bytes under mlx.launch")
        print_ = fingerprint(target, drafter, cache.layout) if limits.directory is not None else None
        self.store = PromptCache(cache, limits, print_)
        check_max_batch(max_batch)
        # Rows share a pass only where every layer is full attention, without a window, on one machine.
        self.max_batch = max_batch if Batch.fits(target, cache) else 1
        self.runner: Optional[Any] = None  # the batching loop, while it runs
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.cancelled = 0  # requests whose client left before they finished
        self.metrics = Metrics()

    def run(self, serving: Callable[[], bool]) -> None:
        """Answer queued requests in order while ``serving()`` holds.

        With a sharded target this is rank 0, which hands each request to the other
        ranks (``follow``) before running it, and tells them to stop when it stops.
        """
        if self.max_batch > 1:
            from .batching import BatchRunner

            self.runner = BatchRunner(self)
            try:
                self.runner.run(serving)
            finally:
                self.store.close()
            return
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
        except KeyboardInterrupt:
            job.report("error", APIError(503, "the server is shutting down", kind="server_error"))
            raise
        except Exception as e:  # noqa: BLE001 (a bug must not take the server down with it)
            job.report("error", failure(e))

    def _cancelled(self, job: Job) -> bool:
        """Whether the client left; with a sharded target rank 0's answer, so that every rank stops together."""
        if self.target.group is None:
            return job.cancelled.is_set()
        return from_main([float(job.cancelled.is_set())], self.target.group)[0] > 0

    def _run(self, job: Job) -> None:
        c = job.completion

        def prefilling(done: int, total: int) -> None:  # between prefill chunks: stop if the client left
            if done == 0:  # the first call: what the caches held is known
                job.report("start", {"prompt_tokens": len(c.ids), "cached_tokens": len(c.ids) - total})
            if self._cancelled(job):
                raise _ClientLeft
            if done == total:
                self.store.prompt_done()

        self.store.prepare(c.ids)
        started = time.perf_counter()
        request = setup(self.target, self.drafter, self.tokenizer, c.ids, self.decoding, c.settings(), cache=self.cache)
        responses = run(request, self.target, prefilling)
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
        result = GenerationResult.from_responses(seen)
        self.metrics.record(result, ttft)
        job.report("done", figures(result))


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


class _ClientLeft(Exception):
    """Raised inside a generation (prefill included) whose client is gone: the generator abandons its cycle."""


