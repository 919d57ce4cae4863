"""One generation: ``stream_generate`` and ``generate``, the library's entry points, over the cycles of ``cycle``.

A call checks its settings, finds or makes its caches (``DFlashCache``: a chat passes the same one
again and prefills only what is new), picks its policy, runs the cycles and turns the tokens they
emit into responses: text detokenized while the next cycle computes, stop strings and the token
budget applied, the run's figures at the end. ``setup`` and ``responses_of`` are the same steps
for a row of a batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from ..chat_template import Prompt, encode_prompt
from ..distributed import shared_seed
from ..errors import DFlashError
from ..models.caches import KVQuantization
from ..models.drafter import Drafter, NoDrafter
from ..models.target import Target
from ..sampling import Sampling
from .batch import Batch, batch_planner, own_policy
from .cycle import Emitted, Row, prefill
from .policy import AUTO, COPY, DRAFTER, DraftPolicy, FixedBlock, adaptive_policy
from .responses import GenerationResponse, GenerationResult
from .scheduler import Scheduler, decode
from .settings import CacheLayout, DecodeSettings, LogitsProcessor, RequestSettings
from .stops import StopStrings, stop_list
from .transaction import DFlashCache

INTERRUPTED = "interrupted"  # the finish_reason of a generation that Ctrl-C cut short (chat, generate)

def check_context(max_positions: Optional[int], prompt_tokens: int, max_tokens: int) -> int:
    """The token budget within the model's positions: ``max_tokens``, or what the prompt leaves of them; a prompt
    that fills them is refused.

    One rule for every way in (the library, generate, chat, serve, whose agents ask for more
    than a local model holds): a reply stops at the end of the context, finish reason "length".
    """
    if max_positions is None:
        return max_tokens
    if prompt_tokens >= max_positions:
        raise DFlashError(f"the prompt has {prompt_tokens} tokens; this model takes at most {max_positions} positions")
    return min(max_tokens, max_positions - prompt_tokens)


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
    cache: Optional[DFlashCache] = None,
    policy: Optional[DraftPolicy] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    **settings: Any,
) -> Iterator[GenerationResponse]:
    """Generate greedily with DFlash, yielding one response per verify cycle.

    ``settings`` are :func:`keyword_settings`' keywords (mlx-lm's names, their defaults there), described here.

    At ``temperature`` 0 the output equals the target's own greedy decoding (under
    the same attention window, if any) token for token. Above it, tokens are drawn
    from the target's distribution after mlx-lm's ``top_p``/``min_p``/``top_k``
    filters, exactly: ``verify="rejection"`` (speculative sampling) or ``"match"``
    (keep drafts equal to target samples; accepts less); ``"auto"`` is rejection,
    or match with a ``seed``. ``seed`` makes a run reproducible: seeded match
    sampling draws each position with a key of its own, so it keeps the adaptive
    depth; seeded rejection sampling drafts full blocks. Generation stops after ``max_tokens`` tokens, before the first
    EOS token (not emitted) or before the first of the ``stop`` strings: that
    string, and any text after it, is never in a response's text (text that could
    begin one is held back until the next cycle decides it); the response that
    ends on it has ``stop_sequence`` set, and its tokens end with the one that
    completed the string. A prompt that fills the target's positions is refused; a reply
    stops at the end of them (``finish_reason`` "length").

    ``logprobs=k`` gives each response ``logprobs`` (each token's log-probability
    under the target's own distribution, before temperature and filters, as plain
    decoding reports it) and ``top_logprobs`` (the k most likely tokens there, with
    theirs), taken from the logits of the verify that emitted the token: no pass
    of its own.

    ``logits_processors`` are mlx-lm's (``mlx_lm.sample_utils.make_logits_processors``:
    repetition, presence and frequency penalties, logit bias; or any callable
    ``(tokens, logits) -> logits``), applied to the target's logits at every
    verified position with that position's own history (the prompt and the tokens
    before it), before sampling and logprobs, as mlx-lm applies them at every step:
    greedy output equals mlx-lm's with the same processors, and sampling keeps the
    processed distribution.

    ``kv_bits`` (with ``kv_group_size`` and ``quantized_kv_start``, as mlx-lm's
    ``generate_step`` takes them) quantizes the target's KV cache once it holds
    ``quantized_kv_start`` tokens, at the point mlx-lm's plain decoding does: greedy
    output equals mlx-lm's greedy decoding with the same quantized cache (and the
    same ``prefill_step_size``). Rejected tokens roll back on the quantized cache as
    on any other.

    ``cache`` (from :func:`make_cache`, same window and block size) carries the
    caches across calls: when its tokens begin the new prompt, only the rest is
    prefilled (``GenerationResponse.prompt_cached`` counts the reused tokens).

    How many tokens to draft is decided each cycle: by default an adaptive policy
    (``policy.AdaptiveDepth``) drafts up to ``block_size - 1`` tokens, as many as
    pay on this machine at the current context and acceptance, none (plain
    decoding) when speculation cannot pay. Passing ``block_size`` pins every
    cycle to a full block; ``policy`` takes any ``DraftPolicy``. Seeded rejection
    sampling also drafts full blocks: its draw depends on the depths, and a seeded
    run must give the same tokens every time.

    ``draft_source`` says where drafts come from: "auto" (the adaptive policy
    chooses, cycle by cycle, between the drafter and a copy draft, the
    continuation of an earlier occurrence of the history's end, which costs no
    drafter pass), "drafter", or "copy" (copy drafts of the block size only, a
    plain step where the history offers none). Every source is verified alike:
    the output is the same.

    ``window`` bounds memory for long contexts: full-attention layers and the
    drafter's context keep ``sinks`` first positions plus the last ``window``.
    The prompt is prefilled ``prefill_step_size`` tokens at a time, reporting
    ``(done, total)`` to ``prompt_progress_callback``. By default that is 2048,
    or ``window // 16`` with a window: a chunk attends over ``window + chunk``
    positions, so small chunks keep a long prompt's peak memory within a few
    percent of a prompt that just fills the window.

    ``draft_window`` bounds the drafter's context alone (agent-sized prompts): it
    attends to the last ``draft_window`` positions while the target keeps its whole
    context (or its ``window``), and a long prompt's head never runs through it.
    None: the drafter's default (``Drafter.context_window``, a bundle's own); 0: its
    whole context. Drafts change, the output does not.
    """
    decoding, asked = keyword_settings(**settings)
    request = setup(target, drafter, tokenizer, prompt, decoding, asked, cache=cache, policy=policy)
    yield from run(request, target, prompt_progress_callback)


def keyword_settings(
    *,
    max_tokens: int = RequestSettings.max_tokens,
    block_size: Optional[int] = CacheLayout.block_size,
    eos_token_ids: Optional[Iterable[int]] = None,
    window: Optional[int] = CacheLayout.window,
    sinks: int = CacheLayout.sinks,
    prefill_step_size: Optional[int] = DecodeSettings.prefill_step_size,
    temperature: float = Sampling.temperature,
    top_p: float = Sampling.top_p,
    top_k: int = Sampling.top_k,
    min_p: float = Sampling.min_p,
    seed: Optional[int] = Sampling.seed,
    verify: str = Sampling.verify,
    stop: Union[None, str, Sequence[str]] = None,
    logprobs: Optional[int] = RequestSettings.logprobs,
    draft_source: str = DecodeSettings.draft_source,
    logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = KVQuantization.group_size,
    quantized_kv_start: int = KVQuantization.start,
    draft_window: Optional[int] = CacheLayout.draft_window,
) -> tuple[DecodeSettings, RequestSettings]:
    """:func:`stream_generate`'s (and :func:`batch_generate`'s) keywords, mlx-lm's names, as the settings objects
    a generation runs with; each is checked as it is built."""
    sampling = Sampling(temperature, top_p, top_k, min_p, seed, verify)
    eos = None if eos_token_ids is None else frozenset(eos_token_ids)
    asked = RequestSettings(max_tokens, sampling, stop_list(stop), logprobs, tuple(logits_processors or ()), eos)
    layout = CacheLayout(window, sinks, block_size, KVQuantization.of(kv_bits, kv_group_size, quantized_kv_start),
                         draft_window)
    return DecodeSettings(layout, prefill_step_size, draft_source), asked


def run(
    request: Request, target: Target, progress: Optional[Callable[[int, int], None]] = None,
) -> Iterator[GenerationResponse]:
    """A generation that ``setup`` prepared, alone: its prefill (reporting ``(done, total)`` to ``progress``), then
    one response per cycle."""
    decoder = decode(request.row, request.ids[request.reused:], request.prefill_step_size,
                     progress or (lambda done, total: None))
    yield from responses_of(decoder, target, request.responder)


@dataclass
class Request:
    """One generation, its settings checked and its cache taken: what the solo loop or a batch runs."""

    row: Row
    ids: list[int]
    reused: int  # leading ids the cache already held
    prefill_step_size: int
    responder: _Responder


def setup(
    target: Target, drafter: Drafter, tokenizer: Any, prompt: Prompt, decoding: DecodeSettings,
    asked: RequestSettings, cache: Optional[DFlashCache] = None, policy: Optional[DraftPolicy] = None,
) -> Request:
    """One generation, its settings checked against the pair and the prompt, its cache taken over the prompt (the
    caller's ``cache`` if it was made for this layout, else a new one) and its policy chosen (``policy``, else the
    default): what the solo loop or a batch runs."""
    layout = decoding.layout.of_pair(target, drafter)
    ids = encode_prompt(tokenizer, prompt)
    max_tokens = check_context(target.max_positions, len(ids), asked.max_tokens)
    eos = frozenset(tokenizer.eos_token_ids) if asked.eos_token_ids is None else asked.eos_token_ids
    cache = _matching_cache(cache, target, drafter, layout)
    sampling = asked.sampling
    if policy is None:
        policy = _default_policy(target, drafter, sampling, layout, decoding.layout.block_size is not None,
                                 decoding.draft_source)
    if target.group is not None and not sampling.greedy and sampling.seed is None:  # every rank must draw the same
        sampling = dataclasses.replace(sampling, seed=shared_seed(target.group))
    reused, lease = cache.begin(ids)
    row = Row(target, drafter, cache, lease, sampling, policy, asked.logprobs, eos, max_tokens,
              asked.logits_processors)
    responder = _Responder(streaming_detokenizer(tokenizer), asked.stop, len(ids), reused)
    return Request(row, ids, reused, decoding.prefill_chunk(layout.block_size), responder)  # type: ignore[arg-type]


def _matching_cache(cache: Optional[DFlashCache], target: Target, drafter: Drafter, layout: CacheLayout
                    ) -> DFlashCache:
    """The caller's cache, if it was made for this pair and this layout, else a new one."""
    if cache is None:
        return DFlashCache.empty(target, drafter, layout)
    cache.check_pair(target, drafter)
    if (cache.window, cache.sinks, cache.block_size, cache.draft_window) != (
            layout.window, layout.sinks, layout.block_size, layout.draft_window):
        raise DFlashError(f"cache was made for {cache.layout.describe()}; this call uses {layout.describe()}")
    if cache.kv != layout.kv:
        raise DFlashError(f"cache was made for kv={cache.kv}; this call uses kv={layout.kv} (make_cache's kv, the "
                          "call's kv_bits, kv_group_size and quantized_kv_start must agree)")
    return cache


