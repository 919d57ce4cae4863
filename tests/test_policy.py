"""The draft-depth policy: synthetic costs and acceptances, then the engine under arbitrary depths."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPTS
from helpers import plain_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_mlx import generate, make_cache
from dflash_mlx.decode.estimates import Acceptance, CycleCosts
from dflash_mlx.decode.policy import COPY, DRAFTER, AdaptiveDepth, Plan
from dflash_mlx.decode.repeats import Repeats


def drafter_depth(plan: Plan) -> int:
    """What the drafter drafts in a world whose text never repeats: a planned copy's fallback."""
    return plan.fallback if plan.source == COPY else plan.depth


class World:
    """A synthetic machine and drafter: cycle cost t(k) = plain + [k>0] drafter + k per_token, and each
    draft position accepted with probability ``alpha`` (given the ones before it were)."""

    def __init__(self, plain: float, drafter: float, per_token: float, alpha: float, seed: int = 0):
        self.plain, self.drafter, self.per_token, self.alpha = plain, drafter, per_token, alpha
        self.rng = np.random.default_rng(seed)

    def cycle(self, k: int) -> tuple[int, float]:
        accepted = 0
        while accepted < k and self.rng.random() < self.alpha:
            accepted += 1
        seconds = self.plain + (self.drafter if k else 0.0) + k * self.per_token
        return accepted, seconds * self.rng.uniform(0.9, 1.1)

    def step(self, policy: AdaptiveDepth, history: list[int]) -> tuple[Plan, int, int, float]:
        """A planned cycle, observed: (plan, drafted, accepted, seconds). This world's text never repeats,
        so a planned copy finds nothing and the drafter's fallback runs."""
        k = drafter_depth(plan := policy.plan(history))
        accepted, seconds = self.cycle(k)
        policy.observe(plan, k, accepted, seconds)
        return plan, k, accepted, seconds

    def best(self, depth: int) -> int:
        rates = [(1 - self.alpha ** (k + 1)) / (1 - self.alpha) / (self.plain + (self.drafter if k else 0) + k * self.per_token)
                 for k in range(depth + 1)]
        return int(np.argmax(rates))


def run(policy: AdaptiveDepth, world: World, cycles: int) -> list[int]:
    chosen = []
    for _ in range(cycles):
        _, k, _, _ = world.step(policy, [])
        chosen.append(k)
    return chosen


def test_plain_decoding_when_speculation_cannot_pay():
    """A drafter the target never agrees with, on a CPU-like machine (a verify costs more per token)."""
    policy = AdaptiveDepth(15)
    chosen = run(policy, World(plain=0.05, drafter=0.02, per_token=0.01, alpha=0.02), 400)
    tail = chosen[100:]
    assert tail.count(0) / len(tail) > 0.95, chosen
    probes = sum(k > 0 for k in tail)
    assert 0 < probes and probes * policy.probe_interval(1) <= len(tail) + policy.probe_interval(1)  # ~1% of the time


def test_long_drafts_when_acceptance_is_high():
    """A good drafter on a GPU-like machine (a 16-token verify costs about one step)."""
    world = World(plain=0.02, drafter=0.004, per_token=0.0004, alpha=0.92)
    policy = AdaptiveDepth(15)
    chosen = run(policy, world, 300)
    assert world.best(15) >= 12
    assert np.median(chosen[50:]) >= 12, chosen


def test_a_drafter_of_a_smaller_block_warms_up_and_drafts_within_it():
    """A drafter trained for blocks of 8 under a verify block of 16 (copies may fill it): the warm-up's full block is
    the drafter's (else it would ask for 15 forever and never time a plain step), and the drafter is planned no
    deeper than 7 however well it does, while its expected tokens stay flat beyond."""
    world = World(plain=0.02, drafter=0.004, per_token=0.0004, alpha=0.92)
    policy = AdaptiveDepth(15, draft_depth=7)
    chosen = run(policy, world, 200)
    assert not policy.warming_up and max(chosen) == 7 and np.median(chosen[50:]) == 7, chosen
    expected = policy.expected(Plan(7))
    assert len(expected) == 16 and expected[8:] == [expected[7]] * 8


def test_intermediate_depth_matches_the_optimum():
    """Moderate acceptance and a costly verify: the best depth is in between, and the policy finds it."""
    world = World(plain=0.02, drafter=0.006, per_token=0.004, alpha=0.7)
    policy = AdaptiveDepth(15)
    chosen = run(policy, world, 400)
    best = world.best(15)
    assert 1 < best < 15
    assert abs(np.median(chosen[100:]) - best) <= 2, (best, chosen[100:])


def _drop_and_recovery(seed: int) -> tuple[int, int, int, int, float]:
    """Good drafts, then bad, then good again: (cycles to the first plain step after the drop, plain steps in the
    drop's last 100 cycles, the probe interval then, cycles to drafting 8+ after the recovery, the median depth
    after that)."""
    policy = AdaptiveDepth(15)
    good = World(plain=0.02, drafter=0.004, per_token=0.0004, alpha=0.92, seed=seed)
    bad = World(plain=0.02, drafter=0.004, per_token=0.0004, alpha=0.02, seed=seed + 1)
    run(policy, good, 200)
    after_drop = run(policy, bad, 200)
    first_plain = next(i for i, k in enumerate(after_drop) if k == 0)
    interval = policy.probe_interval(1)
    after_recovery = run(policy, good, 300)
    back = next(i for i, k in enumerate(after_recovery) if k >= 8)
    return first_plain, after_drop[100:].count(0), interval, back, float(np.median(after_recovery[back + 20 :]))


