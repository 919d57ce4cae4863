"""The drafter trainer: objective pieces checked exactly, then whole runs on a tiny target."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import plain_greedy
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import dflash_mlx.training.train as training
from dflash_mlx import DFlashError, generate, load
from dflash_mlx.cli.main import app
from dflash_mlx.models import fixtures
from dflash_mlx.models.drafter import Blocks, Drafter, DrafterArgs, block_mask
from dflash_mlx.training.objective import block_labels, perturb_features, sample_anchors
from dflash_mlx.training.train import load_checkpoint, train

PROMPTS = [
    {"prompt": "def fibonacci(n):"},
    {"prompt": "The quick brown fox"},
    {"prompt": "import json\nimport os"},
    {"messages": [{"role": "user", "content": "Sort a list in Python."}, {"role": "assistant", "content": "x"}]},
    {"prompt": "class Parser:"},
    {"prompt": "Write a haiku about rain."},
    {"prompt": "What is 17 * 23?"},
    {"prompt": "for i in range(10):"},
    {"prompt": "Explain recursion."},
    {"prompt": "SELECT name FROM users"},
]
# Small but real: blocks of 8, a few dozen tokens per reply.
SMALL = dict(block_size=8, anchors=8, response_tokens=24, batch_size=4)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    fixtures.write_target(root / "target", fixtures.target_config("qwen3", num_hidden_layers=4), seed=0)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return root


@pytest.fixture(scope="module")
def trained(workdir):
    """One 40-step run with evaluation, shared by the tests that inspect its output."""
    events: list[dict] = []
    result = train(
        str(workdir / "target"), str(workdir / "trained"), prompts=str(workdir / "prompts.jsonl"),
        steps=40, eval_prompts=2, checkpoint_every=20, progress=events.append, **SMALL,
    )
    return result, events


# --- the objective, piece by piece ------------------------------------------------------------


def test_block_mask_hides_the_anchor_and_the_context_after_it():
    """Two blocks of 2 at anchors 3 and 5 over 6 context positions; T = visible. (Other blocks are out of reach by
    construction: each block's scores are taken against its own rows only.)"""
    T, F = True, False
    expected = np.array([
        # context 0..5
        [T, T, T, F, F, F],  # block 0 (anchor 3): context 0..2 only
        [T, T, T, F, F, F],
        [T, T, T, T, T, F],  # block 1 (anchor 5): context 0..4 only
        [T, T, T, T, T, F],
    ])
    np.testing.assert_array_equal(block_mask([3, 5], 6, 2), expected)
    # A window of 3: row i at position anchor + i sees context k with anchor + i - k < 3.
    np.testing.assert_array_equal(block_mask([3], 6, 2, window=3), [[F, T, T, F, F, F], [F, F, T, F, F, F]])


def test_labels_position_k_predicts_anchor_plus_k():
    seq = list(range(100, 130))
    np.testing.assert_array_equal(block_labels(seq, [2, 10], 4), [[103, 104, 105], [111, 112, 113]])
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = sample_anchors(rng, prompt_len=7, seq_len=30, block_size=8, n=12)
        assert a.min() >= 7 and a.max() + 8 - 1 < 30  # anchors in the reply, whole block in the sequence


ROPES = {
    "plain": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
}


@pytest.mark.parametrize("rope,window", [(r, None) for r in ROPES] + [("plain", 5)])
def test_training_forward_equals_inference_drafter(rope, window):
    """Three blocks in one masked pass equal three inference calls, each with a fresh cache fed
    the context features of positions 0..a-1: positions, RoPE (also scaled RoPE) and mask agree.
    With a sliding layer (window 5, shorter than the context) the per-row window agrees too.
    Feeding 0..a instead (the published bug) gives different states, so the check is sharp."""
    target = fixtures.target_config(hidden_size=64, num_hidden_layers=6)
    extra = {} if window is None else {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window}
    config = fixtures.drafter_config(target, 2, block_size=4, target_layer_ids=[1, 4], rope_scaling=ROPES[rope], **extra)
    mx.random.seed(7)
    drafter = Drafter(DrafterArgs.from_dict(config))
    for name, value in tree_flatten(drafter.parameters()):
        scaled = 0.5 + mx.random.uniform(shape=value.shape) if "norm" in name else value * 3.0
        drafter.load_weights([(name, scaled)], strict=False)
    B, L, anchors = 4, 14, [[3, 9, 6], [10, 2, 5]]  # two sequences of three blocks each
    assert config["num_attention_heads"] > config["num_key_value_heads"]  # query heads grouped over kv heads
    features = mx.random.normal((2, L, 2 * 64))
    embeddings = mx.random.normal((2, 3 * B, 64))
    trained = drafter(embeddings, features, Blocks(np.array(anchors), L, B))
    for s, row in enumerate(anchors):
        for j, a in enumerate(row):
            block, got = embeddings[s : s + 1, j * B : (j + 1) * B], np.array(trained[s, j * B : (j + 1) * B])
            inference = drafter(block, features[s : s + 1, :a], drafter.make_cache())
            np.testing.assert_allclose(got, np.array(inference[0]), rtol=1e-4, atol=1e-4)
            leaky = drafter(block, features[s : s + 1, : a + 1], drafter.make_cache())
            assert not np.allclose(got, np.array(leaky[0]), atol=1e-3)


# --- whole runs ---------------------------------------------------------------------------------


def test_loss_decreases(trained):
    result, events = trained
    losses = result.losses
    assert len(losses) == result.steps == 40
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    train_events = [e for e in events if e["phase"] == "train"]
    assert [e["step"] for e in train_events] == list(range(1, 41))
    assert all(e["tokens_per_s"] > 0 and e["lr"] > 0 for e in train_events)
    assert events[-1]["phase"] == "done" and events[-1]["tau"] == result.tau


def test_held_out_prompts_are_never_trained_on(trained, workdir):
    result, _ = trained
    data = json.loads((result.output / "data.json").read_text())
    assert len(data["eval"]) >= 2 and len(data["train"]) + len(data["eval"]) == len(PROMPTS)
    train_prompts = {tuple(s["prompt"]) for s in data["train"]}
    assert not train_prompts & {tuple(p) for p in data["eval"]}
    assert result.tau is not None and 1.0 <= result.tau <= 8


def test_replies_are_the_targets_greedy_replies(trained, workdir):
    """Batched generation must not change what the drafter learns from: each cached reply is the
    target's one-prompt-at-a-time greedy reply, plus the EOS token when it stopped on one."""
    result, _ = trained
    target, _, tokenizer = load(str(result.output), str(workdir / "target"))
    eos = set(tokenizer.eos_token_ids)
    data = json.loads((result.output / "data.json").read_text())
    for sample in data["train"]:
        reply = sample["response"]
        assert 0 < len(reply) <= SMALL["response_tokens"]
        expected = plain_greedy(target.model, sample["prompt"], SMALL["response_tokens"], eos=eos)
        assert [t for t in reply if t not in eos] == expected
        assert all(t not in eos for t in reply[:-1])


def test_checkpoint_loads_publicly_and_decodes_losslessly(trained, workdir):
    result, _ = trained
    config = json.loads((result.output / "config.json").read_text())
    reference = fixtures.drafter_config(fixtures.target_config("qwen3", num_hidden_layers=4), 1, target_layer_ids=[2])
    assert set(config) == set(reference)
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    # the tokenizer's <|mask|>, and the drafter's own vocabulary: every token of its training text
    data = json.loads((result.output / "data.json").read_text())
    seen = sorted({t for s in data["train"] for t in s["prompt"] + s["response"]})
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [2], "draft_vocab_size": len(seen)}
    target, drafter, tokenizer = load(str(result.output), str(workdir / "target"))
    assert drafter.vocabulary.ids.tolist() == seen and len(seen) < target.vocab_size
    for prompt in ["The quick brown fox", "def parse(text):"]:
        ids = tokenizer.encode(prompt)
        out = generate(target, drafter, tokenizer, ids, max_tokens=40)
        assert out.tokens == plain_greedy(target.model, ids, 40, eos=tokenizer.eos_token_ids)


