"""Shared test helpers: the plain greedy reference decoder."""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx
from mlx_lm.generate import generate_step


def plain_greedy(model, prompt: list[int], max_tokens: int, eos: Iterable[int] = ()) -> list[int]:
    """mlx-lm's own greedy decoding, stopped the way dflash stops (EOS not emitted)."""
    eos = set(eos)
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out
