"""Rows decoded together (``dflash_mlx.decode.batch``): each row's output is what it would be alone, whatever the others do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import MAX_TOKENS, PROMPTS
from helpers import plain_greedy
from mlx_lm.models.cache import KVCache

from dflash_mlx import DFlashError, generate, load, stream_generate
from dflash_mlx.decode.batch import Batch, BatchPlanner
from dflash_mlx.decode.cycle import prefill
from dflash_mlx.decode.generate import batch_generate, keyword_settings, setup
from dflash_mlx.decode.policy import COPY, AdaptiveDepth, Plan
from dflash_mlx.decode.ragged import RaggedKVCache
from dflash_mlx.decode.repeats import Repeats
from dflash_mlx.decode.transaction import make_cache
from dflash_mlx.models.caches import WindowKVCache

# Prompts of different lengths: the rows' histories differ in length from the first cycle on.
MANY = PROMPTS + ["hi", "A much longer prompt that runs on for a while, so that its row is longer than the others"]


class ByLength:
    """Drafts as many tokens as its history's length modulo 16: rows of different lengths draft different depths in
    one cycle, 0 to 15, from cycle to cycle (not adaptive: the batch leaves its plans alone)."""

    def __init__(self) -> None:
        self.repeats = Repeats()

    def start(self) -> None:
        pass

    def plan(self, history) -> Plan:
        return Plan(len(history) % 16)

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = "drafter") -> None:
        pass


@pytest.mark.parametrize("name,block_size", [(name, b) for name in ("qwen3", "llama") for b in (None, 4, 16)]
                         + [("qwen3", "by length")])
def test_every_row_is_its_own_greedy_decoding(pairs, name, block_size):
    target, drafter, tokenizer = pairs[name]
    pinned = {"block_size": block_size} if block_size != "by length" else {"policy": ByLength()}
    results = batch_generate(target, drafter, tokenizer, MANY, max_tokens=MAX_TOKENS, eos_token_ids=[], **pinned)
    for prompt, result in zip(MANY, results):
        assert result.tokens == plain_greedy(target.model, tokenizer.encode(prompt), MAX_TOKENS), prompt
    if block_size == "by length":  # rows of different depths side by side
        assert len({tuple(r.drafted) for r in results}) == len(MANY)


def test_rows_that_accept_whole_blocks_beside_rows_that_accept_nothing(looping, pairs):
    """The looping pair's rows accept 15 of 15 where the others reject at once: their lengths part every cycle."""
    target, drafter, tokenizer, ids, ref, _ = looping
    prompts = [ids, tokenizer.encode("The quick brown fox"), ids[:1], tokenizer.encode("import os")]
    results = batch_generate(target, drafter, tokenizer, prompts, max_tokens=MAX_TOKENS, eos_token_ids=[],
                             block_size=16)
    assert results[0].tokens == ref[:MAX_TOKENS]
    for prompt, result in zip(prompts, results):
        assert result.tokens == plain_greedy(target.model, prompt, MAX_TOKENS)
        solo = generate(target, drafter, tokenizer, prompt, max_tokens=MAX_TOKENS, eos_token_ids=[], block_size=16)
        assert result.acceptance == solo.acceptance  # cycle for cycle, what the row accepts alone
    assert max(max(r.acceptance) for r in results) == 15 and min(min(r.acceptance) for r in results) == 0


def test_rows_end_at_their_own_stops(pairs):
    """EOS, stop strings and budgets end rows at different cycles; the rest decode on unchanged."""
    target, drafter, tokenizer = pairs["qwen3"]
    alone = [generate(target, drafter, tokenizer, p, max_tokens=MAX_TOKENS, eos_token_ids=[]) for p in MANY]
    eos = alone[1].tokens[7]  # a token the second row emits early: it ends there, others where they emit it
    stop = alone[0].text[30:34]
    together = batch_generate(target, drafter, tokenizer, MANY, max_tokens=MAX_TOKENS, eos_token_ids=[eos],
                              stop=[stop])
    for prompt, result in zip(MANY, together):
        solo = generate(target, drafter, tokenizer, prompt, max_tokens=MAX_TOKENS, eos_token_ids=[eos], stop=[stop])
        assert (result.tokens, result.text, result.finish_reason) == (solo.tokens, solo.text, solo.finish_reason)
    assert len({len(r.tokens) for r in together}) > 2 and together[0].stop_sequence == stop


