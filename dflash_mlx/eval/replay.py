"""Judge a draft policy without noise: replay recorded traces under a cost profile.

On a machine whose speed drifts 10-30% between runs, two policies cannot be told apart
by timing them. A trace (``traces.py``) records, at every position of the target's own
output, how many tokens a draft of each depth would have had accepted; a cost profile
gives the seconds of a cycle drafting k tokens at a context length. ``simulate`` then
runs any ``DraftPolicy`` over the traces exactly as the decode loop would (same caps,
same calls, the profile's seconds as its timings), and ``oracle`` finds the best
schedule of sources and depths in hindsight by dynamic programming over positions:
the ceiling that no policy deciding from the past can pass. Same trace, same policy,
same profile: same result, in seconds.

Copy drafts need no recording: what the history offers at each position follows from
the prompt and the output (``Repeats.continuation``, as the decode loop asks it), so
every trace, old ones included, carries them.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..decode.batch import BatchPlanner
from ..decode.estimates import CycleCosts
from ..decode.policy import COPY, DRAFTER, AdaptiveDepth, DraftPolicy, FixedBlock, Plan
from ..decode.repeats import Repeats
from ..models.caches import COPY_BLOCK


@dataclass
class Trace:
    """One prompt: the target's own output and, per position, what each draft depth proposes and keeps.

    A cycle at position p starts after ``output[p]``. ``drafts[p, k, :k]`` are the k tokens
    the drafter proposes there in a block of k + 1 (the rest is -1), and ``accepted[p, k]``
    how many of them the target accepts (column 0: a plain step, 0). With ``full`` the
    drafter always drafts the whole block and the first k are verified: the whole block's
    agreeing prefix, capped at k.
    """

    name: str
    prompt: list[int]
    output: list[int]
    drafts: np.ndarray  # [len(output) - 1, B, B - 1] int, -1 padded
    accepted: np.ndarray  # [len(output) - 1, B] int
    copied: np.ndarray = field(init=False)  # [len(output) - 1]: the copy draft's agreeing prefix; -1: none offered

    def __post_init__(self) -> None:
        n = len(self.output)
        index, history = Repeats(), list(self.prompt)
        self.copied = np.full(max(n - 1, 0), -1, dtype=np.int64)
        for p in range(n - 1):
            copy = index.continuation(history, self.output[p], self.copy_depth)
            if copy:
                agree = [c == t for c, t in zip(copy, self.output[p + 1 :])]
                self.copied[p] = next((i for i, ok in enumerate(agree) if not ok), len(agree))
            history.append(self.output[p])

    @property
    def max_depth(self) -> int:
        """The deepest draft of the drafter (its block - 1)."""
        return self.accepted.shape[1] - 1

    @property
    def copy_depth(self) -> int:
        """The deepest copy: as the decode loop's default verify (``caches.copy_block``), at least COPY_BLOCK - 1."""
        return max(self.max_depth, COPY_BLOCK - 1)

    @property
    def full_block(self) -> np.ndarray:
        """[len(output) - 1]: how many of a whole block's drafts agree."""
        return self.accepted[:, -1]

    def accepted_at(self, p: int, k: int, full: bool = False) -> int:
        return min(k, int(self.accepted[p, -1])) if full else int(self.accepted[p, k])

    def copy_at(self, p: int, k: int) -> Optional[int]:
        """Accepted tokens of a copy of k at position p; None where the history offers no copy."""
        return None if self.copied[p] < 0 else min(k, int(self.copied[p]))


def synthetic(name: str, prompt: int, tokens: int, acceptance: float, max_depth: int, seed: int = 0) -> Trace:
    """A trace of a drafter whose every next draft is accepted with probability ``acceptance`` (the per-token rate
    published figures give, where there is no pair to record), over text that never repeats (no copies)."""
    rng = np.random.default_rng(seed)
    runs = np.minimum(rng.geometric(1 - acceptance, size=max(tokens - 1, 0)) - 1, max_depth)
    accepted = np.minimum(runs[:, None], np.arange(max_depth + 1)[None, :])
    drafts = np.full((len(runs), max_depth + 1, max_depth), -1, dtype=np.int64)
    return Trace(name, list(range(prompt)), list(range(prompt, prompt + tokens)), drafts, accepted)


