"""`draft_window`: the drafter attends to the last N context positions, the target to all of them; lossless at every
N, and a long prompt's head never runs through the drafter."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import MAX_TOKENS, PROMPTS
from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import DFlashError, batch_generate, generate, load, make_cache
from dflash_mlx.chat_template import render
from dflash_mlx.cli.main import app
from dflash_mlx.decode.cycle import prefill
from dflash_mlx.models.caches import WindowKVCache
from dflash_mlx.server.prompt_cache import CacheLimits, PromptCache

BLOCK = 4


def _long(tokenizer, repeats: int = 6) -> list[int]:
    return tokenizer.encode(" ".join(PROMPTS * repeats))


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [BLOCK, None])  # None: the adaptive policy
@pytest.mark.parametrize("draft_window", [16, 32, 0])
def test_greedy_equals_plain_at_every_draft_window(pairs, name, block_size, draft_window):
    target, drafter, tokenizer = pairs[name]
    long_prompt = _long(tokenizer)
    assert len(long_prompt) > 3 * 32  # a prompt whose head the drafter never sees, prefilled in chunks
    for ids in (tokenizer.encode(PROMPTS[0]), long_prompt):
        out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size,
                       eos_token_ids=[], draft_window=draft_window, prefill_step_size=24)
        assert out.tokens == plain_greedy(target.model, ids, MAX_TOKENS)


@pytest.mark.parametrize("draft_window", [16, 24])
def test_accepted_runs_stay_lossless_under_a_drafter_window(looping, draft_window):
    """A pair whose drafts are accepted: rollbacks mid-block on the drafter's ring, the target's full cache."""
    target, drafter, tokenizer, ids, ref, _ = looping
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=16, eos_token_ids=[],
                   draft_window=draft_window)
    assert out.tokens == ref and out.tau > 1.5


def test_the_prompt_head_is_pruned_and_drafts_are_those_of_the_whole_window(pairs):
    """After a long prompt the drafter's caches skipped all but the positions its window still sees (at most N - 1
    pending), and the next draft's logits equal those of a ring that absorbed every position of the prompt."""
    target, drafter, tokenizer = pairs["llama"]
    ids, window = _long(tokenizer), 32
    pruned = make_cache(target, drafter, block_size=BLOCK, draft_window=window)
    pruned.begin(ids)
    logits = prefill(target, drafter, pruned, ids, 24, lambda done, total: None)
    pruned.check()
    assert pruned.pending <= window - 1 and all(c.first >= len(ids) - window for c in pruned.drafter)

    whole = [WindowKVCache(window, 0, slack=2 * BLOCK) for _ in drafter.layers]
    _, features = target(mx.array(ids)[None], target.make_cache(), last_logits_only=True, undoable=False)
    drafter.add_context(features, whole)
    last = mx.argmax(logits, -1)
    got = drafter.draft_logits(target, last, pruned.context, pruned.drafter, BLOCK - 1)
    want = drafter.draft_logits(target, last, None, whole, BLOCK - 1)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    full = make_cache(target, drafter, block_size=BLOCK, draft_window=0)
    full.begin(ids)
    prefill(target, drafter, full, ids, 24, lambda done, total: None)
    assert not np.allclose(np.array(drafter.draft_logits(target, last, full.context, full.drafter, BLOCK - 1)),
                           np.array(want), atol=1e-4)  # the window is real: the whole context drafts otherwise


