"""Every architecture of the published drafters' targets: lossless, built and loaded from disk."""

from __future__ import annotations

import collections

import mlx.core as mx
import numpy as np
import pytest
from conftest import MAX_TOKENS, PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, Target, generate, load, make_cache, stream_generate
from dflash_mlx.decode.batch import Batch
from dflash_mlx.decode.cycle import prefill
from dflash_mlx.decode.generate import batch_generate, keyword_settings, setup
from dflash_mlx.models import fixtures
from dflash_mlx.models.caches import RecurrentCache, trim_to
from dflash_mlx.models.target import is_tested

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
ARCHS = {
    "qwen3_5": {},
    "qwen3_5_moe": {},
    "qwen3_moe": {},
    "qwen3_next": {},
    "gpt_oss": {},  # sliding window 8, far smaller than the generation
    "llama": {"rope_scaling": LLAMA3_SCALING},
}


@pytest.fixture(scope="module")
def arch_pairs(tmp_path_factory) -> dict:
    """Per architecture: a varied target with a random drafter, a looping target with a drafter of its loop
    token, and a target whose reply repeats its own phrases (copy drafts) with the random drafter."""
    root = tmp_path_factory.mktemp("archs")
    pairs = {}
    for name, extra in ARCHS.items():
        config = fixtures.target_config(name, **extra)
        draft_config = fixtures.drafter_config(config, 2, target_layer_ids=[0, 2])
        fixtures.write_target(root / name, config, seed=7)
        fixtures.write_drafter(root / f"{name}-random", draft_config)
        pairs[name, "random"] = load(str(root / f"{name}-random"), str(root / name))

        fixtures.write_target(root / f"{name}-loop", config, seed=7, init_scale=1.0)
        target, _, tokenizer = load(str(root / f"{name}-random"), str(root / f"{name}-loop"))
        ref = plain_greedy(target.model, tokenizer.encode(PROMPTS[1]), MAX_TOKENS)
        token = collections.Counter(ref).most_common(1)[0][0]
        fixtures.write_constant_drafter(root / f"{name}-constant", draft_config, root / f"{name}-loop", token)
        pairs[name, "constant"] = load(str(root / f"{name}-constant"), str(root / f"{name}-loop"))
        fixtures.write_target(root / f"{name}-repeating", config, seed=7, init_scale=0.3)
        pairs[name, "repeating"] = load(str(root / f"{name}-random"), str(root / f"{name}-repeating"))
    return pairs


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("block_size", [4, 16, None])  # None: the adaptive policy
def test_lossless_with_random_drafter(arch_pairs, name, block_size):
    """Most blocks are rejected at once: many cycles, every rollback path from the first token."""
    target, drafter, tokenizer = arch_pairs[name, "random"]
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        ref = plain_greedy(target.model, ids, MAX_TOKENS)
        out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size, eos_token_ids=[])
        assert out.tokens == ref, f"{name} B={block_size} {prompt!r}"


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("block_size", [4, 16, None])
def test_lossless_with_accepted_drafts(arch_pairs, name, block_size):
    target, drafter, tokenizer = arch_pairs[name, "constant"]
    ids = tokenizer.encode(PROMPTS[1])
    ref = plain_greedy(target.model, ids, MAX_TOKENS)
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size, eos_token_ids=[])
    assert out.tokens == ref
    if block_size is not None:  # the adaptive policy may find plain decoding faster on this machine
        assert max(out.acceptance) >= 1  # some blocks were partly accepted, so rollbacks kept a prefix


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("block_size", [4, 16])
def test_lossless_with_copy_drafts(arch_pairs, name, block_size):
    """Copy drafts of the looping reply, verified and rolled back by every kind of cache (sliding windows,
    recurrent layers); the drafter's context, fed through the copy cycles, drafts exactly afterwards."""
    target, drafter, tokenizer = arch_pairs[name, "repeating"]
    ids = tokenizer.encode(PROMPTS[1])
    ref = plain_greedy(target.model, ids, MAX_TOKENS)
    cache = make_cache(target, drafter, block_size=block_size)
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size, eos_token_ids=[],
                   draft_source="copy", cache=cache)
    assert out.tokens == ref
    assert out.by_source["copy"]["accepted"] >= 1
    cache.check()
    follow = ids + out.tokens
    again = generate(target, drafter, tokenizer, follow, max_tokens=16, block_size=block_size, eos_token_ids=[],
                     cache=cache)
    assert again.tokens == plain_greedy(target.model, follow, 16) and again.by_source["drafter"]["cycles"] > 0


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("step_states", [True, False], ids=["per-step", "replay"])
def test_recurrent_rollback_equals_fresh_run(arch_pairs, name, step_states):
    """After verifying 16 tokens and keeping k, every layer's state equals a run over just those k.

    Both methods: the per-step states the verify kept (CPU), and rerunning the
    recurrence over the kept tokens (what the fused Metal kernel path uses).
    """
    target, _, _ = arch_pairs[name, "random"]
    prompt = mx.array([[5, 9, 17, 33, 2, 71]])
    block = mx.array([[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]])
    for keep in range(0, 17):
        verified = target.make_cache()
        for c in verified:
            if isinstance(c, RecurrentCache):
                c.step_states = step_states
        target(prompt, verified)
        target(block, verified)
        trim_to(verified, verified[0].offset - (16 - keep))
        fresh = target.make_cache()
        target(prompt, fresh)
        if keep:
            target(block[:, :keep], fresh)
        for a, b in zip(verified, fresh):
            if isinstance(a, RecurrentCache):
                for x, y in zip(a.cache, b.cache):
                    np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5)
            else:
                assert a.offset == b.offset
        # And the next step from the rolled-back state gives the same logits.
        nxt = mx.array([[60, 61]])
        np.testing.assert_allclose(np.array(target(nxt, verified)[0]), np.array(target(nxt, fresh)[0]), rtol=1e-4, atol=1e-4)
    assert any(isinstance(c, RecurrentCache) for c in verified)


