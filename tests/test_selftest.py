"""`doctor --selftest`: plain vs DFlash greedy decoding on built-in prompts, and how divergences are reported."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.eval import bench
from dflash_mlx.eval.prompts import builtin
from dflash_mlx.eval.selftest import (
    EXIT_DIVERGED,
    EXIT_IDENTICAL,
    EXIT_NEAR_TIE,
    Divergence,
    PromptCheck,
    SelftestResult,
    first_divergence,
    is_near_tie,
    near_tie_threshold,
    selftest,
)

MAX_TOKENS = 24
POSITION = 5  # where the tampered DFlash path changes its output


def _doctor(models_dir, name, *args):
    result = CliRunner().invoke(app, ["doctor", "--selftest", str(models_dir / f"{name}-dflash"),
                                      "--target", str(models_dir / name), "-m", str(MAX_TOKENS), *args])
    assert "Traceback" not in result.output
    return result


def _prompt_lines(stdout: str) -> dict[str, str]:
    return {line.split()[0]: line for line in stdout.splitlines() if line.startswith("  ")}


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_selftest_is_identical_on_fixture_pairs(models_dir, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    result = _doctor(models_dir, name)
    assert result.exit_code == EXIT_IDENTICAL, result.output
    assert "MLX backend" in result.stdout and "float32 logits" in result.stdout and "within 0.001" in result.stdout
    lines = _prompt_lines(result.stdout)
    assert sorted(lines) == ["chat-0", "code-0", "math-0"]
    assert all(line.endswith("identical") for line in lines.values()), lines
    assert "speedup" in result.stdout and "lossless" in result.stdout


@pytest.fixture
def tampered(monkeypatch):
    """DFlash's output with the token at POSITION swapped for a neighbouring id (the warm-up is left alone)."""
    real = bench.generate

    def generate(*args, **kwargs):
        out = real(*args, **kwargs)
        if len(out.tokens) > POSITION:
            out.tokens[POSITION] ^= 1
        return out

    monkeypatch.setattr(bench, "generate", generate)


def test_injected_divergence_is_located_and_measured(pairs, tampered):
    target, drafter, tokenizer = pairs["qwen3"]
    result = selftest(target, drafter, tokenizer, max_tokens=MAX_TOKENS, sets=("code",))
    (check,) = result.prompts
    text = builtin("code")[0].turns[0]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ref = plain_greedy(target.model, ids, MAX_TOKENS)
    d = check.divergence
    assert d is not None and d.position == POSITION
    assert (d.plain_token, d.dflash_token) == (ref[POSITION], ref[POSITION] ^ 1)
    logits = target.model(mx.array(ids + ref[:POSITION])[None])[0, -1].tolist()
    top = sorted(logits)
    assert d.margin == pytest.approx(top[-1] - top[-2], abs=1e-5) and d.margin > 0
    assert d.gap == pytest.approx(top[-1] - logits[d.dflash_token], abs=1e-5)
    assert not d.near_tie and result.exit_code == EXIT_DIVERGED


def test_injected_divergence_through_the_cli(models_dir, tmp_path, monkeypatch, tampered):
    monkeypatch.chdir(tmp_path)
    result = _doctor(models_dir, "qwen3")
    assert result.exit_code == EXIT_DIVERGED, result.output
    for line in _prompt_lines(result.stdout).values():
        assert f"differs at token {POSITION}:" in line and ">= 0.001: real divergence" in line, line
    assert "this is a bug" in result.stdout


def _constant_model(logits: list[float]):
    """A 'target' whose next-token logits are ``logits`` at every position."""
    row = mx.array(logits)
    return lambda x: mx.broadcast_to(row, (1, x.shape[1], len(logits)))


def test_near_tie_classification():
    assert near_tie_threshold(mx.bfloat16) == 0.5 and near_tie_threshold(mx.float16) == 0.0625
    assert near_tie_threshold(mx.float32) == 1e-3
    assert is_near_tie(0.49, 0.5) and not is_near_tie(0.5, 0.5)
    model = _constant_model([5.0, 4.7, 1.0, 0.0])
    # DFlash took the runner-up, 0.3 below: a near-tie in bf16, too wide for fp16.
    d = first_divergence(model, [1, 2], [0, 0, 3], [0, 1, 3], near_tie_threshold(mx.bfloat16))
    assert (d.position, d.plain_token, d.dflash_token) == (1, 0, 1) and d.near_tie
    assert d.margin == pytest.approx(0.3) and d.gap == pytest.approx(0.3)
    assert not first_divergence(model, [1, 2], [0, 0], [0, 1], near_tie_threshold(mx.float16)).near_tie
    # A close top-2 says nothing about a token far below it: that is a real divergence.
    d = first_divergence(model, [1, 2], [0, 0], [0, 2], near_tie_threshold(mx.bfloat16))
    assert d.margin == pytest.approx(0.3) and d.gap == pytest.approx(4.0) and not d.near_tie
    assert first_divergence(model, [1, 2], [0, 3], [0, 3], 0.5) is None


def test_exit_codes_and_overall_speedup():
    tie, bug = Divergence(3, 0, 1, 0.1, 0.1, True), Divergence(7, 0, 2, 0.1, 4.0, False)

    def result(*divergences):
        checks = [PromptCheck(f"p{i}", 10, 9, 10.0, 20.0 if i else 40.0, d) for i, d in enumerate(divergences)]
        return SelftestResult(checks, mx.bfloat16, 0.5)

    assert result(None, None).exit_code == EXIT_IDENTICAL
    assert result(None, tie).exit_code == EXIT_NEAR_TIE
    assert result(tie, bug).exit_code == EXIT_DIVERGED
    # Decode time summed: plain 0.8 + 0.8 s, DFlash 0.2 + 0.4 s.
    assert result(None, None).speedup == pytest.approx(1.6 / 0.6)
    # A reply that loops is left out of the speedup, as bench leaves it out; all of them: no speedup to claim.
    looped = result(None, None)
    looped.prompts[0].looping = True
    assert looped.speedup == pytest.approx(0.8 / 0.4)
    looped.prompts[1].looping = True
    assert looped.speedup is None


def test_a_pair_whose_replies_loop_is_flagged(looping_dir, monkeypatch, tmp_path):
    """The looping pair's replies are loops: each is flagged, and the speedup leaves them out instead of
    claiming what the loop gave."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["doctor", "--selftest", str(looping_dir / "random"), "--target",
                                      str(looping_dir / "target"), "-m", "64"])
    assert "Traceback" not in result.output
    flagged = [line for line in _prompt_lines(result.stdout).values() if "(degenerate loop)" in line]
    [speedup] = [line for line in result.stdout.splitlines() if line.startswith("speedup")]
    assert flagged, result.stdout
    assert ("n/a" in speedup) if len(flagged) == 3 else (f"{len(flagged)} looping replies left out" in speedup)