def test_follows_a_change_of_acceptance_within_bounded_cycles():
    """Over four draws of the world's noise (its one timed warm-up plain step, 10% off, misprices every depth by as
    much, so one draw takes longer to fall to plain): plain within 30 cycles of the drop at the median and 50 at
    worst, then a probe or two notice the recovery and long drafts return."""
    runs = [_drop_and_recovery(seed) for seed in (1, 11, 21, 31)]
    firsts = [r[0] for r in runs]
    assert np.median(firsts) <= 30 and max(firsts) <= 50, runs
    for first_plain, plain_tail, interval, back, depth in runs:
        assert plain_tail >= 85, runs
        assert interval <= 40, runs  # drafting is cheap here, so probes are frequent
        assert back <= 2 * interval + 10, runs  # a probe or two notice, then it stays
        assert depth >= 12, runs


def test_a_long_context_does_not_pay_for_costs_learnt_at_a_short_one():
    """Costs learnt at short contexts, where a verified token is nearly free, then prompts at a long
    context, where each one costs half a plain step (attention over the window). The estimates still
    hold the short context's per-token cost when each new prompt probes, so probes must be cheap
    whatever the estimates say: the policy stays within 3% of plain decoding."""
    policy = AdaptiveDepth(15)
    run(policy, World(plain=0.02, drafter=0.03, per_token=0.0001, alpha=0.3), 400)
    long = World(plain=0.03, drafter=0.04, per_token=0.015, alpha=0.3, seed=3)
    assert long.best(15) == 0
    tokens, seconds = 0, 0.0
    for _ in range(8):  # prompts of 64 cycles each
        policy.start()
        for _ in range(64):
            _, k, accepted, took = long.step(policy, [])
            tokens, seconds = tokens + accepted + 1, seconds + took
    assert tokens / seconds >= 0.97 / long.plain, (tokens / seconds * long.plain)


def test_new_prompts_stop_bringing_probes_forward_where_drafting_never_pays():
    """Short replies (64 cycles) with a drafter that never pays: the first few prompts each probe a quarter
    interval in; after them, probes come at the budgeted spacing only (one every few replies), as each of
    those probes cost 2-3% at a 16k context. A prompt where drafting pays brings them back."""
    policy = AdaptiveDepth(15)
    never = World(plain=0.05, drafter=0.06, per_token=0.004, alpha=0.02, seed=9)

    def prompts(world: World, n: int) -> list[int]:
        probes = []
        for _ in range(n):
            policy.start()
            probes.append(sum(k > 0 for k in run(policy, world, 64)))
        return probes

    first, later = prompts(never, 6), prompts(never, 24)
    assert sum(first[:3]) >= 3, first
    assert sum(later) <= 24 * 64 / policy.probe_interval(1) + 2, (later, policy.probe_interval(1))
    policy.start()  # a long reply the drafter follows: a budgeted probe finds it (one of the first few: a probe's
    interval = policy.probe_interval(1)  # one token, or the doubling after it, can be refused at 3% a token)
    chosen = run(policy, World(plain=0.05, drafter=0.06, per_token=0.004, alpha=0.97), 800)
    found = next((i for i, k in enumerate(chosen) if k >= 8), len(chosen))
    assert found <= 4 * interval and np.mean([k >= 8 for k in chosen[found:]]) >= 0.6, (found, interval)
    assert sum(prompts(never, 3)) >= 2  # drafting paid a prompt ago: new prompts probe again


def test_ranks_that_time_apart_agree_on_every_depth():
    """The ranks of a sharded target see the same accepts but time their cycles apart. Left alone, their
    depths drift apart (and the ranks would wait on each other forever); with rank 0's costs shared
    (``agree``) they choose the same depth every cycle."""

    def lockstep(agreeing: bool) -> int:
        shared: list[float] = []

        def agree(rank: int):
            def share(theta: list[float]) -> list[float]:
                if rank == 0:  # rank 0 reaches the collective first in this simulation
                    shared[:] = theta
                return list(shared)
            return share if agreeing else None

        ranks = [AdaptiveDepth(15, agree=agree(r)) for r in range(2)]
        world, clocks = World(plain=0.02, drafter=0.01, per_token=0.002, alpha=0.6), np.random.default_rng(7)
        differing = 0
        for _ in range(600):
            plan, other = (p.plan([]) for p in ranks)
            differing += plan != other
            k0 = drafter_depth(plan)
            accepted, seconds = world.cycle(k0)
            for p, own in zip(ranks, (plan, other)):
                p.observe(own, k0, accepted, seconds * clocks.uniform(0.8, 1.2))
        return differing

    assert lockstep(agreeing=False) > 0
    assert lockstep(agreeing=True) == 0


def occurs_before(history: list[int], length: int) -> bool:
    """Does the last ``length`` tokens' stretch occur earlier in ``history`` (ending before its last token)?"""
    tail = history[-length:]
    return any(history[j : j + length] == tail for j in range(len(history) - length))


@settings(max_examples=300, deadline=None)
@given(history=st.lists(st.integers(0, 3), min_size=1, max_size=60), last=st.integers(0, 3), k=st.integers(0, 20))
def test_a_copy_continues_an_earlier_occurrence(history, last, k):
    """A copy draft is what followed an earlier occurrence of the history's last three tokens (LZ77-style: a
    match close behind extends itself), of exactly k tokens; none only where those tokens never occurred
    before, and the same however the history was indexed."""
    seq = history + [last]
    earlier = [s for s in range(3, len(seq)) if seq[s - 3 : s] == seq[-3:]]
    index = Repeats()
    for cut in range(1, len(history)):
        index.length(history[:cut])  # indexed as a generation goes
    copy = index.continuation(history, last, k)
    assert copy == Repeats().continuation(history, last, k)
    if not earlier or k == 0:
        assert copy == []
        return
    assert len(copy) == k
    ext = seq + copy
    assert any(all(ext[s + i] == c for i, c in enumerate(copy)) for s in earlier)