def _default_policy(
    target: Target, drafter: Drafter, sampling: Sampling, layout: CacheLayout, pinned: bool, draft_source: str,
) -> DraftPolicy:
    """Adaptive depth, except where full blocks are asked for or needed: seeded rejection sampling drafts full
    blocks, because adaptive depths would change its draw."""
    block_size = layout.block_size
    reproducible = sampling.seed is not None and not sampling.greedy and not sampling.positional
    alone = isinstance(drafter, NoDrafter)
    if alone and draft_source == DRAFTER:
        raise DFlashError("this model was loaded alone, without a drafter: --draft-source drafter needs one "
                          "(pass a DFlash drafter, or use auto or copy)")
    if draft_source == COPY or (alone and (pinned or reproducible)):
        return FixedBlock(block_size, COPY)  # type: ignore[arg-type]
    if pinned or reproducible:
        return FixedBlock(block_size)  # type: ignore[arg-type]
    return adaptive_policy(target, drafter, (layout.window, layout.draft_window), block_size, copies=draft_source == AUTO,
                           drafts=not alone)


class _SpacesStreamed(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE detokenizer, except that spaces are text as soon as they are decided.

    mlx-lm's holds a single-space token until the next token, to drop the reply's leading space;
    but it keeps holding while the next is a single space too, so a run of them (a reply that
    loops on spaces) streamed nothing until a word came. Only the reply's first space can be
    dropped, so held spaces are text once the reply has text, or once two are held (the first
    dropped): the same text in the end, shown as it is decoded.
    """

    def add_token(self, token: int) -> None:
        super().add_token(token)
        held = self._decode_bytes(self._unflushed)
        if held and not held.strip(" ") and (self.text or len(held) > 1):
            self.text += self._maybe_trim_space(held)
            self._unflushed = ""


def streaming_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for one reply: the tokenizer's own, spaces streamed where it is mlx-lm's BPE one."""
    detokenizer = tokenizer.detokenizer
    if type(detokenizer) is BPEStreamingDetokenizer:
        streamed = _SpacesStreamed.__new__(_SpacesStreamed)
        streamed.__dict__.update(vars(detokenizer))  # its token map and fresh state, under the subclass
        return streamed
    return detokenizer


class _Responder:
    """A generation's cycles as responses: text detokenized up to any stop string, with the run's figures so far."""

    def __init__(self, detokenizer: Any, stops: tuple[str, ...], prompt_tokens: int, reused: int) -> None:
        self.detokenizer, self.prompt_tokens, self.reused = detokenizer, prompt_tokens, reused
        self.stopper = StopStrings(stops) if stops else None
        self.started = time.perf_counter()
        self.prompt_tps, self.first_time, self.generated = 0.0, 0.0, 0

    def respond(self, cycle: Emitted) -> GenerationResponse:
        """The response to one cycle; it has ``stop_sequence`` set when a stop string ended the generation."""
        now = time.perf_counter()
        if not self.generated and not self.first_time:
            self.prompt_tps = (self.prompt_tokens - self.reused) / (now - self.started)
            self.first_time = now
        if self.stopper is None:
            tokens, text, stopped = cycle.tokens, _detokenize(self.detokenizer, cycle.tokens, cycle.reason), None
        else:
            tokens, text, stopped = _detokenize_until_stop(self.detokenizer, self.stopper, cycle.tokens, cycle.reason)
        self.generated += len(tokens)
        elapsed = now - self.first_time
        return GenerationResponse(
            text=text,
            tokens=tokens,
            accepted=cycle.accepted,
            drafted=cycle.drafted,
            source=cycle.source,
            prompt_tokens=self.prompt_tokens,
            prompt_cached=self.reused,
            prompt_tps=self.prompt_tps,
            generation_tokens=self.generated,
            generation_tps=(self.generated - 1) / elapsed if elapsed > 0 and self.generated > 1 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            cache_bytes=cycle.cache_bytes,
            finish_reason="stop" if stopped is not None else cycle.reason,
            stop_sequence=stopped,
            logprobs=None if cycle.logprobs is None else cycle.logprobs[: len(tokens)],
            top_logprobs=None if cycle.top is None else cycle.top[: len(tokens)],
        )


def responses_of(decoder: Iterator[Emitted], target: Target, responder: _Responder) -> Iterator[GenerationResponse]:
    """The decoder's cycles as responses, until the end or a stop string."""
    mx.reset_peak_memory()
    responder.started = time.perf_counter()
    with wired_limit(target.model, [generation_stream]), _release_buffers(), contextlib.closing(decoder):
        for cycle in decoder:
            response = responder.respond(cycle)
            yield response
            if response.stop_sequence is not None:
                return  # closing the decoder abandons its cycle in flight


def _detokenize(detokenizer: Any, tokens: list[int], reason: Optional[str]) -> str:
    """One cycle's new text."""
    for t in tokens:
        detokenizer.add_token(t)
    if reason is not None:
        detokenizer.finalize()
    return detokenizer.last_segment


def _detokenize_until_stop(
    detokenizer: Any, stopper: StopStrings, tokens: list[int], reason: Optional[str]
) -> tuple[list[int], str, Optional[str]]:
    """One cycle's tokens up to the one that completes a stop string, the text that may be shown, the string."""
    text = ""
    for j, t in enumerate(tokens):
        detokenizer.add_token(t)
        piece, stopped = stopper.feed(detokenizer.last_segment)
        text += piece
        if stopped is not None:
            return tokens[: j + 1], text, stopped
    if reason is not None:  # the end: what the detokenizer still holds, then what the stop strings held back
        detokenizer.finalize()
        piece, stopped = stopper.feed(detokenizer.last_segment)
        text += piece if stopped is not None else piece + stopper.flush()
        return tokens, text, stopped
    return tokens, text, None


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
    responses = []
    for response in stream_generate(target, drafter, tokenizer, prompt, **kwargs):
        if on_response is not None:
            on_response(response)
        responses.append(response)
    return GenerationResult.from_responses(responses)


def batch_generate(
    target: Target, drafter: Any, tokenizer: Any, prompts: Sequence[Prompt], *, policy: Optional[DraftPolicy] = None,
    **settings: Any,
) -> list[GenerationResult]:
    """Decode ``prompts`` together, one row each, with :func:`stream_generate`'s settings (``cache`` aside); a
    ``policy`` is shared by the rows as by successive generations.

    Each row's output is what it would be alone: at temperature 0 the target's own
    greedy decoding. Prompts are prefilled one after another and join the batch with
    their first token; a row leaves at its end. Where the target or the settings do
    not batch (``Batch.fits``), the rows run one after another.
    """
    for name, what in (("cache", "a cache"), ("prompt_progress_callback", "a prefill")):
        if name in settings:
            raise DFlashError(f"batch_generate gives each prompt {what} of its own: {name}= is not taken")
    decoding, asked = keyword_settings(**settings)
    requests = [setup(target, drafter, tokenizer, prompt, decoding, asked, policy=policy) for prompt in prompts]
    if not requests:
        return []
    if not Batch.fits(target, requests[0].row.cache):
        return [GenerationResult.from_responses(list(run(r, target))) for r in requests]
    handbacks = [own_policy(request.row) for request in requests]
    seen: dict[int, list[GenerationResponse]] = {id(r.row): [] for r in requests}
    by_row = {id(r.row): r for r in requests}
    scheduler = Scheduler(Batch(target, batch_planner(target, drafter)))

    def answered(request: Request, cycle: Emitted) -> bool:
        response = request.responder.respond(cycle)
        seen[id(request.row)].append(response)
        return response.finish_reason is not None

    try:
        for request in requests:
            row = request.row
            row.policy.start()
            logits = prefill(target, drafter, row.cache, request.ids[request.reused :], request.prefill_step_size,
                             lambda done, total: None)
            if not answered(request, row.first(logits)):
                scheduler.add(row)
        while scheduler.rows:  # a row that ends leaves; the others' next cycle may have started before it is read
            scheduler.advance()
            for row, emitted in scheduler.read():
                if answered(by_row[id(row)], emitted):
                    scheduler.drop(row)
    finally:
        scheduler.close()
        for request, handback in zip(requests, handbacks):
            if request.row.cache.holds_lease(request.row.lease):
                request.row.cache.abandon()
            handback()
        mx.clear_cache()
    return [GenerationResult.from_responses(seen[id(r.row)]) for r in requests]
