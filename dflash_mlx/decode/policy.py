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
plain decoding wins (``ProbeSchedule``), and when to retry copies the estimates
rule out (``CopyRetries``).

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
from .estimates import Acceptance, CycleCosts, combine, span
from .per_pair import PerPair
from .repeats import Repeats

AUTO, DRAFTER, COPY = "auto", "drafter", "copy"
SOURCES = (AUTO, DRAFTER, COPY)  # what ``--draft-source`` takes: auto lets the adaptive policy choose
COPY_STREAK = 4  # retried copies accepted whole in a row before the backoff resumes


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


@dataclass
class ProbeSchedule:
    """When to draft again while plain decoding wins: probe intervals from what probes found, a probe brought
    forward by a new prompt where drafting has paid lately, a probe accepted whole followed by a deeper one.

    ``AdaptiveDepth``'s docstring gives the reasoning and the figures; its knobs are passed through.
    """

    budget: float = 0.005
    min_probe: int = 8
    memory: float = 0.995
    prompt_memory: float = 0.8
    min_paid: float = 0.125
    plain_run: int = 0  # plain cycles since the drafter last drafted
    found: float = 0.0  # decaying sum of the gains g of the drafting runs probes started
    waited: float = 200.0  # decaying count of plain cycles (a prior: none found in two hundred)
    run: Optional[list[float]] = None  # the current run's [tokens, plain steps], when a probe started it
    new_prompt: bool = False
    prompts: float = 1.0  # decaying count of prompts (a prior: one, in which drafting paid)
    paid: float = 1.0  # decaying count of the prompts in which a drafting cycle beat plain steps
    paid_now: bool = False
    follow_up: int = 0  # the depth to draft next: the last probe was accepted whole

    def interval(self, loss: float) -> int:
        """Plain cycles between probes that lose ``loss`` plain steps each: sqrt(2 L / found), at most what
        ``budget`` allows."""
        budgeted = loss / self.budget
        found = self.found / self.waited
        best = (2 * loss / found) ** 0.5 if found > 0 else budgeted
        return int(max(min(best, budgeted), self.min_probe))

    def decide(self, best: int, interval: Callable[[], int]) -> tuple[int, tuple[int, bool]]:
        """(the drafter's depth, the schedule's (plain_run, new_prompt) once that runs) when ``best`` is the
        depth the estimates prefer; ``interval()`` prices a probe, asked only when one may be due."""
        if best > 0:
            return best, (0, self.new_prompt)
        plain_run, new_prompt = self.plain_run + 1, self.new_prompt
        if self.follow_up:  # the last probe was accepted whole: look further at once
            return self.follow_up, (plain_run, new_prompt)
        every = interval()
        if new_prompt:  # the next probe a quarter interval into the reply at the latest
            new_prompt = False
            plain_run = max(plain_run, every - max(self.min_probe, every // 4))
        if plain_run >= every:
            return 1, (0, new_prompt)
        return 0, (plain_run, new_prompt)

    def start(self) -> None:
        self.prompts = self.prompt_memory * self.prompts + 1
        self.paid *= self.prompt_memory
        self.paid_now = False
        self.new_prompt = self.paid >= self.min_paid * self.prompts

    def plain(self) -> None:
        """A plain cycle ran: the run a probe started, if any, has ended, and what it gained per token counts."""
        self.waited = self.memory * self.waited + 1
        self.found *= self.memory
        if self.run is not None:
            tokens, steps = self.run
            self.found += max(0.0, 1 - steps / tokens)
            self.run = None

    def drafted(self, accepted: int, steps: float, paid: bool, started: bool) -> None:
        """A drafting cycle ran, ``accepted`` kept in ``steps`` plain steps' time (predicted); ``paid``: more tokens
        than plain steps would have made; ``started``: a probe that starts a run of drafting."""
        self.new_prompt = False
        if paid and not self.paid_now:
            self.paid_now = True
            self.paid += 1
        if started:
            self.run = [0.0, 0.0]
        if self.run is not None:
            self.run[0] += accepted + 1
            self.run[1] += steps

    def merge(self, other: ProbeSchedule) -> None:
        """Take in what another schedule found (a batch row's): the rates combined; its place in a reply not."""
        rate, self.waited = combine(self.found / self.waited, self.waited, other.found / other.waited, other.waited)
        self.found = rate * self.waited
        share, self.prompts = combine(self.paid / self.prompts, self.prompts, other.paid / other.prompts,
                                       other.prompts)
        self.paid = share * self.prompts


@dataclass
class CopyRetries:
    """When to copy although the cost model says no: where the text repeats, on a backoff (see ``due``)."""

    min_probe: int = 8
    wait: int = 0  # cycles until copies may be retried
    backoff: int = 0  # the retry interval while retries lose
    streak: int = 0  # retries accepted whole in a row

    def __post_init__(self) -> None:
        self.backoff = self.wait = self.min_probe

    def due(self, bucket: int) -> bool:
        """Whether to copy although the cost model says no: the text repeats (``bucket`` > 0) and the retry is due.

        On a busy machine (a browser, a build) a verify costs several plain steps and
        one cycle timed during a spike prices copies out, before any ran or after; only
        another copy measures them again. So copies are never ruled out by timing alone:
        they are retried on a backoff (``min_probe`` cycles, doubling while they lose,
        at most 256), and at once again while retries are accepted whole (up to
        ``COPY_STREAK`` in a row), so a loop's acceptance is learnt in a few cycles.
        Nor by their acceptance so far: copies the target refused earlier in a reply
        say nothing of a loop it falls into later (retries stopped once that fell below
        1.5 tokens a block, and the loop then decoded plainly to its end: replayed under
        a recorded load, 0.29 of copying alone). The backoff grows within one stretch of
        repetition only: new text in between (``new_text``) starts it over.

        Until the plans carried their decisions (``Plan.why``), the decode loop's plan of a
        plain step's successor, made before that step was read, had the step's outcome settle
        it: every retry then counted as chosen by the costs, and retries never backed off
        live (replay, which plans after each outcome, did). Replayed on the real pair's traces
        under every profile, the backoff with that reset matches or beats those live retries
        (a target alone: 0.99-1.06x; with a drafter the copies the costs choose decide, and
        nothing changed); it is a little behind the backoff without the reset (0.90-1.0x), which
        found a random pair's loops too late to copy them.
        """
        return bucket != 0 and self.wait <= 0

    def new_text(self) -> None:
        """The history's end is new (no repeat): the next stretch that repeats is a new question, whatever the
        copies of an earlier one got, so its first retry comes at the shortest interval."""
        self.backoff = self.min_probe
        self.wait = min(self.wait, self.min_probe)

    def copied(self, drafted: int, accepted: int, retried: bool) -> None:
        """After a copy: the schedule reset by one the costs chose, moved on by a retry."""
        if not retried:
            self.backoff, self.wait, self.streak = self.min_probe, self.min_probe, 0
        elif accepted == drafted and self.streak < COPY_STREAK:
            self.wait, self.streak = 0, self.streak + 1
        else:
            self.backoff = min(2 * self.backoff, 256)
            self.wait, self.streak = self.backoff, 0


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
    warm-up (a full block, a plain step, one token). While plain decoding wins
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
    (``_copy_due``): neither a cycle timed during a spike of the machine's load nor copies
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
    probe_budget: float = 0.005
    min_probe: int = 8
    stale: float = 0.995
    memory: float = 0.995
    prompt_memory: float = 0.8
    min_paid: float = 0.125
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
        self.by_repeat = [Acceptance(self.max_depth) for _ in range(3)]
        self.copy_by_repeat = [Acceptance(self.max_depth) for _ in range(3)]
        self.costs = CycleCosts(self.max_depth, drafter=self.drafter)
        self.spans = {}
        self.probes = ProbeSchedule(self.probe_budget, self.min_probe, self.memory, self.prompt_memory, self.min_paid)
        self.retries = CopyRetries(self.min_probe)

    def expected(self, plan: Plan) -> list[float]:
        """E[tokens of a cycle drafting k from the plan's source], k = 0..max_depth, where the plan was made."""
        by_repeat = self.copy_by_repeat if plan.source == COPY else self.by_repeat
        return by_repeat[_bucket(plan)].expected_tokens()

    def _rates(self, bucket: int) -> list[float]:
        """Expected tokens per second of a cycle drafting k = 0..max_depth."""
        assert self.seconds is not None
        if not self.drafter:  # nothing drafts: plain steps are the drafter's plan
            return [1 / self.seconds[0]] + [0.0] * self.max_depth
        return [e / t for e, t in zip(self.by_repeat[bucket].expected_tokens(), self.seconds)]

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
        return self._argmax(self._rates(bucket)) if self.seconds is not None else self.max_depth

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

    def plan(self, history: Sequence[int]) -> Plan:
        if self.max_depth == 0:
            return PLAIN
        bucket, at = self.repeats.bucket(history), span(len(history))
        self._enter(at)  # (a plain step in flight, planned in the span before, moves back to it when observed)
        if self.seconds is None:  # warm-up: a full block, a plain step, one token
            return Plan(self.costs.missing()[0], why=Decision(bucket, at))
        rates = self._rates(bucket)
        planned, schedule = 0, None
        if self.drafter:
            planned, schedule = self.probes.decide(self._argmax(rates), lambda: self.probe_interval(1, bucket))
        if self.copies:
            copying = self._copy_rates(bucket)
            c = self._argmax(copying)
            won = c > 0 and copying[c] > max(rates)
            if won or self.retries.due(bucket):  # the drafter's plan is the fallback, its schedule with it
                return Plan(c if won else self.max_depth, COPY, planned, Decision(bucket, at, schedule, retry=not won))
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
        self.retries.wait -= 1
        if bucket == 0:
            self.retries.new_text()
        if why is not None and why.schedule is not None:  # the drafter's plan ran: its schedule with it
            self.probes.plain_run, self.probes.new_prompt = why.schedule
        probing = drafted > 0 and self.seconds is not None and self.best(bucket) == 0
        self.probes.follow_up = min(2 * drafted, self.max_depth) if probing and accepted == drafted else 0
        if drafted:
            self.by_repeat[bucket].update(drafted, accepted)
        else:
            for acceptance in self.by_repeat:
                acceptance.fade(self.stale)
            self.probes.plain()
        if timed:
            self.costs.update(drafted, seconds)
            self._refresh()
        if drafted and self.seconds is not None:
            steps = self.seconds[drafted] / self.seconds[0]  # predicted: every rank's the same
            self.probes.drafted(accepted, steps, accepted + 1 > steps, probing and self.best(bucket) > 0)
        elif drafted:
            self.probes.new_prompt = False

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
                       lambda: AdaptiveDepth(block_size - 1, copies=copies, drafter=drafts, agree=agree))
