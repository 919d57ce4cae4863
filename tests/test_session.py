"""Caches carried across calls (chat turns): only new prompt tokens are prefilled, output stays exact."""

from __future__ import annotations

import pytest
from conftest import PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, generate, load, make_cache
from dflash_mlx.models import fixtures


def _turns(target, drafter, tokenizer, block_size, window=None, eos=(), max_tokens=60):
    """Three turns; each prompt is the previous prompt + reply + a new message."""
    cache = make_cache(target, drafter, window=window, block_size=block_size)
    history: list[int] = []
    for turn, message in enumerate(PROMPTS):
        prompt = history + tokenizer.encode(message)
        before = list(cache.tokens)
        out = generate(target, drafter, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size,
                       eos_token_ids=list(eos), window=window, cache=cache)
        cache.check()
        ref_cache = target.make_cache(window, 0, 1) if window else None
        assert out.tokens == plain_greedy(target.model, prompt, max_tokens, eos=eos, prompt_cache=ref_cache), f"turn {turn}"
        assert out.prompt_cached == len(before) and prompt[: len(before)] == before
        if turn:
            assert out.prompt_cached >= len(history) - 1  # all but at most the last reply token was reused
        history = prompt + out.tokens
        assert history[: len(cache.tokens)] == cache.tokens
    return cache


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_turns_reuse_the_cache(pairs, name, block_size):
    target, drafter, tokenizer = pairs[name]
    _turns(target, drafter, tokenizer, block_size)


def test_turns_with_window(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    _turns(target, drafter, tokenizer, 8, window=32)


@pytest.mark.parametrize("block_size", [4, 16])
def test_turn_ending_at_eos_inside_accepted_run(looping, block_size):
    """EOS drafted and accepted mid-block: the caches must not keep the EOS or what follows it."""
    target, drafter, tokenizer, ids, ref, loop_token = looping
    cache = make_cache(target, drafter, block_size=block_size)
    out = generate(target, drafter, tokenizer, ids, max_tokens=200, block_size=block_size,
                   eos_token_ids=[loop_token], cache=cache)
    assert out.finish_reason == "stop"
    cache.check()
    assert cache.tokens == ids + out.tokens
    follow = ids + out.tokens + tokenizer.encode(" and then")
    out2 = generate(target, drafter, tokenizer, follow, max_tokens=80, block_size=block_size, eos_token_ids=[], cache=cache)
    cache.check()
    assert out2.prompt_cached == len(ids + out.tokens)
    assert out2.tokens == plain_greedy(target.model, follow, 80)


def test_hybrid_turns(tmp_path):
    config = fixtures.target_config("qwen3_5")
    fixtures.write_target(tmp_path / "t", config)
    fixtures.write_drafter(tmp_path / "d", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    target, drafter, tokenizer = load(str(tmp_path / "d"), str(tmp_path / "t"))
    _turns(target, drafter, tokenizer, 8)


def test_different_history_starts_over(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    cache = make_cache(target, drafter, block_size=4)
    generate(target, drafter, tokenizer, PROMPTS[0], max_tokens=10, block_size=4, cache=cache)
    cache.check()
    ids = tokenizer.encode(PROMPTS[1])
    out = generate(target, drafter, tokenizer, ids, max_tokens=30, block_size=4, eos_token_ids=[], cache=cache)
    cache.check()
    assert out.prompt_cached == 0 and out.tokens == plain_greedy(target.model, ids, 30)


def test_cache_settings_must_match(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    cache = make_cache(target, drafter, window=32, block_size=4)
    with pytest.raises(DFlashError, match="cache was made for"):
        generate(target, drafter, tokenizer, "hi", block_size=4, cache=cache)


def test_diverging_history_keeps_the_common_beginning(pairs):
    """A prompt that shares only a beginning with the cached history: full-attention caches go back to
    it (no new prefill of that part) and the output is still plain greedy decoding."""
    target, drafter, tokenizer = pairs["qwen3"]
    cache = make_cache(target, drafter, block_size=4)
    first = tokenizer.encode(PROMPTS[0])
    out = generate(target, drafter, tokenizer, first, max_tokens=20, block_size=4, eos_token_ids=[], cache=cache)
    ids = first + out.tokens[:5] + tokenizer.encode(" and then")  # diverges after 5 of the reply's tokens
    out2 = generate(target, drafter, tokenizer, ids, max_tokens=30, block_size=4, eos_token_ids=[], cache=cache)
    cache.check()
    assert out2.prompt_cached == len(first) + 5
    assert out2.tokens == plain_greedy(target.model, ids, 30)
