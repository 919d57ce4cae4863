"""Lossless on the real pair: SmolLM2-135M-Instruct and its trained drafter (``make pair``), when present.

Opt-in: it runs where the pair was built (bench/.cache/smollm2/bundle) or where DFLASH_MLX_REAL_PAIR names
a bundle; elsewhere it skips, saying how to build one. Greedy DFlash equals mlx-lm's plain greedy decoding
token for token on the first prompt of each built-in set (math, code, chat, edit), with the adaptive default.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest
from helpers import plain_greedy

from dflash_mlx import generate, load

BUNDLE = Path(os.environ.get("DFLASH_MLX_REAL_PAIR", Path(__file__).parents[1] / "bench/.cache/smollm2/bundle"))
pytestmark = pytest.mark.skipif(not (BUNDLE / "dflash.json").is_file(),
                                reason=f"no real pair at {BUNDLE}: `make pair` builds it (or set DFLASH_MLX_REAL_PAIR)")


@pytest.fixture(scope="module")
def pair():
    return load(str(BUNDLE))


def prompts() -> list[tuple[str, str]]:
    sets = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())
    return [(f"{name}-{i}", p) for name, ps in sets.items() for i, p in enumerate(ps[:1])]


@pytest.mark.parametrize("block_size", [None])
def test_greedy_dflash_is_the_targets_own_greedy_decoding(pair, block_size):
    target, drafter, tokenizer = pair
    eos = tokenizer.eos_token_ids
    for name, text in prompts():
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out = generate(target, drafter, tokenizer, ids, max_tokens=96, block_size=block_size)
        assert out.tokens == plain_greedy(target.model, ids, 96, eos), f"{name} (block {block_size})"