@dataclass
class CostProfile:
    """Seconds of a cycle drafting k tokens (k = 0: the decode loop's plain step) and of mlx-lm's plain step,
    at measured context lengths; between them linear, beyond them the nearest.

    ``cycle[i][k]`` is at ``contexts[i]`` tokens. ``source`` says where the numbers come from.
    """

    name: str
    source: str
    contexts: list[int]
    plain: list[float]  # mlx-lm's step: the baseline every ratio is against
    cycle: list[list[float]]
    row: Optional[float] = None  # what a further row adds to a batch step, in plain steps (None: a verified position)
    _memo: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def _at(self, values: Sequence[float], context: int) -> float:
        i = bisect.bisect_left(self.contexts, context)
        if i == 0:
            return values[0]
        if i == len(self.contexts):
            return values[-1]
        c0, c1 = self.contexts[i - 1], self.contexts[i]
        w = (context - c0) / (c1 - c0)
        return values[i - 1] * (1 - w) + values[i] * w

    def seconds(self, k: int, context: int) -> float:
        key = (k, context)
        if key not in self._memo:
            self._memo[key] = self._at([row[k] for row in self.cycle], context)
        return self._memo[key]

    def copy_seconds(self, k: int, context: int) -> float:
        """A cycle copying k, priced as the policy prices copies it has not timed (``CycleCosts.predict_copy``):
        the plain step plus the drafting cycles' per-token cost (their line from 1 to the deepest), without the
        drafter's share (its intercept)."""
        key = (-1 - k, context)  # apart from seconds()'s keys
        if key not in self._memo:
            top = len(self.cycle[0]) - 1
            costs = CycleCosts(top)
            for depth in dict.fromkeys((0, 1, top)):
                costs.update(depth, self.seconds(depth, context))
            self._memo[key] = costs.predict_copy(k)
        return self._memo[key]

    def plain_seconds(self, context: int) -> float:
        return self._at(self.plain, context)

    def _line(self, context: int) -> tuple[float, float]:
        """(drafter pass, seconds per verified position) at ``context``: the drafting cycles' line from depth 1 to
        the deepest measured."""
        top = len(self.cycle[0]) - 1
        per_position = (self.seconds(top, context) - self.seconds(1, context)) / max(top - 1, 1)
        return max(self.seconds(1, context) - self.seconds(0, context) - per_position, 0.0), max(per_position, 0.0)

    def _row_seconds(self, context: int) -> float:
        """What one more row adds to a batch step: ``row`` plain steps where measured, else a verified position."""
        return self.row * self.plain_seconds(context) if self.row is not None else self._line(context)[1]

    def batch_seconds(self, cycles: Sequence[tuple[int, str]], context: int) -> float:
        """Seconds of one batch cycle whose rows draft (k, source): a row alone as a solo cycle; else one plain
        step, what each further row adds (``_row_seconds``), a drafter pass per row drafting from it, and a
        verified position per padded draft position (rows' blocks are padded to the deepest). For one row this is
        the row's own line (``_line``); bench/batch_replay.py checks it against measured batch cycles."""
        if len(cycles) == 1:
            (k, source), = cycles
            return self.copy_seconds(k, context) if source == COPY else self.seconds(k, context)
        drafter, per_position = self._line(context)
        deepest = max(k for k, _ in cycles)
        drafting = sum(1 for k, source in cycles if k and source != COPY)
        return (self.seconds(0, context) + self._row_seconds(context) * (len(cycles) - 1) + drafter * drafting
                + per_position * len(cycles) * deepest)

    def plain_batch_seconds(self, rows: int, context: int) -> float:
        """mlx-lm's batched plain step over ``rows`` rows."""
        return self.plain_seconds(context) + self._row_seconds(context) * (rows - 1)

    @classmethod
    def relative(cls, name: str, source: str, max_depth: int, plain_step: float, upkeep: float, drafter: float,
                 per_token: float, per_token_growth: float = 0.0) -> "CostProfile":
        """A profile from ratios to a plain step: t(0) = plain (1 + upkeep), t(k) = plain (1 + drafter + p(c) k),
        where a verified position's share p(c) = per_token + per_token_growth * c grows with the context c (a
        block's attention over it), the plain step staying as it is."""
        contexts = [0] if not per_token_growth else [0, 1024, 2048, 4096, 8192, 16384, 32768]
        cycles = [[plain_step * (1 + upkeep)] + [plain_step * (1 + drafter + (per_token + per_token_growth * c) * k)
                                                 for k in range(1, max_depth + 1)] for c in contexts]
        return cls(name, source, contexts, [plain_step] * len(contexts), cycles)

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "contexts": self.contexts, "plain": self.plain,
                "cycle": self.cycle, "row": self.row}

    @classmethod
    def from_dict(cls, spec: dict) -> "CostProfile":
        return cls(spec["name"], spec["source"], spec["contexts"], spec["plain"], spec["cycle"], spec.get("row"))


