"""The target adapter: same logits as the model's own forward, plus the requested layer outputs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPTS
from helpers import plain_greedy

from dflash_mlx import Target, stream_generate


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_logits_equal_model_forward(pairs, name):
    target, _, _ = pairs[name]
    tokens = mx.array([[5, 17, 42, 99, 3, 250, 7]])
    ours_cache, theirs_cache = target.make_cache(), target.make_cache()
    for chunk in (tokens[:, :4], tokens[:, 4:]):  # prefill then a multi-token step with a cache
        logits, _ = target(chunk, ours_cache)
        expected = target.model(chunk, cache=theirs_cache)
        np.testing.assert_array_equal(np.array(logits), np.array(expected))


def _reference_hidden_states(target, tokens):
    """Transformers' ``hidden_states`` as z-lab's code reads them: the embeddings, every layer's output but the
    last, then the last layer's output after the final norm (index i + 1 is layer i's feature)."""
    from mlx_lm.models.base import create_attention_mask

    h = target.body.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    states = [h]
    for layer in target.body.layers:
        h = layer(h, mask, None)
        states.append(h)
    states[-1] = target.body.norm(h)
    return states


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_features_are_the_reference_hidden_states(pairs, name):
    """Layer i's feature is its output, the last layer's after the final norm (z-lab's extraction): so the head
    over the last layer's feature gives the logits, and a drafter trained on it drafts as the reference does."""
    target, _, _ = pairs[name]
    n = target.num_layers
    tokens = mx.array([[1, 2, 3, 4, 5]])
    states = _reference_hidden_states(target, tokens)
    last = Target(target.model, [n - 1])
    logits, feats = last(tokens, last.make_cache())
    np.testing.assert_allclose(np.array(last.lm_head(feats)), np.array(logits), rtol=1e-5, atol=1e-5)
    some = Target(target.model, [0, n // 2, n - 1])
    _, got = some(tokens, some.make_cache())
    expected = mx.concatenate([states[i + 1] for i in (0, n // 2, n - 1)], axis=-1)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)
    both = Target(target.model, [0, target.num_layers - 1])
    _, feats2 = both(tokens, both.make_cache())
    assert feats2.shape[-1] == 2 * target.hidden_size
    np.testing.assert_array_equal(np.array(feats2[..., target.hidden_size :]), np.array(feats))


def test_last_logits_only(pairs):
    target, _, _ = pairs["qwen3"]
    tokens = mx.array([[9, 8, 7, 6]])
    full, f1 = target(tokens, target.make_cache())
    last, f2 = target(tokens, target.make_cache(), last_logits_only=True)
    assert last.shape[1] == 1
    np.testing.assert_allclose(np.array(last[:, 0]), np.array(full[:, -1]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.array(f1), np.array(f2))


def test_two_targets_interleaved_in_one_process(pairs):
    """Two different architectures generating at once, step by step, stay independent and exact."""
    streams, refs = {}, {}
    for name, (target, drafter, tokenizer) in pairs.items():
        ids = tokenizer.encode(PROMPTS[0])
        refs[name] = plain_greedy(target.model, ids, 80)
        streams[name] = stream_generate(target, drafter, tokenizer, ids, max_tokens=80, block_size=4, eos_token_ids=[])
    got = {name: [] for name in streams}
    while streams:
        for name in list(streams):
            try:
                got[name].extend(next(streams[name]).tokens)
            except StopIteration:
                del streams[name]
    assert got == refs
