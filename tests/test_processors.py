"""mlx-lm's logits processors under speculation: applied at every verified position with its own history, exactly."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import MAX_TOKENS
from helpers import plain_greedy
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import generate
from dflash_mlx.decode.generate import batch_generate

SETTINGS = {
    "repetition": dict(repetition_penalty=1.3, repetition_context_size=3),
    "presence": dict(presence_penalty=0.7, presence_context_size=5),
    "frequency": dict(frequency_penalty=0.4, frequency_context_size=30),
    "bias": "loop",  # the looping target's loop token pushed down
    "all": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2),
}


def _processors(name: str, loop_token: int):
    spec = SETTINGS[name]
    return make_logits_processors(logit_bias={loop_token: -3.0}) if spec == "loop" else make_logits_processors(**spec)


# Each processor at one block and source, and all of them together at every block and source.
CASES = [("repetition", None, "auto"), ("presence", 4, "drafter"), ("frequency", 16, "copy"), ("bias", 16, "drafter"),
         ("all", None, "auto"), ("all", 4, "drafter"), ("all", 16, "drafter"), ("all", 16, "copy")]


@pytest.mark.parametrize("name,block_size,source", CASES)
def test_greedy_with_processors_is_mlx_lms(looping, name, block_size, source):
    """The looping pair: its drafter drafts the loop token, copies follow the loop; each processor changes the
    reply, and dflash's equals mlx-lm's greedy decoding with the same processors at every block and source."""
    target, drafter, tokenizer, ids, ref, loop_token = looping
    processors = _processors(name, loop_token)
    expected = plain_greedy(target.model, ids, MAX_TOKENS, logits_processors=processors)
    assert expected != ref  # the processors change the reply
    run = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size, eos_token_ids=[],
                   draft_source=source, logits_processors=processors)
    assert run.tokens == expected


def test_drafts_accepted_under_a_history_dependent_processor(looping):
    """Accepted blocks with a penalty that depends on each position's history: a position judged with the
    committed history only (not the drafts before it in the block) would diverge from mlx-lm."""
    target, drafter, tokenizer, ids, _, loop_token = looping
    processors = make_logits_processors(repetition_penalty=1.05, repetition_context_size=4)
    expected = plain_greedy(target.model, ids, MAX_TOKENS, logits_processors=processors)
    run = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, eos_token_ids=[], block_size=16,
                   draft_source="copy", logits_processors=processors)
    assert run.tokens == expected
    assert max(run.acceptance) >= 3, run.acceptance


def test_a_batch_applies_each_rows_own_processors(pairs):
    """Rows with different processors (and one with none) in one batch: each equals mlx-lm's with its own."""
    target, drafter, tokenizer = pairs["qwen3"]
    prompts = ["the first row", "a second, longer row of the batch", "third"]
    settings = [dict(repetition_penalty=1.5), dict(logit_bias={5: 4.0, 7: -2.0}), None]
    for prompt, spec in zip(prompts, settings):
        processors = make_logits_processors(**spec) if spec else None
        results = batch_generate(target, drafter, tokenizer, [prompt, prompts[1]], max_tokens=MAX_TOKENS,
                                 eos_token_ids=[], logits_processors=processors)
        for p, result in zip([prompt, prompts[1]], results):
            assert result.tokens == plain_greedy(target.model, tokenizer.encode(p), MAX_TOKENS,
                                                 logits_processors=processors)


def test_logprobs_are_of_the_processed_distribution(looping):
    """As mlx-lm reports them: each token's log-probability after the processors."""
    target, drafter, tokenizer, ids, _, loop_token = looping
    processors = make_logits_processors(repetition_penalty=1.3, logit_bias={loop_token: -1.0})
    run = generate(target, drafter, tokenizer, ids, max_tokens=12, eos_token_ids=[], logprobs=0,
                   logits_processors=processors)
    steps = list(generate_step(mx.array(ids), target.model, max_tokens=12, logits_processors=processors))
    assert run.tokens == [int(t) for t, _ in steps]
    for lp, (token, logprobs) in zip(run.logprobs, steps):
        assert lp == pytest.approx(logprobs[int(token)].item(), abs=1e-4)


def test_seeded_sampling_with_processors_is_the_same_at_any_depth(looping):
    """Seeded (position-keyed) sampling draws from the processed distribution at every position: the same tokens
    whatever the depth, and not those drawn without the processors."""
    target, drafter, tokenizer, ids, _, loop_token = looping
    processors = make_logits_processors(repetition_penalty=1.4, presence_penalty=0.5)
    runs = [generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, eos_token_ids=[], temperature=0.8,
                     seed=3, verify="match", block_size=b, logits_processors=processors).tokens for b in (1, 4, 16)]
    assert runs[0] == runs[1] == runs[2]
    bare = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, eos_token_ids=[], temperature=0.8, seed=3,
                    verify="match", block_size=1).tokens
    assert bare != runs[0]
