"""How many tokens to draft each cycle.

The decode loop asks its policy before every cycle and tells it what happened
after: how many tokens were drafted, how many the target accepted, and how long
the cycle took. Any depth is lossless (verification keeps only what the target
agrees with); the policy only decides speed. 0 means a plain decoding step.

Each plan also names its source: the drafter's block, or a copy draft (what
followed an earlier occurrence of the history's end, ``Repeats.continuation``),
which costs only its verify.

``FixedBlock`` always fills the block (``--block-size N``). ``AdaptiveDepth``
(the default) picks the source and depth that maximise expected tokens per second
from two live estimates (``estimates``): the acceptance of each draft position, per
source (apart for text that repeats and text that does not), and the cost of a cycle
as a function of its depth, both measured from the cycles as they run. Two small
schedules decide what the estimates cannot: when to probe the drafter again while
plain decoding wins, and when to retry copies the estimates rule out (``schedules``).

Planning changes nothing but the context span whose costs price the cycle: what a
plan decided that its outcome settles (the probe schedule's next state, whether a copy
was a retry) travels in the plan
(``Plan.why``) and takes effect when ``observe`` gets the plan back with what ran.
The decode loop plans a plain step's successor before it reads that step, so a
policy that kept its decision to itself would settle the wrong cycle with it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from ..distributed import from_main
from ..errors import DFlashError
from .estimates import Acceptance, CycleCosts, span
from .per_pair import PerPair
from .repeats import Repeats
from .schedules import CopyRetries, ProbeSchedule

AUTO, DRAFTER, COPY = "auto", "drafter", "copy"
SOURCES = (AUTO, DRAFTER, COPY)  # what ``--draft-source`` takes: auto lets the adaptive policy choose


@dataclass(frozen=True)
class Plan:
    """The next cycle: draft ``depth`` tokens (0: a plain step) from ``source``.

    A copy is planned before the cycle's first token is known; where the history
    then offers none, the cycle drafts ``fallback`` tokens from the drafter instead.
    ``why`` is the policy's own record of the decision, handed back to it with the
    outcome (not part of what the plan is: plans compare without it).
    """

    depth: int
    source: str = DRAFTER
    fallback: int = 0
    why: Any = field(default=None, compare=False, repr=False)

    @property
    def plain(self) -> bool:
        return self == PLAIN

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)


PLAIN = Plan(0)


class DraftPolicy(Protocol):
    repeats: Repeats  # the history's index, which copy drafts come from

    def start(self) -> None:
        """A generation begins: a new prompt, whose acceptance may differ from the last one's."""
        ...

    def plan(self, history: Sequence[int]) -> Plan:
        """The next cycle, given the tokens the caches hold (the loop caps its depth); changes nothing."""
        ...

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        """A verified cycle of ``plan`` (as the loop ran it): ``accepted`` of ``drafted`` tokens agreed with the
        target; it took ``seconds``. ``source`` is where the drafts came from (a planned copy found nowhere ran
        its drafter fallback).
        """
        ...


def check_source(source: str) -> str:
    if source not in SOURCES:
        raise DFlashError(f"draft source must be one of {', '.join(SOURCES)}, got {source!r}")
    return source


@dataclass
class FixedBlock:
    """Always fill the block: ``block_size - 1`` tokens after the last verified one, from one source.

    Copying, a cycle where the history offers no copy is a plain step (prompt-lookup decoding).
    """

    block_size: int
    source: str = DRAFTER
    repeats: Repeats = field(default_factory=Repeats)

    def start(self) -> None:
        self.repeats.reset()

    def plan(self, history: Sequence[int]) -> Plan:
        return Plan(self.block_size - 1, self.source)

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        pass


@dataclass(frozen=True)
class Decision:
    """What ``AdaptiveDepth.plan`` decided that the cycle's outcome settles."""

    bucket: int  # how the history repeated itself: whose acceptance the cycle updates
    span: Optional[int] = None  # the context span it was planned at (``estimates.span``): whose costs it updates
    schedule: Optional[tuple[int, bool]] = None  # the probe schedule's (plain_run, new_prompt) once the drafter's
    # plan runs (None: the drafter's plan does not move it: a warm-up, a target alone)
    retry: bool = False  # a copy the retry schedule asked for, not the costs


