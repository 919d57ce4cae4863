"""The engine's one loop: requests in arrival order, up to ``max_batch`` of them decoding together.

Each turn reads the cycle in flight, lets the rows go that ended or whose client left, takes in
waiting requests while there is room, runs one prefill chunk (of the prefill with the least left,
so a short request behind a long prompt starts at once, and a long prompt holds up the running
streams by one chunk per turn at most), starts the next cycle, and only then answers the cycle it
read, while the device computes the next (``Scheduler``). A row joins with its first token and
leaves at its end, when its client leaves, or on an error; its caches then go to the prompt cache.

One request at a time (``--max-batch 1``, a target or settings that do not batch, a sharded
target) decodes alone on the engine's own caches, which still hold its conversation when the next
request continues it; rows of a batch decode in caches of their own, which the prompt cache fills.
Every row decodes exactly as it would alone. A sharded target's ranks run the same turns: rank 0
hands each request over and says when its client left, so that every rank runs the same passes.
"""

from __future__ import annotations

import logging
import queue
from typing import Any, Callable, Optional, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from ..decode.batch import Batch, batch_planner, own_policy
from ..decode.cycle import Emitted, prefill_steps
from ..decode.generate import setup
from ..decode.responses import GenerationResult
from ..decode.scheduler import Scheduler
from ..decode.settings import DecodeSettings
from ..decode.transaction import DFlashCache
from ..distributed import from_main, from_main_bytes
from .jobs import Active, Job, failure, figures
from .metrics import Metrics
from .prompt_cache import PromptCache
from .request import APIError, Completion

log = logging.getLogger("dflash_mlx.serve")


class Host(Protocol):
    """What the runner reads of the engine."""

    target: Any
    drafter: Any
    tokenizer: Any
    decoding: DecodeSettings
    store: PromptCache
    jobs: queue.Queue[Job]
    metrics: Metrics
    max_batch: int
    cancelled: int


