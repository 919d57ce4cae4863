"""Tiny checkpoints written to disk once per session and loaded through the public loader."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest
from helpers import plain_greedy

from dflash_mlx import load
from dflash_mlx.models import fixtures

# The reference-BLAS warning of every decoding command has its own test (test_system.py); elsewhere it
# would be one more stderr line in what the tests read.
os.environ["DFLASH_MLX_BLAS_WARNING"] = "0"

MAX_TOKENS = 200
PROMPTS = ["def fibonacci(n):\n    return", "The quick brown fox", "import json\nimport os\n\nclass"]


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory):
    """Tests never write into the user's home (the list of converted bundles, chat history)."""
    home, before = tmp_path_factory.mktemp("home"), os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    yield home
    if before is not None:
        os.environ["HOME"] = before


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """Two targets (Qwen3 with its own LM head, Llama with tied embeddings) and their drafters."""
    root = tmp_path_factory.mktemp("models")
    qwen = fixtures.target_config("qwen3", tie_word_embeddings=False)
    llama = fixtures.target_config("llama", tie_word_embeddings=True, num_hidden_layers=5)
    fixtures.write_target(root / "qwen3", qwen, seed=0)
    fixtures.write_target(root / "llama", llama, seed=1)
    # A one-layer drafter in one bf16 file, and a two-layer one sharded in three files.
    fixtures.write_drafter(root / "qwen3-dflash", fixtures.drafter_config(qwen, 1, target_layer_ids=[2]))
    fixtures.write_drafter(
        root / "llama-dflash", fixtures.drafter_config(llama, 2, target_layer_ids=[0, 3]), shards=3
    )
    return root


@pytest.fixture(scope="session")
def pairs(models_dir) -> dict:
    return {
        name: load(str(models_dir / f"{name}-dflash"), str(models_dir / name))
        for name in ("qwen3", "llama")
    }


@pytest.fixture(scope="session")
def looping_dir(tmp_path_factory):
    """A folder with a target that falls into greedy loops (target/) and a random drafter for it (random/)."""
    root = tmp_path_factory.mktemp("looping")
    config = fixtures.target_config("qwen3")
    fixtures.write_target(root / "target", config, seed=0, init_scale=1.0)
    fixtures.write_drafter(root / "random", fixtures.drafter_config(config))
    return root


@pytest.fixture(scope="session")
def looping(looping_dir):
    """A target that falls into greedy loops, and a drafter that drafts its loop token.

    This gives long accepted runs (tau well above 1), so stop conditions are hit in
    the middle of accepted blocks.
    """
    root = looping_dir
    config = json.loads((root / "target" / "config.json").read_text())
    target, _, tokenizer = load(str(root / "random"), str(root / "target"))
    ids = tokenizer.encode("hello world")
    ref = plain_greedy(target.model, ids, MAX_TOKENS)
    loop_token = collections.Counter(ref).most_common(1)[0][0]
    fixtures.write_constant_drafter(root / "constant", fixtures.drafter_config(config), root / "target", loop_token)
    target, drafter, tokenizer = load(str(root / "constant"), str(root / "target"))
    return target, drafter, tokenizer, ids, ref, loop_token


@pytest.fixture(scope="session")
def agent_dir(tmp_path_factory) -> Path:
    """A scripted target in Qwen3's tool format (``fixtures.AGENT_SCRIPTS``: a think block then an answer, a tool
    call when tools are offered, an answer after a tool's result, the agents' shell calls), with a random drafter.
    Its script pieces are added tokens, so their ids lie past the tokenizer's ``vocab_size``, as Qwen's
    ``<tool_call>`` does. Its tokenizer compresses as a real one does (an agent's 80k-character request is ~25k
    tokens) and it has Qwen3-8B's 40,960 positions, which agents ask more of than it holds."""
    root = tmp_path_factory.mktemp("agent")
    # Qwen3-8B's positions; one layer of one narrow head, so that an agent's 15-25k-token prompt prefills in seconds
    config = fixtures.target_config("qwen3", vocab_size=8192, max_position_embeddings=40960, num_hidden_layers=1,
                                    num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    fixtures.write_scripted_target(root / "target", fixtures.AGENT_SCRIPTS, fixtures.TOOLS_TEMPLATE, config,
                                   large_corpus=True)
    fixtures.write_drafter(root / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[0]))
    return root