# Apple Silicon profiles from published end-to-end figures (../shared/reference/mac-figures.md), as ratios to
# a plain step: tok/s = tau / t(k) and t(k) = plain (1 + drafter + per_token k). Two figures of one model at two
# depths give the two ratios; where the source gives tau as a range for several runs, the derivation says which.
MAC_PROFILES = {
    # z-lab/dflash issue 151, M5 Max 128 GB, Qwen3.5-27B-4bit: 52.0 tok/s at block 5 (k=4) and 36.8 at block 16
    # (k=15); plain 33.6 tok/s (bstnxbt/dflash-mlx README, same Mac and model). Taken: tau 2.95 at block 5 and
    # 4.30 at block 16 (the ends of the range). t(4) = 2.95 * 33.6 / 52.0 = 1.91 plain steps, t(15) =
    # 4.30 * 33.6 / 36.8 = 3.93: per_token = 0.184, drafter = 0.17. A dense model whose verify of 16 is
    # compute-bound: depth costs.
    "m5max-27b-4bit": dict(plain_step=1 / 33.6, upkeep=0.0, drafter=0.17, per_token=0.184,
                           source="z-lab/dflash#151 (block 5 vs 16) with bstnxbt/dflash-mlx README (plain), M5 Max"),
    # bstnxbt/dflash-mlx README, M5 Max 64 GB, Qwen3.5-4B bf16, 1,024 generated: 53.8 -> 182.9 tok/s (3.40x) at 86%
    # acceptance per drafted token, block 16: E[tokens] = 1 + sum_j 0.86^j (j = 1..15) = 6.5, so t(15) = 6.5 / 3.40 =
    # 1.91 plain steps. The split between drafter and per-token is not in the figures: taken as the 27B's drafter
    # share (0.17), leaving per_token = (1.91 - 1 - 0.17) / 15 = 0.049. A small memory-bound model: depth is cheap.
    "m5max-4b-bf16": dict(plain_step=1 / 53.8, upkeep=0.0, drafter=0.17, per_token=0.049,
                          source="bstnxbt/dflash-mlx README (Qwen3.5-4B, 3.40x at 86%), M5 Max"),
    # The same README, Qwen3.5-27B-4bit, 1,024 and 8,192 generated: 33.6 -> 79.0 tok/s at 90% per drafted token and
    # 33.9 -> 45.3 at 86%: plain steps as quick at either length, block 16's cycle dearer with context. E[tokens] =
    # 1 + sum_j a^j (j = 1..15) = 8.15 and 6.50, so t(15) = 8.15 / 2.351 = 3.47 plain steps at a mean context of
    # about 512 and 6.50 / 1.336 = 4.87 at about 4,096. With the drafter's 0.17 as above, a verified position costs
    # 0.153 plain steps at 512 and 0.247 at 4,096: 0.140 + 2.61e-5 per token of context, all of the growth put on
    # the verify (the drafter's own attention over its context grows too; the figures do not split them).
    "m5max-27b-4bit-long": dict(plain_step=1 / 33.6, upkeep=0.0, drafter=0.17, per_token=0.140,
                                per_token_growth=2.61e-5,
                                source="bstnxbt/dflash-mlx README (Qwen3.5-27B-4bit, 1,024 vs 8,192 generated), "
                                       "M5 Max"),
}


