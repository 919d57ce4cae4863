"""The DFlash decode loop: draft a block in one pass, verify it in one pass, keep the agreeing prefix.

Each cycle is built as one lazy graph (draft -> verify -> argmax) and evaluated
asynchronously; the previous cycle's tokens are detokenized and handed to the
caller while the device works (on Metal; MLX's CPU backend does most of the
work inside ``async_eval`` itself). The host reads the device once per cycle:
the drafted and verified token ids, from which the accepted length follows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from .caches import check_window
from .drafter import Drafter
from .errors import DFlashError
from .target import Target

Prompt = Union[str, Sequence[int], mx.array]


@dataclass
class GenerationResponse:
    """What one decode cycle produced, plus running statistics."""

    text: str
    tokens: list[int]
    accepted: int  # drafted tokens the target agreed with in this cycle
    drafted: list[int]  # what the drafter proposed this cycle (empty for the prefill token)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float  # tokens after the first, per second after the first
    peak_memory: float  # GB
    cache_bytes: int  # KV caches of target and drafter together
    finish_reason: Optional[str] = None  # "stop" (EOS), "length" (max_tokens) or None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: Optional[str]
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    acceptance: list[int] = field(default_factory=list)  # accepted drafts, per cycle

    @property
    def cycles(self) -> int:
        return len(self.acceptance)

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle, the target's own (bonus) token included."""
        return sum(a + 1 for a in self.acceptance) / len(self.acceptance) if self.acceptance else 0.0

    @property
    def histogram(self) -> list[int]:
        """``histogram[k]`` = number of cycles that accepted exactly k drafted tokens."""
        hist = [0] * (max(self.acceptance, default=0) + 1)
        for a in self.acceptance:
            hist[a] += 1
        return hist

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
            "peak_memory_gb": self.peak_memory,
            "cycles": self.cycles,
            "tau": self.tau,
            "acceptance_histogram": self.histogram,
        }


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        ids = prompt.tolist()
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise DFlashError("the prompt is empty")
    return ids


def _cut(tokens: list[int], eos: frozenset[int], budget: int) -> tuple[list[int], Optional[str]]:
    """Tokens up to (not including) the first EOS, and at most ``budget`` of them."""
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j], "stop"
    if len(tokens) >= budget:
        return tokens[:budget], "length"
    return tokens, None


def _draft(target: Target, drafter: Drafter, last: mx.array, context: mx.array, cache: list, n: int) -> mx.array:
    """n - 1 draft tokens for the block [last, MASK x (n-1)], from one drafter pass."""
    block = mx.concatenate([last, mx.full((n - 1,), drafter.mask_token_id, dtype=last.dtype)])
    embeddings = target.embed(block[None])
    if drafter.input_embedding_scale != 1.0:
        embeddings = embeddings * drafter.input_embedding_scale
    h = drafter(embeddings, context, cache)
    return mx.argmax(drafter.compute_logits(target.lm_head(h[:, 1:])), axis=-1)[0]


def _prefill(
    target: Target,
    drafter: Optional[Drafter],
    prompt: list[int],
    target_cache: list,
    draft_cache: list,
    chunk: int,
    progress: Callable[[int, int], None],
) -> tuple[mx.array, Optional[mx.array]]:
    """Run the prompt through the target in chunks; return the next token and the pending context.

    Each chunk's attention sees only what the caches keep, so no prompt-sized mask
    is ever built. Features of all chunks but the last go straight into the
    drafter's context cache (windowed like the target's); the last chunk's are
    handed to the first draft.
    """
    total = len(prompt)
    progress(0, total)
    for start in range(0, total, chunk):
        ids = mx.array(prompt[start : start + chunk])[None]
        with mx.stream(generation_stream):
            logits, features = target(ids, target_cache, last_logits_only=True)
            if start + chunk < total:
                if drafter is not None:
                    drafter.add_context(features, draft_cache)
                mx.eval([c.state for c in target_cache + draft_cache])
        progress(min(start + chunk, total), total)
    with mx.stream(generation_stream):
        last = mx.argmax(logits[0], axis=-1)
    mx.eval(last, features)
    mx.clear_cache()  # prefill's temporaries are the largest buffers of the run
    return last, features if drafter is not None else None


class _Cycle(NamedTuple):
    tokens: list[int]
    drafted: list[int]
    accepted: int
    reason: Optional[str]
    cache_bytes: int


