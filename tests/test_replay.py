"""Traces and their replay: recorded drafts are the decode loop's, the replay is deterministic, the oracle optimal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.decode.policy import COPY, AdaptiveDepth, FixedBlock
from dflash_mlx.eval import replay, traces
from dflash_mlx.eval.replay import CostProfile, Trace
from dflash_mlx.sampling import Sampling


def _positions(target, drafter, tokenizer, ids, max_tokens, block_size, sampling=Sampling(), draft_window=None):
    """(position, drafted, accepted) per drafting cycle; position p: the cycle starts after output[p]."""
    emitted, out = 0, []
    for r in stream_generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=block_size,
                             eos_token_ids=[], temperature=sampling.temperature, seed=sampling.seed,
                             draft_window=draft_window):
        if len(r.drafted):
            out.append((emitted - 1, list(r.drafted), r.accepted))
        emitted += len(r.tokens)
    return out


@pytest.mark.parametrize("pair", ["qwen3", "llama"])
def test_recorded_drafts_are_the_decode_loops(pairs, pair):
    target, drafter, tokenizer = pairs[pair]
    ids = tokenizer.encode("the trace of a prompt")
    trace = traces.record(target, drafter, tokenizer, "p", ids, 24)
    assert trace.drafts.shape == (23, drafter.block_size, drafter.block_size - 1)
    for block in (2, 5, drafter.block_size):
        cycles = _positions(target, drafter, tokenizer, ids, 24, block)
        assert len(cycles) > 3
        for p, drafted, accepted in cycles:
            k = len(drafted)
            assert trace.drafts[p, k, :k].tolist() == drafted, (block, p)
            assert trace.accepted[p, k] == accepted


def test_recorded_drafts_within_a_drafter_window_are_the_decode_loops(pairs):
    """A trace recorded for a drafter window drafts as the decode loop does with that window, on a prompt much longer
    than the window (its head pruned at inference, masked in the trace), and otherwise than the whole context."""
    target, drafter, tokenizer = pairs["llama"]
    ids = tokenizer.encode("the trace of a long prompt, " * 12)
    window = 16
    trace = traces.record(target, drafter, tokenizer, "w", ids, 24, draft_window=window)
    whole = traces.record(target, drafter, tokenizer, "w", ids, 24, output=trace.output)
    assert whole.output == trace.output and not np.array_equal(whole.drafts, trace.drafts)
    for block in (3, drafter.block_size):
        for p, drafted, accepted in _positions(target, drafter, tokenizer, ids, 24, block, draft_window=window):
            assert trace.drafts[p, len(drafted), : len(drafted)].tolist() == drafted, (block, p)
            assert trace.accepted[p, len(drafted)] == accepted


def test_recorded_acceptance_of_a_drafter_that_agrees(looping):
    target, drafter, tokenizer, ids, ref, _ = looping
    trace = traces.record(target, drafter, tokenizer, "loop", ids, 40)
    assert trace.output == ref[:40]
    assert trace.accepted[:, -1].max() >= 4  # long accepted runs, as the decode loop sees them
    for p, drafted, accepted in _positions(target, drafter, tokenizer, ids, 40, drafter.block_size):
        assert trace.accepted[p, len(drafted)] == accepted


def test_a_sampled_trace_follows_the_seeded_target(looping):
    target, drafter, tokenizer, ids, _, _ = looping
    sampling = Sampling(temperature=1.0, seed=5)
    trace = traces.record(target, drafter, tokenizer, "s", ids, 20, sampling)
    plain = [t for r in stream_generate(target, drafter, tokenizer, ids, max_tokens=20, block_size=1, eos_token_ids=[],
                                        temperature=1.0, seed=5) for t in r.tokens]
    deep = [t for r in stream_generate(target, drafter, tokenizer, ids, max_tokens=20, eos_token_ids=[],
                                       temperature=1.0, seed=5) for t in r.tokens]
    assert trace.output == plain == deep  # position-keyed draws: the same tokens at any depth


def _trace(accepted_full: list[int], B: int = 3, prompt: int = 4, output: list[int] = None) -> Trace:
    """A hand-made trace whose block of k + 1 accepts min(k, accepted_full[p]) (drafts are not needed); its
    output never repeats unless given."""
    full = np.array(accepted_full)
    accepted = np.minimum(full[:, None], np.arange(B + 1)[None, :])
    drafts = np.full((len(full), B + 1, B), -1)
    return Trace("hand", list(range(prompt)), output or list(range(100, 100 + len(full) + 1)), drafts, accepted)


def _profile(B: int = 3, upkeep: float = 0.1, drafter: float = 0.3, per_token: float = 0.2) -> CostProfile:
    return CostProfile.relative("hand", "a test", B, 1.0, upkeep, drafter, per_token)


def _brute(trace: Trace, profile: CostProfile, p: int = 0) -> float:
    n = len(trace.output)
    if p >= n - 1:
        return 0.0
    depths = range(min(trace.max_depth, n - p - 2) + 1)
    options = [profile.seconds(k, 0) + _brute(trace, profile, p + trace.accepted_at(p, k) + 1) for k in depths]
    if trace.copy_at(p, 1) is not None:  # copies go deeper than the drafter's block (``Trace.copy_depth``)
        options += [profile.copy_seconds(k, 0) + _brute(trace, profile, p + trace.copy_at(p, k) + 1)
                    for k in range(1, min(trace.copy_depth, n - p - 2) + 1)]
    return min(options)


@pytest.mark.parametrize("seed", range(6))
def test_the_oracle_is_optimal_by_brute_force(seed):
    """Over the drafter's depths and, where the output repeats (a small alphabet), copies of every depth."""
    rng = np.random.default_rng(seed)
    output = rng.integers(0, 2, size=14).tolist() if seed % 2 else None  # 11 trigrams of 8: one repeats
    trace = _trace(rng.integers(0, 4, size=13).tolist(), output=output)
    assert (trace.copied >= 0).any() == bool(output)
    profile = _profile(per_token=float(rng.uniform(0.0, 0.6)))
    assert replay.oracle(trace, profile) == pytest.approx(_brute(trace, profile))
    for k in range(4):  # and no fixed depth of either source beats it
        for source in ("drafter", COPY):
            fixed = replay.simulate(FixedBlock(k + 1, source), [trace], profile).seconds
            assert replay.oracle(trace, profile) <= fixed + 1e-12
    assert replay.oracle(trace, profile, copies=False) >= replay.oracle(trace, profile)


