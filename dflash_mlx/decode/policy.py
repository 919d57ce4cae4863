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
from two live estimates: the acceptance of each draft position, per source (apart
for text that repeats and text that does not), and the cost of a cycle as a
function of its depth, both measured from the cycles as they run.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import numpy as np

from ..distributed import from_main
from ..errors import DFlashError
from .repeats import Repeats

AUTO, DRAFTER, COPY = "auto", "drafter", "copy"
SOURCES = (AUTO, DRAFTER, COPY)  # what ``--draft-source`` takes: auto lets the adaptive policy choose


class Plan(NamedTuple):
    """The next cycle: draft ``depth`` tokens (0: a plain step) from ``source``.

    A copy is planned before the cycle's first token is known; where the history
    then offers none, the cycle drafts ``fallback`` tokens from the drafter instead.
    """

    depth: int
    source: str = DRAFTER
    fallback: int = 0


class DraftPolicy(Protocol):
    repeats: Repeats  # the history's index, which copy drafts come from

    def start(self) -> None:
        """A generation begins: a new prompt, whose acceptance may differ from the last one's."""
        ...

    def plan(self, history: Sequence[int]) -> Plan:
        """The next cycle, given the tokens the caches hold (the loop caps its depth)."""
        ...

    def observe(self, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        """A verified cycle: ``accepted`` of ``drafted`` tokens agreed with the target; it took ``seconds``.

        ``source`` is where the drafts came from (a planned copy found nowhere ran its drafter fallback).
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

    def observe(self, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        pass


@dataclass
class Acceptance:
    """P(draft position j is accepted | every position before it was), for j = 0..K-1, with decay.

    Each cycle observes positions 0..accepted (the first rejection ends it). Counts
    decay by ``decay`` per cycle, so a change of topic is followed within tens of
    cycles. A position seen rarely leans on the one before it (``prior``
    pseudo-observations; the first position on the pooled rate of all), which
    also covers depths never drafted yet: after drafts of k accepted whole (a run
    the drafter follows), the positions beyond k look as good as the k-th, so the
    next draft reaches further. Leaning on the pooled rate instead, a policy
    climbing out of plain decoding drafted 10 to 14 tokens for tens of cycles in
    loops a full block would have taken whole.
    """

    depth: int
    decay: float = 0.9
    prior: float = 2.0
    hits: np.ndarray = field(init=False)
    trials: np.ndarray = field(init=False)
    _expected: Optional[list[float]] = field(default=None, init=False, repr=False)
    _fading: float = field(default=1.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.hits = np.zeros(self.depth)
        self.trials = np.zeros(self.depth)

    def fade(self, factor: float) -> None:
        """Weigh what was seen so far by ``factor`` from the next update on, so that it counts for more.

        Applied lazily: a plain step calls this and must stay cheap.
        """
        self._fading *= factor

    def update(self, drafted: int, accepted: int) -> None:
        self.hits *= self.decay * self._fading
        self.trials *= self.decay * self._fading
        self._fading = 1.0
        seen = min(accepted + 1, drafted)
        self.trials[:seen] += 1
        self.hits[:accepted] += 1
        self._expected = None

    def rates(self) -> np.ndarray:
        lean = (self.hits.sum() + 1) / (self.trials.sum() + 2)  # pooled, for the first position
        rates = np.empty(self.depth)
        for j in range(self.depth):
            rates[j] = lean = (self.hits[j] + self.prior * lean) / (self.trials[j] + self.prior)
        return rates

    def expected_tokens(self) -> list[float]:
        """E[tokens of a cycle drafting k], k = 0..K: the target's own token plus the accepted run.

        Kept between updates: a plain step asks for it without changing it.
        """
        if self._expected is None:
            self._expected = [1.0] + (1.0 + np.cumsum(np.cumprod(self.rates()))).tolist()
        return self._expected


COPY_STREAK = 4  # retried copies accepted whole in a row before the backoff resumes


@dataclass
class Line:
    """Overhead of a kind of cycle over a plain step, in plain steps, as a line in its depth: fixed + k * per_token.

    Each depth keeps its own decaying mean of what its cycles took beyond the plain
    estimate; the line goes through those means, each weighted by how often its depth
    was seen (at most ``1 / (1 - decay)``). Per depth, because a long run at one depth
    (a reply's loop at full blocks) measures only one point of the line: fitted to the
    cycles as they come, the line would drift with the noise along the direction that
    depth cannot see, until a one-token probe looked three plain steps dear.
    """

    decay: float = 0.95
    fit: Optional[tuple[float, float]] = None  # (fixed, per_token), once a depth has been seen
    _means: dict[int, list[float]] = field(default_factory=dict)  # depth -> [weight, mean overhead]

    def add(self, k: int, y: float) -> None:
        mean = self._means.setdefault(k, [0.0, 0.0])
        mean[0] = min(self.decay * mean[0] + 1, 1 / (1 - self.decay))
        mean[1] += (y - mean[1]) / mean[0]
        w = sum(n for n, _ in self._means.values())
        wk = sum(n * d for d, (n, _) in self._means.items())
        wkk = sum(n * d * d for d, (n, _) in self._means.items())
        wy = sum(n * m for n, m in self._means.values())
        wky = sum(n * d * m for d, (n, m) in self._means.items())
        det = w * wkk - wk * wk
        if det <= 1e-12 * w * wkk:  # one depth only: its mean is all there is
            self.fit = (max(wy / w, 0.0), 0.0)
            return
        fixed, per_token = (wkk * wy - wk * wky) / det, (w * wky - wk * wy) / det
        if per_token < 0:  # the best fit with the negative parameter held at zero, not a clipped one
            fixed, per_token = max(wy / w, 0.0), 0.0
        elif fixed < 0:
            fixed, per_token = 0.0, max(wky / wkk, 0.0)
        self.fit = (fixed, per_token)

    @property
    def depths(self) -> int:
        return len(self._means)

    def through(self, per_token: float) -> tuple[float, float]:
        """Until two depths are seen: the line with this slope through the one seen (through 0 if none)."""
        if len(self._means) >= 2:
            assert self.fit is not None
            return self.fit
        (k, (_, mean)), = self._means.items() or [(0, (0.0, 0.0))]
        if k and mean < per_token * k:  # the line must still go through the depth seen: a dear slope (timed
            return 0.0, mean / k  # during a spike of load) priced a copy of 15 measured at 0.75 steps at 42
        return mean - per_token * k, per_token


@dataclass
class CycleCosts:
    """Seconds of a cycle drafting k tokens: t(k) = plain * (1 + [k > 0] * (drafter + k * per_token)).

    ``plain`` is a decaying mean of the plain steps; the drafting overhead (``drafter``,
    ``per_token``, in plain steps) a ``Line``. Relative, because whatever slows the
    machine down (another process, heat, a longer context) slows both kinds of cycle:
    measured apart in seconds, the kind measured last would look dear. This runs every
    cycle, the plain step of a small model included, so it is arithmetic on floats
    rather than array calls.

    A copy cycle runs no drafter: its overhead is a line of its own, measured from
    the copy cycles alone. Until they have measured two depths, it takes the drafting
    cycles' per-token cost (the same verify) as its slope, through the depth measured,
    or through zero before any: a copy costs its verified tokens and nothing fixed, so
    copies are tried, and the first measures what they cost here. (Taken flat instead,
    one first copy of 15 priced a copy of 1 as dear and none was tried again.)

    Without a drafter (``drafter`` False: a target loaded alone) only plain and copy
    cycles run; the model is ready once a plain step is timed, and a copy's slope
    before two copy depths are seen is zero (a copy is priced at one plain step until
    one runs).
    """

    max_depth: int = 15
    decay: float = 0.95
    drafter: bool = True
    plain: Optional[float] = None
    drafting: Line = field(init=False)
    copying: Line = field(init=False)
    _plain_weight: float = 0.0
    _early: list[tuple[int, float, bool]] = field(default_factory=list)  # cycles seen before any plain one
    depths_seen: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.drafting, self.copying = Line(self.decay), Line(self.decay)

    def update(self, k: int, seconds: float, copy: bool = False) -> None:
        if self.ready:  # a stall (the caller busy, the machine swapping) is not the model's cost
            seconds = min(seconds, 4 * (self.predict_copy(k) if copy else self.predict(k)))
        if k and self.plain is not None and seconds < self.plain:
            # A cycle that verifies k drafts costs at least a plain step: one quicker than the plain estimate shows
            # that estimate was timed during a spike of load. Left alone, it would price every depth as one plain
            # step, and plain steps would never run again to correct it (replayed under a recorded load: auto ran
            # its drafter's full block wherever no copy was offered, 0.66 of copying alone).
            self.plain = seconds
        if not copy:
            self.depths_seen.add(k)
        if k == 0:
            self._plain_weight = self.decay * self._plain_weight + 1
            self.plain = seconds if self.plain is None else self.plain + (seconds - self.plain) / self._plain_weight
            early, self._early = self._early, []
            for depth, took, copied in early:
                (self.copying if copied else self.drafting).add(depth, took / self.plain - 1)
        elif self.plain is None:
            self._early.append((k, seconds, copy))
        else:
            (self.copying if copy else self.drafting).add(k, seconds / self.plain - 1)

    def missing(self) -> list[int]:
        """Depths to measure before the model is determined: plain and two drafting depths (without a drafter,
        plain alone)."""
        if self.ready:
            return []
        wanted = [self.max_depth, 0, 1] if self.drafter else [0]  # a full block first: a short generation drafts
        return [k for k in wanted if k not in self.depths_seen]

    @property
    def ready(self) -> bool:
        return self.plain is not None and (not self.drafter or self.drafting.depths >= min(2, self.max_depth))

    @property
    def _drafting(self) -> tuple[float, float]:
        """The drafting line's (fixed, per_token); none without a drafter."""
        return self.drafting.fit or (0.0, 0.0)

    @property
    def theta(self) -> Optional[list[float]]:
        """(plain, drafter, per_token, copy fixed, copy per_token) in seconds at the current plain step, once measured."""
        if not self.ready:
            return None
        return [self.plain * x for x in (1.0, *self._drafting, *self.copying.through(self._drafting[1]))]

    def predict(self, k: int) -> float:
        """Predicted seconds of a cycle drafting k."""
        assert self.ready
        fixed, per_token = self._drafting
        return max(self.plain * (1 + (fixed + per_token * k if k else 0.0)), 1e-9)

    def predict_copy(self, k: int) -> float:
        """Predicted seconds of a cycle copying k."""
        assert self.ready
        fixed, per_token = self.copying.through(self._drafting[1])
        return max(self.plain * (1 + (fixed + per_token * k if k else 0.0)), 1e-9)


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
    predictions, refreshed after every cycle. The ranks of a sharded target (``distributed``) see the same
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
    costs: CycleCosts = field(init=False)
    seconds: Optional[list[float]] = None  # predicted seconds of a cycle drafting k = 0..max_depth
    copy_seconds: Optional[list[float]] = None  # predicted seconds of a cycle copying k = 0..max_depth
    _plain_run: int = 0
    _found: float = 0.0  # decaying sum of the gains g of the drafting runs probes started
    _waited: float = 200.0  # decaying count of plain cycles (a prior: none found in two hundred)
    _run: Optional[list[float]] = None  # the current run's [tokens, plain steps], when a probe started it
    _new_prompt: bool = False
    _prompts: float = 1.0  # decaying count of prompts (a prior: one, in which drafting paid)
    _paid: float = 1.0  # decaying count of the prompts in which a drafting cycle beat plain steps
    _paid_now: bool = False
    _follow_up: int = 0
    _since_agreed: int = 0
    _timed: bool = False  # whether the next cycle's seconds are its depth's (not a generation's first cycle)
    _bucket: int = 0  # how the history repeated itself at the last decision
    _fallback_rates: Optional[list[float]] = None  # a planned copy's: the drafter's plan, made if the copy is not
    _copy_probe: bool = False  # the planned copy is a retry the costs did not choose
    _copy_next: int = 0  # cycles until copies may be retried
    _copy_backoff: int = 0  # the retry interval while retries lose
    _copy_streak: int = 0  # retries accepted whole in a row

    def __post_init__(self) -> None:
        self.by_repeat = [Acceptance(self.max_depth) for _ in range(3)]
        self.copy_by_repeat = [Acceptance(self.max_depth) for _ in range(3)]
        self.costs = CycleCosts(self.max_depth, drafter=self.drafter)
        self._copy_backoff = self._copy_next = self.min_probe

    @property
    def acceptance(self) -> Acceptance:
        """The acceptance estimate the last decision went by (its repeat bucket's)."""
        return self.by_repeat[self._bucket]

    def expected(self, source: str) -> list[float]:
        """E[tokens of a cycle drafting k from ``source``], k = 0..max_depth, where the last decision was made."""
        by_repeat = self.copy_by_repeat if source == COPY else self.by_repeat
        return by_repeat[self._bucket].expected_tokens()

    def _rates(self) -> list[float]:
        """Expected tokens per second of a cycle drafting k = 0..max_depth."""
        assert self.seconds is not None
        if not self.drafter:  # nothing drafts: plain steps are the drafter's plan
            return [1 / self.seconds[0]] + [0.0] * self.max_depth
        return [e / t for e, t in zip(self.acceptance.expected_tokens(), self.seconds)]

    def _copy_rates(self) -> list[float]:
        """Expected tokens per second of a cycle copying k = 0..max_depth."""
        assert self.copy_seconds is not None
        return [e / t for e, t in zip(self.copy_by_repeat[self._bucket].expected_tokens(), self.copy_seconds)]

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

    def best(self) -> int:
        """The depth with the most expected tokens per second under the current estimates."""
        return self._argmax(self._rates()) if self.seconds is not None else self.max_depth

    def probe_interval(self, depth: int) -> int:
        """Plain cycles between probes at ``depth``: sqrt(2 L / found), at most what ``probe_budget`` allows.

        A probe loses what it takes beyond the plain steps that would have made its
        expected tokens (L, in plain steps). Where drafting is nearly as good as
        plain decoding that is little, and probes come often: the decision is close
        and worth checking.
        """
        assert self.seconds is not None
        plain = self.seconds[0]
        loss = max(self.seconds[depth] / plain - self.acceptance.expected_tokens()[depth], 0.0)
        budgeted = loss / self.probe_budget
        found = self._found / self._waited
        best = (2 * loss / found) ** 0.5 if found > 0 else budgeted
        return int(max(min(best, budgeted), self.min_probe))

    def plan(self, history: Sequence[int]) -> Plan:
        if self.max_depth == 0:
            return Plan(0)
        self._bucket = self.repeats.bucket(history)
        if self.seconds is None:  # warm-up: a full block, a plain step, one token
            return Plan(self.costs.missing()[0])
        rates = self._rates()
        schedule = (self._plain_run, self._new_prompt)
        planned = self._plan_drafter(rates) if self.drafter else 0
        if self.copies:
            copying = self._copy_rates()
            c = self._argmax(copying)
            won = c > 0 and copying[c] > max(rates)
            if won or self._copy_due():
                # The drafter's plan is only the fallback: its move of the probe schedule (a due probe spent, say)
                # waits for observe(), which makes it only if the fallback is what ran.
                self._plain_run, self._new_prompt = schedule
                self._fallback_rates, self._copy_probe = rates, not won
                return Plan(c if won else self.max_depth, COPY, planned)
        return Plan(planned)

    def _copy_due(self) -> bool:
        """Whether to copy although the cost model says no: the text repeats and the retry is due.

        On a busy machine (a browser, a build) a verify costs several plain steps and
        one cycle timed during a spike prices copies out, before any ran or after; only
        another copy measures them again. So copies are never ruled out by timing alone:
        they are retried on a backoff (``min_probe`` cycles, doubling while they lose,
        at most 256), and at once again while retries are accepted whole (up to
        ``COPY_STREAK`` in a row), so a loop's acceptance is learnt in a few cycles.
        Nor by their acceptance so far: copies the target refused earlier in a reply
        say nothing of a loop it falls into later (retries stopped once that fell below
        1.5 tokens a block, and the loop then decoded plainly to its end: replayed under
        a recorded load, 0.29 of copying alone).
        """
        return self._bucket != 0 and self._copy_next <= 0

    def _copy_seen(self, drafted: int, accepted: int, retried: bool) -> None:
        """The retry schedule after a copy: reset by one the costs chose, moved on by a retry."""
        if not retried:
            self._copy_backoff, self._copy_next, self._copy_streak = self.min_probe, self.min_probe, 0
        elif accepted == drafted and self._copy_streak < COPY_STREAK:
            self._copy_next, self._copy_streak = 0, self._copy_streak + 1
        else:
            self._copy_backoff = min(2 * self._copy_backoff, 256)
            self._copy_next, self._copy_streak = self._copy_backoff, 0

    def _plan_drafter(self, rates: list[float]) -> int:
        """The drafter's depth: the best, or plain steps with a probe when one is due."""
        k = self._argmax(rates)
        if k > 0:
            self._plain_run = 0
            return k
        self._plain_run += 1
        if self._follow_up:  # the last probe was accepted whole: look further at once
            return self._follow_up
        interval = self.probe_interval(1)
        if self._new_prompt:  # the next probe a quarter interval into the reply at the latest
            self._new_prompt = False
            self._plain_run = max(self._plain_run, interval - max(self.min_probe, interval // 4))
        if self._plain_run >= interval:
            self._plain_run = 0
            return 1
        return 0

    def start(self) -> None:
        self._prompts = self.prompt_memory * self._prompts + 1
        self._paid *= self.prompt_memory
        self._paid_now = False
        self._new_prompt = self._paid >= self.min_paid * self._prompts
        self._timed = False
        self._fallback_rates, self._copy_probe = None, False
        self.repeats.reset()

    def observe(self, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        # A generation's first cycle also pays for the buffers its prefill handed back (measured here: +15 ms
        # on a 6 ms plain step and on a 19 ms full block alike): not what its depth costs.
        timed, self._timed = self._timed, True
        fallback, self._fallback_rates = self._fallback_rates, None
        if fallback is not None and source != COPY:  # a planned copy found none: the drafter's plan ran
            self._plan_drafter(fallback)
        retried, self._copy_probe = self._copy_probe, False
        if source != COPY:
            self._copy_next -= 1
        else:
            self._copy_seen(drafted, accepted, retried)
            self.copy_by_repeat[self._bucket].update(drafted, accepted)
            if timed:
                self.costs.update(drafted, seconds, copy=True)
                self._refresh()
            return
        probing = drafted > 0 and self.seconds is not None and self.best() == 0
        self._follow_up = min(2 * drafted, self.max_depth) if probing and accepted == drafted else 0
        if drafted:
            self._new_prompt = False
            self.acceptance.update(drafted, accepted)
        else:
            for acceptance in self.by_repeat:
                acceptance.fade(self.stale)
            self._waited = self.memory * self._waited + 1
            self._found *= self.memory
            if self._run is not None:  # the run a probe started has ended: what it gained per token
                tokens, steps = self._run
                self._found += max(0.0, 1 - steps / tokens)
                self._run = None
        if timed:
            self.costs.update(drafted, seconds)
            self._refresh()
        if drafted and self.seconds is not None and not self._paid_now:  # more tokens than plain steps in its time
            self._paid_now = accepted + 1 > self.seconds[drafted] / self.seconds[0]
            if self._paid_now:
                self._paid += 1
        if drafted and self.seconds is not None:
            if probing and self.best() > 0:
                self._run = [0.0, 0.0]
            if self._run is not None:
                self._run[0] += accepted + 1
                self._run[1] += self.seconds[drafted] / self.seconds[0]  # predicted: every rank's the same


_shared: "weakref.WeakKeyDictionary[Any, dict[tuple, AdaptiveDepth]]" = weakref.WeakKeyDictionary()


def adaptive_policy(target: Any, drafter: Any, window: Optional[int], block_size: int, copies: bool = True,
                    drafts: bool = True) -> AdaptiveDepth:
    """The adaptive policy of this loaded pair and settings, shared by its generations in this process.

    What it measured (this machine's cycle costs for this model, the recent
    acceptance) carries over from one call to the next; a new process, or a newly
    loaded model, measures afresh. A sharded target's ranks agree on rank 0's costs.
    """
    per_target = _shared.setdefault(target, {})
    key = (id(drafter), window, block_size, copies, drafts)
    if key not in per_target:
        group = getattr(target, "group", None)
        agree = None if group is None else functools.partial(from_main, g=group)
        per_target[key] = AdaptiveDepth(block_size - 1, copies=copies, drafter=drafts, agree=agree)
    return per_target[key]
