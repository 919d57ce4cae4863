"""The two schedules the adaptive policy keeps beside its estimates.

The estimates (``estimates``) say which depth pays now; they cannot say when to look
again at what they ruled out. ``ProbeSchedule`` decides when to draft again while
plain decoding wins, ``CopyRetries`` when to copy where the text repeats although the
costs say no. Each owns its state: the policy tells it what ran, and it answers what
is due (``AdaptiveDepth``'s docstring gives the reasoning and the figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .estimates import combine

COPY_STREAK = 4  # retried copies accepted whole in a row before the backoff resumes


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

    def settle(self, state: tuple[int, bool]) -> None:
        """The drafter's plan that ``decide`` returned ``state`` with has run: its (plain_run, new_prompt) hold."""
        self.plain_run, self.new_prompt = state

    def answered(self, drafted: int, accepted: int, probing: bool, max_depth: int) -> None:
        """A cycle drafted ``drafted``: a probe (``probing``) accepted whole is followed by one twice as deep."""
        self.follow_up = min(2 * drafted, max_depth) if probing and accepted == drafted else 0

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

    def drafted(self, accepted: int, steps: Optional[float], started: bool) -> None:
        """A drafting cycle ran, ``accepted`` kept in ``steps`` plain steps' time (predicted; None while the costs
        warm up, which prices nothing); ``started``: a probe that starts a run of drafting."""
        self.new_prompt = False
        if steps is None:
            return
        if accepted + 1 > steps and not self.paid_now:  # more tokens than plain steps would have made
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
    deeper: int = 0  # the next retry's depth after one accepted whole: twice its depth (0: none was)

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

        What a refused retry loses grows with the context: a copy of 15 verified over 4k
        tokens of the real pair took 3.4 plain steps, and a reply about a long source file
        repeats its names every few tokens, so retries of 15 came every few cycles and lost
        5.3 plain steps of a 94-token reply (0.91x plain; issue 62). So a retry drafts no
        deeper than the policy lets a retry cost (``depth``: where a verify of 16 is cheap, a
        full block as before), and twice as deep after one accepted whole, so a loop still
        reaches the full block within a few cycles.

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

    def depth(self, affordable: int, max_depth: int) -> int:
        """A due retry's depth: ``affordable`` (the deepest whose verify costs what a retry may), deeper after a
        retry accepted whole."""
        return min(max(affordable, self.deeper, 1), max_depth)

    def passed(self, bucket: int) -> None:
        """A cycle of the drafter's plan (or a plain step) ran at repeat ``bucket``: a retry is one cycle nearer,
        and new text (bucket 0) starts the backoff over."""
        self.wait -= 1
        if bucket == 0:
            self.new_text()

    def new_text(self) -> None:
        """The history's end is new (no repeat): the next stretch that repeats is a new question, whatever the
        copies of an earlier one got, so its first retry comes at the shortest interval."""
        self.backoff = self.min_probe
        self.wait = min(self.wait, self.min_probe)

    def copied(self, drafted: int, accepted: int, retried: bool) -> None:
        """After a copy: the schedule reset by one the costs chose, moved on by a retry."""
        self.deeper = 0
        if not retried:
            self.backoff, self.wait, self.streak = self.min_probe, self.min_probe, 0
        elif accepted == drafted and self.streak < COPY_STREAK:
            self.wait, self.streak, self.deeper = 0, self.streak + 1, 2 * drafted
        else:
            self.backoff = min(2 * self.backoff, 256)
            self.wait, self.streak = self.backoff, 0