def test_memorised_replies_are_drafted_back(workdir):
    """End to end, training is inference: a drafter overfitted on a few replies drafts those very
    replies almost fully (tau near B = 4) when decoding their prompts, which needs labels,
    positions and the block layout to mean at training what they mean at inference, and its own
    vocabulary's positions to map back to the target's tokens. (A context leak up to the anchor can
    still be memorised around; the forward-equality test catches it.)"""
    prompts = workdir / "few.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS[:5]) + "\n")
    result = train(str(workdir / "target"), str(workdir / "overfit"), prompts=str(prompts), steps=80, lr=3e-3, batch_size=4,
                   block_size=4, anchors=16, response_tokens=24, eval_prompts=0)
    target, drafter, tokenizer = load(str(result.output), str(workdir / "target"))
    data = json.loads((result.output / "data.json").read_text())
    assert drafter.vocabulary is not None
    taus = [generate(target, drafter, tokenizer, s["prompt"], max_tokens=24, draft_source="drafter").tau
            for s in data["train"]]
    assert np.mean(taus) > 3.0, taus


class Interrupted(Exception):
    pass


def _stop_at(step: int):
    def progress(event: dict) -> None:
        if event["phase"] == "train" and event["step"] == step:
            raise Interrupted
    return progress


def _weights(out: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}


