"""What the adaptive policy measures as it runs: the acceptance of each draft position, and what a cycle costs.

Both are decaying estimates, updated every cycle, cheap enough for the plain step of a small model
(arithmetic on floats and small arrays). Each can take in another of its kind (``merge``): a batch row
decodes with a copy of the shared policy, and what it measured joins the shared estimates when it ends.
Two estimates of the same quantity combine weighted by what each has seen, and the result counts as much
as the one that saw more (``combine``): the rows' copies share the history they started from, so their
weights are not added.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

SEED_WEIGHT = 2.0  # what a context span's costs seeded from another's count for: its own cycles soon outweigh them
TRACK = 0.5  # how far each drafting or copy cycle moves the plain estimate toward the plain step its time implies
TRACK_AFTER = 3.0  # ... once its depth's mean counts this many cycles (before, the mean is still a guess)


def span(context: int) -> int:
    """The context span a cycle's costs belong to: 0 below 512 tokens, then one per doubling (512-1k, 1k-2k, ...). A
    verify attends over the whole context, so what it costs against a plain step changes with it (on a CPU a verify
    of 16 is about 3 plain steps at 256 tokens and dearer at 8k; published Mac figures put block 16 of a 27B at 3.5
    plain steps at 1k and 4.9 at 8k)."""
    return max(0, int(context).bit_length() - 9)


def combine(value: float, weight: float, other: float, other_weight: float) -> tuple[float, float]:
    """Two estimates' weighted mean, with the larger weight."""
    total = weight + other_weight
    if total <= 0:
        return value, weight
    return (value * weight + other * other_weight) / total, max(weight, other_weight)


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

    def merge(self, other: Acceptance) -> None:
        """Take in another estimate of the same positions: pooled per position, counting as the larger."""
        hits, trials = self.hits * self._fading, self.trials * self._fading
        other_hits, other_trials = other.hits * other._fading, other.trials * other._fading
        seen, other_seen = trials.sum(), other_trials.sum()
        scale = max(seen, other_seen) / (seen + other_seen) if seen + other_seen > 0 else 1.0
        self.hits, self.trials = (hits + other_hits) * scale, (trials + other_trials) * scale
        self._fading, self._expected = 1.0, None

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


