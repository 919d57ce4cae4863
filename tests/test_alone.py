"""A model without a drafter (``load`` of a plain mlx-lm folder): plain steps and copy drafts, exact everywhere."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from helpers import finish, plain_greedy, start_server
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, load
from dflash_mlx.cli.main import app
from dflash_mlx.decode.generate import batch_generate
from dflash_mlx.models.drafter import NoDrafter

PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def alone(looping_dir):
    """The looping target, loaded alone: its replies fall into loops that copies take whole."""
    return load(str(looping_dir / "target"))


def test_a_plain_model_loads_alone_and_copies_its_loops_exactly(alone):
    """The default policy weighs the cycles' measured times, so how many copies it drafts follows the machine's
    load (144-155 of 200 tokens quiet, 95 beside the test suite): its count is checked loosely, and a pinned
    block, which drafts every copy it finds, checks that loops are taken whole."""
    target, drafter, tokenizer = alone
    assert isinstance(drafter, NoDrafter) and target.layer_ids == []
    ids = tokenizer.encode(PROMPT)
    reference = plain_greedy(target.model, ids, 200)
    result = generate(target, drafter, tokenizer, ids, max_tokens=200, eos_token_ids=[])
    assert result.tokens == reference
    assert result.by_source["drafter"]["drafted"] == 0  # never a drafter pass
    assert result.by_source["copy"]["accepted"] > 50
    pinned = generate(target, drafter, tokenizer, ids, max_tokens=200, eos_token_ids=[], block_size=16)
    assert pinned.tokens == reference and pinned.by_source["drafter"]["drafted"] == 0
    assert pinned.by_source["copy"]["accepted"] > 100 and pinned.cycles < 100


@pytest.mark.parametrize("settings", [dict(block_size=4), dict(draft_source="copy"), dict(temperature=0.8, seed=3)])
def test_every_setting_that_needs_no_drafter_runs_alone(alone, settings):
    target, drafter, tokenizer = alone
    ids = tokenizer.encode(PROMPT)
    result = generate(target, drafter, tokenizer, ids, max_tokens=60, eos_token_ids=[], **settings)
    if "temperature" not in settings:
        assert result.tokens == plain_greedy(target.model, ids, 60)
    assert len(result.tokens) == 60 and result.by_source["drafter"]["drafted"] == 0


def test_asking_a_model_alone_for_drafter_drafts_is_refused(alone):
    target, drafter, tokenizer = alone
    with pytest.raises(DFlashError, match="loaded alone, without a drafter"):
        generate(target, drafter, tokenizer, PROMPT, max_tokens=8, draft_source="drafter")


def test_rows_of_a_model_alone_batch_exactly(alone):
    target, drafter, tokenizer = alone
    prompts = [PROMPT, "The quick brown fox", "import json\n"]
    results = batch_generate(target, drafter, tokenizer, prompts, max_tokens=80, eos_token_ids=[])
    for prompt, result in zip(prompts, results):
        assert result.tokens == plain_greedy(target.model, tokenizer.encode(prompt), 80)


def test_generate_takes_a_plain_model_folder(alone, looping_dir):
    target, drafter, tokenizer = alone
    result = CliRunner().invoke(app, ["generate", str(looping_dir / "target"), "-p", PROMPT, "-m", "50",
                                      "--no-chat-template", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == generate(target, drafter, tokenizer, PROMPT, max_tokens=50).tokens
    refused = CliRunner().invoke(app, ["generate", str(looping_dir / "target"), "-p", "hi", "--draft-source", "drafter"])
    assert refused.exit_code != 0 and "without a drafter" in refused.output and "Traceback" not in refused.output


def test_serve_answers_with_a_plain_model(alone, looping_dir, tmp_path):
    """Batched, with its prompt cache on disk: the second request reuses the first's prompt."""
    target, drafter, tokenizer = alone
    proc, url = start_server(looping_dir / "target", None, "--max-batch", "2", "--prompt-cache-dir", str(tmp_path))
    try:
        body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}
        for _ in range(2):
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
            assert answer["choices"][0]["text"] == generate(target, drafter, tokenizer, PROMPT, max_tokens=60).text
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        proc.send_signal(2)
        out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_convert_says_a_model_alone_needs_no_bundle(looping_dir, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(looping_dir / "target"), "-o", str(tmp_path / "out")])
    assert result.exit_code != 0 and "without a drafter" in result.output and not (tmp_path / "out").exists()


def test_bench_measures_a_model_alone_against_plain_decoding(looping_dir):
    result = CliRunner().invoke(app, ["bench", str(looping_dir / "target"), "--num-prompts", "1", "-m", "24"])
    assert result.exit_code == 0, result.output
    assert "dflash (no drafter: copy drafts) vs plain decoding" in result.stdout