def _decode(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_tokens: int,
    block_size: int,
    eos: frozenset[int],
    window: Optional[int],
    sinks: int,
    prefill_step_size: int,
    progress: Callable[[int, int], None],
) -> Iterator[_Cycle]:
    """Yield each cycle's outcome, the prefill's token first."""
    target_cache = target.make_cache(window, sinks, slack=block_size)
    draft_cache = drafter.make_cache(window, sinks, block_size) if block_size > 1 else []
    last, context = _prefill(
        target, drafter if block_size > 1 else None, prompt, target_cache, draft_cache, prefill_step_size, progress
    )
    pending, reason = _cut(last.tolist(), eos, max_tokens)
    draft_tokens: list[int] = []
    accepted, emitted = 0, len(pending)
    while True:
        if reason is None:
            n = min(block_size, max_tokens - emitted)
            with mx.stream(generation_stream):
                if n > 1:
                    drafted = _draft(target, drafter, last, context, draft_cache, n)
                    block = mx.concatenate([last, drafted])
                else:
                    drafted, block = None, last
                logits, features = target(block[None], target_cache)
                verified = mx.argmax(logits[0], axis=-1)
            mx.async_eval(verified, drafted) if drafted is not None else mx.async_eval(verified)
        # The caller's work on these tokens overlaps the cycle computing above.
        yield _Cycle(pending, draft_tokens, accepted, reason, sum(c.nbytes for c in target_cache + draft_cache))
        if reason is not None:
            return
        target_tokens = verified.tolist()  # the one host read per cycle
        draft_tokens = drafted.tolist() if drafted is not None else []
        accepted = 0
        while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
            accepted += 1
        Target.rollback(target_cache, n - accepted - 1)
        last = verified[accepted : accepted + 1]
        if block_size > 1:
            context = features[:, : accepted + 1]
        pending, reason = _cut(target_tokens[: accepted + 1], eos, max_tokens - emitted)
        emitted += len(pending)


@contextlib.contextmanager
def _release_buffers() -> Iterator[None]:
    """Hand MLX's cached buffers back when a generation ends, however it ends."""
    try:
        yield
    finally:
        mx.clear_cache()


def stream_generate(
    target: Target,
    drafter: Drafter,
    tokenizer: Any,
    prompt: Prompt,
    *,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    eos_token_ids: Optional[Iterable[int]] = None,
    window: Optional[int] = None,
    sinks: int = 0,
    prefill_step_size: Optional[int] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
) -> Iterator[GenerationResponse]:
    """Generate greedily with DFlash, yielding one response per verify cycle.

    The output equals the target's own greedy decoding (under the same attention
    window, if any) token for token. Generation stops after ``max_tokens`` tokens
    or before the first EOS token (not emitted).

    ``window`` bounds memory for long contexts: full-attention layers and the
    drafter's context keep ``sinks`` first positions plus the last ``window``.
    The prompt is prefilled ``prefill_step_size`` tokens at a time, reporting
    ``(done, total)`` to ``prompt_progress_callback``. By default that is 2048,
    or ``window // 16`` with a window: a chunk attends over ``window + chunk``
    positions, so small chunks keep a long prompt's peak memory within a few
    percent of a prompt that just fills the window.
    """
    block_size = drafter.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or block_size < 1:
        raise DFlashError(f"block_size must be an integer >= 1, got {block_size!r}")
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be >= 1, got {max_tokens}")
    if window is not None:
        check_window(window, sinks, block_size)
    if prefill_step_size is None:
        prefill_step_size = 2048 if window is None else max(block_size, min(2048, window // 16))
    if prefill_step_size < 1:
        raise DFlashError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
    ids = encode_prompt(tokenizer, prompt)
    eos = frozenset(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
    detokenizer = tokenizer.detokenizer

    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps, first_time, generated = 0.0, 0.0, 0
    with wired_limit(target.model, [generation_stream]), _release_buffers():
        for i, cycle in enumerate(
            _decode(
                target, drafter, ids, max_tokens, block_size, eos, window, sinks, prefill_step_size,
                prompt_progress_callback or (lambda done, total: None),
            )
        ):
            now = time.perf_counter()
            if i == 0:
                prompt_tps = len(ids) / (now - tic)
                first_time = now
            generated += len(cycle.tokens)
            for t in cycle.tokens:
                detokenizer.add_token(t)
            if cycle.reason is not None:
                detokenizer.finalize()
            elapsed = now - first_time
            yield GenerationResponse(
                text=detokenizer.last_segment,
                tokens=cycle.tokens,
                accepted=cycle.accepted,
                drafted=cycle.drafted,
                prompt_tokens=len(ids),
                prompt_tps=prompt_tps,
                generation_tokens=generated,
                generation_tps=(generated - 1) / elapsed if elapsed > 0 and generated > 1 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                cache_bytes=cycle.cache_bytes,
                finish_reason=cycle.reason,
            )


def generate(
    target: Target,
    drafter: Drafter,
    tokenizer: Any,
    prompt: Prompt,
    on_response: Optional[Callable[[GenerationResponse], None]] = None,
    **kwargs: Any,
) -> GenerationResult:
    """Run :func:`stream_generate` to the end; return the text with the run's statistics.

    ``on_response`` sees every cycle's response as it arrives (to stream the text).
    """
    text: list[str] = []
    tokens: list[int] = []
    acceptance: list[int] = []
    response = None
    for i, response in enumerate(stream_generate(target, drafter, tokenizer, prompt, **kwargs)):
        if on_response is not None:
            on_response(response)
        text.append(response.text)
        tokens.extend(response.tokens)
        if i > 0:  # the first response is the prefill's token, not a verify cycle
            acceptance.append(response.accepted)
    assert response is not None
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        finish_reason=response.finish_reason,
        prompt_tokens=response.prompt_tokens,
        prompt_tps=response.prompt_tps,
        generation_tokens=response.generation_tokens,
        generation_tps=response.generation_tps,
        peak_memory=response.peak_memory,
        acceptance=acceptance,
    )