@settings(max_examples=200, deadline=None)
@given(history=st.lists(st.integers(0, 3), max_size=60), cuts=st.lists(st.integers(0, 60), max_size=5))
def test_repeats_measures_a_repeat_that_is_there_however_the_history_arrives(history, cuts):
    """0 exactly when the last three tokens never occurred before; otherwise a stretch of the reported length
    (3..12) did. Fed in any chunks, the answer is the one for the whole history."""
    repeats = Repeats()
    for cut in sorted(cuts) + [len(history)]:
        length = repeats.length(history[:cut])
    assert (length == 0) == (len(history) < 4 or not occurs_before(history, 3))
    assert length == 0 or (3 <= length <= 12 and occurs_before(history, length))
    assert Repeats().length(history) == length


def test_repeats_follows_a_loop_and_starts_over_on_a_shorter_history():
    loop = [7, 8, 9, 10, 11]
    history = [1, 2, 3] + loop * 4
    repeats = Repeats()
    lengths = [repeats.length(history[:i]) for i in range(1, len(history) + 1)]
    assert lengths[:10] == [0] * 10  # the first pass of the loop is new text
    assert lengths[10:] == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12, 12, 12]  # then it repeats, longer and longer
    assert repeats.bucket(history) == 2 and repeats.bucket(history + [99]) == 0
    assert repeats.length([1, 2, 3, 1, 2, 3]) == 3  # a new generation's history (shorter): indexed afresh
    short = Repeats(horizon=8)
    long = [1, 2, 3] + list(range(100, 140)) + [1, 2, 3]
    assert [short.length(long[:i]) for i in range(1, len(long) + 1)][-1] == 0  # beyond the horizon: forgotten
    assert len(short._ends) <= 4 * 8 and Repeats().length(long) == 3


