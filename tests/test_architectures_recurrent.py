"""Lossless on every tested architecture with recurrent state or several caches per layer: GatedDeltaNet hybrids,
short convolutions, Mamba-2 mixers, DeepSeek sparse attention's indexer (``arch_matrix.check``)."""

from __future__ import annotations

import pytest
from arch_matrix import check, on_demand

NAMES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1", "mamba2", "granitemoehybrid",
         "glm_moe_dsa"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return on_demand(tmp_path_factory.mktemp("recurrent"))


@pytest.mark.parametrize("name", NAMES)
def test_lossless(pairs, name):
    check(pairs(name), name)
