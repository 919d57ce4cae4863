"""What a new user meets first: each bad input is one line and exit 2 with nothing written, each message says what
to do, and the help and listings say what they show (issue 60, review findings 1-12)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import weakref

import pytest
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate
from dflash_mlx.cli.main import app
from dflash_mlx.decode.estimates import CycleCosts
from dflash_mlx.decode.per_pair import PerPair


def _one_line(*args, env=None) -> str:
    result = CliRunner(env=env).invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_a_bundle_whose_drafter_window_holds_no_block_is_refused(models_dir, tmp_path):
    line = _one_line("convert", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-o", tmp_path / "b",
                     "--draft-window", "5")
    assert "draft window (5) must be at least the block size (16)" in line
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flag", ["--window", "--draft-window"])
@pytest.mark.parametrize("value", ["99999999999999999999", "3000000000"])
def test_windows_beyond_any_context_are_one_line(models_dir, flag, value):
    line = _one_line("generate", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-p", "hi", flag, value)
    assert "must be at most 1,073,741,824 positions" in line


def test_a_window_beyond_the_models_positions_is_refused(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    with pytest.raises(DFlashError, match=r"--window 5,000 is beyond this model's 4,096 positions"):
        generate(target, drafter, tokenizer, "hi", max_tokens=2, window=5000)


@pytest.mark.parametrize("flags", [["--draft-quantize", "4bit"], ["--quantize-fc"], ["--draft-window", "512"]])
def test_a_gguf_convert_refuses_what_is_for_a_drafter(tmp_path, flags):
    from test_gguf import make_source, write_gguf

    source = make_source(tmp_path, "qwen3", num_hidden_layers=2)
    write_gguf(source, tmp_path / "m.gguf")
    line = _one_line("convert", tmp_path / "m.gguf", "-o", tmp_path / "out", *flags)
    assert f"{flags[0]} is for a drafter; a GGUF file converts alone" in line
    assert not (tmp_path / "out").exists()


def test_gguf_paths_say_what_to_do(tmp_path):
    assert "no such file" in _one_line("convert", tmp_path / "nonexistent.gguf", "-o", tmp_path / "out")
    (tmp_path / "some.gguf").write_bytes(b"GGUF")
    for command in ("generate", "chat"):
        line = _one_line(command, tmp_path / "some.gguf", *(["-p", "hi"] if command == "generate" else []))
        assert "is a file" in line and f"dflash-mlx convert {tmp_path / 'some.gguf'} -o FOLDER" in line


def test_a_model_without_a_drafter_that_cannot_be_downloaded_says_so(monkeypatch):
    """The README's own example of a model served alone, offline: it is a download that failed, not a drafter
    missing its target."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args in (["serve", "mlx-community/Qwen3-4B-4bit"], ["generate", "HuggingFaceTB/SmolLM2-135M-Instruct", "-p", "hi"]):
        line = _one_line(*args)
        assert "cannot download" in line and "--target" not in line, line


def test_a_prompt_longer_than_the_model_is_our_line_alone(models_dir, tmp_path):
    """Transformers' "Token indices sequence length is longer than..." (its tokenizer's model_max_length, which real
    tokenizers set) no longer comes before it: a real process, whose stderr is what a user sees."""
    target = tmp_path / "target"
    shutil.copytree(models_dir / "qwen3", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=4096)))
    run = subprocess.run([sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "generate",
                          str(models_dir / "qwen3-dflash"), "--target", str(target), "-p", "word " * 5000],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "this model takes at most 4096 positions" in lines[0]


def test_a_cycle_that_took_no_time_costs_the_estimates_nothing():
    costs = CycleCosts(15)
    for k, seconds in [(15, 0.0), (0, 0.0), (1, 0.0), (0, 0.01), (3, 0.02), (0, 0.0)]:
        costs.update(k, seconds)
    assert costs.plain > 0 and all(costs.predict(k) > 0 for k in range(16))


def test_a_new_drafter_at_a_freed_ones_address_starts_afresh(pairs):
    """Policies are kept per loaded pair: a drafter loaded where a freed one lived must not inherit what it learned
    (an ``id`` alone would match)."""
    target = pairs["qwen3"][0]

    class Drafter:  # stands in for any drafter: what matters is its identity
        pass

    shared, first = PerPair(), Drafter()
    address, learned = id(first), shared.get(target, first, "settings", object)
    assert shared.get(target, first, "settings", object) is learned
    gone = weakref.ref(first)
    del first
    assert gone() is None
    newcomer = next((d for d in (Drafter() for _ in range(10000)) if id(d) == address), None)
    if newcomer is None:
        pytest.skip("the allocator gave no new object the freed address")
    assert shared.get(target, newcomer, "settings", object) is not learned


def test_help_shows_flags_without_a_type(models_dir):
    for args in ([], ["models"], ["chat"], ["generate"], ["serve"], ["train"]):
        text = CliRunner(env={"COLUMNS": "120"}).invoke(app, [*args, "--help"]).output
        assert "<bool>" not in text, args
        assert "--help" in text


def test_doctor_and_models_list_models_converted_from_gguf(tmp_path):
    from test_gguf import make_source, write_gguf

    source = make_source(tmp_path, "qwen3", num_hidden_layers=2)
    write_gguf(source, tmp_path / "m.gguf")
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "from-gguf")])
    assert result.exit_code == 0, result.output
    for command in ("doctor", "models"):
        out = CliRunner(env={"COLUMNS": "200"}).invoke(app, [command]).output
        assert str((tmp_path / "from-gguf").resolve()) in out, command


def test_models_explains_every_status_and_think_value():
    out = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["models"]).output
    legend = " ".join(out.split())
    for word in ("none: the model has no such mode", "unknown: not stated", "untested:", "not yet:", "gated:"):
        assert word in legend, word