class Text:
    """A synthetic reply: new text (fresh tokens, which the drafter rarely guesses) and, now and then, a
    loop (a phrase repeated, which it follows), on a CPU-like machine where a probe costs more than a plain
    step. The drafter's acceptance depends only on whether the text repeats, as measured on the CPU pair."""

    def __init__(self, seed: int):
        self.rng, self.fresh = np.random.default_rng(seed), 1000
        self.world = World(plain=0.05, drafter=0.08, per_token=0.004, alpha=0.0, seed=seed)

    def reply(self, new: int, loop: int) -> list[int]:
        phrase = list(range(self.fresh, self.fresh + 9))
        out = list(range(self.fresh + 9, self.fresh + 9 + new))
        self.fresh += 9 + new
        return out + (phrase * (loop // 9 + 1))[:loop]

    def decode(self, policy: AdaptiveDepth, prompt: list[int], reply: list[int], looping_from: int) -> tuple[int, float]:
        """(tokens into the loop when the policy first drafts 8 or more there, seconds taken)."""
        history, made, noticed, seconds = list(prompt), 0, None, 0.0
        policy.start()
        while made < len(reply):
            k = (plan := policy.plan(history)).depth
            self.world.alpha = 0.97 if made >= looping_from + 9 else 0.05  # from the loop's second pass on
            accepted, took = self.world.cycle(k)
            accepted = min(accepted, len(reply) - made - 1)
            policy.observe(plan, k, accepted, took)
            if noticed is None and k >= 8 and made >= looping_from:
                noticed = made - looping_from
            history += reply[made : made + accepted + 1]
            made, seconds = made + accepted + 1, seconds + took
        return (len(reply) if noticed is None else noticed), seconds


def test_drafts_where_the_text_repeats_without_waiting_for_a_probe():
    """Replies that open with new text and fall into a loop. Once it has seen a loop or two, the policy
    keeps apart what it knows of repeating and of new text: it decodes the new text plainly and drafts
    long blocks by the time the loop's second pass has repeated twelve tokens, where a policy blind to
    repeats waits for its next probe; and it is faster for it. Three texts: how soon a probe lands is luck in
    any one (the blind policy's median delay was 23-35 tokens over seeds 11-13)."""
    delays, times = {"sees repeats": [], "blind": []}, {"sees repeats": 0.0, "blind": 0.0}
    for seed in (11, 12, 13):
        for name, repeats in (("sees repeats", Repeats()), ("blind", Repeats(n=10**9))):
            text, policy = Text(seed=seed), AdaptiveDepth(15, copies=False, repeats=repeats)
            for i in range(12):
                new = int(text.rng.integers(40, 80))
                reply = text.reply(new, 120)
                noticed, seconds = text.decode(policy, text.reply(20, 0), reply, new)
                if i >= 4:  # the first replies teach the policy what loops are
                    delays[name].append(noticed)
                times[name] += seconds
    assert np.median(delays["sees repeats"]) <= 9 + 12, delays  # the loop's first pass is new text
    assert np.median(delays["blind"]) >= 2 * np.median(delays["sees repeats"]), delays
    assert times["sees repeats"] < 0.9 * times["blind"], times


def test_acceptance_estimate_per_position():
    acc = Acceptance(4, decay=1.0)
    for accepted in (4, 4, 2, 0):
        acc.update(4, accepted)
    # Position 0 seen 4 times, accepted 3; position 2 seen 3 times (after 4, 4, 2), accepted twice.
    np.testing.assert_allclose(acc.trials, [4, 3, 3, 2])
    np.testing.assert_allclose(acc.hits, [3, 3, 2, 2])
    rates = acc.rates()
    pooled = (10 + 1) / (12 + 2)
    np.testing.assert_allclose(rates[0], (3 + 2 * pooled) / (4 + 2))
    e = acc.expected_tokens()
    assert e[0] == 1 and np.isclose(e[1], 1 + rates[0]) and np.isclose(e[4], 1 + np.cumprod(rates).sum())


def test_cost_fit_recovers_the_machine():
    """Drafting cycles give the drafter's and the verify's per-token cost; copy cycles (no drafter pass) their
    own fixed cost beyond the verify's, without disturbing the drafting line."""
    costs = CycleCosts(15)
    rng = np.random.default_rng(0)
    for i in range(90):
        k, copy = [(15, False), (0, False), (7, False), (3, False), (0, False), (12, False), (9, True), (2, True),
                   (15, True)][i % 9]
        fixed = 0.003 if copy else 0.01 if k else 0
        costs.update(k, 0.03 + fixed + 0.002 * k + rng.normal(0, 1e-5), copy=copy)
    np.testing.assert_allclose(costs.theta, [0.03, 0.01, 0.002, 0.003, 0.002], rtol=0.05, atol=2e-4)
    assert np.isclose(costs.predict_copy(5), 0.03 + 0.003 + 0.01, rtol=0.05) and costs.predict_copy(0) == costs.plain


def _quiet_costs() -> CycleCosts:
    """Costs measured on a quiet machine: a 2 ms plain step, drafting cycles and copies of several depths."""
    costs = CycleCosts(15)
    for _ in range(6):
        for k, copy in ((15, False), (0, False), (1, False), (0, False), (15, True), (4, True), (0, False)):
            costs.update(k, 0.002 * ((1 + (0.3 + 0.05 * k if not copy else 0.05 + 0.02 * k)) if k else 1), copy=copy)
    return costs


def test_the_plain_step_follows_the_load_while_copies_run():
    """A loop copied whole runs no plain step for hundreds of cycles. When the machine's load triples meanwhile,
    the copies' time says so: the plain estimate follows (3x), and a copy keeps its price in plain steps. (Before,
    the quiet plain step stood, each copy of 15 cost 4 plain steps and not 1.35, and beside two CPU busy loops
    a looping reply went to short copies and plain steps.)"""
    costs = _quiet_costs()
    quiet_plain, quiet_ratio = costs.plain, costs.predict_copy(15) / costs.plain
    for _ in range(40):
        costs.update(15, 3 * 0.002 * (1.05 + 0.02 * 15), copy=True)
    assert np.isclose(costs.plain, 3 * quiet_plain, rtol=0.15), (costs.plain, quiet_plain)
    assert np.isclose(costs.predict_copy(15) / costs.plain, quiet_ratio, rtol=0.15)
    assert np.isclose(costs.predict_copy(4) / costs.plain, 1.05 + 0.02 * 4, rtol=0.15)


def test_plain_steps_between_copies_keep_the_plain_step_true():
    """Beside busy loops a verify of 16 slows more than a plain step (its BLAS threads wait for a descheduled
    one). Copies then claim a dearer plain step than the plain steps between them measure; the plain steps must
    be heard as fast, so that the copies, not the plain step, carry the slowdown."""
    costs = _quiet_costs()
    plain = costs.plain
    for _ in range(60):
        costs.update(15, 3 * 0.002 * (1.05 + 0.02 * 15), copy=True)
        for _ in range(3):
            costs.update(0, 0.002)
    assert costs.plain == pytest.approx(plain, rel=0.25), (costs.plain, plain)
    assert costs.predict_copy(15) / costs.plain > 2.5 * (1.05 + 0.02 * 15) * 0.8


def test_a_depth_seen_first_prices_itself_not_the_plain_step():
    """A depth's first cycles teach its own mean, whatever the line predicted for it: they leave the plain step
    where it was (a depth seen twice moves it not at all)."""
    costs = _quiet_costs()
    plain = costs.plain
    for _ in range(2):  # the line says about 1.23 plain steps
        costs.update(9, 0.002 * 3.0, copy=True)
    assert costs.plain == pytest.approx(plain)
    assert costs.copying.mean(9) == pytest.approx(2.0)


def test_one_stalled_cycle_moves_no_prediction_more_than_fourfold():
    """A cycle timed across a stall (the caller busy, the machine swapping: here 1000x) counts as at most four
    times its prediction: every depth's price stays within fourfold, and the next cycles bring it back."""
    costs = _quiet_costs()
    before = [costs.predict(k) for k in range(16)]
    costs.update(15, 1000 * costs.predict(15))
    after = [costs.predict(k) for k in range(16)]
    assert max(a / b for a, b in zip(after, before)) <= 4, after
    for _ in range(8):
        costs.update(15, before[15])
    assert costs.predict(15) == pytest.approx(before[15], rel=0.1)


def test_cycles_timed_before_any_plain_step_are_priced_against_the_first():
    """The warm-up drafts a full block before its plain step: that cycle waits, and counts once a plain step
    says what its seconds are worth."""
    costs = CycleCosts(15)
    costs.update(15, 0.004)
    costs.update(1, 0.0024)
    assert not costs.ready
    costs.update(0, 0.002)
    assert costs.ready and costs.drafting.mean(15) == pytest.approx(1.0) and costs.drafting.mean(1) == pytest.approx(0.2)


def test_copies_cost_their_verify_until_measured():
    """Before any copy cycle a copy costs a plain step and its verified tokens at the drafting cycles' rate
    (nothing fixed: copies are tried); one depth measured moves that line through it; two give the copies'
    own line, apart from the drafting cycles'."""
    costs = CycleCosts(15)
    for k in (15, 0, 1, 0):
        costs.update(k, 0.03 + (0.01 + 0.002 * k if k else 0))
    assert np.isclose(costs.predict_copy(9), 0.03 + 9 * 0.002)
    costs.update(15, 0.03 + 0.003 + 0.002 * 15, copy=True)  # a first copy of 15: not every depth priced as it
    assert np.isclose(costs.predict_copy(15), 0.063) and np.isclose(costs.predict_copy(1), 0.03 + 0.003 + 0.002)
    for _ in range(20):
        costs.update(12, 0.03 + 0.002 + 0.001 * 12, copy=True)
        costs.update(4, 0.03 + 0.002 + 0.001 * 4, copy=True)
    assert np.isclose(costs.predict_copy(8), 0.03 + 0.002 + 0.008, rtol=0.05)
    assert np.isclose(costs.predict(8), 0.03 + 0.01 + 0.016)


def _copies_win_drafting_does_not() -> AdaptiveDepth:
    """A policy whose estimates say: the drafter's drafts are never accepted, copies always are."""
    policy = AdaptiveDepth(15)
    for _ in range(20):  # cycles that cost plain 10 ms, drafting 5 ms + 1 ms a token, copying 1 ms + 1 ms a token
        for k in (0, 1, 15):
            policy.costs.update(k, 0.010 + (0.005 + 0.001 * k if k else 0))
        for k in (4, 15):
            policy.costs.update(k, 0.011 + 0.001 * k, copy=True)
    policy._refresh()
    assert not policy.warming_up and np.allclose(policy.seconds, [0.010] + [0.015 + 0.001 * k for k in range(1, 16)])
    for _ in range(50):
        policy.by_repeat[0].update(15, 0)
        policy.copy_by_repeat[0].update(15, 15)
    return policy


@pytest.mark.parametrize("ran", [COPY, DRAFTER])
def test_a_copy_that_wins_leaves_a_due_probe_due(ran):
    """plan() spends the drafter's due probe only where the drafter's plan runs: a copy that wins leaves it due
    (it was lost before), a planned copy that finds nothing runs the probe and spends it."""
    policy = _copies_win_drafting_does_not()
    policy.probes.plain_run = policy.probe_interval(1) - 1  # the next plain plan probes
    plan = policy.plan([])
    assert plan.source == COPY and plan.depth > 0 and plan.fallback == 1
    policy.observe(plan, plan.depth if ran == COPY else plan.fallback, 0 if ran == DRAFTER else plan.depth, 0.02,
                   ran)
    policy.copies = False
    assert policy.plan([]) == (Plan(1) if ran == COPY else Plan(0))


def _loop(policy: AdaptiveDepth, cycles: int, spiked: int = -1) -> tuple[float, int]:
    """A reply that loops with period 7 (a copy is always offered and accepted whole; the drafter never is) on a
    machine whose cycles cost 10 ms + [drafting] 4 ms + k 0.5 ms, cycle ``spiked`` twenty times that (another
    process took the cores): the policy's tokens per second, and how many cycles copied."""
    history, tokens, seconds, copies = [1, 2, 3, 4, 5, 6, 7] * 3, 0, 0.0, 0
    policy.start()
    for i in range(cycles):
        plan = policy.plan(history)
        copying = plan.source == COPY
        took = (0.010 + (0.004 if plan.depth and not copying else 0.0) + plan.depth * 0.0005) * (20 if i == spiked
                                                                                                 else 1)
        accepted = plan.depth if copying else 0
        policy.observe(plan, plan.depth, accepted, took, COPY if copying else DRAFTER)
        for _ in range(accepted + 1):
            history.append(history[-7])
        tokens, seconds, copies = tokens + accepted + 1, seconds + took, copies + copying
    return tokens / seconds, copies


@pytest.mark.parametrize("spiked", [None, 1, 2, 3, 40])
def test_copies_that_are_accepted_are_not_ruled_out_by_one_spike(spiked):
    """A spike of the machine's load during the first timed full block made the drafting cycles' slope dear, and
    copies, priced by it until one is timed, were never tried (0 copy cycles, 87 tok/s against 914 copying
    always); nor could a copy's own timing count, the line through it being held to that slope. Now accepted
    copies are retried on a backoff and the line goes through the depth measured: within 0.9 of copying always,
    whenever the spike comes (a quiet run: as before)."""
    rate, copies = _loop(AdaptiveDepth(15), 300, -1 if spiked is None else spiked)
    always = 16 / (0.010 + 15 * 0.0005)
    assert copies > 250 and rate >= 0.9 * always, (rate / always, copies)


def test_retried_copies_back_off_where_they_are_refused():
    """Where the text repeats but the target refuses the copies, retries double their interval: few cycles lost."""
    policy = AdaptiveDepth(15)
    history = [1, 2, 3, 4, 5, 6, 7] * 3
    retried = 0
    for _ in range(2000):
        plan = policy.plan(history)
        copying = plan.source == COPY
        policy.observe(plan, plan.depth, 0, 0.010 + plan.depth * 0.004 + (0.004 if plan.depth and not copying else 0.0),
                       COPY if copying else DRAFTER)
        retried += copying
        history.append(history[-7])
    assert 1 <= retried <= 12, retried


def test_copies_refused_earlier_are_retried_when_the_text_starts_looping():
    """A reply repeats itself but the target refuses the copies (200 cycles), then falls into a loop it copies
    whole. Retries used to stop once the copies' acceptance fell low (below 1.5 tokens for a full block) and the
    loop then decoded plainly to its end: replayed on the looping pair's built-in prompts under a recorded load,
    auto ran 0.29-0.5 of copying alone. Retries now go on at the backoff whatever the acceptance, so the loop is
    found within one backoff interval."""
    policy, history, copies, tokens, seconds = AdaptiveDepth(15), [1, 2, 3, 4, 5, 6, 7] * 3, 0, 0, 0.0
    policy.start()
    for i in range(800):
        plan = policy.plan(history)
        copying = plan.source == COPY
        accepted = plan.depth if copying and i >= 200 else 0
        took = 0.010 + (0.004 if plan.depth and not copying else 0.0) + plan.depth * 0.0005
        policy.observe(plan, plan.depth, accepted, took, COPY if copying else DRAFTER)
        history += [history[-7]] * (accepted + 1)
        if i >= 200:
            tokens, seconds, copies = tokens + accepted + 1, seconds + took, copies + copying
    always = 16 / (0.010 + 15 * 0.0005)
    assert copies > 400 and tokens / seconds >= 0.7 * always, (copies, tokens / seconds / always)


class Scripted:
    """A policy that drafts a given sequence of depths and sources (cycling), as hypothesis draws them."""

    def __init__(self, depths: list[int], sources: list[str] = (DRAFTER,)):
        self.depths, self.sources, self.i, self.histories, self.seen = depths, sources, 0, [], []
        self.repeats = Repeats()

    def start(self) -> None:
        self.repeats.reset()

    def plan(self, history) -> Plan:
        self.histories.append(list(history))
        self.i += 1
        return Plan(self.depths[(self.i - 1) % len(self.depths)], self.sources[(self.i - 1) % len(self.sources)])

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        self.seen.append((drafted, accepted, source))


@pytest.mark.parametrize("window", [None, 32])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depths=st.lists(st.integers(0, 20), min_size=1, max_size=12), max_tokens=st.integers(1, 90),
       sources=st.lists(st.sampled_from([DRAFTER, COPY]), min_size=1, max_size=5))
def test_any_depth_sequence_is_lossless(pairs, looping, window, depths, max_tokens, sources):
    """Whatever the policy drafts each cycle (0 included, beyond the block capped), from the drafter or
    copied from the history, output = plain greedy, and a second turn on the same cache is exact too."""
    for target, drafter, tokenizer, ids in (
        (*pairs["qwen3"], pairs["qwen3"][2].encode(PROMPTS[0])),
        looping[:3] + (looping[3],),
    ):
        ref_cache = (lambda: target.make_cache(window, 0, 1)) if window else (lambda: None)
        cache = make_cache(target, drafter, window=window, block_size=8)
        out = generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=8, eos_token_ids=[],
                       window=window, cache=cache, policy=(policy := Scripted(depths, sources)))
        cache.check()
        assert out.tokens == plain_greedy(target.model, ids, max_tokens, prompt_cache=ref_cache())
        told = policy.histories  # each decision saw the history so far: all but the newest token, on every path
        emitted = np.cumsum([1] + [a + 1 for a in out.acceptance]).tolist()[: out.cycles]
        assert [len(h) for h in told] == [len(ids) + e - 1 for e in emitted]
        assert all(h == (ids + out.tokens)[: len(h)] for h in told)
        assert set(out.drafted) <= {min(d, 7) for d in depths} | set(range(8))
        assert out.sources == [s for _, _, s in policy.seen] and [d for d, _, _ in policy.seen] == out.drafted
        follow = ids + out.tokens + tokenizer.encode(" and")
        out2 = generate(target, drafter, tokenizer, follow, max_tokens=20, block_size=8, eos_token_ids=[],
                        window=window, cache=cache, policy=Scripted(depths[::-1], sources[::-1]))
        cache.check()
        assert out2.tokens == plain_greedy(target.model, follow, 20, prompt_cache=ref_cache())


