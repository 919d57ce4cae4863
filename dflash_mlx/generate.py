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
from .sampling import Sampling, verify_match, verify_rejection
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
    prompt_cached: int  # prompt tokens reused from the cache, not prefilled
    prompt_tps: float  # prefilled tokens per second
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
    prompt_cached: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    acceptance: list[int] = field(default_factory=list)  # accepted drafts, per cycle
    drafted: list[int] = field(default_factory=list)  # drafts proposed, per cycle

    @property
    def cycles(self) -> int:
        return len(self.acceptance)

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle, the target's own (bonus) token included."""
        return sum(a + 1 for a in self.acceptance) / len(self.acceptance) if self.acceptance else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target accepted."""
        return sum(self.acceptance) / sum(self.drafted) if sum(self.drafted) else 0.0

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
            "prompt_cached": self.prompt_cached,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
            "peak_memory_gb": self.peak_memory,
            "cycles": self.cycles,
            "tau": self.tau,
            "acceptance_histogram": self.histogram,
            "acceptance_rate": self.acceptance_rate,
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


def _draft_logits(target: Target, drafter: Drafter, last: mx.array, context: mx.array, cache: list, n: int) -> mx.array:
    """Logits [n-1, V] for the block [last, MASK x (n-1)], from one drafter pass."""
    block = mx.concatenate([last, mx.full((n - 1,), drafter.mask_token_id, dtype=last.dtype)])
    embeddings = target.embed(block[None])
    if drafter.input_embedding_scale != 1.0:
        embeddings = embeddings * drafter.input_embedding_scale
    h = drafter(embeddings, context, cache)
    return drafter.compute_logits(target.lm_head(h[:, 1:]))[0]


def _cycle(
    target: Target,
    drafter: Drafter,
    sampling: Sampling,
    last: mx.array,
    context: Optional[mx.array],
    caches: tuple[list, list],
    n: int,
    key: Optional[mx.array],
) -> tuple[Optional[mx.array], mx.array, mx.array, mx.array]:
    """One draft + verify graph: (drafts, accept per draft, token to emit per stop position, features)."""
    target_cache, draft_cache = caches
    drafted = q = None
    if key is not None:
        k_draft, k_verify = mx.random.split(key)
    if n > 1:
        draft_logits = _draft_logits(target, drafter, last, context, draft_cache, n)
        if sampling.greedy:
            drafted = mx.argmax(draft_logits, axis=-1)
        else:
            q = sampling.logprobs(draft_logits)
            drafted = mx.random.categorical(q, key=k_draft)
    block = last if drafted is None else mx.concatenate([last, drafted])
    logits, features = target(block[None], target_cache)
    if sampling.greedy:
        stops = mx.argmax(logits[0], axis=-1)
        accept = drafted == stops[:-1] if drafted is not None else None
    else:
        p = sampling.logprobs(logits[0])
        if drafted is None:
            accept, stops = None, mx.random.categorical(p, key=k_verify)
        elif sampling.verify == "match":
            accept, stops = verify_match(drafted, p, k_verify)
        else:
            accept, stops = verify_rejection(drafted, q, p, k_verify)
    return drafted, accept, stops, features


def _prefill(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    cache: "DFlashCache",
    chunk: int,
    progress: Callable[[int, int], None],
    sampling: Sampling,
    key: Optional[mx.array],
) -> mx.array:
    """Run ``prompt`` (the tokens the cache lacks) through the target in chunks; return the next token.

    Each chunk's attention sees only what the caches keep, so no prompt-sized mask
    is ever built. Features of all chunks but the last go straight into the
    drafter's context cache (windowed like the target's); the last chunk's stay
    pending in ``cache.context`` for the first draft.
    """
    total = len(prompt)
    progress(0, total)
    for start in range(0, total, chunk):
        ids = mx.array(prompt[start : start + chunk])[None]
        with mx.stream(generation_stream):
            if cache.context is not None:
                drafter.add_context(cache.context, cache.drafter)
            logits, features = target(ids, cache.target, last_logits_only=True)
            cache.context = features if cache.drafter else None
            if start + chunk < total:
                mx.eval([c.state for c in cache.target + cache.drafter])
        progress(min(start + chunk, total), total)
    cache.tokens.extend(prompt)
    with mx.stream(generation_stream):
        logits = logits[0, -1:]
        last = mx.argmax(logits, axis=-1) if key is None else mx.random.categorical(sampling.logprobs(logits), key=key)
    mx.eval([x for x in (last, cache.context) if x is not None])
    mx.clear_cache()  # prefill's temporaries are the largest buffers of the run
    return last


@dataclass
class DFlashCache:
    """Target and drafter caches that outlive one generation.

    Pass the same cache to successive calls of :func:`stream_generate` (a chat) and
    each call prefills only the prompt tokens the cache does not already hold.
    """

    target: list
    drafter: list
    settings: tuple  # (window, sinks, block_size) the caches were built for
    tokens: list[int] = field(default_factory=list)  # what the target cache holds, in order
    context: Optional[mx.array] = None  # features of cached tokens the drafter has not seen yet

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.target + self.drafter)


def make_cache(
    target: Target, drafter: Drafter, window: Optional[int] = None, sinks: int = 0, block_size: Optional[int] = None
) -> DFlashCache:
    """Empty caches for generations with these settings (see :func:`stream_generate`)."""
    block_size = drafter.block_size if block_size is None else block_size
    if window is not None:
        check_window(window, sinks, block_size)
    return DFlashCache(
        target=target.make_cache(window, sinks, slack=block_size),
        drafter=drafter.make_cache(window, sinks, block_size) if block_size > 1 else [],
        settings=(window, sinks, block_size),
    )


class _Cycle(NamedTuple):
    tokens: list[int]
    drafted: list[int]
    accepted: int
    reason: Optional[str]
    cache_bytes: int


def _decode(
    target: Target,
    drafter: Drafter,
    cache: DFlashCache,
    prompt: list[int],
    max_tokens: int,
    eos: frozenset[int],
    prefill_step_size: int,
    progress: Callable[[int, int], None],
    sampling: Sampling,
) -> Iterator[_Cycle]:
    """Yield each cycle's outcome, the prefill's token first.

    On return ``cache`` holds exactly the prompt and the emitted tokens, except a
    last token the target has not consumed yet (the next prompt supplies it).
    """
    block_size = cache.settings[2]
    key = None if sampling.greedy else sampling.key()
    if key is not None:
        key, first_key = mx.random.split(key)
    last = _prefill(target, drafter, prompt, cache, prefill_step_size, progress, sampling,
                    None if key is None else first_key)
    last_id = last.item()
    pending, reason = _cut([last_id], eos, max_tokens)
    draft_tokens: list[int] = []
    accepted, emitted = 0, len(pending)
    while True:
        if reason is None:
            n = min(block_size, max_tokens - emitted)
            if key is not None:
                key, cycle_key = mx.random.split(key)
            with mx.stream(generation_stream):
                drafted, accept, stops, features = _cycle(
                    target, drafter, sampling, last, cache.context, (cache.target, cache.drafter), n,
                    None if key is None else cycle_key,
                )
            mx.async_eval([x for x in (drafted, accept, stops) if x is not None])
        # The caller's work on these tokens overlaps the cycle computing above.
        yield _Cycle(pending, draft_tokens, accepted, reason, cache.nbytes)
        if reason is not None:
            return
        stop_tokens = stops.tolist()  # the one host read per cycle (the rest is ready with it)
        draft_tokens = drafted.tolist() if drafted is not None else []
        accepts = accept.tolist() if accept is not None else []
        accepted = 0
        while accepted < len(accepts) and accepts[accepted]:
            accepted += 1
        pending, reason = _cut(draft_tokens[:accepted] + [stop_tokens[accepted]], eos, max_tokens - emitted)
        emitted += len(pending)
        # Keep [last] + accepted drafts in the caches, but no EOS draft nor what follows it.
        keep = min(accepted, len(pending)) + 1
        Target.rollback(cache.target, n - keep)
        cache.tokens.extend([last_id] + draft_tokens[: keep - 1])
        cache.context = features[:, :keep] if cache.drafter else None
        last = stops[accepted : accepted + 1]
        last_id = stop_tokens[accepted]


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
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    verify: str = "rejection",
    cache: Optional[DFlashCache] = None,
) -> Iterator[GenerationResponse]:
    """Generate greedily with DFlash, yielding one response per verify cycle.

    At ``temperature`` 0 the output equals the target's own greedy decoding (under
    the same attention window, if any) token for token. Above it, tokens are drawn
    from the target's distribution after mlx-lm's ``top_p``/``min_p``/``top_k``
    filters, exactly: ``verify="rejection"`` (speculative sampling) or ``"match"``
    (keep drafts equal to target samples; accepts less). ``seed`` makes a run
    reproducible. Generation stops after ``max_tokens`` tokens or before the first
    EOS token (not emitted).

    ``cache`` (from :func:`make_cache`, same window and block size) carries the
    caches across calls: when its tokens begin the new prompt, only the rest is
    prefilled (``GenerationResponse.prompt_cached`` counts the reused tokens).

    ``window`` bounds memory for long contexts: full-attention layers and the
    drafter's context keep ``sinks`` first positions plus the last ``window``.
    The prompt is prefilled ``prefill_step_size`` tokens at a time, reporting
    ``(done, total)`` to ``prompt_progress_callback``. By default that is 2048,
    or ``window // 16`` with a window: a chunk attends over ``window + chunk``
    positions, so small chunks keep a long prompt's peak memory within a few
    percent of a prompt that just fills the window.
    """
    sampling = Sampling(temperature, top_p, top_k, min_p, seed, verify)
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
    if cache is None:
        cache = make_cache(target, drafter, window, sinks, block_size)
    elif cache.settings != (window, sinks, block_size):
        raise DFlashError(
            f"cache was made for (window, sinks, block_size) = {cache.settings}, "
            f"this call uses {(window, sinks, block_size)}"
        )
    reused = len(cache.tokens)
    if not (0 < reused < len(ids) and ids[:reused] == cache.tokens):
        # A different history (or nothing new to prefill): start from empty caches.
        fresh = make_cache(target, drafter, window, sinks, block_size)
        cache.target, cache.drafter, cache.tokens, cache.context = fresh.target, fresh.drafter, [], None
        reused = 0
    detokenizer = tokenizer.detokenizer

    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps, first_time, generated = 0.0, 0.0, 0
    with wired_limit(target.model, [generation_stream]), _release_buffers():
        for i, cycle in enumerate(
            _decode(
                target, drafter, cache, ids[reused:], max_tokens, eos, prefill_step_size,
                prompt_progress_callback or (lambda done, total: None), sampling,
            )
        ):
            now = time.perf_counter()
            if i == 0:
                prompt_tps = (len(ids) - reused) / (now - tic)
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
                prompt_cached=reused,
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
    drafted: list[int] = []
    response = None
    for i, response in enumerate(stream_generate(target, drafter, tokenizer, prompt, **kwargs)):
        if on_response is not None:
            on_response(response)
        text.append(response.text)
        tokens.extend(response.tokens)
        if i > 0:  # the first response is the prefill's token, not a verify cycle
            acceptance.append(response.accepted)
            drafted.append(len(response.drafted))
    assert response is not None
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        finish_reason=response.finish_reason,
        prompt_tokens=response.prompt_tokens,
        prompt_cached=response.prompt_cached,
        prompt_tps=response.prompt_tps,
        generation_tokens=response.generation_tokens,
        generation_tps=response.generation_tps,
        peak_memory=response.peak_memory,
        acceptance=acceptance,
        drafted=drafted,
    )
