"""How many tokens to draft each cycle.

The decode loop asks its policy before every cycle and tells it what happened
after: how many tokens were drafted, how many the target accepted, and how long
the cycle took. Any depth is lossless (verification keeps only what the target
agrees with); the policy only decides speed. 0 means a plain decoding step.

``FixedBlock`` always fills the block (``--block-size N``). ``AdaptiveDepth``
(the default) picks the depth that maximises expected tokens per second from two
live estimates: the acceptance of each draft position, and the cost of a cycle
as a function of its depth, both measured from the cycles as they run.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np


class DraftPolicy(Protocol):
    def draft_length(self, context_tokens: int) -> int:
        """Tokens to draft in the next cycle, given how many the caches hold (the loop caps it)."""
        ...

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        """A verified cycle: ``accepted`` of ``drafted`` tokens agreed with the target; it took ``seconds``."""
        ...


@dataclass
class FixedBlock:
    """Always fill the block: ``block_size - 1`` drafted tokens after the last verified one."""

    block_size: int

    def draft_length(self, context_tokens: int) -> int:
        return self.block_size - 1

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


@dataclass
class Acceptance:
    """P(draft position j is accepted | every position before it was), for j = 0..K-1, with decay.

    Each cycle observes positions 0..accepted (the first rejection ends it). Counts
    decay by ``decay`` per cycle, so a change of topic is followed within tens of
    cycles. A position seen rarely leans on the pooled rate of all positions
    (``prior`` pseudo-observations), which also covers depths never drafted yet.
    """

    depth: int
    decay: float = 0.9
    prior: float = 2.0
    hits: np.ndarray = field(init=False)
    trials: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.hits = np.zeros(self.depth)
        self.trials = np.zeros(self.depth)

    def update(self, drafted: int, accepted: int) -> None:
        self.hits *= self.decay
        self.trials *= self.decay
        seen = min(accepted + 1, drafted)
        self.trials[:seen] += 1
        self.hits[:accepted] += 1

    def rates(self) -> np.ndarray:
        pooled = (self.hits.sum() + 1) / (self.trials.sum() + 2)
        return (self.hits + self.prior * pooled) / (self.trials + self.prior)

    def expected_tokens(self) -> np.ndarray:
        """E[tokens of a cycle drafting k], k = 0..K: the target's own token plus the accepted run."""
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.rates()))])


@dataclass
class CycleCosts:
    """Seconds of a cycle drafting k tokens: t(k) = plain + [k > 0] * drafter + k * per_token.

    Fitted from measured cycles by least squares with exponential forgetting
    (``decay`` per cycle), so the fit follows the context as it grows. A small
    pull towards the previous fit keeps directions that recent cycles do not
    measure (say, long drafts while decoding plainly) where they were.
    """

    max_depth: int = 15
    decay: float = 0.95
    pull: float = 0.05
    theta: Optional[np.ndarray] = None  # (plain, drafter, per_token)
    gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    moment: np.ndarray = field(default_factory=lambda: np.zeros(3))
    depths_seen: set[int] = field(default_factory=set)

    @staticmethod
    def features(k: int) -> np.ndarray:
        return np.array([1.0, float(k > 0), float(k)])

    def update(self, k: int, seconds: float) -> None:
        if self.theta is not None:  # a stall (the caller busy, the machine swapping) is not the model's cost
            seconds = min(seconds, 4 * self.predict(k))
        x = self.features(k)
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + seconds * x
        self.depths_seen.add(k)
        if not self.missing():
            previous = np.linalg.lstsq(self.gram, self.moment, rcond=None)[0] if self.theta is None else self.theta
            a = self.gram + self.pull * np.eye(3)
            self.theta = np.maximum(np.linalg.solve(a, self.moment + self.pull * previous), 0.0)

    def missing(self) -> list[int]:
        """Depths to measure before the three parameters are determined: plain and two drafting depths."""
        drafting = {k for k in self.depths_seen if k > 0}
        if 0 in self.depths_seen and len(drafting) >= min(2, self.max_depth):
            return []
        wanted = [self.max_depth, 0, max(1, self.max_depth // 2), 1]
        return [k for k in wanted if k not in self.depths_seen]

    @property
    def ready(self) -> bool:
        return self.theta is not None

    def predict(self, k: int) -> float:
        return float(self.predict_all()[k])

    def predict_all(self) -> np.ndarray:
        """Predicted seconds of a cycle drafting k, for k = 0..max_depth."""
        assert self.theta is not None
        k = np.arange(self.max_depth + 1)
        return np.maximum(self.theta[0] + self.theta[1] * (k > 0) + self.theta[2] * k, 1e-9)


@dataclass
class AdaptiveDepth:
    """Draft the k in 0..``max_depth`` that maximises E[tokens(k)] / t(k), probing now and then.

    Until the cost model has seen plain, one-draft and longer cycles it runs a short
    warm-up (a full block, a plain step, half a block). While plain decoding wins
    it drafts again now and then, so that a drafter whose acceptance recovers is
    noticed: at the best drafting depth, spaced so that probes cost at most
    ``probe_budget`` of the decoding time (at least ``min_probe`` cycles apart, at
    most ``max_probe``). Where drafting is cheap that is every few tens of cycles;
    where it is dear (a CPU), every few hundred.
    """

    max_depth: int
    probe_budget: float = 0.01
    min_probe: int = 8
    max_probe: int = 1024
    acceptance: Acceptance = field(init=False)
    costs: CycleCosts = field(init=False)
    _plain_run: int = 0

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.max_depth)
        self.costs = CycleCosts(self.max_depth)

    def _rates(self) -> np.ndarray:
        """Expected tokens per second of a cycle drafting k = 0..max_depth."""
        return self.acceptance.expected_tokens() / self.costs.predict_all()

    def best(self) -> int:
        """The depth with the most expected tokens per second under the current estimates."""
        return int(np.argmax(self._rates())) if self.costs.ready else self.max_depth

    def probe_interval(self, depth: int) -> int:
        """Plain cycles between probes at ``depth``: a probe's extra cost over ``probe_budget`` of a plain step."""
        extra = self.costs.predict(depth) - self.costs.predict(0)
        cycles = extra / (self.probe_budget * self.costs.predict(0))
        return int(min(max(cycles, self.min_probe), self.max_probe))

    def draft_length(self, context_tokens: int) -> int:
        if self.max_depth == 0:
            return 0
        if not self.costs.ready:  # warm-up: a full block, a plain step, half a block
            return self.costs.missing()[0]
        k = self.best()
        if k > 0:
            self._plain_run = 0
            return k
        self._plain_run += 1
        probe = 1 + int(np.argmax(self._rates()[1:]))
        if self._plain_run >= self.probe_interval(probe):
            self._plain_run = 0
            return probe
        return 0

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        if drafted:
            self.acceptance.update(drafted, accepted)
        self.costs.update(drafted, seconds)


_shared: "weakref.WeakKeyDictionary[Any, dict[tuple, AdaptiveDepth]]" = weakref.WeakKeyDictionary()


def adaptive_policy(target: Any, drafter: Any, window: Optional[int], block_size: int) -> AdaptiveDepth:
    """The adaptive policy of this loaded pair and settings, shared by its generations in this process.

    What it measured (this machine's cycle costs for this model, the recent
    acceptance) carries over from one call to the next; a new process, or a newly
    loaded model, measures afresh.
    """
    per_target = _shared.setdefault(target, {})
    key = (id(drafter), window, block_size)
    if key not in per_target:
        per_target[key] = AdaptiveDepth(block_size - 1)
    return per_target[key]
