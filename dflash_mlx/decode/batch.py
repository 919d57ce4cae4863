"""Generations decoded together: each row drafts on its own, the target verifies every row's block in one pass.

Rows accept different lengths each cycle, so the target's layers keep a length per
row (``ragged``): a row's block is written right after its own history and attends to
that alone; what a row rejected is undone in its row only.

Each row keeps its own ``DFlashCache`` (history, drafter context, pending
features) whose target layers are views of its row (``RowView``), so commit,
abandon and the cache invariant work per row exactly as in a solo generation; a
row leaves with its target layers copied back out, as the caches it had alone. The
drafter runs per row (its context differs per row); the drafts, the stacked verify
and every row's verdict are one graph, read once per cycle.

What batches: every target (full attention, sliding-window layers, recurrent
layers of the hybrid ones) on one machine, without ``--window`` or ``--kv-bits``
(``Batch.fits``). Those and a sharded target decode one request at a time.
"""

from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError
from ..models.caches import RecurrentCache, WindowKVCache
from ..models.target import Target, is_tested
from .cycle import Emitted, InFlight, Row
from .estimates import CycleCosts
from .per_pair import PerPair
from .policy import COPY, DRAFTER, AdaptiveDepth, Plan
from .ragged import RowView, ragged_layer
from .transaction import DFlashCache

SOLO = {"full": KVCache, "sliding": WindowKVCache, "linear": RecurrentCache}  # a layer's cache alone, by kind
ROW_TOKENS = 8192  # the context one row of a batch is sized for (an agent's prompt and reply)
MAX_ROWS = 8


