"""Rows decoded together (``dflash_mlx.batch``): each row's output is what it would be alone, whatever the others do."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from conftest import MAX_TOKENS, PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, generate, stream_generate
from dflash_mlx.batch import Batch, BatchGate, RaggedKVCache, batch_generate
from dflash_mlx.caches import make_cache
from dflash_mlx.generate import prefill, setup

# Prompts of different lengths: the rows' histories differ in length from the first cycle on.
MANY = PROMPTS + ["hi", "A much longer prompt that runs on for a while, so that its row is longer than the others"]


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [None, 4, 16])
def test_every_row_is_its_own_greedy_decoding(pairs, name, block_size):
    target, drafter, tokenizer = pairs[name]
    results = batch_generate(target, drafter, tokenizer, MANY, max_tokens=MAX_TOKENS, eos_token_ids=[],
                             block_size=block_size)
    for prompt, result in zip(MANY, results):
        assert result.tokens == plain_greedy(target.model, tokenizer.encode(prompt), MAX_TOKENS), prompt
    if block_size is None:  # copies and plain steps side by side: the rows' depths differed
        assert len({tuple(r.drafted) for r in results}) > 1


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
        request = setup(target, drafter, tokenizer, prompt, max_tokens=MAX_TOKENS, eos_token_ids=[])
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


def test_the_gate_holds_drafting_back_where_it_does_not_pay_and_retries_on_a_backoff():
    """Synthetic cycles of a 4-row batch: a plain cycle 10 ms for 4 tokens; drafting 30 ms for 5 tokens loses."""
    gate = BatchGate()

    def run(cycles: int, drafting_tokens: int) -> list[bool]:
        seen = []
        for _ in range(cycles):
            allowed = gate.allows()
            seen.append(allowed)
            gate.observe(allowed, allowed, drafting_tokens if allowed else 4, 0.030 if allowed else 0.010)
        return seen

    assert gate.allows()  # nothing measured: the rows' policies decide
    gate.observe(True, True, 5, 0.030)
    gate.observe(True, False, 4, 0.010)  # the rows' own warm-up brings a plain cycle
    seen = run(600, drafting_tokens=5)
    retries = [i for i, allowed in enumerate(seen) if allowed]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps[:5] == [17, 33, 65, 129, 257] and set(gaps[5:]) <= {257}  # 16, 32, ... plain cycles between
    assert sum(seen) / len(seen) < 0.02
    # Acceptance recovers (whole blocks: 64 tokens a cycle): the next retry wins and drafting goes on.
    while not gate.allows():
        gate.observe(False, False, 4, 0.010)
    assert all(run(50, drafting_tokens=64))


def test_a_batch_decodes_plainly_where_its_drafts_do_not_pay(pairs):
    """The random drafter never agrees: the batch's cycles go plain, and every row's output is still exact."""
    target, drafter, tokenizer = pairs["qwen3"]
    results = batch_generate(target, drafter, tokenizer, MANY, max_tokens=MAX_TOKENS, eos_token_ids=[],
                             draft_source="drafter")
    for prompt, result in zip(MANY, results):
        assert result.tokens == plain_greedy(target.model, tokenizer.encode(prompt), MAX_TOKENS)
    plain = sum(d == 0 for r in results for d in r.drafted)
    assert plain > 0.8 * sum(len(r.drafted) for r in results)