def test_a_rewind_beyond_the_ring_remakes_the_drafters_context(pairs):
    """A second prompt that leaves the first far back (a client resending a conversation whose reply it edited):
    the target keeps the common part, the drafter's context is made again from it, and the drafts are those of a
    cache that prefilled the second prompt cold."""
    target, drafter, tokenizer = pairs["qwen3"]
    first, window = _long(tokenizer), 32
    second = first[: len(first) // 2] + tokenizer.encode(" and then something else entirely")
    cache = make_cache(target, drafter, block_size=BLOCK, draft_window=window)
    generate(target, drafter, tokenizer, first, max_tokens=MAX_TOKENS, cache=cache, block_size=BLOCK,
             draft_window=window)
    out = generate(target, drafter, tokenizer, second, max_tokens=MAX_TOKENS, cache=cache, block_size=BLOCK,
                   eos_token_ids=[], draft_window=window)
    cache.check()
    assert out.prompt_cached == len(first) // 2 and out.tokens == plain_greedy(target.model, second, MAX_TOKENS)

    rewound = make_cache(target, drafter, block_size=BLOCK, draft_window=window)
    rewound.begin(first)
    prefill(target, drafter, rewound, first, 24, lambda done, total: None)
    reused, _ = rewound.begin(second)
    rewound.check()
    cold = make_cache(target, drafter, block_size=BLOCK, draft_window=window)
    cold.begin(second)
    prefill(target, drafter, cold, second[:reused], 24, lambda done, total: None)
    last = mx.array([second[reused]])
    got = drafter.draft_logits(target, last, rewound.context, rewound.drafter, BLOCK - 1)
    want = drafter.draft_logits(target, last, cold.context, cold.drafter, BLOCK - 1)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_rows_with_a_drafter_window_batch_and_stay_lossless(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    prompts = [_long(tokenizer, 3), tokenizer.encode(PROMPTS[1]), _long(tokenizer, 5)]
    results = batch_generate(target, drafter, tokenizer, prompts, max_tokens=MAX_TOKENS, eos_token_ids=[],
                             block_size=BLOCK, draft_window=16)
    assert [r.tokens for r in results] == [plain_greedy(target.model, p, MAX_TOKENS) for p in prompts]


def test_a_shared_system_prompt_still_serves_a_new_conversation(pairs):
    """The server's prompt cache: a drafter window leaves the target rewindable, so another conversation resumes
    from the common system prompt (the drafter's context made again), and its reply is plain decoding's."""
    target, drafter, tokenizer = pairs["qwen3"]
    store = PromptCache(make_cache(target, drafter, block_size=BLOCK, draft_window=16), CacheLimits(), None)
    assert store.cache.rewindable
    shared = "A long instruction every conversation starts with. " * 12
    for question in ("first", "second"):
        ids = render(tokenizer, [{"role": "system", "content": shared}, {"role": "user", "content": question}])
        store.prepare(ids)
        out = generate(target, drafter, tokenizer, ids, max_tokens=12, cache=store.cache, block_size=BLOCK,
                       eos_token_ids=[], draft_window=16,
                       prompt_progress_callback=lambda done, total: done == total and store.prompt_done())
        store.keep()
        store.cache.check()
        assert out.tokens == plain_greedy(target.model, ids, 12)
    assert out.prompt_cached >= len(tokenizer.encode(shared)) - 1


def test_a_snapshot_keeps_its_drafter_window(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    ids = _long(tokenizer)
    cache = make_cache(target, drafter, block_size=BLOCK, draft_window=16)
    generate(target, drafter, tokenizer, ids, max_tokens=8, cache=cache, block_size=BLOCK, draft_window=16)
    state = cache.snapshot()
    assert state.draft_window == 16
    with pytest.raises(DFlashError, match="draft_window=16"):
        make_cache(target, drafter, block_size=BLOCK, draft_window=32).restore(state)
    again = make_cache(target, drafter, block_size=BLOCK, draft_window=16)
    again.restore(state)
    follow = state.tokens + tokenizer.encode(PROMPTS[2])
    out = generate(target, drafter, tokenizer, follow, max_tokens=MAX_TOKENS, cache=again, block_size=BLOCK,
                   eos_token_ids=[], draft_window=16)
    assert out.prompt_cached == len(state.tokens) and out.tokens == plain_greedy(target.model, follow, MAX_TOKENS)
    with pytest.raises(DFlashError, match="cache was made for"):
        generate(target, drafter, tokenizer, follow, max_tokens=4, cache=again, block_size=BLOCK, draft_window=32)


@pytest.mark.parametrize("value,match", [(-1, "integer >= 0"), (3, r"at least the block size \(4\)")])
def test_a_bad_draft_window_is_refused(pairs, value, match):
    target, drafter, tokenizer = pairs["qwen3"]
    with pytest.raises(DFlashError, match=match):
        generate(target, drafter, tokenizer, PROMPTS[0], max_tokens=4, block_size=BLOCK, draft_window=value)


def test_the_commands_take_it_and_a_bundle_keeps_its_own(models_dir, tmp_path):
    runner = CliRunner()
    draft, target = str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3")
    bad = runner.invoke(app, ["generate", draft, "--target", target, "-p", "hi", "--draft-window", "-2"])
    assert bad.exit_code == 2 and "draft window must be an integer >= 0" in bad.output
    small = runner.invoke(app, ["generate", draft, "--target", target, "-p", "hi", "-m", "4", "--draft-window", "8"])
    assert small.exit_code == 2 and "at least the block size (16)" in small.output
    ok = runner.invoke(app, ["generate", draft, "--target", target, "-p", "hi", "-m", "4", "--draft-window", "16"])
    assert ok.exit_code == 0, ok.output

    bundle = tmp_path / "bundle"
    made = runner.invoke(app, ["convert", draft, "--target", target, "--out", str(bundle), "--draft-window", "64"])
    assert made.exit_code == 0, made.output
    assert json.loads((bundle / "dflash.json").read_text())["draft_window"] == 64
    _, loaded, _ = load(str(bundle))
    assert loaded.context_window == 64
    cache = make_cache(*load(str(bundle))[:2])
    assert {c.window for c in cache.drafter} == {64}
    assert {type(c).__name__ for c in make_cache(*load(str(bundle))[:2], draft_window=0).drafter} == {"KVCache"}
