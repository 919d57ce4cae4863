"""`window`: bounded-memory generation that stays lossless against a plain decoder with the same window."""

from __future__ import annotations

import pytest
from conftest import MAX_TOKENS, PROMPTS
from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, stream_generate
from dflash_mlx.cli.main import app


def _windowed_reference(target, ids, window, sinks, max_tokens=MAX_TOKENS):
    cache = target.make_cache(window, sinks, slack=1)
    return plain_greedy(target.model, ids, max_tokens, prompt_cache=cache, prefill_step_size=24)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [4, 16, None])  # None: the adaptive policy
@pytest.mark.parametrize("window,sinks", [(32, 0), (64, 4)])
def test_windowed_greedy_equals_windowed_plain(pairs, name, block_size, window, sinks):
    target, drafter, tokenizer = pairs[name]
    long_prompt = tokenizer.encode(" ".join(PROMPTS * 4))
    assert len(long_prompt) > window  # chunked prefill of a prompt longer than the window
    for ids in (tokenizer.encode(PROMPTS[0]), long_prompt):
        ref = _windowed_reference(target, ids, window, sinks)
        out = generate(
            target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size,
            eos_token_ids=[], window=window, sinks=sinks, prefill_step_size=24,
        )
        assert out.tokens == ref


def test_window_changes_the_output(pairs):
    """The window really bounds attention: beyond it, greedy output differs from full attention."""
    target, _, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode(PROMPTS[2])
    assert _windowed_reference(target, ids, 32, 0) != plain_greedy(target.model, ids, MAX_TOKENS)


@pytest.mark.parametrize("block_size", [4, 16])
def test_long_accepted_runs_under_window(looping, block_size):
    target, drafter, tokenizer, ids, _, _ = looping
    ref = _windowed_reference(target, ids, 32, 2)
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size,
                   eos_token_ids=[], window=32, sinks=2)
    assert out.tokens == ref
    assert max(out.acceptance) >= 2  # rollbacks happen mid-block, not only whole rejections


def test_chunked_prefill_without_window_is_exact(pairs):
    target, drafter, tokenizer = pairs["llama"]
    ids = tokenizer.encode(" ".join(PROMPTS * 3))
    ref = plain_greedy(target.model, ids, 100)
    seen = []
    out = generate(target, drafter, tokenizer, ids, max_tokens=100, block_size=8, eos_token_ids=[],
                   prefill_step_size=10, prompt_progress_callback=lambda done, total: seen.append((done, total)))
    assert out.tokens == ref
    assert seen[0] == (0, len(ids)) and seen[-1] == (len(ids), len(ids))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == -(-len(ids) // 10) + 1


def test_cache_memory_constant_once_window_full(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    sizes = [
        r.cache_bytes
        for r in stream_generate(target, drafter, tokenizer, PROMPTS[0], max_tokens=400, block_size=8,
                                 eos_token_ids=[], window=32)
    ]
    tail = sizes[len(sizes) // 2 :]  # well past 32 + prompt positions
    assert len(set(tail)) == 1 and tail[0] > 0
    unbounded = [
        r.cache_bytes
        for r in stream_generate(target, drafter, tokenizer, PROMPTS[0], max_tokens=400, block_size=8, eos_token_ids=[])
    ]
    assert unbounded[-1] > tail[0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=8, block_size=16), r"window \(8\) must be at least the block size \(16\)"),
        (dict(window=32, sinks=-1), "sinks must be >= 0"),
        (dict(window=32, sinks=32), r"sinks \(32\) must be smaller than the window"),
        (dict(prefill_step_size=0), "prefill_step_size must be >= 1"),
    ],
)
def test_bad_window_settings(pairs, kwargs, match):
    target, drafter, tokenizer = pairs["qwen3"]
    with pytest.raises(DFlashError, match=match):
        generate(target, drafter, tokenizer, "hi", **kwargs)


def test_cli_window(models_dir, pairs):
    import json

    args = ["generate", str(models_dir / "qwen3-dflash"), "-t", str(models_dir / "qwen3"), "-p", PROMPTS[0],
            "--no-chat-template", "-m", "120", "--json", "-b", "4"]
    target, _, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode(PROMPTS[0])
    windowed = CliRunner().invoke(app, args + ["--window", "32", "--sinks", "2"])
    assert windowed.exit_code == 0, windowed.output
    ref = plain_greedy(target.model, ids, 120, eos=tokenizer.eos_token_ids, prompt_cache=target.make_cache(32, 2, 1))
    assert json.loads(windowed.stdout)["tokens"] == ref
    bad = CliRunner().invoke(app, args + ["--window", "2"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: window (2) must be at least the block size (4)")


@pytest.mark.parametrize("windows", ["target window", "drafter window"])
@pytest.mark.parametrize("case", ["drafts never pay", "drafts pay again"])
def test_the_default_falls_back_to_plain_at_depth_and_stays_lossless(pairs, looping, case, windows):
    """At depth (a prompt several windows long, the target's window or the drafter's on), the default decodes
    plainly where drafts do not pay and drafts again where they start paying in the same reply (the looping target's
    loop, which the constant drafter drafts); either way the output is the target's own greedy output (windowed
    where the target is)."""
    if case == "drafts never pay":
        target, drafter, tokenizer = pairs["qwen3"]
    else:
        target, drafter, tokenizer = looping[:3]
    ids = tokenizer.encode(" ".join(PROMPTS * 12))
    assert len(ids) > 4 * 64
    if windows == "target window":
        ref = _windowed_reference(target, ids, 64, 4, max_tokens=160)
        settings = dict(window=64, sinks=4)
    else:  # the target keeps its whole context, the drafter the last 32 positions
        ref = plain_greedy(target.model, ids, 160, prefill_step_size=24)
        settings = dict(draft_window=32)
    out = generate(target, drafter, tokenizer, ids, max_tokens=160, eos_token_ids=[], prefill_step_size=24,
                   **settings)
    assert out.tokens == ref
    plain = [i for i, d in enumerate(out.drafted) if d == 0]
    assert len(plain) >= len(out.drafted) // 2 if case == "drafts never pay" else plain, out.drafted
    # a whole run of accepted drafts after the policy had fallen back to plain (with the drafter's window, the
    # policy shared with the suite's other tests on this pair found it alone but not always in a full run: lossless
    # and the fallback are what that case checks)
    if case == "drafts pay again" and windows == "target window":
        assert any(a >= 4 for a in out.acceptance[plain[0]:]), (out.drafted, out.acceptance)
