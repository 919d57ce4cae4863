"""Continuous batching: requests join and leave a running batch between its cycles.

The engine's loop when more than one request may run at once (``serve --max-batch N``,
N > 1) and the target batches (``Batch.fits``). Each turn it takes in waiting requests
while there is room, runs one prefill chunk (of the prefill with the least left, so a
short request behind a long prompt starts at once, and a long prompt holds up the
running streams by one chunk per turn at most), then one cycle of every decoding row:
each row drafts on its own, the target verifies all rows in one pass. A row joins with
its first token and leaves at its end, when its client leaves, or on an error; its
caches then go to the prompt cache as a solo request's do.
Every row decodes exactly as it would alone.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from ..decode.batch import Batch, BatchCycle, batch_planner, own_policy
from ..decode.cycle import Emitted, prefill_steps
from ..decode.generate import Request, setup
from ..decode.responses import GenerationResponse, GenerationResult
from ..decode.transaction import DFlashCache
from ..errors import DFlashError
from .engine import Engine, Job, failure, figures
from .request import APIError

log = logging.getLogger("dflash_mlx.serve")


@dataclass(eq=False)
class Active:
    """A request the runner has taken: prefilling (``steps``) or decoding in the batch."""

    job: Job
    request: Request
    started: float
    steps: Optional[Iterator[Optional[mx.array]]]  # the prefill's chunks; None once the row decodes
    left: int = 0  # prompt tokens still to prefill
    handback: Callable[[], None] = lambda: None  # what the row's policy learned, back to the shared one
    seen: list[GenerationResponse] = field(default_factory=list)
    ttft: float = 0.0


class BatchRunner:
    """Runs the engine's queue with up to ``engine.max_batch`` requests decoding together."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.batch = Batch(engine.target, batch_planner(engine.target, engine.drafter))
        self.active: list[Active] = []
        self.flight: Optional[BatchCycle] = None  # the cycle the device is computing
        self.leaving: list[tuple[Active, bool]] = []  # rows in flight that end (cancelled or not) once it is read

    def run(self, serving: Callable[[], bool]) -> None:
        with wired_limit(self.engine.target.model, [generation_stream]):
            try:
                while serving():
                    self._turn()
            except KeyboardInterrupt:
                for a in list(self.active):
                    a.job.report("error", APIError(503, "the server is shutting down", kind="server_error"))
                    self._finish(a, reported=True)
                raise

    def _turn(self) -> None:
        """Read the cycle in flight; rows that ended leave, waiting requests come in (a prefill chunk, a join); start
        the next cycle; then answer the cycle read while the device computes the next, as the solo loop does. While
        the batch decodes plainly and nobody joins or leaves, the next cycle starts before the one in flight is read
        (``Batch.follow``), as the solo loop pipelines its plain steps."""
        ahead = self._ahead()
        read = self._read(ahead)
        for a, cycle in [(a, c) for a, c in read if c.reason is not None]:  # EOS or budget: known before the start
            self._answer(a, cycle)
            self._end(a, cancelled=False)
        read = [(a, c) for a, c in read if c.reason is None]
        for a in [a for a in self.active if a.job.cancelled.is_set() and all(a is not b for b, _ in read)]:
            self._end(a, cancelled=True)
        if self.flight is None:  # rows join only between cycles
            self._admit()
            self._prefill_one()
            if self.batch.rows:
                self.engine.metrics.batch.set(len(self.batch))
                try:
                    self.flight = self.batch.start()
                except Exception as e:  # noqa: BLE001 (a cycle is every row's: each fails, the server goes on)
                    self._fail_decoding(e)
        for a, cycle in read:
            if self._answer(a, cycle) or a.job.cancelled.is_set():  # a stop string, or the client left
                self._end(a, cancelled=not a.seen[-1].finish_reason)

    def _ahead(self) -> Optional[BatchCycle]:
        """The cycle after the one in flight, started before it is read, when nothing waits to join or leave."""
        if self.flight is None or self.leaving or not self.engine.jobs.empty():
            return None
        if any(a.steps is not None or a.job.cancelled.is_set() for a in self.active):
            return None
        try:
            return self.batch.follow(self.flight)
        except Exception as e:  # noqa: BLE001
            self._fail_decoding(e)
            return None

    def _read(self, ahead: Optional[BatchCycle] = None) -> list[tuple[Active, Emitted]]:
        """The cycle in flight, read and committed (rows that ended meanwhile: undone, and gone); ``ahead`` (started
        after it) is in flight next."""
        if self.flight is None:
            return []
        flight, self.flight = self.flight, None
        leaving, self.leaving = self.leaving, []
        try:
            cycles = self.batch.finish(flight, [a.request.row for a, _ in leaving], then=ahead)
        except Exception as e:  # noqa: BLE001
            self._fail_decoding(e)
            return []
        self.flight = ahead
        for a, cancelled in leaving:
            self._finish(a, cancelled=cancelled)
        by_row = {id(a.request.row): a for a in self.active}
        return [(by_row[id(row)], c) for row, c in zip(flight.rows, cycles) if c is not None]

    def _end(self, a: Active, cancelled: bool) -> None:
        """A decoding row ends: at once, or once the cycle it is in flight in is read."""
        if self.flight is not None and any(a.request.row is r for r in self.flight.rows):
            self.leaving.append((a, cancelled))
        else:
            self._finish(a, cancelled=cancelled)

    def _fail_decoding(self, e: Exception) -> None:
        self.flight, self.leaving = None, []
        for a in [a for a in self.active if a.steps is None]:
            a.job.report("error", failure(e))
            self._finish(a, reported=True)

    def describe(self) -> dict[str, Any]:
        """What /health shows of the batch."""
        return {"max": self.engine.max_batch, "decoding": len(self.batch),
                "prefilling": sum(a.steps is not None for a in self.active)}

    def _admit(self) -> None:
        """Take waiting requests while there is room (waiting a little for one when nothing runs)."""
        while len(self.active) < self.engine.max_batch:
            try:
                job = self.engine.jobs.get(timeout=0.1) if not self.active else self.engine.jobs.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self.engine.cancelled += 1
                job.report("done", None)
                continue
            self._take(job)

    def _take(self, job: Job) -> None:
        engine, c = self.engine, job.completion
        cache = DFlashCache.empty(engine.target, engine.drafter, engine.decoding.layout)
        engine.store.prepare(c.ids, cache)
        try:
            request = setup(engine.target, engine.drafter, engine.tokenizer, c.ids, engine.decoding, c.settings(),
                            cache=cache)
        except DFlashError as e:
            job.report("error", APIError(400, str(e)))
            return
        row = request.row
        handback = own_policy(row)
        row.policy.start()
        job.report("start", {"prompt_tokens": len(c.ids), "cached_tokens": request.reused})
        steps = prefill_steps(engine.target, engine.drafter, cache, request.ids[request.reused :],
                              request.prefill_step_size, lambda done, total: None)
        self.active.append(Active(job, request, time.perf_counter(), steps, len(request.ids) - request.reused,
                                  handback))

    def _prefill_one(self) -> None:
        """One chunk of the prefill with the least left (a short request that joins behind a long prompt starts at
        once); a prefill that ends gives its row the first token and a place in the batch."""
        prefilling = [a for a in self.active if a.steps is not None]
        if not prefilling:
            return
        a = min(prefilling, key=lambda a: a.left)
        try:
            logits = next(a.steps)
            a.left -= a.request.prefill_step_size
            if logits is None:
                return
            a.steps = None
            if not self._answer(a, a.request.row.first(logits)):
                self.batch.join(a.request.row)
                return
        except Exception as e:  # noqa: BLE001 (this request fails; the others go on)
            a.job.report("error", failure(e))
            self._finish(a, reported=True)
            return
        self._finish(a)

    def _answer(self, a: Active, cycle: Emitted) -> bool:
        """Report one cycle's piece; whether the request is finished."""
        response = a.request.responder.respond(cycle)
        if not a.seen:
            a.ttft = time.perf_counter() - a.started
        a.seen.append(response)
        a.job.report("piece", {"text": response.text, "tokens": response.tokens, "logprobs": response.logprobs,
                               "top": response.top_logprobs})
        return response.finish_reason is not None

    def _finish(self, a: Active, cancelled: bool = False, reported: bool = False) -> None:
        """The request leaves: its caches (what it committed) go to the prompt cache, its client gets the end."""
        row = a.request.row
        if any(r is row for r in self.batch.rows):
            self.batch.leave(row)
        if row.cache.holds_lease(row.lease):
            row.cache.abandon()
        a.handback()
        self.active.remove(a)
        try:
            self.engine.store.keep(row.cache)
        except Exception as e:  # noqa: BLE001 (the answer stands without its cache entry)
            log.warning("prompt cache: could not keep an entry: %s", e)
        if not self.active:
            mx.clear_cache()
        if reported:
            return
        if cancelled or not a.seen or not a.seen[-1].finish_reason:
            self.engine.cancelled += 1
            a.job.report("done", None)
            return
        run = GenerationResult.from_responses(a.seen)
        self.engine.metrics.record(run, a.ttft)
        a.job.report("done", figures(run))