def test_recorded_copies_are_the_decode_loops(looping):
    """The copy a trace derives at each position is the one the decode loop verifies there, and is accepted
    as far: the loop's copy cycles, pinned to copies, replay to the same tokens."""
    target, drafter, tokenizer, ids, _, _ = looping
    trace = traces.record(target, drafter, tokenizer, "loop", ids, 60)
    emitted, cycles = 0, 0
    for r in stream_generate(target, drafter, tokenizer, ids, max_tokens=60, eos_token_ids=[], draft_source=COPY):
        if r.drafted:
            p, k = emitted - 1, len(r.drafted)
            assert r.source == COPY and trace.copy_at(p, k) == r.accepted, (p, k)
            assert r.drafted == (ids + trace.output)[len(ids) + p + 1 :][: r.accepted] + r.drafted[r.accepted :]
            cycles += 1
        elif emitted:
            assert trace.copied[emitted - 1] < 0  # a plain step: the history offered no copy there
        emitted += len(r.tokens)
    assert cycles > 3 and trace.copied.max() >= 4  # the loop is copied, several tokens at a time
    run = replay.simulate(FixedBlock(drafter.block_size, COPY), [trace], _profile(B=drafter.block_size - 1))
    assert run.copies == cycles


def test_a_hand_made_replay():
    trace = _trace([3, 0, 0, 0, 2, 1, 0])  # 7 positions, 8 output tokens
    profile = _profile()
    # k = 3 at p 0 (accepts 3), then the budget leaves room for 2 at p 4 (accepts 2): p 7 ends it
    run = replay.simulate(FixedBlock(4), [trace], profile)
    assert run.depths == [0, 0, 1, 1] + [0] * 12 and run.seconds == pytest.approx(1.9 + 1.7) and run.tokens == 7
    plain = replay.simulate(FixedBlock(1), [trace], profile)  # the loop's plain steps cost 1.1 mlx-lm steps
    assert plain.seconds == pytest.approx(7 * 1.1) and plain.vs_plain == pytest.approx(1 / 1.1)
    k, best = replay.best_fixed([trace], profile)
    assert k == 3 and best.seconds == run.seconds


def test_the_replay_is_deterministic():
    rng = np.random.default_rng(0)
    recorded = [_trace(rng.integers(0, 16, size=120).tolist(), B=15, prompt=50) for _ in range(4)]
    profile = replay.mac_profile("m5max-27b-4bit", 15)
    runs = [replay.simulate(AdaptiveDepth(15), recorded, profile) for _ in range(2)]
    assert runs[0].seconds == runs[1].seconds and runs[0].depths == runs[1].depths
    judged = replay.judge(replay.adaptive, recorded, profile)
    assert judged["oracle_vs_plain"] >= judged["best_fixed_vs_plain"] and judged["policy_of_oracle"] <= 1