def default_max_batch(target: Target, memory_bytes: int) -> int:
    """How many rows of ``ROW_TOKENS`` each fit in half the machine's memory beside the weights (1 to ``MAX_ROWS``).

    A row's attention layers, sliding ones too (a batch keeps their whole history), grow
    with its tokens; a recurrent layer holds its states whatever the length.
    """
    per_token, fixed = target.cache_bytes
    weights = sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))
    row = per_token * ROW_TOKENS + fixed
    return max(1, min(MAX_ROWS, int((memory_bytes / 2 - weights) // row)))


_batches: "weakref.WeakKeyDictionary[Target, bool]" = weakref.WeakKeyDictionary()


def batches(target: Target) -> bool:
    """Whether rows of this target can share a pass: attention layers (full or sliding) and GatedDeltaNet layers
    only (a recurrent state that is saved and replayed, or a layer of several caches, decodes alone), an
    architecture whose batches are tested here, and a model file that takes the batch's per-row masks (two rows of
    a token each are run through it once; Gemma 2's attention, for one, does not)."""
    if target not in _batches:
        _batches[target] = (all(kind in SOLO for kind in target.kinds) and is_tested(target.model_type)
                            and _takes_rows(target))
    return _batches[target]


def _takes_rows(target: Target) -> bool:
    """Two rows of different lengths run together give each row's own logits (a model that broadcasts the batch's
    masks against its heads where it should not would give others, or fail)."""
    histories, block = ([5], [5, 7, 9]), mx.array([[1, 2]])
    layers = [ragged_layer(c) for c in target.make_cache()]
    alone = []
    with mx.stream(generation_stream):
        for history in histories:
            solo = target.make_cache()
            target(mx.array([history]), solo, undoable=False)
            for layer, c in zip(layers, solo):
                layer.append(c)
            alone.append(target(block, solo)[0])
        try:
            together = target(mx.concatenate([block, block]), layers)[0]
            mx.eval(together, alone)
        except (ValueError, RuntimeError):  # what MLX raises where the model's shapes do not take the batch's
            return False
    return all(mx.allclose(together[i], row[0], rtol=1e-3, atol=1e-3).item() for i, row in enumerate(alone))


def check_max_batch(rows: Optional[int]) -> None:
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise DFlashError(f"--max-batch must be an integer of at least 1, got {rows!r}")


@dataclass
class BatchPlanner:
    """How deep the adaptive rows of a batch cycle draft: one depth for all, the one with the most expected tokens
    per second of the whole batch.

    Alone, a row weighs its drafts against its own cycle. In a batch one row's drafts widen
    every row's verify (blocks are padded to the deepest), so the depth is the batch's
    choice: each row still chooses its source (its drafter, or a copy of its own history)
    and keeps its acceptance estimates (``AdaptiveDepth.expected``), and the planner sums
    them and prices a cycle of each depth with a cost model of its own, measured from the
    batch's cycles (``CycleCosts``: its plain cycle and a line over the depth drafted,
    relative to it; relative, because a further row adds its plain step and its positions
    alike, so the line hardly moves as rows join and leave). It warms up as a row does (a
    full block, a plain cycle, one token). While plain cycles win, a probe runs on a backoff
    (``min_probe`` cycles, doubling while probes do not turn the decision, up to
    ``max_backoff``), at the depth drafting would be best at: the rows' estimates learn only
    from cycles that draft, and a one-token probe says nothing of the positions after the
    first (replayed: a 4-row batch of a drafter accepted at 86% a token stayed plain, its
    estimates of deep positions stuck low, at 0.88 of one request at a time).

    It replaced a gate that let rows draft as they would alone or not at all: replayed on
    published Mac costs, a 4B drafter accepted at 86% a token ran 0.71x one request at a
    time at 2 rows and 0.96x at 4 (bench/batch_replay.py), the rows drafting full blocks a
    batch could not pay for and the gate then holding them to plain steps.
    """

    max_depth: int = 15
    min_probe: int = 8
    max_backoff: int = 256
    draft_depth: Optional[int] = None  # the deepest draft the drafter makes (None: max_depth): its warm-up's full block
    costs: CycleCosts = field(init=False)
    _wait: int = 0  # plain cycles until the next probe
    _backoff: int = 0
    _probe_against: Optional[float] = None  # the expected tokens per second of a plain cycle, while probing

    def __post_init__(self) -> None:
        self.costs = CycleCosts(self.max_depth if self.draft_depth is None else min(self.draft_depth, self.max_depth))
        self._wait = self._backoff = self.min_probe

    def depth(self, expected: Sequence[Sequence[float]]) -> int:
        """The next cycle's depth, given each adaptive row's expected tokens per depth (of the source it plans)."""
        if not self.costs.ready:
            return self.costs.missing()[0]
        deepest = min(self.max_depth, *(len(e) - 1 for e in expected))  # the rows' blocks may be smaller
        rates = [sum(e[k] for e in expected) / self.costs.predict(k) for k in range(deepest + 1)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if best > 0:
            self._wait = self._backoff = self.min_probe
            return best
        self._wait -= 1
        if self._wait > 0:
            return 0
        self._wait, self._backoff = self._backoff, min(2 * self._backoff, self.max_backoff)
        self._probe_against = rates[0]
        return max(range(1, len(rates)), key=rates.__getitem__)  # the depth drafting would be best at

    def observe(self, deepest: int, seconds: float, tokens: int) -> None:
        """A cycle: the most any row drafted, its seconds, and the tokens all rows got from it. A probe that got
        more tokens a second than plain cycles are expected to is followed by another at once. (A plain cycle
        read after the probe was planned, which pipelining leads to, is not the probe.)"""
        self.costs.update(deepest, seconds)
        if self._probe_against is None or deepest == 0:
            return
        if tokens / seconds >= self._probe_against:
            self._wait, self._backoff = 0, self.min_probe
        self._probe_against = None

    def plans(self, policies: Sequence[Any], plans: Sequence[Plan]) -> list[Plan]:
        """The rows' plans, with every adaptive row drafting the batch's depth from the source it planned. Pinned
        blocks, seeded rejection sampling (whose draw depends on its depths) and a target alone (its rows copy or
        step plainly, no drafter to pace) draft as they planned."""
        adaptive = [i for i, policy in enumerate(policies) if isinstance(policy, AdaptiveDepth) and policy.drafter]
        if not adaptive:
            return list(plans)
        k = self.depth([policies[i].expected(plans[i]) for i in adaptive])
        out = list(plans)
        for i in adaptive:  # a planned copy the history does not offer falls back to the row's own drafter plan:
            fallback = min(plans[i].fallback, k) if plans[i].source == COPY else k  # k was priced on the copy
            deepest = k if plans[i].source == COPY else min(k, policies[i].draft_depth)  # a drafter drafts its block
            out[i] = plans[i].replace(depth=deepest, fallback=min(fallback, policies[i].draft_depth)) if k else \
                plans[i].replace(depth=0, source=DRAFTER, fallback=0)
        return out


_planners = PerPair()


def batch_planner(target: Target, drafter: Any) -> BatchPlanner:
    """The batch planner of this loaded pair, shared by its batches in this process, as ``adaptive_policy`` is by
    its generations: the batch's cycle costs it measured (a full block of every row the dearest) carry over."""
    return _planners.get(target, drafter, None, lambda: BatchPlanner(draft_depth=drafter.block_size - 1))


@dataclass
class BatchCycle:
    """A batch cycle the device is computing: its rows (as they were), each row's verdict, when it started, whether
    the planner chose its depth, the most any row drafted, and whether its rows committed it already (a plain
    cycle: every row keeps its one input whatever the device answers)."""

    rows: list[Row]
    verdicts: list[InFlight]
    started: float
    planned: bool
    deepest: int
    committed: bool = False


class Batch:
    """Rows decoding together on one target: join after the prefill, a cycle for all, leave with plain caches.

    ``alone``: one row on its own caches, whatever they are (a window, a quantized cache, a sharded target): the
    solo loop, and a server that does not batch. Its cycles are the row's own, built as a batch's are.
    """

    def __init__(self, target: Target, planner: Optional[BatchPlanner] = None, alone: bool = False) -> None:
        self.target, self.alone = target, alone
        self.layers = [] if alone else [ragged_layer(c) for c in target.make_cache()]
        self.rows: list[Row] = []
        self._places: dict[int, int] = {}  # id(row) -> its index in ``rows`` and in every layer
        self.planner = BatchPlanner() if planner is None else planner
        self._planned: Optional[tuple[list[Row], list[Plan]]] = None  # the next cycle's plans, made ahead of it
        self._read_at = time.perf_counter()  # when the last cycle was read: a cycle started before waits from there

    @staticmethod
    def fits(target: Target, cache: DFlashCache) -> bool:
        """Whether rows of this target and these settings can share a pass: no window over the full-attention
        layers, no quantized KV cache, one machine, and a target that batches (``batches``)."""
        return cache.window is None and cache.kv is None and target.group is None and batches(target)

    def __len__(self) -> int:
        return len(self.rows)

    def index(self, row: Row) -> int:
        """The row's place in the batch (asked by every layer of every row's commit: a lookup, not a search)."""
        return self._places[id(row)]

    def join(self, row: Row) -> None:
        """Take in a row that has its first token: its target layers move into the batch."""
        if self.alone:
            if self.rows:
                raise ValueError("a row alone decodes alone: this batch has one already")
            self._places, self.rows = {id(row): 0}, [row]
            return
        odd = next((c for c, kind in zip(row.cache.target, self.target.kinds) if type(c) is not SOLO[kind]), None)
        if odd is not None:  # checked before any layer moves: a refused row keeps its caches
            raise ValueError(f"a batch takes its target's own caches, not a {type(odd).__name__}")
        for layer, cache in zip(self.layers, row.cache.target):
            layer.append(cache)
        self._places[id(row)] = len(self.rows)
        self.rows.append(row)
        row.cache.target = [RowView(layer, lambda: self.index(row)) for layer in self.layers]

    def leave(self, row: Row) -> None:
        """Give a row its target layers back as the caches it had alone (what it committed); drop it from the batch."""
        i = self.index(row)
        if self.alone:
            self._places, self.rows = {}, []
            return
        row.cache.target = [layer.pop(i) for layer in self.layers]
        del self.rows[i]
        self._places = {id(r): j for j, r in enumerate(self.rows)}

    def _plans(self, ahead: int = 0) -> list[Plan]:
        """Every row's plan for its next cycle, ``ahead`` tokens after what it has emitted (one: after the plain
        cycle in flight)."""
        plans = [row.plan(row.emitted + ahead) for row in self.rows]
        if len(self.rows) == 1:  # a row alone: its own policy is the whole story
            return plans
        chosen = self.planner.plans([row.policy for row in self.rows], plans)
        return [row.capped(plan, row.emitted + ahead) for row, plan in zip(self.rows, chosen)]

    def start(self) -> BatchCycle:
        """Build one draft-verify cycle for every row and start evaluating it (rows must not join or leave until
        ``finish``).

        Blocks of different depths are padded at their end: a padding position comes after
        every real one of its row, so no real position attends to it, and the row's commit
        drops it with the rejected drafts. A cycle where no row drafts is committed at once,
        unless a row reaches its budget in it, so that ``follow`` can start the next.
        """
        planned = self._planned
        plans = planned[1] if planned is not None and planned[0] == self.rows else self._plans()
        self._planned = None
        cycle = self._start(plans, [(row.last, row.last_id) for row in self.rows])
        if self._plain(cycle):
            self._commit(cycle, cycle.rows)
        return cycle

    def follow(self, cycle: BatchCycle) -> Optional[BatchCycle]:
        """The cycle after ``cycle``, started before ``cycle`` is read, where that is safe: ``cycle`` committed
        already and no row drafts in the next (its input is then ``cycle``'s token, still lazy), as the solo loop
        pipelines its plain steps. Otherwise None; the plans made stay for the next ``start``."""
        if not cycle.committed or cycle.rows != self.rows:
            return None
        plans = self._plans(ahead=1)
        if not all(plan.plain for plan in plans):
            self._planned = (list(self.rows), plans)
            return None
        return self._start(plans, [(v.target_tokens, None) for v in cycle.verdicts])

    def _start(self, plans: Sequence[Plan], inputs: Sequence[tuple[mx.array, Optional[int]]]) -> BatchCycle:
        started = time.perf_counter()
        with mx.stream(generation_stream):
            drafted = [row.draft(plan, last, last_id) for row, plan, (last, last_id) in zip(self.rows, plans, inputs)]
            n = max(d.block.shape[0] for d in drafted)
            if self.alone:
                logits, features = self.target(drafted[0].block[None], self.rows[0].cache.target)
            else:
                blocks = mx.stack([mx.pad(d.block, (0, n - d.block.shape[0])) for d in drafted])
                logits, features = self.target(blocks, self.layers)
            cycles = [
                row.verdict(d, logits[i, : d.block.shape[0]], features[i : i + 1, : d.block.shape[0]])
                for i, (row, d) in enumerate(zip(self.rows, drafted))
            ]
        mx.async_eval([c.arrays() for c in cycles], [d.absorbed for d in drafted])
        return BatchCycle(list(self.rows), cycles, started, len(self.rows) > 1, n - 1)

    @staticmethod
    def _plain(cycle: BatchCycle, rows: Optional[Sequence[Row]] = None) -> bool:
        """Whether no row drafts in ``cycle`` and none of ``rows`` (all) reaches its budget in it."""
        rows = cycle.rows if rows is None else rows
        return all(v.proposal is None for v in cycle.verdicts) and all(r.emitted + 1 < r.max_tokens for r in rows)

    @staticmethod
    def _commit(cycle: BatchCycle, rows: Sequence[Row]) -> None:
        """Commit a plain cycle's one input on ``rows`` before it is read."""
        for row, verdict in zip(cycle.rows, cycle.verdicts):
            if any(row is r for r in rows):
                row.cache.commit([row.last_id], verdict.features)
        cycle.committed = True

    def finish(self, cycle: BatchCycle, dropped: Sequence[Row] = (), then: Optional[BatchCycle] = None
               ) -> list[Optional[Emitted]]:
        """Read a started cycle and commit every row's part, but for the ``dropped`` rows (a stop string or a client
        gone meanwhile), whose part is undone as an abandoned solo cycle's is: None in their place. ``then``: the
        cycle ``follow`` started after it, committed here on the rows that go on (their input is now known) unless
        one reaches its budget in it; a row that ended here is dropped from it."""
        out: list[Optional[Emitted]] = []
        for row, verdict in zip(cycle.rows, cycle.verdicts):
            if any(row is r for r in dropped):
                row.cache.abandon()
                out.append(None)
            else:
                out.append(row.finish(verdict, cycle.started, committed=cycle.committed))
        now = time.perf_counter()
        if cycle.planned:
            tokens = sum(e.accepted + 1 for e in out if e is not None)
            self.planner.observe(cycle.deepest, now - max(cycle.started, self._read_at), tokens)
        self._read_at = now
        if then is not None:
            going = [row for row, e in zip(cycle.rows, out) if e is not None and e.reason is None]
            if self._plain(then, going):
                self._commit(then, going)
        return out

    def cycle(self) -> list[Emitted]:
        """One draft-verify-commit cycle for every row; each row's tokens, in the order of ``rows``."""
        return self.finish(self.start())  # type: ignore[return-value]  (nothing dropped: no None)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)



def own_policy(row: Row) -> Callable[[], None]:
    """Give ``row`` a copy of its policy, shared by the generations of its pair and settings: in a batch a row's
    depth and copies follow its own text. The call returned merges what the row learned (acceptance, cycle costs,
    what probes found) into the shared policy once the row ends, as one generation's policy carries over to the
    next: every row's, not the last one's over the others'."""
    shared = row.policy
    row.policy = copy.deepcopy(shared)
    merge = getattr(shared, "merge", None)  # a policy that learns nothing (FixedBlock) has nothing to merge

    def hand_back() -> None:
        if merge is not None:
            merge(row.policy)

    return hand_back
