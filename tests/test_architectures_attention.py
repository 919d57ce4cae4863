"""Lossless on every tested attention-only architecture: full attention, sliding windows, KV-shared layers, MLA,
MoE (``arch_matrix.check``)."""

from __future__ import annotations

import pytest
from arch_matrix import check, on_demand

NAMES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2", "olmo3", "granite", "smollm3", "glm4",
         "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "cohere2", "exaone4", "ministral3", "gpt_oss",
         "laguna", "muse_glimmer", "minimax_m2", "deepseek_v2", "deepseek_v3", "kimi_k25"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return on_demand(tmp_path_factory.mktemp("attention"))


@pytest.mark.parametrize("name", NAMES)
def test_lossless(pairs, name):
    check(pairs(name), name)