def test_copies_replay_deeper_than_a_small_drafters_block():
    """As the decode loop: a drafter of blocks of 8 drafts at most 7, copies fill a verify of 16, alone and batched
    (whose planner warms up on the drafter's block, not on 15 it never drafts)."""
    output = list(range(20, 36)) * 6  # a loop of 16 tokens: copies of 15 are offered and accepted whole
    trace = _trace([1] * (len(output) - 1), B=7, output=output)
    assert trace.max_depth == 7 and trace.copy_depth == 15 and trace.copied.max() >= 15
    profile = _profile(B=7, drafter=0.3, per_token=0.02)  # a verified position is cheap: deep copies pay
    run = replay.simulate(replay.adaptive([trace]), [trace], profile)
    assert len(run.depths) == 16 and sum(run.depths[8:]) > 0 and run.copies
    assert replay.oracle(trace, profile) < replay.oracle(_trace([1] * (len(output) - 1), B=7), profile)
    batch = replay.simulate_batch(lambda: replay.adaptive([trace]), [trace, trace], profile)
    assert batch.tokens == 2 * (len(output) - 1) and batch.vs_plain_batch > 1


def test_trace_files_round_trip(pairs, tmp_path):
    target, drafter, tokenizer = pairs["qwen3"]
    trace = traces.record(target, drafter, tokenizer, "p", tokenizer.encode("round trip"), 8)
    traces.write(str(tmp_path / "t.jsonl"), [trace], {"pair": "qwen3"})
    meta, (back,) = traces.read(str(tmp_path / "t.jsonl"))
    assert meta == {"pair": "qwen3"} and back.output == trace.output and back.prompt == trace.prompt
    assert (back.drafts == trace.drafts).all() and (back.accepted == trace.accepted).all()


def test_costs_are_measured_per_depth_and_context(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    profile = traces.measure_costs(target, drafter, tokenizer, [16, 64], steps=2, repeats=1)
    assert profile.contexts == [16, 64] and len(profile.cycle) == 2
    assert all(len(row) == drafter.block_size and min(row) > 0 for row in profile.cycle) and min(profile.plain) > 0
    assert profile.seconds(3, 40) == pytest.approx((profile.cycle[0][3] + profile.cycle[1][3]) / 2)


def test_a_replay_under_load_prices_each_cycle_at_the_moment_it_runs():
    """A load that alternates 3x and 1x each second: plain steps of 1 s cost 3 (starting at 0 s), then 1 (at 3 s),
    3 (at 4 s), ...; the policy sees what it pays; from an offset of 1 s the same spikes fall on the other cycles."""
    trace = _trace([0] * 6)
    profile = CostProfile("flat", "a test", [0], [1.0], [[1.0, 2.0, 2.0, 2.0]])
    load = replay.Load([3.0, 1.0], dt=1.0)
    seen = []

    class Plain(FixedBlock):
        def observe(self, plan, drafted, accepted, seconds, source="drafter"):
            seen.append(seconds)

    assert replay.simulate(Plain(1), [trace], profile).seconds == 6.0
    seen.clear()
    assert replay.simulate(Plain(1), [trace], profile, load=load).seconds == 12.0
    assert seen == [3.0, 1.0, 3.0, 1.0, 3.0, 1.0]
    seen.clear()
    assert replay.simulate(Plain(1), [trace], profile, load=load, offset=1.0).seconds == 12.0
    assert seen == [1.0, 3.0, 1.0, 3.0, 1.0, 3.0]


def test_the_measured_profile_beside_traces_comes_first_and_a_damaged_one_is_left_out(tmp_path, caplog):
    """bench/trace.py writes NAME.profile.json beside NAME.jsonl: it leads the profiles; a damaged or foreign
    file is left out with a warning, and the Apple Silicon estimates still come."""
    macs = [p.name for p in traces.profiles(str(tmp_path / "none.jsonl"), 7)]
    assert macs == [replay.mac_profile(name, 7).name for name in replay.MAC_PROFILES]
    own = CostProfile("this machine", "measured", [256], [0.05], [[0.05 * (1 + 0.1 * k) for k in range(8)]])
    (tmp_path / "t.profile.json").write_text(json.dumps(own.to_dict()))
    assert [p.name for p in traces.profiles(str(tmp_path / "t.jsonl"), 7)] == ["this machine"] + macs
    for damaged in ('{"name": "half', '{"other": 1}', "[1, 2]"):
        (tmp_path / "t.profile.json").write_text(damaged)
        with caplog.at_level("WARNING"):
            assert [p.name for p in traces.profiles(str(tmp_path / "t.jsonl"), 7)] == macs
        assert "ignoring the damaged cost profile" in caplog.text
        caplog.clear()