MIN_SECONDS = 1e-6  # the least a cycle is taken to cost: below any verify, above a clock that did not move


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
        self._refit()

    def merge(self, other: Line) -> None:
        """Take in another line's depths: each depth's means combined."""
        for k, (weight, mean) in other._means.items():
            mine = self._means.get(k, [0.0, 0.0])
            combined, most = combine(mine[1], mine[0], mean, weight)
            self._means[k] = [most, combined]
        if self._means:
            self._refit()

    def _refit(self) -> None:
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

    def weight(self, k: int) -> float:
        """How many of depth ``k``'s cycles its mean counts (decaying; 0 if none)."""
        return self._means.get(k, (0.0, 0.0))[0]

    def mean(self, k: int) -> float:
        """Depth ``k``'s own mean overhead (it has been seen)."""
        return self._means[k][1]

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

    ``update`` learns from each cycle in four steps, each keeping one invariant that a
    test in tests/test_policy.py breaks without it (``_bounded``, ``_floor``,
    ``_plain_step``, ``_overhead``); their docstrings give the measurements behind them.
    Cycles timed before any plain step wait for one (``_early``).

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
        """Learn from a cycle that drafted (or copied) ``k`` tokens in ``seconds``."""
        seconds = self._bounded(k, seconds, copy)
        self._floor(k, seconds)
        if not copy:
            self.depths_seen.add(k)
        if k == 0:
            self._plain_step(seconds)
        elif self.plain is None:
            self._early.append((k, seconds, copy))
        else:
            self._overhead(self.copying if copy else self.drafting, k, seconds)

    def _bounded(self, k: int, seconds: float, copy: bool) -> float:
        """Invariant: one cycle moves no prediction more than fourfold, and none reaches zero.

        A clock that did not move counts ``MIN_SECONDS`` (the estimates divide by a plain
        step); a stall (the caller busy, the machine swapping), at most four times its
        prediction, so a spike is halved by each cycle after it."""
        seconds = max(seconds, MIN_SECONDS)
        if self.ready:
            seconds = min(seconds, 4 * (self.predict_copy(k) if copy else self.predict(k)))
        return seconds

    def _floor(self, k: int, seconds: float) -> None:
        """Invariant: the plain step costs no more than the last cycle that verified drafts.

        Such a cycle quicker than the plain estimate shows that estimate was timed during
        a spike of load. Left alone, it would price every depth as one plain step, and plain
        steps would never run again to correct it (replayed under a recorded load: auto ran
        its drafter's full block wherever no copy was offered, 0.66 of copying alone)."""
        if k and self.plain is not None and seconds < self.plain:
            self.plain = seconds

    def _plain_step(self, seconds: float) -> None:
        """Invariant: each plain step moves ``plain`` at least ``TRACK / 2`` of the way to its time.

        Where the load slows a verify more than a plain step (beside busy loops, a 16-row
        product waits for a descheduled BLAS thread), tracked cycles (``_overhead``)
        overstate the plain step, and the plain steps between them must be heard as fast.
        Half, because a plain step started before the previous one was read is timed from
        that read, so such steps alternate short and long. The cycles that waited for a
        first plain step are priced against it."""
        self._plain_weight = self.decay * self._plain_weight + 1
        gain = max(1 / self._plain_weight, TRACK / 2)
        self.plain = seconds if self.plain is None else self.plain + gain * (seconds - self.plain)
        early, self._early = self._early, []
        for depth, took, copied in early:
            (self.copying if copied else self.drafting).add(depth, took / self.plain - 1)

    def _overhead(self, line: Line, k: int, seconds: float) -> None:
        """Invariant: a change of load shows in ``plain`` without a plain step, once the cycle's depth is known.

        A plain step may not run for hundreds of cycles (a loop copied whole) while the
        load comes and goes, and relative costs hold only while ``plain`` is what a plain
        step costs now. So a cycle of a depth seen ``TRACK_AFTER`` times or more first says
        what a plain step costs now (its seconds over its depth's mean overhead) and moves
        ``plain`` ``TRACK`` of the way; its depth's mean takes what is left. A depth seen
        fewer times teaches only its own mean, still a guess. (Without this and
        ``_plain_step``, beside two CPU busy loops, the tests' looping pair decoded its loop
        at tau 5.3-11.1 against 11.6 quiet; with them 10.9-11.6: docs/benchmarks.md.)"""
        if line.weight(k) >= TRACK_AFTER:
            self.plain += TRACK * (seconds / (1 + max(line.mean(k), 0.0)) - self.plain)
        line.add(k, seconds / self.plain - 1)

    def merge(self, other: CycleCosts) -> None:
        """Take in another model of the same cycles: plain steps and both lines combined."""
        if other.plain is not None:
            if self.plain is None:
                self.plain, self._plain_weight = other.plain, other._plain_weight
            else:
                self.plain, self._plain_weight = combine(self.plain, self._plain_weight, other.plain,
                                                          other._plain_weight)
        self.drafting.merge(other.drafting)
        self.copying.merge(other.copying)
        self.depths_seen |= other.depths_seen
        early, self._early = self._early + other._early, []
        for depth, took, copied in early:
            if self.plain is None:
                self._early.append((depth, took, copied))
            else:
                (self.copying if copied else self.drafting).add(depth, took / self.plain - 1)

    def seeded(self) -> CycleCosts:
        """A copy for another context span: what this one measured, counting for at most ``SEED_WEIGHT`` cycles, so
        that the span's own cycles take over within a few instead of warming up from nothing."""
        seed = copy.deepcopy(self)
        seed._plain_weight = min(seed._plain_weight, SEED_WEIGHT)
        for line in (seed.drafting, seed.copying):
            for mean in line._means.values():
                mean[0] = min(mean[0], SEED_WEIGHT)
        return seed

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