def mac_profile(name: str, max_depth: int) -> CostProfile:
    spec = dict(MAC_PROFILES[name])
    return CostProfile.relative(name, spec.pop("source"), max_depth, **spec)


@dataclass
class Replay:
    """What a replay produced: tokens (after each prompt's first), seconds, and the plain baseline's seconds."""

    tokens: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0
    depths: list[int] = field(default_factory=list)  # cycles per drafted depth
    copies: int = 0  # cycles that verified a copy draft

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def vs_plain(self) -> float:
        """Speed relative to mlx-lm's plain decoding of the same tokens."""
        return self.plain_seconds / self.seconds if self.seconds else 0.0

    def add(self, other: "Replay") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.plain_seconds += other.plain_seconds
        self.copies += other.copies
        for k, n in enumerate(other.depths):
            self.depths += [0] * (k + 1 - len(self.depths))
            self.depths[k] += n


@dataclass
class Load:
    """A machine's slowdown over wall time, recorded beside a load (a browser, a build; bench: CPU hogs): the
    seconds a plain step took, each over the quiet machine's median, one sample per ``dt`` seconds of the recording.

    A replay under a load prices each cycle at the slowdown of the moment it runs (its start on the replay's own
    clock, from ``offset`` seconds into the recording, wrapping around): the policy sees those seconds and pays
    them, as on the busy machine, and two policies replayed from the same offset meet the same spikes at the same
    times.
    """

    factors: list[float]
    dt: float

    def at(self, t: float) -> float:
        return self.factors[int(t / self.dt) % len(self.factors)]


def _plain_seconds(trace: Trace, profile: CostProfile) -> float:
    return sum(profile.plain_seconds(len(trace.prompt) + p + 1) for p in range(len(trace.output) - 1))


def _outcome(plan: Plan, trace: Trace, p: int, full: bool) -> tuple[int, int, str]:
    """What a cycle planned at position p drafts, how many the target keeps, and from where: as the decode loop,
    the plan's depth capped by the block and the budget; a copy planned where the history offers none runs the
    plan's fallback from the drafter."""
    left = len(trace.output) - p - 2
    if plan.source == COPY:
        k = max(0, min(plan.depth, trace.copy_depth, left))
        copied = trace.copy_at(p, k) if k else None
        if copied is not None:
            return k, copied, COPY
    k = max(0, min(plan.fallback if plan.source == COPY else plan.depth, trace.max_depth, left))
    return k, trace.accepted_at(p, k, full), DRAFTER


def simulate(policy: DraftPolicy, traces: Sequence[Trace], profile: CostProfile, full: bool = False,
             load: Optional[Load] = None, offset: float = 0.0) -> Replay:
    """Run ``policy`` over ``traces`` in order, as one process serving them one after another.

    As the decode loop: ``start`` per prompt, ``plan`` given the committed tokens (the
    prompt and the output before the last emitted token), then ``observe`` with the
    profile's seconds at the current context length (times the ``load``'s slowdown of
    the moment, from ``offset`` seconds into it).
    """
    total = Replay()
    clock = offset
    for trace in traces:
        policy.start()
        n = len(trace.output)
        got = Replay(tokens=n - 1, plain_seconds=_plain_seconds(trace, profile), depths=[0] * (trace.copy_depth + 1))
        history = list(trace.prompt)
        p = 0  # output[p] is emitted; the target has not consumed it yet
        while p < n - 1:
            plan = policy.plan(history)
            k, a, source = _outcome(plan, trace, p, full)
            context = len(history) + 1
            seconds = profile.copy_seconds(k, context) if source == COPY else profile.seconds(k, context)
            if load is not None:
                seconds *= load.at(clock)
                clock += seconds
            policy.observe(plan, k, a, seconds, source)
            got.seconds += seconds
            got.depths[k] += 1
            got.copies += source == COPY
            history.extend(trace.output[p : p + a + 1])
            p += a + 1
        total.add(got)
    return total