@dataclass
class AdaptiveDepth:
    """Draft the k in 0..``max_depth`` that maximises E[tokens(k)] / t(k), probing now and then.

    Until the cost model has seen plain, one-draft and longer cycles it runs a short
    warm-up (a full block, a plain step, one token). A generation's first cycle is
    not timed, so there it drafts one token: its seconds would teach the model
    nothing, but the drafter's first call (its weights read in, its buffers made)
    is paid there, not priced into every later draft; a full block there was
    drafted twice, and at a long first prompt each costs several plain steps (3.4
    at 4k tokens of the real pair on a CPU, issue 62). While plain decoding wins
    it drafts again now and then, so that a drafter whose acceptance recovers is
    noticed. A probe drafts one token, the cheapest question (does the target take
    the drafter's first token?), and one accepted whole is followed at once by one
    twice as deep (1, 2, 4, 8, ...): the cost of a long draft learnt at one context
    length does not hold at another (a 16-token verify over an 8k window costs
    several plain steps on a CPU, about one at a short context), so a probe must be
    cheap whatever the estimates say.

    Probes are spaced by what they have found. Probing every n plain cycles loses
    L/n of a plain step per cycle (L: what a probe costs beyond the plain steps for
    its tokens); a recovery that gains g per cycle once noticed is noticed n/2
    cycles late on average. With recoveries found at r per plain cycle the loss
    L/n + r g n / 2 is least at n = sqrt(2 L / (r g)). Each run of drafting that a
    probe started is followed to its end (g = 1 - its time in plain steps, as
    predicted, / its tokens), and r g is their sum per plain cycle, both decaying
    by ``memory`` per plain cycle. Probes thus come every ~20 cycles where replies
    keep falling into runs the drafter follows (a chat reply's loops), and where
    they never do, no more often than losing ``probe_budget`` of the time allows
    (at least ``min_probe`` cycles apart).

    A new generation (a new prompt), where acceptance changes most, brings the next
    probe forward to a quarter of an interval into its reply, not to its first
    cycle: a reply's opening is where a drafter agrees least (the target chooses
    how to answer), and the runs it follows come later (measured on chat replies:
    six to twelve rejected blocks, then full ones). Each prompt thus adds at most
    one probe, and a reply shorter than a quarter interval (a short answer at a
    long context) none. It does so only while drafting has paid (a cycle gave more
    tokens than plain steps would have in its time) in at least ``min_paid`` of the
    recent prompts (decaying by ``prompt_memory`` per prompt): with a drafter that
    never pays, one probe per reply of 64 tokens at a 16k context cost 2-3%; now
    such prompts stop bringing probes forward after about four. The acceptance seen
    before a run of plain steps fades by ``stale`` per step, so a probe after a long
    run weighs more.

    Acceptance is kept apart by how the text repeats itself (``Repeats.bucket``: the
    end of the history is new, repeats a short stretch, or a long one), and each
    decision goes by its bucket's. A reply that falls into a loop the drafter has
    followed before is drafted within a few tokens of the loop's second pass, not
    at the next probe, while the new text around it decodes plainly (measured on the
    CPU pair's chat set: from 0.86-0.97 of a full block's speed to 1.07-1.24 in three
    runs of four; on its code set plain decoding stays the best path).

    Copy drafts (``copies``) are a second source with acceptances of their own, per
    bucket, of the copies the history offered. A cycle plans a copy where a copy's
    expected tokens per second beat the drafter's best and plain decoding, with what
    the drafter would have done as its fallback: where the history offers no copy
    (which the decode loop learns only once the cycle's first token is known), the
    cycle runs that instead, so planning a copy never costs the drafter's cycle. Where the
    text repeats, copies are retried on a backoff even where the estimates say no
    (``CopyRetries.due``): neither a cycle timed during a spike of the machine's load nor copies
    refused earlier in the reply may rule them out for good.

    Decisions read the cost model through ``seconds`` and ``copy_seconds``, its
    predictions, refreshed after every cycle. The model is kept per context span
    (``estimates.span``: below 512 tokens, then one per doubling), because a verify
    over 8k positions costs more plain steps than one over 256: a span entered for
    the first time starts from the nearest span's costs, counting for a couple of
    cycles only, so its own cycles price it within a few (a depth chosen at a short
    context is not drafted for a whole long reply), and a short prompt after a long
    one finds its own span's costs where it left them. The ranks of a sharded target (``distributed``) see the same
    tokens but time their cycles apart, and must all draft the same depth: there
    ``agree`` gives every rank rank 0's (plain, drafter, per-token) seconds, which
    replace the predictions every ``agree_every`` cycles and nowhere else.
    """

    max_depth: int
    copies: bool = True
    drafter: bool = True  # False: a target loaded alone, which decodes plainly or copies
    draft_depth: Optional[int] = None  # the deepest draft the drafter makes (its block - 1; None: max_depth): copies
    # go deeper where the verify block is larger than the drafter's (a drafter trained for blocks of 8)
    probe_budget: float = 0.005
    min_probe: int = 8
    stale: float = 0.995
    memory: float = 0.995
    prompt_memory: float = 0.8
    min_paid: float = 0.125
    retry_steps: float = 2.0  # the most plain steps a copy retry's verify may cost (``CopyRetries.depth``)
    agree: Optional[Callable[[list[float]], list[float]]] = None
    agree_every: int = 32
    repeats: Repeats = field(default_factory=Repeats)
    by_repeat: list[Acceptance] = field(init=False)  # one per ``Repeats.bucket``
    copy_by_repeat: list[Acceptance] = field(init=False)  # the same, of copy drafts
    costs: CycleCosts = field(init=False)  # the current context span's
    spans: dict[int, CycleCosts] = field(init=False)  # every span's, once a cycle ran in it
    span: Optional[int] = None  # the current one (None until the first cycle)
    probes: ProbeSchedule = field(init=False)
    retries: CopyRetries = field(init=False)
    seconds: Optional[list[float]] = None  # predicted seconds of a cycle drafting k = 0..max_depth
    copy_seconds: Optional[list[float]] = None  # predicted seconds of a cycle copying k = 0..max_depth
    _since_agreed: int = 0
    _timed: bool = False  # whether the next cycle's seconds are its depth's (not a generation's first cycle)

    def __post_init__(self) -> None:
        self.draft_depth = self.max_depth if self.draft_depth is None else min(self.draft_depth, self.max_depth)
        self.by_repeat = [Acceptance(self.max_depth) for _ in range(3)]
        self.copy_by_repeat = [Acceptance(self.max_depth) for _ in range(3)]
        self.costs = CycleCosts(self.draft_depth, drafter=self.drafter)  # its warm-up's full block is the drafter's
        self.spans = {}
        self.probes = ProbeSchedule(self.probe_budget, self.min_probe, self.memory, self.prompt_memory, self.min_paid)
        self.retries = CopyRetries(self.min_probe)

    @property
    def warming_up(self) -> bool:
        """Whether the cost model still lacks a cycle it needs (``CycleCosts.missing``): plans then measure what it
        lacks, and ``seconds`` (its predictions) is None."""
        return not self.costs.ready

    def expected(self, plan: Plan) -> list[float]:
        """E[tokens of a cycle drafting k from the plan's source], k = 0..max_depth, where the plan was made: the
        drafter's held beyond ``draft_depth``, which it drafts when asked for more."""
        if plan.source == COPY:
            return self.copy_by_repeat[_bucket(plan)].expected_tokens()
        return self._drafted(self.by_repeat[_bucket(plan)].expected_tokens())

    def _drafted(self, expected: list[float]) -> list[float]:
        return expected[: self.draft_depth + 1] + [expected[self.draft_depth]] * (self.max_depth - self.draft_depth)

    def _rates(self, bucket: int) -> list[float]:
        """Expected tokens per second of a cycle drafting k = 0..max_depth."""
        assert self.seconds is not None
        if not self.drafter:  # nothing drafts: plain steps are the drafter's plan
            return [1 / self.seconds[0]] + [0.0] * self.max_depth
        rates = [e / t for e, t in zip(self.by_repeat[bucket].expected_tokens(), self.seconds)]
        return rates[: self.draft_depth + 1] + [0.0] * (self.max_depth - self.draft_depth)

    def _copy_rates(self, bucket: int) -> list[float]:
        """Expected tokens per second of a cycle copying k = 0..max_depth."""
        assert self.copy_seconds is not None
        return [e / t for e, t in zip(self.copy_by_repeat[bucket].expected_tokens(), self.copy_seconds)]

    def _refresh(self) -> None:
        """The predictions the next decisions use (every rank's the same, with ``agree``)."""
        if not self.costs.ready:
            return
        if self.agree is not None:
            self._since_agreed += 1
            if self.seconds is not None and self._since_agreed < self.agree_every:
                return
            self._since_agreed = 0
            plain, drafter, per_token, copy_fixed, copy_per_token = self.agree(self.costs.theta)
        else:
            plain, drafter, per_token, copy_fixed, copy_per_token = self.costs.theta
        depths = range(1, self.max_depth + 1)
        self.seconds = [plain] + [max(plain + drafter + k * per_token, 1e-9) for k in depths]
        self.copy_seconds = [plain] + [max(plain + copy_fixed + k * copy_per_token, 1e-9) for k in depths]

    @staticmethod
    def _argmax(values: list[float]) -> int:
        return max(range(len(values)), key=values.__getitem__)

    def best(self, bucket: int = 0) -> int:
        """The depth with the most expected tokens per second under the current estimates."""
        return self.draft_depth if self.warming_up else self._argmax(self._rates(bucket))

    def probe_interval(self, depth: int, bucket: int = 0) -> int:
        """Plain cycles between probes at ``depth`` (``ProbeSchedule.interval``).

        A probe loses what it takes beyond the plain steps that would have made its
        expected tokens (L, in plain steps). Where drafting is nearly as good as
        plain decoding that is little, and probes come often: the decision is close
        and worth checking.
        """
        assert self.seconds is not None
        loss = max(self.seconds[depth] / self.seconds[0] - self.by_repeat[bucket].expected_tokens()[depth], 0.0)
        return self.probes.interval(loss)

    def _affordable_copy(self) -> int:
        """The deepest copy whose verify costs at most ``retry_steps`` plain steps (``CopyRetries.depth``)."""
        assert self.copy_seconds is not None
        limit = self.retry_steps * self.copy_seconds[0]
        return max((k for k in range(1, self.max_depth + 1) if self.copy_seconds[k] <= limit), default=1)

    def plan(self, history: Sequence[int]) -> Plan:
        if self.max_depth == 0:
            return PLAIN
        bucket, at = self.repeats.bucket(history), span(len(history))
        self._enter(at)  # (a plain step in flight, planned in the span before, moves back to it when observed)
        if self.warming_up:  # a full block, a plain step, one token; untimed, one token (see the class doc)
            return Plan(self.costs.missing()[0] if self._timed else int(self.drafter), why=Decision(bucket, at))
        rates = self._rates(bucket)
        planned, schedule = 0, None
        if self.drafter:
            planned, schedule = self.probes.decide(self._argmax(rates), lambda: self.probe_interval(1, bucket))
        if self.copies:
            copying = self._copy_rates(bucket)
            c = self._argmax(copying)
            won = c > 0 and copying[c] > max(rates)
            if won or self.retries.due(bucket):  # the drafter's plan is the fallback, its schedule with it
                depth = c if won else self.retries.depth(self._affordable_copy(), self.max_depth)
                return Plan(depth, COPY, planned, Decision(bucket, at, schedule, retry=not won))
        return Plan(planned, why=Decision(bucket, at, schedule))

    def start(self) -> None:
        self.probes.start()
        self._timed = False
        self.repeats.reset()

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        # A generation's first cycle also pays for the buffers its prefill handed back (measured here: +15 ms
        # on a 6 ms plain step and on a 19 ms full block alike): not what its depth costs.
        timed, self._timed = self._timed, True
        why: Optional[Decision] = plan.why
        bucket = _bucket(plan)
        if why is not None and why.span is not None:
            self._enter(why.span)
        if source == COPY:
            self.retries.copied(drafted, accepted, why is not None and why.retry)
            self.copy_by_repeat[bucket].update(drafted, accepted)
            if timed:
                self.costs.update(drafted, seconds, copy=True)
                self._refresh()
            return
        self.retries.passed(bucket)
        if why is not None and why.schedule is not None:  # the drafter's plan ran: its schedule with it
            self.probes.settle(why.schedule)
        probing = drafted > 0 and not self.warming_up and self.best(bucket) == 0
        self.probes.answered(drafted, accepted, probing, self.draft_depth)
        if drafted:
            self.by_repeat[bucket].update(drafted, accepted)
        else:
            for acceptance in self.by_repeat:
                acceptance.fade(self.stale)
            self.probes.plain()
        if timed:
            self.costs.update(drafted, seconds)
            self._refresh()
        if drafted:
            steps = None if self.warming_up else self.seconds[drafted] / self.seconds[0]  # predicted: every rank's
            self.probes.drafted(accepted, steps, probing and self.best(bucket) > 0)

    def _enter(self, at: int) -> None:
        """Price cycles with the costs of context span ``at`` from now on (seeded from the nearest span's, the
        first time)."""
        if at == self.span:
            return
        if self.span is None:  # the first cycle: what was measured so far (nothing, or a merge) is this span's
            self.span, self.spans[at] = at, self.costs
            return
        if at not in self.spans:
            self.spans[at] = self.spans[min(self.spans, key=lambda s: abs(s - at))].seeded()
        self.span, self.costs = at, self.spans[at]
        self.seconds = self.copy_seconds = None
        self._refresh()

    def merge(self, other: AdaptiveDepth) -> None:
        """Take in what another copy of this policy learnt (a batch row's, as it leaves): acceptance, cycle costs
        of every context span and what probes found, combined with this one's; its place in its reply (probe and
        copy schedules) not."""
        for mine, theirs in zip(self.by_repeat + self.copy_by_repeat, other.by_repeat + other.copy_by_repeat):
            mine.merge(theirs)
        if other.span is None:  # it ran no cycle: what it holds (a merge's) belongs to no span yet
            self.costs.merge(other.costs)
        else:
            if self.span is None:  # a policy that only merges (a batch's shared one) takes the rows' spans
                self.span, self.spans[other.span] = other.span, self.costs
            for at, costs in other.spans.items():
                if at in self.spans:
                    self.spans[at].merge(costs)
                else:
                    self.spans[at] = copy.deepcopy(costs)
        self.probes.merge(other.probes)
        self._refresh()


def _bucket(plan: Plan) -> int:
    """The repeat bucket a plan was made in (0, text that does not repeat, for a plan made elsewhere)."""
    return plan.why.bucket if isinstance(plan.why, Decision) else 0


_shared = PerPair()


def adaptive_policy(target: Any, drafter: Any, windows: tuple[Optional[int], int], block_size: int,
                    copies: bool = True, drafts: bool = True) -> AdaptiveDepth:
    """The adaptive policy of this loaded pair and settings, shared by its generations in this process.

    What it measured (this machine's cycle costs for this model, the recent
    acceptance) carries over from one call to the next; a new process, or a newly
    loaded model, measures afresh. A sharded target's ranks agree on rank 0's costs.
    """
    group = getattr(target, "group", None)
    agree = None if group is None else functools.partial(from_main, g=group)
    return _shared.get(target, drafter, (windows, block_size, copies, drafts),  # windows: the target's and drafter's
                       lambda: AdaptiveDepth(block_size - 1, copies=copies, drafter=drafts, agree=agree,
                                             draft_depth=min(block_size, drafter.block_size) - 1))