def test_the_loss_gamma_weighs_the_block_positions(workdir):
    """One step from the same start on the same blocks: the loss is the position-weighted mean, so another gamma
    gives another first loss; at block 8 the default is the published 4."""
    common = dict(prompts=str(workdir / "prompts.jsonl"), eval_prompts=0, steps=1, **SMALL)
    target = str(workdir / "target")
    first = {g: train(target, str(workdir / f"gamma-{g}"), loss_gamma=g, **common).losses[0] for g in (None, 4.0, 1.0)}
    assert first[None] == pytest.approx(first[4.0], rel=1e-6) and first[1.0] != pytest.approx(first[4.0], rel=1e-3)
    assert json.loads((workdir / "gamma-1.0" / "checkpoint" / "state.json").read_text())["settings"]["loss_gamma"] == 1.0


def test_feature_noise_is_relative_to_each_layers_scale():
    """Two feature layers of very different sizes each get noise of ``noise`` x their own row RMS; no noise is none."""
    rng = np.random.default_rng(0)
    small, large = rng.normal(size=(2, 500, 64)), 100 * rng.normal(size=(2, 500, 64))
    features = mx.array(np.concatenate([small, large], -1), dtype=mx.float32)
    assert perturb_features(features, 0.0, 2, mx.random.key(1)) is features
    noisy = perturb_features(features, 0.5, 2, mx.random.key(1))
    delta = np.array(noisy - features).reshape(2, 500, 2, 64)
    for layer, scale in ((0, 1.0), (1, 100.0)):
        assert np.std(delta[:, :, layer]) == pytest.approx(0.5 * scale, rel=0.05)
    np.testing.assert_array_equal(np.array(perturb_features(features, 0.5, 2, mx.random.key(1))), np.array(noisy))


def test_feature_noise_reaches_the_loss_and_old_checkpoints_resume_without_it(workdir, trained):
    """One step from the same start on the same blocks: noise on the features changes the first loss, and is kept
    in the checkpoint's settings. A checkpoint made before the setting existed was trained without noise: it
    resumes with --feature-noise 0 and refuses the default in one line."""
    common = dict(prompts=str(workdir / "prompts.jsonl"), eval_prompts=0, steps=1, **SMALL)
    target = str(workdir / "target")
    first = {n: train(target, str(workdir / f"noise-{n}"), feature_noise=n, **common).losses[0] for n in (0.0, 1.0)}
    assert first[0.0] != pytest.approx(first[1.0], rel=1e-3)
    assert json.loads((workdir / "noise-1.0" / "checkpoint" / "state.json").read_text())["settings"]["feature_noise"] == 1.0

    old = workdir / "before-noise"
    shutil.copytree(trained[0].output, old)
    state = json.loads((old / "checkpoint" / "state.json").read_text())
    del state["settings"]["feature_noise"]
    (old / "checkpoint" / "state.json").write_text(json.dumps(state))
    kwargs = dict(SMALL, prompts=str(workdir / "prompts.jsonl"), eval_prompts=2, steps=42, resume=True)
    with pytest.raises(DFlashError, match="was trained with --feature-noise 0.0: resume with the same settings"):
        train(target, str(old), **kwargs)
    assert train(target, str(old), feature_noise=0.0, **kwargs).steps == 42