class Runner:
    """Runs the engine's queue (rank 0, or the only process), or follows rank 0's (the other ranks)."""

    def __init__(self, engine: Host) -> None:
        self.engine = engine
        self.alone = engine.max_batch == 1
        batch = Batch(engine.target, batch_planner(engine.target, engine.drafter), alone=self.alone)
        self.scheduler = Scheduler(batch)
        self.group = engine.target.group
        self.active: list[Active] = []

    def run(self, serving: Callable[[], bool]) -> None:
        """Answer queued requests while ``serving()`` holds; with a sharded target, tell the other ranks to stop."""
        with wired_limit(self.engine.target.model, [generation_stream]):
            try:
                while serving():
                    self._turn()
            except KeyboardInterrupt:
                for a in list(self.active):
                    a.job.report("error", APIError(503, "the server is shutting down", kind="server_error"))
                    self._finish(a, reported=True)
                raise
            finally:
                self._mirror(None)

    def follow(self) -> None:
        """Ranks > 0 of a sharded target: run the requests rank 0 hands over, in its turns, until it stops."""
        with wired_limit(self.engine.target.model, [generation_stream]):
            while self._turn(following=True):
                pass

    def describe(self) -> dict[str, Any]:
        """What /health shows of the batch (one request at a time: its size alone)."""
        if self.alone:
            return {"max": 1}
        return {"max": self.engine.max_batch, "decoding": len(self.scheduler.rows),
                "prefilling": sum(a.steps is not None for a in self.active)}

    def _turn(self, following: bool = False) -> bool:
        """One turn (see the module); False when a follower is told to stop. Cycles read are answered only after
        the next cycle has started (``_end_known`` hands them on to ``_answer``), rows join only between cycles."""
        self._agree_who_left()
        self.scheduler.advance(follow=self._may_follow())
        unanswered = self._end_known(self._read())
        if self.scheduler.idle:  # rows join only between cycles
            if not self._admit(following):
                return False
            self._prefill_one()
            self._start()
        self._answer(unanswered)
        return True

    def _agree_who_left(self) -> None:
        """Whose client left, once per turn: with a sharded target rank 0's word, so that every rank stops it at
        the same cycle."""
        flags = [float(a.job.cancelled.is_set()) for a in self.active]
        if self.group is not None and self.active:
            flags = from_main(flags, self.group)
        for a, flag in zip(self.active, flags):
            a.client_left = flag > 0

    def _may_follow(self) -> bool:
        """Whether the next cycle may start before this one is read: nobody waits to join, prefills or leaves."""
        room = len(self.active) < self.engine.max_batch
        if (room and not self.engine.jobs.empty()) or any(a.leaving or a.client_left for a in self.active):
            return False
        return all(a.steps is None for a in self.active)

    def _read(self) -> list[tuple[Active, Emitted]]:
        """The cycle in flight, read and committed; the rows that ended while it was in flight (their part undone)
        leave with it."""
        try:
            read = self.scheduler.read()
        except Exception as e:  # noqa: BLE001 (every decoding row fails, the leaving ones with them)
            self._fail_decoding(e)
            return []
        for a in [a for a in self.active if a.leaving]:
            self._finish(a)
        by_row = {id(a.request.row): a for a in self.active}
        return [(by_row[id(row)], e) for row, e in read]

    def _end_known(self, read: list[tuple[Active, Emitted]]) -> list[tuple[Active, Emitted]]:
        """Before the next cycle starts, end the rows whose end is known without detokenizing: a cycle that ended
        at EOS or the budget (answered now), a client that left; the other cycles read, to answer after it starts."""
        for a, cycle in read:
            if cycle.reason is not None:
                a.answer(cycle)
                self._end(a)
        for a in [a for a in self.active if a.client_left and all(a is not b for b, _ in read)]:
            self._end(a)
        return [(a, c) for a, c in read if c.reason is None]

    def _start(self) -> None:
        """The next cycle, for the decoding rows (the row whose prefill just ended among them)."""
        if not self.scheduler.rows:
            return
        self.engine.metrics.batch.set(len(self.scheduler.rows))
        try:
            self.scheduler.advance(follow=False)
        except Exception as e:  # noqa: BLE001 (a cycle is every row's: each fails, the server goes on)
            self._fail_decoding(e)

    def _answer(self, unanswered: list[tuple[Active, Emitted]]) -> None:
        """The cycles read, answered while the device computes the next: a stop string or a client gone ends one."""
        for a, cycle in unanswered:
            if a.answer(cycle) or a.client_left:
                self._end(a)

    def _end(self, a: Active) -> None:
        """Where every decoding row ends: it leaves at once, or (in a cycle in flight) when that cycle is read."""
        if any(a.request.row is r for r in self.scheduler.rows) and not self.scheduler.drop(a.request.row):
            a.leaving = True
        else:
            self._finish(a)

    def _fail_decoding(self, e: Exception) -> None:
        for a in [a for a in self.active if a.steps is None]:
            a.job.report("error", failure(e))
            self._finish(a, reported=True, failed=True)
        self.scheduler.close()

    def _admit(self, following: bool) -> bool:
        """Take waiting requests while there is room (waiting a little for one when nothing runs); False when a
        follower is told to stop."""
        while len(self.active) < self.engine.max_batch:
            if following:  # rank 0's next request, handed over once it has room for it
                if self.active:
                    return True
                completion = self._mirror(None)
                if completion is None:
                    return False
                self._take(Job(completion, None))
                continue
            try:
                job = self.engine.jobs.get(timeout=0.1) if not self.active else self.engine.jobs.get_nowait()
            except queue.Empty:
                return True
            if job.cancelled.is_set():
                self.engine.cancelled += 1
                job.report("done", None)
                continue
            self._mirror(job.completion)
            self._take(job)
            if self.group is not None:
                return True  # a sharded target takes one request at a time
        return True

    def _mirror(self, completion: Optional[Completion]) -> Optional[Completion]:
        """Rank 0's next request (None: stop), on every rank of a sharded target; a no-op on one machine. Only what
        decides the tokens travels (``Completion.SHARED``)."""
        if self.group is None:
            return completion
        received = from_main_bytes(b"" if completion is None else completion.shared(), self.group)
        return Completion.from_shared(received) if received else None

    def _take(self, job: Job) -> None:
        """A request begins: its caches (the engine's own when alone) take what the prompt cache holds of its
        prompt, its settings are checked, its client hears how much of the prompt was cached."""
        engine, c = self.engine, job.completion
        cache = engine.store.cache if self.alone else DFlashCache.empty(engine.target, engine.drafter,
                                                                        engine.decoding.layout)
        try:
            origin = engine.store.prepare(c.ids, cache)
            request = setup(engine.target, engine.drafter, engine.tokenizer, c.ids, engine.decoding, c.settings(),
                            cache=cache)
        except Exception as e:  # noqa: BLE001 (this request fails; the others go on)
            job.report("error", failure(e))
            return
        row = request.row
        handback = (lambda: None) if self.alone else own_policy(row)  # alone, the shared policy itself learns
        row.policy.start()
        job.report("start", {"prompt_tokens": len(c.ids), "cached_tokens": request.reused})
        steps = prefill_steps(engine.target, engine.drafter, cache, request.ids[request.reused :],
                              request.prefill_step_size, lambda done, total: None)
        self.active.append(Active(job, request, steps, len(request.ids) - request.reused, handback, origin))

    def _prefill_one(self) -> None:
        """One chunk of the prefill with the least left; a prefill that ends gives its row the first token and a
        place among the decoding rows."""
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
            self.engine.store.prompt_done(a.request.row.cache)
            if not a.answer(a.request.row.first(logits)):
                self.scheduler.add(a.request.row)
                return
        except Exception as e:  # noqa: BLE001 (this request fails; the others go on)
            a.job.report("error", failure(e))
            self._finish(a, reported=True, failed=True)
            return
        self._finish(a)

    def _finish(self, a: Active, reported: bool = False, failed: bool = False) -> None:
        """The request leaves: its caches (what it committed) go to the prompt cache, its client gets the end. The
        caches of a request that failed are kept by nobody, nor the entry they came from."""
        row = a.request.row
        if any(r is row for r in self.scheduler.rows):
            self.scheduler.drop(row)
        if row.cache.holds_lease(row.lease):
            row.cache.abandon()
        a.handback()
        self.active.remove(a)
        try:
            if failed:
                self.engine.store.discard(a.origin, row.cache)
            else:
                self.engine.store.keep(row.cache)
        except Exception as e:  # noqa: BLE001 (the answer stands without its cache entry)
            log.warning("prompt cache: could not keep an entry: %s", e)
        if not self.active:
            mx.clear_cache()
        if reported:
            return
        if not a.finished:  # its client left
            self.engine.cancelled += 1
            a.job.report("done", None)
            return
        run = GenerationResult.from_responses(a.seen)
        self.engine.metrics.record(run, a.ttft)
        a.job.report("done", figures(run))