def test_adaptive_is_the_default_and_reports_its_depths(looping):
    """No block_size: the adaptive policy picks depths; generate's JSON carries the histogram."""
    target, drafter, tokenizer, ids, ref, _ = looping
    out = generate(target, drafter, tokenizer, ids, max_tokens=150, eos_token_ids=[])
    assert out.tokens == ref[:150]
    hist = out.to_dict()["depth_histogram"]
    assert sum(hist) == out.cycles and hist == out.depth_histogram
    assert len([k for k, n in enumerate(hist) if n]) >= 2  # not one fixed depth
    pinned = generate(target, drafter, tokenizer, ids, max_tokens=150, eos_token_ids=[], block_size=8)
    emitted = 1 + np.cumsum([0] + [a + 1 for a in pinned.acceptance[:-1]])
    assert pinned.drafted == [min(7, 150 - e - 1) for e in emitted]  # a full block unless the budget ends


def test_seeded_sampling_drafts_full_blocks_and_reproduces(pairs):
    """Seeded rejection sampling's draw depends on the depths, so it does not adapt: same seed, same tokens. A
    seeded run by default (verify "auto": match, a key per position) adapts and reproduces all the same."""
    target, drafter, tokenizer = pairs["qwen3"]
    runs = [generate(target, drafter, tokenizer, PROMPTS[1], max_tokens=60, eos_token_ids=[], temperature=0.9, seed=3,
                     verify="rejection") for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    emitted = 1 + np.cumsum([0] + [a + 1 for a in runs[0].acceptance[:-1]])
    assert runs[0].drafted == [min(drafter.block_size - 1, 60 - e - 1) for e in emitted]
    default = [generate(target, drafter, tokenizer, PROMPTS[1], max_tokens=60, eos_token_ids=[], temperature=0.9,
                        seed=3) for _ in range(2)]
    assert default[0].tokens == default[1].tokens
    assert default[0].depth_histogram[0] > 0  # the adaptive policy decoded plainly where drafting did not pay


def test_generate_json_reports_depths(models_dir):
    import json

    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    args = ["generate", str(models_dir / "qwen3-dflash"), "-t", str(models_dir / "qwen3"), "-p", PROMPTS[0],
            "--no-chat-template", "-m", "40", "--json"]
    adaptive = json.loads(CliRunner().invoke(app, args).stdout)
    assert sum(adaptive["depth_histogram"]) == adaptive["cycles"]
    drafted = sum(k * n for k, n in enumerate(adaptive["depth_histogram"]))
    assert sum(s["drafted"] for s in adaptive["sources"].values()) == drafted
    assert sum(s["accepted"] for s in adaptive["sources"].values()) == sum(k * n for k, n in enumerate(
        adaptive["acceptance_histogram"]))
    drafter_only = json.loads(CliRunner().invoke(app, args + ["--draft-source", "drafter"]).stdout)
    assert drafter_only["sources"]["copy"] == {"cycles": 0, "drafted": 0, "accepted": 0}
    pinned = json.loads(CliRunner().invoke(app, args + ["-b", "4"]).stdout)
    assert pinned["depth_histogram"][3] >= pinned["cycles"] - 3 and sum(pinned["depth_histogram"]) == pinned["cycles"]


def test_a_new_prompt_probes_into_its_reply_and_a_whole_accept_looks_further():
    """A server-like process: a prompt the drafter cannot follow, then one it follows well. The policy
    probes a quarter of an interval into the new reply (not at its first cycle, where drafters agree
    least), and, while probes are accepted whole, probes twice as deep next, so long drafts return within
    a few cycles of that instead of after the next scheduled probes."""
    world = dict(plain=0.05, drafter=0.02, per_token=0.01)  # CPU-like: probes are dear, so they are rare

    def cycles_to_long_drafts(seed: int, new_prompt: bool) -> tuple[int, int]:
        policy = AdaptiveDepth(15)
        bad = World(**world, alpha=0.02, seed=seed)
        chosen = run(policy, bad, 300)
        while not chosen[-1] or policy.probes.follow_up:  # until just past a probe (one not accepted whole: 2% are)
            chosen += run(policy, bad, 1)
        interval = policy.probe_interval(1)
        assert interval > 40 and drafter_depth(policy.plan([])) == 0
        if new_prompt:
            policy.start()
        chosen = run(policy, World(**world, alpha=0.97, seed=100 + seed), 150)
        first = next(i for i, k in enumerate(chosen) if k)
        assert not new_prompt or 1 <= first <= interval // 4 + 1, (first, interval)
        return first, next((i for i, k in enumerate(chosen) if k >= 8), len(chosen))

    told = [cycles_to_long_drafts(seed, True) for seed in range(8)]
    untold = [cycles_to_long_drafts(seed, False) for seed in range(8)]
    assert np.median([long - first for first, long in told]) <= 8, told  # doubling: 1, 2, 4, 8 accepted whole
    assert np.median([long for _, long in untold]) >= 2 * np.median([long for _, long in told]), (told, untold)


def test_probes_come_often_where_drafting_keeps_coming_back():
    """Replies that fall into runs the drafter follows (a chat reply's loops), on a CPU-like machine where a
    probe costs more than a plain step: once probes have found a few such runs, they come every ~20 cycles
    and a run is noticed within a few tens of tokens, not after a budget-spaced ~100."""
    policy = AdaptiveDepth(15)
    cpu = dict(plain=0.05, drafter=0.1, per_token=0.004)
    bad, good = World(**cpu, alpha=0.02, seed=5), World(**cpu, alpha=0.97, seed=6)
    delays = []
    for phase in range(8):
        for world, tokens in ((bad, 60), (good, 300)):
            policy.start()
            made, noticed = 0, None
            while made < tokens:
                _, k, accepted, took = world.step(policy, [])
                if world is good and noticed is None and k >= 8:
                    noticed = made
                made += accepted + 1
            if world is good:
                delays.append(tokens if noticed is None else noticed)
    assert np.median(delays[3:]) <= 30, delays
    assert policy.probe_interval(1) <= 30
    never = AdaptiveDepth(15)
    run(never, bad, 400)
    assert never.probe_interval(1) >= 3 * policy.probe_interval(1)  # where drafting never comes back


def test_a_plain_step_timed_during_a_spike_does_not_price_drafting_as_free():
    """The warm-up's one plain step lands in a spike of load (10x); drafts are never accepted. A cycle that drafts
    costs at least a plain step, so the quicker drafting cycles correct the estimate and plain decoding resumes.
    (Before: every depth was priced at the spiked plain step and the drafter ran a full block to the end.)"""
    policy = AdaptiveDepth(15, copies=False)
    policy.start()
    history, plans, quiet = list(range(50)), [], 0.002
    for i in range(400):
        k = (plan := policy.plan(history)).depth
        spiked = k == 0 and not any(d == 0 for d in plans)
        policy.observe(plan, k, 0, quiet * 10 if spiked else quiet * (1 + (0.3 + 0.05 * k if k else 0)))
        plans.append(k)
        history.append(1000 + i)
    assert sum(k == 0 for k in plans[-200:]) > 190


def _replayed(policy: AdaptiveDepth, cycles: int, extra_plans: bool) -> list[Plan]:
    """Plans over a text that loops after a while (both sources, probes, the warm-up), each observed with its own
    plan; with ``extra_plans`` the next cycle is also planned before each observe, as the decode loop plans a plain
    step's successor before reading it."""
    world, history, plans = World(plain=0.01, drafter=0.004, per_token=0.001, alpha=0.3, seed=3), list(range(40)), []
    policy.start()
    for i in range(cycles):
        plan = policy.plan(history)
        if extra_plans:
            policy.plan(history + [7])
            policy.plan(history[:-3])
        k = plan.depth if plan.source == COPY and len(history) > 200 else drafter_depth(plan)
        source = COPY if plan.source == COPY and len(history) > 200 else DRAFTER
        accepted, seconds = world.cycle(k)
        policy.observe(plan, k, k if source == COPY else accepted, seconds, source)
        plans.append(plan)
        history += [3, 1, 4, 1, 5, 9, 2, 6][: accepted + 1] if len(history) > 200 else [1000 + i] * (accepted + 1)
    return plans


def test_planning_changes_nothing():
    """plan() decides and keeps nothing: a policy asked for extra plans between a plan and its outcome (as the
    decode loop asks for a plain step's successor before reading it) decides every cycle as one asked once."""
    once, twice = _replayed(AdaptiveDepth(15), 600, False), _replayed(AdaptiveDepth(15), 600, True)
    assert [(p.depth, p.source, p.fallback) for p in once] == [(p.depth, p.source, p.fallback) for p in twice]
    assert {p.source for p in once} == {COPY, DRAFTER} and len({p.depth for p in once}) > 3  # it decided things


def test_a_batch_rows_learning_merges_into_the_shared_policy():
    """Rows decode with copies of the shared policy; each one's acceptance joins the shared estimate when it hands
    back (weighted by what each saw, counting as the one that saw more), not the last row's over the others'."""
    from dflash_mlx.decode.batch import own_policy
    from dflash_mlx.decode.cycle import Row

    shared = AdaptiveDepth(15)
    rows = [Row.__new__(Row) for _ in range(2)]
    handbacks = []
    for row, alpha in zip(rows, (0.9, 0.1)):
        row.policy = shared
        handbacks.append(own_policy(row))
        world = World(plain=0.01, drafter=0.004, per_token=0.001, alpha=alpha, seed=1)
        for _ in range(80):
            plan = row.policy.plan([])
            k = drafter_depth(plan)
            accepted, seconds = world.cycle(k)
            row.policy.observe(plan, k, accepted, seconds)
    first = [p.by_repeat[0].rates()[0] for p in (rows[0].policy, rows[1].policy)]
    for handback in handbacks:
        handback()
    merged = shared.by_repeat[0].rates()[0]
    assert first[1] + 0.1 < merged < first[0] - 0.05, (first, merged)  # both rows count
    seen = max(p.by_repeat[0].trials.sum() for p in (rows[0].policy, rows[1].policy))
    assert shared.by_repeat[0].trials.sum() == pytest.approx(seen)  # no more certain than the row that saw most
    assert shared.costs.ready and shared.seconds is not None  # the next request does not warm up again


def test_costs_are_kept_per_context_span():
    """A verify dear at 8k and cheap at 256 (its attention over the context): a short prompt after long ones drafts
    deep again from its first cycles (its span's costs where they were left), where one cost model for every
    context would first have to unlearn the long prompts'."""
    from dflash_mlx.eval import replay

    profile = replay.CostProfile.relative("growing", "test", 15, plain_step=0.01, upkeep=0.0, drafter=0.17,
                                          per_token=0.05, per_token_growth=1e-4)
    short, long = (replay.synthetic(name, prompt, 200, 0.9, 15, seed) for name, prompt, seed in
                   (("short", 256, 0), ("long", 8000, 1)))
    policy = AdaptiveDepth(15)
    replay.simulate(policy, [short, long, long], profile)  # a block of 16 over 8k costs 14 plain steps here
    assert {0, 4} <= set(policy.spans)
    again = replay.simulate(policy, [short], profile)
    assert sum(again.depths[8:]) >= 0.8 * sum(again.depths)  # one cost model for all: drafts of 3-5 (measured)


def test_retries_at_a_long_context_are_shallow_and_spaced_by_what_they_lose():
    """At 4k tokens of the real pair a copy of 15 took 3.4 plain steps, and a reply about a long source file, new
    text every few tokens between names it repeats, had retries of 15 every few cycles: 5.3 plain steps lost of a
    94-token reply (0.91x plain). Here copies of k cost 1 + 0.2 k plain steps and are refused, the drafter's drafts
    too, with new text every fourth token (each starts the backoff over): retries draft no deeper than 2 plain steps
    allow and lose under 10% of plain decoding (retries of 15 lost 25%)."""
    policy = AdaptiveDepth(15)
    for _ in range(20):
        for k in (0, 1, 15):
            policy.costs.update(k, 0.010 + (0.003 + 0.002 * k if k else 0))
        for k in (4, 15):
            policy.costs.update(k, 0.010 + 0.002 * k, copy=True)
    policy._refresh()
    for _ in range(50):
        policy.by_repeat[0].update(15, 0)
    history, steps, tokens, retries = [1, 2, 3, 4, 5, 6, 7] * 3, 0.0, 0, []
    for i in range(2000):
        plan = policy.plan(history)
        copying = plan.source == COPY
        took = 0.010 + 0.002 * plan.depth + (0.003 if plan.depth and not copying else 0.0)
        policy.observe(plan, plan.depth, 0, took, COPY if copying else DRAFTER)
        if copying:
            retries.append(plan.depth)
        history.append(1000 + i if i % 4 == 0 else history[-7])  # new text every fourth token
        steps, tokens = steps + took / 0.010, tokens + 1
    assert retries and max(retries) <= 5, retries
    assert steps / tokens - 1 < 0.10, (steps / tokens, len(retries))


def test_the_warm_up_drafts_its_full_block_once_and_not_on_a_first_cycle():
    """A generation's first cycle is not timed (it pays for the prefill's buffers and the drafter's first call), so
    a full block there taught the cost model nothing and the next cycle drafted another: at a 4k first prompt on a
    CPU each costs several plain steps (issue 62). The first cycle drafts one token (the drafter's first call paid
    where it is not timed); the full block, the plain step and the one token follow, each once; the next generation
    is not warmed up again. A target alone (no drafter) starts with a plain step."""
    policy, world = AdaptiveDepth(15), World(plain=0.05, drafter=0.02, per_token=0.01, alpha=0.5)
    policy.start()
    assert run(policy, world, 4) == [1, 15, 0, 1]
    policy.start()
    assert not policy.warming_up and policy.seconds is not None  # the next generation plans from the estimates
    alone = AdaptiveDepth(15, drafter=False)
    alone.start()
    assert alone.plan([]).depth == 0