def test_resume_continues_exactly(workdir):
    """Resume restores step, weights and AdamW state exactly.

    A run of N+M steps straight equals one interrupted after N and resumed (same seed): the
    weights match bit for bit. "N steps, then resume to N+M" cannot match the straight run:
    the cosine schedule spans the run's step budget, so the first run decayed its learning
    rate to ~0 over N steps and the resumed one re-stretches it over N+M. What that path can
    show is checked instead: the step count continues, the earlier losses are kept, and the
    restored optimizer state equals the saved one.
    """
    common = dict(prompts=str(workdir / "prompts.jsonl"), eval_prompts=0, checkpoint_every=3, seed=1, **SMALL)
    target = str(workdir / "target")

    short = workdir / "resume-short"
    first = train(target, str(short), steps=6, **common)
    mx.random.seed(123)  # a resumed run must not depend on the global RNG
    drafter = Drafter(DrafterArgs.from_dict(json.loads((short / "config.json").read_text())))
    optimizer = optim.AdamW(learning_rate=1.0)
    state = load_checkpoint(short / "checkpoint", drafter, optimizer)
    saved = mx.load(str(short / "checkpoint" / f"optimizer-{state['tag']}.safetensors"))
    restored = dict(tree_flatten(optimizer.state))
    assert state["step"] == 6 and set(restored) == set(saved) and any(k.endswith(".v") for k in saved)
    for k in saved:
        np.testing.assert_array_equal(np.array(restored[k]), np.array(saved[k]))
    steps_seen: list[int] = []
    more = train(target, str(short), steps=10, resume=True,
                 progress=lambda e: e["phase"] == "train" and steps_seen.append(e["step"]), **common)
    assert steps_seen == [7, 8, 9, 10] and more.steps == 10
    assert more.losses[:6] == first.losses

    straight = train(target, str(workdir / "resume-straight"), steps=10, **common)
    split = workdir / "resume-split"
    with pytest.raises(Interrupted):
        train(target, str(split), steps=10, progress=_stop_at(6), **common)
    resumed = train(target, str(split), steps=10, resume=True, **common)
    assert resumed.losses == straight.losses
    a, b = _weights(straight.output), _weights(resumed.output)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_ctrl_c_checkpoints_the_last_completed_step(workdir):
    """Ctrl-C between checkpoints loses nothing: resuming continues from the step it stopped at."""
    common = dict(prompts=str(workdir / "prompts.jsonl"), eval_prompts=0, checkpoint_every=50, seed=1, **SMALL)
    target = str(workdir / "target")
    straight = train(target, str(workdir / "ctrlc-straight"), steps=8, **common)

    def interrupt(event: dict) -> None:
        if event["phase"] == "train" and event["step"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(target, str(workdir / "ctrlc"), steps=8, progress=interrupt, **common)
    assert json.loads((workdir / "ctrlc" / "checkpoint" / "state.json").read_text())["step"] == 5
    resumed = train(target, str(workdir / "ctrlc"), steps=8, resume=True, **common)
    assert resumed.losses == straight.losses
    a, b = _weights(straight.output), _weights(resumed.output)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_time_budget_run(workdir):
    events: list[dict] = []
    result = train(str(workdir / "target"), str(workdir / "timed"), prompts=str(workdir / "prompts.jsonl"),
                   time_budget=0.5, eval_prompts=0, progress=events.append, **SMALL)
    train_events = [e for e in events if e["phase"] == "train"]
    assert result.steps >= 1 and train_events[-1]["progress"] == 1.0 and train_events[-1]["steps"] is None
    assert result.tau is None


# --- bad input ------------------------------------------------------------------------------------


def _bad_target(root: Path, kind: str) -> str:
    path = root / f"bad-{kind}"
    path.mkdir(exist_ok=True)
    if kind == "unknown":
        (path / "config.json").write_text(json.dumps(fixtures.target_config("qwen9")))
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown", "'qwen9' is not an mlx-lm model"),
        ("no-config", "has no config.json"),
        ("missing", "no such folder"),
        ("missing-prompts", "no such file"),
        ("empty-prompts", "is empty"),
        ("bad-line", "line 2 is not valid JSON"),
        ("bad-row", 'line 1: expected {"prompt"'),
        ("layers", "layers must be >= 1"),
        ("prompt-count", "--prompt-count must be >= 1"),
        ("too-many-prompts", "the built-in set has"),
        ("block", "--block-size must be >= 2"),
        ("budgets", "either steps or time_budget"),
        ("no-resume", "add --resume to continue it"),
        ("changed", "was trained with --block-size 8: resume with the same settings"),
        ("changed-gamma", "was trained with the default --loss-gamma: resume with the same settings"),
        ("gamma", "--loss-gamma must be positive, got 0"),
        ("blocks", "--blocks must be >= 1, got 0"),
        ("noise", "--feature-noise must be >= 0, got -0.1"),
        ("changed-noise", "was trained with --feature-noise 0.3: resume with the same settings"),
        ("draft-vocab", "--draft-vocab must be >= 0 (0: the target's whole vocabulary), got -1"),
    ],
)
def test_bad_input_is_one_clear_error(case, message, workdir, trained):
    target, out, kwargs = str(workdir / "target"), str(workdir / f"out-{case}"), dict(SMALL, steps=2)
    if case in ("unknown", "no-config"):
        target = _bad_target(workdir, case)
    elif case == "missing":
        target = str(workdir / "no-such-target")
    elif case == "missing-prompts":
        kwargs["prompts"] = str(workdir / "no-such.jsonl")
    elif case in ("empty-prompts", "bad-line", "bad-row"):
        text = {"empty-prompts": "\n  \n", "bad-line": '{"prompt": "ok"}\n{"prompt": \n', "bad-row": '{"text": 1}\n'}[case]
        (workdir / f"{case}.jsonl").write_text(text)
        kwargs["prompts"] = str(workdir / f"{case}.jsonl")
    elif case == "layers":
        kwargs["layers"] = 0
    elif case in ("prompt-count", "too-many-prompts"):
        kwargs["prompt_count"] = -3 if case == "prompt-count" else 100_000
    elif case == "block":
        kwargs["block_size"] = 1
    elif case == "budgets":
        kwargs["time_budget"] = 10.0
    elif case == "gamma":
        kwargs["loss_gamma"] = 0.0
    elif case == "blocks":
        kwargs["anchors"] = 0
    elif case == "noise":
        kwargs["feature_noise"] = -0.1
    elif case == "draft-vocab":
        kwargs["draft_vocab"] = -1
    elif case in ("no-resume", "changed", "changed-gamma", "changed-noise"):
        out = str(trained[0].output)
        kwargs.update(prompts=str(workdir / "prompts.jsonl"), eval_prompts=2)
        if case == "changed":
            kwargs.update(block_size=4, resume=True)
        elif case == "changed-gamma":
            kwargs.update(loss_gamma=3.0, resume=True)
        elif case == "changed-noise":
            kwargs.update(feature_noise=0.0, resume=True)
    with pytest.raises(DFlashError) as info:
        train(target, out, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_train_command(tmp_path, models_dir):
    """`dflash-mlx train` end to end: a loadable drafter, lossless generation, one-line errors."""
    out = tmp_path / "drafter"
    args = ["train", str(models_dir / "qwen3"), "-o", str(out), "--prompt-count", "16", "--steps", "6", "--block-size",
            "8", "--batch-size", "2"]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out tau" in result.stdout and (out / "checkpoint").is_dir()
    gen = CliRunner().invoke(app, ["generate", str(out), "-t", str(models_dir / "qwen3"), "-p", "hi", "-m", "30", "--json"])
    target, _, tokenizer = load(str(out), str(models_dir / "qwen3"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert json.loads(gen.stdout)["tokens"] == plain_greedy(target.model, ids, 30, eos=tokenizer.eos_token_ids)
    assert load(str(out), str(models_dir / "qwen3"))[1].vocabulary is not None  # its own, by default
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and again.stderr.startswith("error:") and "resume" in again.stderr
    # a resume may change the vocabulary (it is a matter of the export): 0 drafts from the target's whole one
    resumed = CliRunner().invoke(app, args[:-4] + ["--steps", "8", "--block-size", "8", "--batch-size", "2", "--resume",
                                                   "--draft-vocab", "0"])
    assert resumed.exit_code == 0, resumed.output
    assert "8 steps" in resumed.stdout
    assert load(str(out), str(models_dir / "qwen3"))[1].vocabulary is None
    assert "draft_vocab_size" not in json.loads((out / "config.json").read_text())["dflash_config"]
    for bad, message in ((["--layers", "0"], "layers must be >= 1"), (["--time", "soon"], "--time takes a duration"),
                         (["--loss-gamma", "-1"], "--loss-gamma must be positive"), (["--blocks", "0"], "--blocks must"),
                         (["--draft-vocab", "-5"], "--draft-vocab must be >= 0")):
        r = CliRunner().invoke(app, ["train", str(models_dir / "qwen3"), "-o", str(tmp_path / "x"), *bad])
        assert r.exit_code == 2 and message in r.stderr, r.output


def test_a_target_that_only_loops_is_said_to(tmp_path):
    """Drafts of a loop are accepted whatever the drafter learnt: tau then measures the loop, and train says so."""
    config = fixtures.target_config("qwen3")
    fixtures.write_target(tmp_path / "target", config, init_scale=1.0)  # small weights: greedy replies loop
    out = tmp_path / "drafter"
    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["train", str(tmp_path / "target"), "-o", str(out),
                                                            "--prompt-count", "16", "--steps", "2", "--block-size", "8",
                                                            "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert "held-out tau" in result.stdout
    said = re.search(r"all \d+ held-out replies of the target loop|\d+ of \d+ held-out replies loop", result.stderr)
    assert said, result.stderr


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def _train_args(models_dir: Path, workdir: Path, out: Path, *budget: str) -> list[str]:
    """`dflash-mlx train` on the tiny Qwen3 target with the test prompts (six to train on, four held out)."""
    return ["train", str(models_dir / "qwen3"), "-o", str(out), "--prompts", str(workdir / "prompts.jsonl"),
            "--block-size", "8", "--batch-size", "2", *budget]


def test_progress_shows_the_step_and_the_time_left(tmp_path, models_dir, workdir):
    """On an 80-column terminal the bar reads "step N/total" and an ETA; with --time, time spent and left.

    A subprocess, because rich decides when its console is created whether to draw live
    bars; the environment tells it that stderr is an interactive terminal.
    """
    terminal = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "TERM": "xterm", "COLUMNS": "80",
                "NO_COLOR": "1"}

    def shown(*args: str) -> str:
        run = subprocess.run([sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", *args], env=terminal,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        return ANSI.sub("", run.stderr)

    steps = shown(*_train_args(models_dir, workdir, tmp_path / "steps", "--steps", "6"))
    assert re.search(r"train +step 6/6 .*ETA 0:00:00 +loss \d", steps), steps
    assert re.search(r"generate +6/6 .*ETA", steps), steps
    timed = shown(*_train_args(models_dir, workdir, tmp_path / "timed", "--time", "1s"))
    assert re.search(r"train +step \d+ .*0:00:0\d elapsed, 0:00:0\d left +loss \d", timed), timed


def test_ctrl_c_says_how_to_resume(tmp_path, models_dir, workdir, monkeypatch):
    """Ctrl-C exits 130 with one line: what was saved and where, and that --resume continues; --resume
    then runs only the steps left. Before any step, it says how many replies are kept, or that nothing was saved."""
    out = tmp_path / "drafter"
    args = _train_args(models_dir, workdir, out, "--steps", "6")

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    def lines(result) -> list[str]:
        assert result.exit_code == 130 and isinstance(result.exception, SystemExit), result.output
        assert "Traceback" not in result.output and result.stdout == ""
        return [line for line in result.stderr.splitlines() if line.strip()]

    respond = training.respond
    with monkeypatch.context() as patch:
        patch.setattr(training, "respond", ctrl_c)  # Ctrl-C while the target writes its replies
        assert lines(CliRunner().invoke(app, args)) == ["interrupted before the first training step; nothing was saved"]

        def two_then_ctrl_c(model, prompts, max_tokens, eos, progress, keep):
            respond(model, prompts[:2], max_tokens, eos, progress, keep)
            raise KeyboardInterrupt

        patch.setattr(training, "respond", two_then_ctrl_c)
        assert lines(CliRunner().invoke(app, args)) == [
            f"interrupted before the first training step; the target's 2 replies so far are kept in "
            f"{out / 'data.json'}: the same command goes on from them"]

    make_batch, batches = training.make_batch, []

    def counting(ctrl_c_at: int = 0):
        """make_batch, counting its calls (one per step); Ctrl-C arrives during step ``ctrl_c_at``."""
        def batch(*args, **kwargs):
            batches.append(1)
            if len(batches) == ctrl_c_at:
                raise KeyboardInterrupt
            return make_batch(*args, **kwargs)
        return batch

    monkeypatch.setattr(training, "make_batch", counting(ctrl_c_at=4))
    assert lines(CliRunner().invoke(app, args)) == [
        f"interrupted: checkpoint of step 3 saved in {out / 'checkpoint'}; run the same command with --resume to continue"
    ]
    batches.clear()
    monkeypatch.setattr(training, "make_batch", counting())
    resumed = CliRunner().invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert len(batches) == 3 and f"{out}: 6 steps" in resumed.stdout


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_replies_are_kept_one_by_one_as_the_target_decodes_them_alone(tmp_path, name):
    """Each prompt's reply reaches ``keep`` once, as it is done: batched where the batch's reply to the first prompt
    is the model's own, else (Gemma 2's attention takes no padded batch masks) one prompt at a time; either way the
    first reply is the model's greedy decoding of that prompt alone."""
    fixtures.write_target(tmp_path / "target", fixtures.target_config(name), seed=0)
    target, _, tokenizer = load(str(tmp_path / "target"))
    prompts = [tokenizer.encode(text) for text in ("def parse(text):", "The quick brown fox", "1 + 1 =")]
    kept: list[tuple[int, list[int]]] = []
    training.respond(target.model, prompts, 6, frozenset(), lambda e: None, lambda i, r: kept.append((i, r)))
    assert sorted(i for i, _ in kept) == [0, 1, 2] and all(len(r) == 6 for _, r in kept)
    alone = {i: plain_greedy(target.model, p, 6) for i, p in enumerate(prompts)}
    replies = dict(kept)
    assert replies[0] == alone[0]
    if name == "gemma2":
        assert replies == alone


@pytest.mark.parametrize("name", ["gemma3_text", "gemma2", "lfm2"])
def test_trains_for_any_target(tmp_path, name):
    """A drafter for a target of another family (Gemma's scaled embedding, 1 + weight norms and soft-capped logits;
    a hybrid with short-convolution layers): it shares the target's embedding and head with their scale and
    transforms, and the pair decodes losslessly."""
    config = fixtures.target_config(name)
    fixtures.write_target(tmp_path / "target", config, seed=0)
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    result = train(str(tmp_path / "target"), str(tmp_path / "out"), prompts=str(tmp_path / "prompts.jsonl"), steps=6,
                   eval_prompts=0, **SMALL)
    draft = json.loads((result.output / "config.json").read_text())["dflash_config"]
    target, drafter, tokenizer = load(str(result.output), str(tmp_path / "target"))
    kept = ("mask_token_id", "target_layer_ids", "draft_vocab_size")
    assert {k: v for k, v in draft.items() if k not in kept} == target.logit_transforms
    assert ("final_logit_softcapping" in draft) == (name == "gemma2")
    ids = tokenizer.encode("def parse(text):")
    out = generate(target, drafter, tokenizer, ids, max_tokens=40, block_size=8, eos_token_ids=[])
    assert out.tokens == plain_greedy(target.model, ids, 40)


def test_a_loss_that_is_not_finite_stops_training_in_one_line(tmp_path, workdir):
    """A step whose loss is nan or inf (here a learning rate of 1e30) stops the run with one line: the weights it
    made are not kept, the last good step's checkpoint is (features out of range gave nan at every step of a
    15-minute run before)."""
    with pytest.raises(DFlashError, match=r"training diverged: the loss is (nan|inf) at step \d+ \(step \d+ is kept"):
        train(str(workdir / "target"), str(tmp_path / "d"), prompts=str(workdir / "prompts.jsonl"), steps=20,
              eval_prompts=2, checkpoint_every=100, progress=lambda e: None, **{**SMALL, "lr": 1e30})
    state = json.loads((tmp_path / "d" / "checkpoint" / "state.json").read_text())
    assert all(math.isfinite(loss) for loss in state["losses"])
