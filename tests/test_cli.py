"""`dflash-mlx generate` through Typer's CliRunner on tiny checkpoints."""

from __future__ import annotations

import json

from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import __version__
from dflash_mlx.cli import app


def _args(models_dir, *extra):
    return ["generate", str(models_dir / "llama-dflash"), "--target", str(models_dir / "llama"), *extra]


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"dflash-mlx {__version__}"


def test_generate_json_equals_plain_greedy(pairs, models_dir):
    target, _, tokenizer = pairs["llama"]
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello there", "-m", "40", "-b", "4", "--json"))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("text", "tokens", "tau", "prompt_tokens", "generation_tokens", "generation_tps", "prompt_tps"):
        assert key in out
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    ref = plain_greedy(target.model, ids, 40, eos=tokenizer.eos_token_ids)
    assert out["tokens"] == ref
    assert out["text"] == tokenizer.decode(ref)
    assert out["prompt_tokens"] == len(ids) and out["generation_tokens"] == len(ref)
    assert 1.0 <= out["tau"] <= 4.0


def test_generate_text_then_stats_line(models_dir):
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello", "-m", "12", "--no-chat-template"))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()  # the generated text
    stats = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(stats) == 1 and "tok/s" in stats[0] and "tau" in stats[0]


def test_prompt_from_stdin(models_dir):
    a = CliRunner().invoke(app, _args(models_dir, "-p", "-", "-m", "8", "--json"), input="Hello")
    b = CliRunner().invoke(app, _args(models_dir, "-p", "Hello", "-m", "8", "--json"))
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]
