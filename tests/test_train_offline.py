"""Offline training's parts: the feature store, the loss's sub-head and the built-in prompts."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx.models import fixtures
from dflash_mlx.models.drafter import Drafter, DrafterArgs
from dflash_mlx.models.loader import load_target
from dflash_mlx.training import data as data_module
from dflash_mlx.training.data import prepare_data
from dflash_mlx.training.drafter_init import draft_config
from dflash_mlx.training.features import FEATURES, INDEX, feature_store
from dflash_mlx.training.objective import Head, block_loss, make_batch, position_weights
from dflash_mlx.training.prompts import _evaluation_prompts, synthetic_prompts
from dflash_mlx.training.train import _feature_target


@pytest.fixture(scope="module")
def target_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("offline")
    return fixtures.write_target(root / "t", fixtures.target_config("qwen3", num_hidden_layers=4), seed=0)


def load(path: Path, quantized: bool = False):
    model, _ = load_target(path)
    if quantized:
        nn.quantize(model, group_size=32, bits=8)
    return _feature_target(model, 2, [1, 3])


@pytest.fixture(scope="module")
def target(target_path):
    return load(target_path)


def sequences(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 300, 5 + i).tolist(), rng.integers(0, 300, 20 + 3 * i).tolist()) for i in range(n)]


def test_features_are_computed_once_and_equal_the_targets_own(target, tmp_path):
    seqs, key = sequences(4), {"data": 1}
    events: list[dict] = []
    store = feature_store(tmp_path, target, seqs, key, events.append)
    assert [e["done"] for e in events if e["phase"] == "features"] == [1, 2, 3, 4]
    for i, (p, r) in enumerate(seqs):
        _, want = target(mx.array(p + r)[None], target.make_cache(), last_logits_only=True)
        np.testing.assert_allclose(np.array(store[i]), np.array(want[0]), rtol=8e-3, atol=8e-3)  # kept in bfloat16
    events.clear()
    again = feature_store(tmp_path, target, seqs, key, events.append)
    assert not events, "a matching store is read back, not computed again"
    np.testing.assert_array_equal(np.array(again[3]), np.array(store[3]))


def test_features_beyond_float16s_range_are_kept(target_path, tmp_path):
    """Gemma's hidden states pass float16's 65,504 (Gemma 3 270M's reach 300k): stored as inf, they trained a
    drafter whose loss was nan from its first step. Here a target whose embedding is scaled 1e5 times."""
    target = load(target_path)
    embed = target.model.model.embed_tokens
    embed.weight = embed.weight * 1e5
    seqs = sequences(2)
    store = feature_store(tmp_path, target, seqs, {"data": 1}, lambda e: None)
    p, r = seqs[1]
    _, want = target(mx.array(p + r)[None], target.make_cache(), last_logits_only=True)
    assert float(mx.abs(want).max()) > 65504 and bool(mx.isfinite(store[1]).all())
    np.testing.assert_allclose(np.array(store[1]), np.array(want[0]), rtol=8e-3, atol=8e-3 * float(mx.abs(want).max()))


@pytest.mark.parametrize("spoil", ["other data", "other sequences", "truncated", "garbage index"])
def test_a_store_of_other_data_or_a_damaged_one_is_made_again(target, tmp_path, spoil):
    seqs, key = sequences(3), {"data": 1}
    feature_store(tmp_path, target, seqs, key, lambda e: None)
    if spoil == "other data":
        key = {"data": 2}
    elif spoil == "other sequences":
        seqs = sequences(3, seed=1)
    elif spoil == "truncated":
        path = tmp_path / FEATURES
        path.write_bytes(path.read_bytes()[:-64])
    else:
        (tmp_path / INDEX).write_text("{not json")
    events: list[dict] = []
    store = feature_store(tmp_path, target, seqs, key, events.append)
    assert len([e for e in events if e["phase"] == "features"]) == 3
    p, r = seqs[2]
    _, want = target(mx.array(p + r)[None], target.make_cache(), last_logits_only=True)
    np.testing.assert_allclose(np.array(store[2]), np.array(want[0]), rtol=8e-3, atol=8e-3)
    assert json.loads((tmp_path / INDEX).read_text())["data"] == key


@pytest.mark.parametrize("quantized", [False, True])
def test_a_steps_columns_score_as_the_full_head_and_their_samples_stand_for_the_rest(target_path, quantized,
                                                                                      monkeypatch):
    """With every token drawn a step's columns give the full loss (rows, label columns and shifts agree); with only
    its labels' tokens the loss is lower (fewer competitors in the softmax); the two samples, shifted by
    log(pool / drawn), bring it back to the full loss on average."""
    target = load(target_path, quantized)
    seqs = sequences(3)
    head = Head.of(target, seqs)
    ids = np.unique(np.concatenate([p + r for p, r in seqs]))
    h = mx.random.normal((5, target.hidden_size))
    np.testing.assert_allclose(np.array(h @ head.rows.T), np.array(target.lm_head(h)[:, mx.array(ids)]), rtol=1e-4, atol=1e-4)
    drawn = np.random.default_rng(1).choice(head.others, size=5, replace=False)
    np.testing.assert_allclose(np.array(head.weight(mx.array(drawn)) @ h.T).T,
                               np.array(target.lm_head(h)[:, mx.array(drawn)]), rtol=1e-4, atol=1e-4)

    config = draft_config(target, 2, 8, target.layer_ids, 7)
    drafter = Drafter(DrafterArgs.from_dict(config))
    feats = [target(mx.array(p + r)[None], target.make_cache(), last_logits_only=True)[1][0] for p, r in seqs]
    batch = make_batch(target, seqs, feats, np.random.default_rng(0), 4, 8, 7)
    labels, weights, rng = np.array(batch.labels), position_weights(8), np.random.default_rng(0)
    full = block_loss(drafter, target, batch, weights).item()  # no columns: the whole head

    def loss(labelled_with: int, negatives: int) -> float:
        monkeypatch.setattr("dflash_mlx.training.objective.LABELLED_WITH", labelled_with)
        monkeypatch.setattr("dflash_mlx.training.objective.NEGATIVES", negatives)
        batch.columns = head.sample(rng, labels)
        return block_loss(drafter, target, batch, weights).item()

    everything = target.vocab_size
    assert loss(everything, everything) == pytest.approx(full, rel=1e-4)
    assert batch.columns.rows.shape[0] == target.vocab_size
    own = loss(0, 0)
    assert batch.columns.rows.shape[0] == len(np.unique(labels)) < len(ids) and own < full
    estimates = [loss(24, 24) for _ in range(8)]
    assert abs(np.mean(estimates) - full) < 0.25 * abs(own - full), (estimates, own, full)


def test_built_in_prompts_mix_code_math_and_chat_and_leave_the_evaluation_sets_alone():
    prompts = synthetic_prompts(600, seed=0)
    assert len(prompts) == 600 == len(set(prompts))
    assert prompts == synthetic_prompts(600, seed=0) and prompts != synthetic_prompts(600, seed=1)
    assert not set(prompts) & _evaluation_prompts()
    code = sum("function" in p for p in prompts)
    math = sum(any(c.isdigit() for c in p) and "function" not in p for p in prompts)
    assert code >= 150 and math >= 150 and len(prompts) - code - math >= 150
    from dflash_mlx.eval.score import humaneval_problems

    try:
        humaneval = {p.prompt.strip() for p in humaneval_problems()}
    except ImportError:
        humaneval = set()
    assert not set(prompts) & humaneval
    widest = synthetic_prompts(2500, seed=0)  # enough for make pair's 1,500 with room to spare
    assert len(widest) == len(set(widest)) == 2500 and not set(widest) & (_evaluation_prompts() | humaneval)


def test_replies_already_generated_are_kept_when_prompts_are_added(target_path, tmp_path):
    _, tokenizer = load_target(target_path)
    asked: list[list[int]] = []

    def answer(ids: list[list[int]], keep) -> None:
        asked.extend(ids)
        for i, p in enumerate(ids):
            keep(i, [len(p)] * 3)

    key = {"prompts": "first", "seed": 0, "response_tokens": 8}
    first = prepare_data(tmp_path, tokenizer, ["alpha", "beta", "gamma"], ["held"], key, answer)
    assert len(asked) == 3
    asked.clear()
    second = prepare_data(tmp_path, tokenizer, ["alpha", "gamma", "delta"], ["held"], dict(key, prompts="second"),
                          answer)
    assert len(asked) == 1, "only the new prompt is answered"
    assert second["train"][0] == first["train"][0] and second["train"][1] == first["train"][2]
    asked.clear()
    prepare_data(tmp_path, tokenizer, ["alpha", "gamma"], ["beta"], dict(key, seed=1), answer)
    assert not asked, "another split keeps the replies"
    prepare_data(tmp_path, tokenizer, ["alpha"], ["held"], dict(key, response_tokens=9), answer)
    assert len(asked) == 1, "another reply length (or target) answers again"
    (tmp_path / "data.json").write_text('{"key": ')
    asked.clear()
    prepare_data(tmp_path, tokenizer, ["alpha", "beta"], ["held"], key, answer)
    assert len(asked) == 2, "a damaged cache is made again"


def test_replies_done_before_an_interruption_are_kept(target_path, tmp_path, monkeypatch):
    """Ctrl-C (or an error) while replies are generated: those done are in the cache, on the way out and every
    KEEP_EVERY replies (a killed process keeps those), and the next run asks only for the rest."""
    _, tokenizer = load_target(target_path)
    monkeypatch.setattr(data_module, "KEEP_EVERY", 2)
    prompts = ["alpha", "beta", "gamma", "delta", "epsilon"]
    key = {"prompts": "p", "seed": 0, "response_tokens": 8}
    asked: list[list[int]] = []

    def interrupted_after(n: int):
        def answer(ids, keep) -> None:
            for i, p in enumerate(ids[:n]):
                asked.append(p)
                keep(i, [len(p), i])
                cached = json.loads((tmp_path / "data.json").read_text()) if (tmp_path / "data.json").exists() else None
                written.append(len(cached["train"]) if cached else 0)
            raise KeyboardInterrupt
        return answer

    written: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        prepare_data(tmp_path, tokenizer, prompts, ["held"], key, interrupted_after(3))
    assert written == [0, 2, 2], "written every KEEP_EVERY replies"
    assert len(json.loads((tmp_path / "data.json").read_text())["train"]) == 3, "and on the way out"
    done, asked[:] = list(asked), []

    def answer(ids, keep) -> None:
        asked.extend(ids)
        for i, p in enumerate(ids):
            keep(i, [len(p), -1])

    data = prepare_data(tmp_path, tokenizer, prompts, ["held"], key, answer)
    assert len(asked) == 2 and not {tuple(p) for p in asked} & {tuple(p) for p in done}, "only the rest is asked"
    assert [s["response"][1] for s in data["train"]] == [0, 1, 2, -1, -1]
    assert data["key"] == key and prepare_data(tmp_path, tokenizer, prompts, ["held"], key, answer) == data