def test_gpt_oss_sliding_layers_roll_back(arch_pairs):
    """gpt-oss keeps its own 8-token window (in a cache that can roll back), even with a larger user window."""
    target, drafter, tokenizer = arch_pairs["gpt_oss", "random"]
    assert target.kinds == ["sliding", "full"] * 2
    caches = target.make_cache(window=64, slack=16)
    assert [getattr(c, "window", None) for c in caches] == [8, 64, 8, 64]
    ids = tokenizer.encode(PROMPTS[0])
    ref = plain_greedy(target.model, ids, MAX_TOKENS, prompt_cache=target.make_cache(64, 0, 1))
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=16, eos_token_ids=[], window=64)
    assert out.tokens == ref


@pytest.mark.parametrize("name", ["qwen3_5", "gpt_oss"])
def test_logits_equal_model_forward(arch_pairs, name):
    target, _, _ = arch_pairs[name, "random"]
    tokens = mx.array([[5, 17, 42, 99, 3, 250, 7]])
    ours, theirs = target.make_cache(), target.model.make_cache()
    for chunk in (tokens[:, :4], tokens[:, 4:]):
        np.testing.assert_allclose(
            np.array(target(chunk, ours)[0]), np.array(target.model(chunk, cache=theirs)), rtol=1e-5, atol=1e-5
        )


def test_an_architecture_mlx_lm_lacks_is_named(tmp_path, models_dir):
    config = fixtures.target_config("qwen3")
    fixtures.write_target(tmp_path / "t", config)
    (tmp_path / "t" / "config.json").write_text((tmp_path / "t" / "config.json").read_text().replace('"qwen3"', '"qwen9"'))
    with pytest.raises(DFlashError, match=r"^target architecture 'qwen9' is not an mlx-lm model"):
        load(str(models_dir / "qwen3-dflash"), str(tmp_path / "t"))