@pytest.mark.parametrize("verify", ["rejection", "match"])
def test_seeded_rows_sample_what_they_sample_alone(pairs, verify):
    target, drafter, tokenizer = pairs["llama"]
    settings = dict(max_tokens=60, eos_token_ids=[], temperature=0.9, top_p=0.95, seed=5, verify=verify, logprobs=2)
    together = batch_generate(target, drafter, tokenizer, MANY, **settings)
    for prompt, result in zip(MANY, together):
        solo = generate(target, drafter, tokenizer, prompt, **settings)
        assert result.tokens == solo.tokens
        assert result.logprobs == pytest.approx(solo.logprobs, abs=1e-4)


def test_a_target_that_does_not_batch_runs_its_rows_one_after_another(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    assert not Batch.fits(target, make_cache(target, drafter, window=32))
    results = batch_generate(target, drafter, tokenizer, PROMPTS, max_tokens=40, eos_token_ids=[], window=32)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == generate(target, drafter, tokenizer, prompt, max_tokens=40, eos_token_ids=[],
                                         window=32).tokens
    with pytest.raises(DFlashError, match="cache of its own"):
        batch_generate(target, drafter, tokenizer, PROMPTS, cache=make_cache(target, drafter))
    with pytest.raises(DFlashError, match="prefill of its own"):
        batch_generate(target, drafter, tokenizer, PROMPTS, prompt_progress_callback=lambda done, total: None)


def test_a_row_that_leaves_holds_its_history_and_goes_on_alone(pairs):
    """Join three rows, run cycles, take one out mid-way: its cache holds exactly what it committed (the
    invariant), and a solo generation on that cache continues it as one uninterrupted greedy run."""
    target, drafter, tokenizer = pairs["qwen3"]
    batch, rows, ids = Batch(target), [], [tokenizer.encode(p) for p in PROMPTS]
    for prompt in ids:
        request = setup(target, drafter, tokenizer, prompt, *keyword_settings(max_tokens=MAX_TOKENS, eos_token_ids=[]))
        row = request.row
        row.first(prefill(target, drafter, row.cache, prompt, 2048, lambda done, total: None))
        batch.join(row)
        rows.append(row)
    emitted = [[row.last_id] for row in rows]
    for _ in range(6):
        for tokens, out in zip(emitted, batch.cycle()):
            tokens.extend(out.tokens)
    leaving = rows[1]
    batch.leave(leaving)
    assert len(batch) == 2 and leaving.cache.target[0].offset == len(leaving.cache.tokens)
    leaving.cache.check()
    assert leaving.cache.tokens == ids[1] + emitted[1][:-1]  # the last token is not consumed yet
    for tokens, out in zip(emitted[::2], batch.cycle()):  # the others go on without it
        tokens.extend(out.tokens)
    history = ids[1] + emitted[1]
    rest = [t for r in stream_generate(target, drafter, tokenizer, history, max_tokens=50, eos_token_ids=[],
                                       cache=leaving.cache) for t in r.tokens]
    assert emitted[1] + rest == plain_greedy(target.model, ids[1], len(emitted[1]) + 50)
    for prompt, tokens in zip(ids[::2], emitted[::2]):
        assert tokens == plain_greedy(target.model, prompt, len(tokens))


def test_the_ragged_cache_masks_each_row_to_its_own_history():
    layer = RaggedKVCache()
    for length in (3, 1):
        kv = KVCache()
        kv.update_and_fetch(mx.ones((1, 2, length, 4)), mx.ones((1, 2, length, 4)))
        layer.append(kv)
    mask = layer.make_mask(2)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    assert mask[1, 0].tolist() == [[True, True, False, False, False], [True, True, True, False, False]]
    assert layer.offset.tolist() == [3, 1]
    keys, _ = layer.update_and_fetch(mx.full((2, 2, 2, 4), 7.0), mx.full((2, 2, 2, 4), 7.0))
    assert layer.lengths == [5, 3] and keys.shape[2] == 5
    assert keys[1, 0, :, 0].tolist()[:3] == [1, 7, 7]  # row 1's block right after its one position
    layer.update_and_fetch(mx.zeros((2, 2, 300, 4)), mx.zeros((2, 2, 300, 4)))
    assert layer.keys.shape[2] == 512  # grown in steps of 256
    popped = layer.pop(0)
    assert popped.offset == 305 and layer.lengths == [303] and layer.keys.shape[0] == 1
    layer.lengths = [3]  # (as a row's trim leaves it)
    layer.append(popped)
    layer.pop(1)
    assert layer.keys.shape == (1, 2, 256, 4)  # the long row gone, the width it needed goes too


def _planned(planner: BatchPlanner, cycles: int, rows: int, acceptance: float) -> list[int]:
    """Depths the planner chooses for ``rows`` adaptive rows whose drafts are accepted at ``acceptance`` a token,
    on a batch whose cycle costs 10 ms + 1 ms a further row + 1 ms a drafting row + 1 ms a padded position."""
    policies = [AdaptiveDepth(15) for _ in range(rows)]
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(cycles):
        plans = planner.plans(policies, [policy.plan([]) for policy in policies])
        k = max(plan.depth for plan in plans)
        seconds = 0.010 + 0.001 * (rows - 1) + (0.001 * rows + 0.001 * rows * k if k else 0.0)
        accepted = [min(int(rng.geometric(1 - acceptance)) - 1, k) if acceptance else 0 for _ in policies]
        for policy, plan, a in zip(policies, plans, accepted):
            policy.observe(plan, k, a, seconds)
        planner.observe(k, seconds, sum(a + 1 for a in accepted))
        chosen.append(k)
    return chosen


def test_a_planned_copy_not_offered_falls_back_to_the_rows_own_drafter_plan():
    """The batch's depth was priced on the copy's acceptance: where the history offers none, the row drafts what its
    own policy would have (plain here), not that depth with its drafter."""
    planner = BatchPlanner()
    _planned(planner, 40, rows=2, acceptance=0.9)  # the planner now drafts
    policies = [AdaptiveDepth(15), AdaptiveDepth(15)]
    plans = planner.plans(policies, [Plan(15, COPY, 0), Plan(15, COPY, 3)])
    k = plans[0].depth
    assert k > 0 and [(p.depth, p.source, p.fallback) for p in plans] == [(k, COPY, 0), (k, COPY, min(3, k))]


def test_the_planner_drafts_the_depth_that_pays_for_the_batch_and_probes_on_a_backoff():
    """Four rows. Drafts never accepted: the batch decodes plainly, probing with one token at gaps that double to
    256. Drafts accepted at 90% a token: it drafts the depths that pay for the batch (on average within 3% of the
    best rate in hindsight), not the full block, which gives 0.83 of the best here (60 padded positions cost 60 ms)."""
    chosen = _planned(BatchPlanner(), 700, rows=4, acceptance=0.0)
    assert chosen[:3] == [15, 0, 1]  # warm-up, as a row's
    probes = [i for i, k in enumerate(chosen) if k][2:]
    assert all(chosen[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:6] == [8, 16, 32, 64, 128, 256] and set(gaps[6:]) <= {256}, gaps
    chosen = _planned(BatchPlanner(), 300, rows=4, acceptance=0.9)
    rate = [4 * (1 + 9 * (1 - 0.9**k)) / (0.013 + (0.004 + 0.004 * k if k else 0.0)) for k in range(16)]
    assert rate[15] < 0.85 * max(rate)
    got = [rate[k] / max(rate) for k in chosen[-200:]]
    assert np.mean(got) >= 0.97 and min(got) >= 0.93, chosen[-20:]


class MostlyPlain(ByLength):
    """Plain steps, but a 3-token draft where the history's length is a multiple of 7: cycles where every row is plain
    (pipelined) alternate with cycles where some row drafts."""

    def plan(self, history) -> Plan:
        return Plan(3 if len(history) % 7 == 0 else 0)


def test_pipelined_plain_cycles_stay_exact_as_rows_end_in_them(pairs, monkeypatch):
    """A plain cycle's successor starts before it is read; rows that end meanwhile (EOS, a stop string, the budget)
    are dropped from the successor, the others commit it: every row gets what it gets alone."""
    target, drafter, tokenizer = pairs["qwen3"]
    followed = []
    follow = Batch.follow
    monkeypatch.setattr(Batch, "follow", lambda self, cycle: followed.append(follow(self, cycle)) or followed[-1])
    first = generate(target, drafter, tokenizer, MANY[1], max_tokens=MAX_TOKENS, eos_token_ids=[], policy=MostlyPlain())
    eos, stop = [first.tokens[12]], tokenizer.decode(first.tokens[20:22])
    settings = dict(max_tokens=MAX_TOKENS, eos_token_ids=eos, stop=[stop], policy=MostlyPlain())
    results = batch_generate(target, drafter, tokenizer, MANY, **settings)
    alone = [generate(target, drafter, tokenizer, prompt, **settings) for prompt in MANY]
    assert [r.tokens for r in results] == [r.tokens for r in alone]
    assert [r.text for r in results] == [r.text for r in alone]
    assert len({len(r.tokens) for r in alone}) > 2  # rows ended at different cycles
    assert sum(c is not None for c in followed) > 10


def test_what_the_rows_learned_carries_over_to_the_next_generation(models_dir):
    """Each row decodes with a copy of the shared policy; when it ends, what it measured goes back, as a solo
    generation's policy carries over: the next request does not warm up again."""
    target, drafter, tokenizer = load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"))  # a fresh planner
    policy = AdaptiveDepth(15)
    assert not policy.costs.ready
    batch_generate(target, drafter, tokenizer, PROMPTS, max_tokens=40, eos_token_ids=[], policy=policy)
    assert policy.costs.ready


def test_a_batch_decodes_plainly_where_its_drafts_do_not_pay(pairs):
    """The random drafter never agrees: the batch's cycles go plain, and every row's output is still exact."""
    target, drafter, tokenizer = pairs["qwen3"]
    results = batch_generate(target, drafter, tokenizer, MANY, max_tokens=MAX_TOKENS, eos_token_ids=[],
                             draft_source="drafter")
    for prompt, result in zip(MANY, results):
        assert result.tokens == plain_greedy(target.model, tokenizer.encode(prompt), MAX_TOKENS)
    plain = sum(d == 0 for r in results for d in r.drafted)
    assert plain > 0.8 * sum(len(r.drafted) for r in results)


def test_what_the_batch_planner_measured_carries_over_to_the_next_call(models_dir):
    """The planner's first batch measures a full block of every row (the dearest cycle of a batch); the next call of
    the same loaded pair starts from what it measured, as a generation starts from the shared adaptive policy."""
    target, drafter, tokenizer = load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"))  # a fresh planner
    first = batch_generate(target, drafter, tokenizer, MANY, max_tokens=24, eos_token_ids=[])
    again = batch_generate(target, drafter, tokenizer, MANY, max_tokens=24, eos_token_ids=[])
    assert all(r.drafted[0] == 15 for r in first)  # the first cycle: a full block, every row
    assert all(r.drafted[0] < 15 for r in again)
    for prompt, result in zip(MANY, again):
        assert result.tokens == plain_greedy(target.model, tokenizer.encode(prompt), 24)


def test_a_windowed_layer_attends_each_row_as_its_ring_does():
    """Rows of a sliding-window layer joined from their rings: a block attends in the batch exactly as in each row's
    own ring, and the keys handed to attention start at the shortest row's window, not at position 0."""
    window, heads, dim, block = 8, 2, 4, 3
    rings, layer = [], RaggedKVCache(window)
    for length in (20, 25, 23):
        ring = WindowKVCache(window, 0, slack=4)
        for start in range(0, length, 5):
            k = mx.random.normal((1, heads, min(5, length - start), dim))
            ring.update_and_fetch(k, -k)
        rings.append(ring)
        layer.append(ring)
    new, query = mx.random.normal((3, heads, block, dim)), mx.random.normal((3, heads, block, dim))
    mask = layer.make_mask(block)
    keys, values = layer.update_and_fetch(new, new)
    assert keys.shape[2] == 25 + block - (20 - window + 1)  # from position 13: the shortest row's window
    together = mx.fast.scaled_dot_product_attention(query, keys, values, scale=0.5, mask=mask)
    for i, ring in enumerate(rings):
        mask = ring.make_mask(block)
        k, v = ring.update_and_fetch(new[i : i + 1], new[i : i + 1])
        alone = mx.fast.scaled_dot_product_attention(query[i : i + 1], k, v, scale=0.5, mask=mask)
        assert mx.allclose(together[i : i + 1], alone, atol=1e-5)
    assert isinstance(layer.pop(1), WindowKVCache) and layer.lengths == [23, 26]
