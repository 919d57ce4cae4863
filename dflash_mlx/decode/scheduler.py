"""Pipelined cycles for any number of rows: ``add`` a row, ``drop`` it, ``advance`` and ``read`` the cycles between.

One scheduler drives the solo loop (``decode``), ``batch_generate`` and the server's runner, as
mlx-lm's ``BatchGenerator`` does its ``insert``/``next``/``remove``. Its rows decode in one ``Batch``
(a row ``alone`` on its own caches, or many sharing a verify). A cycle is started before the caller
handles the previous one's tokens, so the device computes while the host detokenizes; and while every
row decodes plainly and none joins or leaves, the next cycle is started even before this one is read
(``Batch.follow``), as mlx-lm pipelines its plain steps. Rows join between cycles; a row dropped while
a cycle is in flight leaves when that cycle is read, its part undone.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from .batch import Batch, BatchCycle
from .cycle import Emitted, Row, prefill


class Scheduler:
    """The rows of one ``Batch`` and its cycles in flight: at most the one being read and the one after it."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.flight: Optional[BatchCycle] = None  # the cycle the device is computing
        self.ahead: Optional[BatchCycle] = None  # the one after it, started before it is read
        self.leaving: list[Row] = []  # rows in flight that leave once it is read

    @property
    def rows(self) -> list[Row]:
        return self.batch.rows

    def add(self, row: Row) -> None:
        """A row that has its first token joins; only between cycles (``idle``)."""
        if self.flight is not None:
            raise RuntimeError("rows join between cycles: read the one in flight first")
        self.batch.join(row)

    def drop(self, row: Row) -> bool:
        """The row leaves: now (True), or when the cycle in flight is read, its part undone (False)."""
        if self.flight is not None and any(row is r for r in self.flight.rows):
            self.leaving.append(row)
            return False
        self.batch.leave(row)
        return True

    @property
    def idle(self) -> bool:
        """Whether no cycle is in flight: rows may join."""
        return self.flight is None

    def advance(self, follow: bool = True) -> None:
        """Start a cycle for the rows, if none is in flight; then, with ``follow``, the one after it where that is
        safe (a plain cycle in flight, no row drafting next, none leaving)."""
        if self.flight is None and self.rows:
            self.flight = self.batch.start()
        if follow and self.flight is not None and self.ahead is None and not self.leaving:
            self.ahead = self.batch.follow(self.flight)

    def read(self) -> list[tuple[Row, Emitted]]:
        """Read the cycle in flight and commit it: each row's tokens (rows dropped meanwhile undone and gone). The
        cycle started ahead of it, if any, is in flight next."""
        flight, ahead, leaving = self.flight, self.ahead, self.leaving
        self.flight, self.ahead, self.leaving = None, None, []
        if flight is None:
            return []
        out = self.batch.finish(flight, leaving, then=ahead)
        self.flight = ahead
        for row in leaving:
            self.batch.leave(row)
        return [(row, e) for row, e in zip(flight.rows, out) if e is not None]

    def close(self) -> None:
        """Every row leaves, cycles in flight abandoned: each row's cache holds what it committed."""
        self.flight = self.ahead = None
        self.leaving = []
        for row in list(self.rows):
            self.batch.leave(row)
            if row.cache.holds_lease(row.lease):
                row.cache.abandon()


def decode(row: Row, prompt: list[int], prefill_step_size: int, progress: Callable[[int, int], None]
           ) -> Iterator[Emitted]:
    """One row alone: prefill, then draft-verify-commit cycles; yield each verified cycle's tokens.

    The next cycle is started before the previous one's tokens are yielded, so the caller's work overlaps the
    device's. However the caller leaves (a break, ``close()``, an exception, Ctrl-C), the cycles in flight are
    abandoned and the cache holds the committed history: the prompt and the emitted tokens, except possibly the
    last one, which the target has not consumed yet.
    """
    row.policy.start()
    scheduler = Scheduler(Batch(row.target, alone=True))
    try:
        out = row.first(prefill(row.target, row.drafter, row.cache, prompt, prefill_step_size, progress))
        scheduler.add(row)
        while out.reason is None:
            scheduler.advance()
            yield out  # the previous cycle's
            ((_, out),) = scheduler.read()
        yield out
    finally:
        scheduler.close()
        if row.cache.holds_lease(row.lease):
            row.cache.abandon()
