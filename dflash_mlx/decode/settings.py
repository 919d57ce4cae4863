"""What a generation runs with, as three frozen objects, each default written once.

``CacheLayout`` is what a pair's caches are made for (every generation that shares a cache shares it);
``DecodeSettings`` how a loaded pair decodes, the same for every request of a chat, a server or a batch;
``RequestSettings`` what one request asks. The CLI and the server build them once; ``stream_generate``'s
keywords (mlx-lm's shape, for library users) are a facade that builds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from ..errors import DFlashError
from ..models.caches import (
    FULL_CONTEXT,
    KVQuantization,
    check_block_size,
    check_draft_window,
    check_kv,
    check_window,
    check_window_fits,
    copy_block,
)
from ..sampling import Sampling
from .policy import AUTO, check_source
from .stops import stop_list

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # mlx-lm's: (tokens so far, logits [1, V]) -> logits
PREFILL_STEP = 2048  # prompt tokens a prefill chunk takes, without a window


@dataclass(frozen=True)
class CacheLayout:
    """What a pair's caches are made for: a cache made for one layout is refused by a generation with another."""

    window: Optional[int] = None  # full-attention layers and the drafter's context keep the last `window` positions
    sinks: int = 0  # ... and, with a window, these first ones
    block_size: Optional[int] = None  # positions a verify takes at most; None: ``caches.copy_block``
    kv: Optional[KVQuantization] = None  # the target's KV cache quantized (--kv-bits), from kv.start tokens
    # The drafter's context window (--draft-window): it attends to the last ``draft_window`` context positions, the
    # target to all (or its ``window``). None: the drafter's own default; FULL_CONTEXT (0): all of them.
    draft_window: Optional[int] = None

    def of_pair(self, target: Any, drafter: Any) -> CacheLayout:
        """This layout checked against the pair, its block size and drafter window resolved."""
        block_size = copy_block(drafter) if self.block_size is None else self.block_size
        check_block_size(block_size, drafter)
        check_window(self.window, self.sinks, block_size)
        check_window_fits(self.window, target)
        check_kv(self.kv, target, self.window)
        draft_window = getattr(drafter, "context_window", FULL_CONTEXT) if self.draft_window is None else self.draft_window
        check_draft_window(draft_window, block_size)
        return dataclasses.replace(self, block_size=block_size, draft_window=draft_window)

    def drafter_window(self) -> tuple[Optional[int], int]:
        """(window, sinks) of the drafter's context caches: the narrower of ``window`` and ``draft_window``; the
        sinks only where the target's window is the drafter's."""
        own = self.draft_window or None
        if self.window is None or (own is not None and own < self.window):
            return own, 0
        return self.window, self.sinks

    def describe(self) -> str:
        return (f"window={self.window}, sinks={self.sinks}, block_size={self.block_size}, "
                f"draft_window={self.draft_window}")


@dataclass(frozen=True)
class DecodeSettings:
    """How a loaded pair decodes, the same for every request it serves; ``layout.block_size`` set pins every cycle
    to a full block (else the adaptive policy chooses each cycle's depth)."""

    layout: CacheLayout = CacheLayout()
    prefill_step_size: Optional[int] = None  # None: PREFILL_STEP, or window // 16 with a window
    draft_source: str = AUTO  # "auto" (the policy chooses), "drafter" or "copy"

    def __post_init__(self) -> None:
        check_source(self.draft_source)
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise DFlashError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")

    def prefill_chunk(self, block_size: int) -> int:
        """Prompt tokens per prefill chunk. With a window a chunk attends over ``window + chunk`` positions, so
        small chunks keep a long prompt's peak memory within a few percent of a prompt that just fills it."""
        if self.prefill_step_size is not None:
            return self.prefill_step_size
        window = self.layout.window
        return PREFILL_STEP if window is None else max(block_size, min(PREFILL_STEP, window // 16))


@dataclass(frozen=True)
class RequestSettings:
    """What one request asks: its budget, sampling, stops, logprobs and logits processors."""

    max_tokens: int = 256
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()  # stop strings (checked by ``stops.stop_list``)
    logprobs: Optional[int] = None  # alternatives per token with their log-probabilities; None: none
    logits_processors: tuple[LogitsProcessor, ...] = ()
    eos_token_ids: Optional[frozenset[int]] = None  # None: the tokenizer's

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", stop_list(self.stop))  # one string is one stop, not its characters
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if self.max_tokens < 1:
            raise DFlashError(f"max_tokens must be >= 1, got {self.max_tokens}")
        logprobs = self.logprobs
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise DFlashError(f"logprobs must be an integer >= 0 (alternatives per token), got {logprobs!r}")