@dataclass
class BatchReplay:
    """A batch of rows replayed together: tokens, the batch's seconds, and the same rows' seconds one after another
    (``serve --max-batch 1``) and in mlx-lm's batched plain decoding (``mlx_lm.server``)."""

    rows: int
    tokens: int = 0
    seconds: float = 0.0
    fifo_seconds: float = 0.0
    plain_batch_seconds: float = 0.0
    drafting_cycles: int = 0
    cycles: int = 0

    @property
    def vs_fifo(self) -> float:
        return self.fifo_seconds / self.seconds if self.seconds else 0.0

    @property
    def vs_plain_batch(self) -> float:
        return self.plain_batch_seconds / self.seconds if self.seconds else 0.0


def simulate_batch(make_policy: Callable[[], DraftPolicy], traces: Sequence[Trace], profile: CostProfile,
                   full: bool = False) -> BatchReplay:
    """Decode ``traces`` as rows of one batch, all joining at once and each leaving at its end, as ``Batch`` does.

    Each row plans with a policy of its own (``make_policy``), the batch's ``BatchPlanner``
    chooses the adaptive rows' depth, every
    row observes the whole cycle's seconds, and the cycle is priced by
    ``CostProfile.batch_seconds``. Against it: the rows one after another with one
    shared policy (the FIFO server), and mlx-lm's batched plain steps.
    """
    rows = [(trace, make_policy(), list(trace.prompt), [0]) for trace in traces]
    for _, policy, _, _ in rows:
        policy.start()
    planner = BatchPlanner(draft_depth=min((t.max_depth for t in traces), default=None))
    out = BatchReplay(len(rows))
    while active := [row for row in rows if row[3][0] < len(row[0].output) - 1]:
        plans = [policy.plan(history) for _, policy, history, _ in active]
        planned = len(active) > 1
        if planned:
            plans = planner.plans([policy for _, policy, _, _ in active], plans)
        cycles = [_outcome(plan, trace, at[0], full) for plan, (trace, _, _, at) in zip(plans, active)]
        context = round(sum(len(history) for _, _, history, _ in active) / len(active)) + 1
        seconds = profile.batch_seconds([(k, source) for k, _, source in cycles], context)
        for (trace, policy, history, at), plan, (k, a, source) in zip(active, plans, cycles):
            policy.observe(plan, k, a, seconds, source)
            history.extend(trace.output[at[0] : at[0] + a + 1])
            at[0] += a + 1
        tokens = sum(a + 1 for _, a, _ in cycles)
        deepest = max(k for k, _, _ in cycles)
        if planned:
            planner.observe(deepest, seconds, tokens)
        out.tokens += tokens
        out.seconds, out.cycles, out.drafting_cycles = out.seconds + seconds, out.cycles + 1, out.drafting_cycles + (deepest > 0)
    out.fifo_seconds = simulate(make_policy(), traces, profile, full).seconds
    longest = max((len(trace.output) - 1 for trace in traces), default=0)
    for step in range(longest):  # mlx-lm: one token per row per step, rows leave at their end
        contexts = [len(t.prompt) + step + 1 for t in traces if len(t.output) - 1 > step]
        out.plain_batch_seconds += profile.plain_batch_seconds(len(contexts), round(sum(contexts) / len(contexts)))
    return out