def test_a_cache_that_cannot_roll_back_is_refused_naming_layer_and_type(tmp_path):
    """Llama 4's chunked attention cache drops a chunk's keys when the next one starts: a rollback across that point
    would need them. Refused before any weight runs, in one line."""
    text = dict(fixtures._TEXT, model_type="llama4_text", attention_bias=False, attention_chunk_size=8,
                interleave_moe_layer_step=2, intermediate_size_mlp=128, num_experts_per_tok=1, num_local_experts=2,
                rope_scaling=None, rope_theta=10000.0, use_qk_norm=True)
    config = fixtures.target_config("llama4", text_config=text)
    fixtures.write_target(tmp_path / "t", config, seed=3)
    fixtures.write_drafter(tmp_path / "d", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    with pytest.raises(DFlashError, match=r"^this llama4 target keeps a ChunkedKVCache for its layer 0, which cannot "
                                          r"take back rejected drafts: dflash-mlx cannot run it$"):
        load(str(tmp_path / "d"), str(tmp_path / "t"))


def test_an_untested_architecture_runs_after_its_self_check(tmp_path):
    """StarCoder2 is not among the architectures tested here: it loads (its self-check passes) and is lossless."""
    config = fixtures.target_config("starcoder2")
    assert not is_tested("starcoder2")
    fixtures.write_target(tmp_path / "t", config, seed=7)
    fixtures.write_drafter(tmp_path / "d", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    target, drafter, tokenizer = load(str(tmp_path / "d"), str(tmp_path / "t"))
    ids = tokenizer.encode(PROMPTS[0])
    out = generate(target, drafter, tokenizer, ids, max_tokens=40, block_size=16, eos_token_ids=[])
    assert out.tokens == plain_greedy(target.model, ids, 40)


def test_the_self_check_refuses_caches_that_do_not_roll_back(arch_pairs):
    """What the self-check sees when a rollback leaves what it should have undone: it refuses in one line."""
    target, drafter, _ = arch_pairs["qwen3_5", "random"]

    class Forgetful(Target):  # a rollback that keeps everything
        def rewind(self, caches, length):
            pass

    with pytest.raises(DFlashError, match=r"does not give its own logits back after a rolled-back verify"):
        Forgetful(target.model, drafter.target_layer_ids).self_check()
    Target(target.model, drafter.target_layer_ids).self_check()


# Rows of different lengths and acceptances, decoded together (``dflash_mlx.decode.batch``): sliding-window layers and the
# recurrent layers of the hybrid targets undo each row's part of a verify alone.
BATCHED = ["qwen3_5", "qwen3_next", "gpt_oss"]
BATCH_PROMPTS = PROMPTS + ["hi", "A much longer prompt that runs on for a while, so that its row is longer"]


@pytest.mark.parametrize("name", BATCHED)
def test_rows_decoded_together_are_each_their_own_greedy_decoding(arch_pairs, name):
    """Copies of each row's own repeats: whole blocks accepted in one row, a part or none in the others."""
    target, drafter, tokenizer = arch_pairs[name, "repeating"]
    settings = dict(max_tokens=MAX_TOKENS, eos_token_ids=[], block_size=16, draft_source="copy")
    together = batch_generate(target, drafter, tokenizer, BATCH_PROMPTS, **settings)
    for prompt, result in zip(BATCH_PROMPTS, together):
        solo = generate(target, drafter, tokenizer, prompt, **settings)
        assert result.tokens == solo.tokens == plain_greedy(target.model, tokenizer.encode(prompt), MAX_TOKENS)
        assert result.acceptance == solo.acceptance  # cycle for cycle, what the row accepts alone
    acceptances = [a for result in together for a in result.acceptance]
    assert max(acceptances) == 15 and min(acceptances) == 0 and set(range(2, 15)) & set(acceptances)


@pytest.mark.parametrize("name", BATCHED)
@pytest.mark.parametrize("step_states", [True, False], ids=["per-step", "replay"])
def test_a_row_leaves_the_batch_with_the_caches_it_had_alone(arch_pairs, name, step_states):
    """Mid-way out of a batch, a row holds a ring for its sliding layers and its own recurrent states (taken back
    from the per-step states the verify kept, or by rerunning the recurrence, the Metal path), and goes on alone as
    one uninterrupted greedy run; the rows left go on exact."""
    target, drafter, tokenizer = arch_pairs[name, "repeating"]
    settings = dict(max_tokens=MAX_TOKENS, eos_token_ids=[], block_size=16, draft_source="copy")
    batch, rows, ids = Batch(target), [], [tokenizer.encode(p) for p in BATCH_PROMPTS]
    for prompt in ids:
        row = setup(target, drafter, tokenizer, prompt, *keyword_settings(**settings)).row
        for c in row.cache.target:
            if isinstance(c, RecurrentCache):
                c.step_states = step_states
        row.first(prefill(target, drafter, row.cache, prompt, 2048, lambda done, total: None))
        batch.join(row)
        rows.append(row)
    emitted = [[row.last_id] for row in rows]
    cycles = 0
    while max(map(len, emitted)) < 60 + cycles and cycles < 100:  # until a row is a whole block ahead of another
        for tokens, out in zip(emitted, batch.cycle()):
            tokens.extend(out.tokens)
        cycles += 1
    leaving = rows[1]
    batch.leave(leaving)
    assert [type(c) for c in leaving.cache.target] == [type(c) for c in target.make_cache(slack=16)]
    leaving.cache.check()
    others = [tokens for row, tokens in zip(rows, emitted) if row is not leaving]
    for tokens, out in zip(others, batch.cycle()):
        tokens.extend(out.tokens)
    history = ids[1] + emitted[1]
    rest = [t for r in stream_generate(target, drafter, tokenizer, history, **dict(settings, max_tokens=40),
                                       cache=leaving.cache) for t in r.tokens]
    assert emitted[1] + rest == plain_greedy(target.model, ids[1], len(emitted[1]) + 40)
    for prompt, tokens in zip([p for p in ids if p is not ids[1]], others):
        assert tokens == plain_greedy(target.model, prompt, len(tokens))
    assert max(map(len, emitted)) - min(map(len, emitted)) >= 15  # blocks were accepted, rows parted