def oracle(trace: Trace, profile: CostProfile, full: bool = False, copies: bool = True) -> float:
    """The least seconds any schedule takes over ``trace``: best[p] = min over the drafter's depths k of
    t(k) + best[p + a_k(p) + 1], and, where the history offers a copy (``copies``), over copies of k too."""
    n = len(trace.output)
    best = [0.0] * n
    for p in range(n - 2, -1, -1):
        context = len(trace.prompt) + p + 1
        depths = range(min(trace.max_depth, n - p - 2) + 1)
        best[p] = min(profile.seconds(k, context) + best[p + trace.accepted_at(p, k, full) + 1] for k in depths)
        if copies and trace.copied[p] >= 0:
            best[p] = min([best[p]] + [profile.copy_seconds(k, context) + best[p + trace.copy_at(p, k) + 1]
                                       for k in range(1, min(trace.copy_depth, n - p - 2) + 1)])
    return best[0] if n > 1 else 0.0


def oracle_replay(traces: Sequence[Trace], profile: CostProfile, full: bool = False, copies: bool = True) -> Replay:
    total = Replay()
    for trace in traces:
        total.add(Replay(tokens=len(trace.output) - 1, seconds=oracle(trace, profile, full, copies),
                         plain_seconds=_plain_seconds(trace, profile)))
    return total


def best_fixed(traces: Sequence[Trace], profile: CostProfile, full: bool = False,
               source: str = DRAFTER) -> tuple[int, Replay]:
    """The fixed depth (0 = plain steps of the decode loop) that was fastest over all ``traces``, in hindsight."""
    deepest = traces[0].copy_depth if source == COPY else traces[0].max_depth
    runs = [(k, simulate(FixedBlock(k + 1, source), traces, profile, full)) for k in range(deepest + 1)]
    return max(runs, key=lambda run: run[1].tokens_per_second)


def adaptive(traces: Sequence[Trace], kind: type[AdaptiveDepth] = AdaptiveDepth, **settings: Any) -> AdaptiveDepth:
    """The default policy as the decode loop makes it for the traces' drafter: copies up to ``copy_depth``, the
    drafter's drafts up to its block - 1. ``kind``: a subclass that watches it (bench/decisions.py)."""
    return kind(traces[0].copy_depth, draft_depth=traces[0].max_depth, **settings)


def judge(make_policy: Callable[[Sequence[Trace]], DraftPolicy], traces: Sequence[Trace], profile: CostProfile,
          full: bool = False) -> dict:
    """The policy (``make_policy(traces)``, e.g. ``adaptive``) against plain decoding, the best fixed drafter depth
    and the best fixed copy depth in hindsight, and the oracle (drafter and copies)."""
    policy = simulate(make_policy(traces), traces, profile, full)
    k, fixed = best_fixed(traces, profile, full)
    c, copying = best_fixed(traces, profile, full, COPY)
    ceiling = oracle_replay(traces, profile, full)
    return {"profile": profile.name, "policy_vs_plain": policy.vs_plain, "best_fixed_depth": k,
            "best_fixed_vs_plain": fixed.vs_plain, "best_copy_depth": c, "best_copy_vs_plain": copying.vs_plain,
            "oracle_vs_plain": ceiling.vs_plain,
            "policy_of_best_fixed": policy.tokens_per_second / fixed.tokens_per_second,
            "policy_of_oracle": policy.tokens_per_second / ceiling.tokens_per_second,
            "depths": policy.depths, "copies": policy.copies}


def mean_acceptance(traces: Sequence[Trace], full: bool = False) -> list[float]:
    """E[accepted] of a draft of k, k = 0..B, over every position of every trace."""
    B = traces[0].max_depth
    rows = [t.accepted if not full else np.minimum(t.full_block[:, None], np.arange(B + 1)[None, :]) for t in traces]
    stacked = np.concatenate(rows) if rows else np.zeros((0, B + 1))
    return stacked.mean(0).tolist() if len(stacked) else [math.nan] * (B + 1)

