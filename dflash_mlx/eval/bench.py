"""Paired, honest speed measurements: plain decoding and DFlash on the same target, in one process.

Every prompt runs plain mlx-lm decoding and DFlash with the same caches (window
semantics included) and the same token budget; with repeats the order alternates
to cancel drift. At temperature 0 the two texts must be identical, and output that
loops on a short span (which inflates tau and tok/s) is flagged and left out of
the headline figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..chat_template import has_chat_template, prompt_ids
from ..decode.generate import generate, keyword_settings
from ..decode.transaction import DFlashCache, common_prefix
from ..models.caches import layer_state, set_layer_state
from .prompts import Conversation


def repetition(tokens: list[int], max_period: int = 16, n: int = 4) -> tuple[int, float]:
    """Longest run repeating a span of at most ``max_period`` tokens, and the distinct n-gram ratio."""
    longest = 0
    for period in range(1, max_period + 1):
        run = 0
        for i in range(period, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run >= period:  # the span occurred at least twice in a row
                longest = max(longest, run + period)
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    distinct = len(set(grams)) / len(grams) if grams else 1.0
    return longest, distinct


def from_prompt(prompt: list[int], output: list[int], n: int = 8) -> float:
    """Share of ``output`` tokens inside an ``n``-token span that also occurs in ``prompt``: how much of a reply
    re-emits its prompt (a file asked back with one change), whichever way it was drafted."""
    spans = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in spans:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(output) if output else 0.0


def degenerate(tokens: list[int]) -> bool:
    """A greedy loop: half the output repeats a short span, or few distinct 4-grams."""
    longest, distinct = repetition(tokens)
    return len(tokens) >= 16 and (longest >= len(tokens) / 2 or distinct < 0.5)


class PlainCache:
    """mlx-lm's caches for plain decoding, kept from one run to the next with the tokens they hold: a prompt that
    begins like that history prefills only the rest (``measure``'s ``reuse_prefix``)."""

    def __init__(self, target: Any, window: Optional[int], sinks: int) -> None:
        self.fresh = lambda: target.make_cache(window, sinks, slack=1)
        self.layers, self.tokens = self.fresh(), []

    def take(self, ids: list[int]) -> list[int]:
        """The caches brought back to the longest beginning they share with ``ids`` (all but its last token at most:
        its logits start decoding), anew where they cannot go back that far; the ids left to prefill."""
        keep = min(common_prefix(self.tokens, ids), len(ids) - 1)
        excess = len(self.tokens) - keep
        if excess and not (can_trim_prompt_cache(self.layers) and trim_prompt_cache(self.layers, excess) == excess):
            self.layers, keep = self.fresh(), 0
        self.tokens = ids[:keep]
        return ids[keep:]

    def adopt(self, layers: list[Any], tokens: list[int]) -> None:
        """Hold copies of another path's caches (the DFlash target's, after it prefilled), which hold ``tokens``;
        where they are of another kind (a window's slack differs, a layer has no snapshot) this path goes on
        prefilling for itself."""
        try:
            self.layers = [set_layer_state(c, layer_state(t)) for c, t in zip(self.fresh(), layers)]
            self.tokens = list(tokens)
        except (ValueError, TypeError):
            pass


def _plain(target: Any, ids: list[int], max_tokens: int, window: Optional[int], sinks: int,
           temperature: float, top_p: float, top_k: int, min_p: float, seed: Optional[int],
           kept: Optional[PlainCache] = None, **kv: Any) -> dict[str, Any]:
    """mlx-lm's own decoding, with the same cache type (and window, or KV quantization) as the DFlash run; on
    ``kept``'s caches where given."""
    sampler = make_sampler(temp=temperature, top_p=top_p if top_p < 1 else 0.0, min_p=min_p, top_k=top_k)
    if seed is not None:
        mx.random.seed(seed)
    cache, rest = (kept.layers, kept.take(ids)) if kept is not None else (target.make_cache(window, sinks, slack=1), ids)
    mx.reset_peak_memory()
    tokens, stamps = [], []
    tic = time.perf_counter()
    for token, _ in generate_step(mx.array(rest), target.model, max_tokens=max_tokens, sampler=sampler,
                                  prompt_cache=cache, **kv):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
    if kept is not None:
        kept.tokens = ids + tokens  # generate_step has run every token it yielded through the caches
    ttft = stamps[0] - tic
    decode = (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(tokens) > 1 else 0.0
    return {"tokens": tokens, "prefilled_tokens": len(rest), "ttft_s": ttft, "prefill_tps": len(rest) / ttft,
            "decode_tps": decode, "peak_memory_gb": mx.get_peak_memory() / 1e9}


def _dflash(target: Any, drafter: Any, tokenizer: Any, ids: list[int], **kwargs: Any) -> dict[str, Any]:
    r = generate(target, drafter, tokenizer, ids, eos_token_ids=[], **kwargs)
    prefilled = r.prompt_tokens - r.prompt_cached
    return {"tokens": r.tokens, "prefilled_tokens": prefilled, "ttft_s": prefilled / r.prompt_tps, "prefill_tps": r.prompt_tps,
            "decode_tps": r.generation_tps, "peak_memory_gb": r.peak_memory, "tau": r.tau,
            "histogram": r.histogram, "depth_histogram": r.depth_histogram, "cycles": r.cycles,
            "sources": r.by_source}


Run = Callable[..., dict[str, Any]]  # one decoding path: (prompt ids, max_tokens) -> its measurement


def measure(
    target: Any,
    drafter: Any,
    tokenizer: Any,
    conversations: list[Conversation],
    *,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    draft_source: str = "auto",
    window: Optional[int] = None,
    sinks: int = 0,
    draft_window: Optional[int] = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = 0,
    repeats: int = 1,
    on_record: Callable[[dict[str, Any]], None] = lambda record: None,
    reuse_prefix: bool = False,
    **kv: Any,
) -> list[dict[str, Any]]:
    """One record per prompt (per turn for multi-turn conversations), after a warm-up of both paths. ``kv``:
    mlx-lm's ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start``, for both paths alike.

    ``reuse_prefix`` keeps each path's caches from one run to the next, so a prompt prefills only what the last
    run's history did not begin with: the repeats of a prompt, and prompts cut from one text at growing lengths,
    cost one prefill, which DFlash runs before the rounds and plain decoding takes a copy of (at 8k tokens of the
    real pair on 2 cores a prefill takes ~90 s, a 96-token reply ~25 s). Decode speeds are unchanged; time to
    first token and prefill speed then count the part prefilled in the round, a token or so."""
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    dflash_kwargs: dict[str, Any] = dict(block_size=block_size, draft_source=draft_source, window=window, sinks=sinks,
                                         draft_window=draft_window, **sampling, **kv)
    kept = PlainCache(target, window, sinks) if reuse_prefix else None
    if reuse_prefix:
        dflash_kwargs["cache"] = DFlashCache.empty(target, drafter, keyword_settings(**dflash_kwargs)[0].layout)
    paths: dict[str, Run] = {
        "plain": lambda ids, n=max_tokens: _plain(target, ids, n, window, sinks, kept=kept, **sampling, **kv),
        "dflash": lambda ids, n=max_tokens: _dflash(target, drafter, tokenizer, ids, max_tokens=n, **dflash_kwargs),
    }
    warm = tokenizer.encode("Hello", add_special_tokens=False) or [0]
    for run in paths.values():
        run(warm, 4)
    records = []

    def paired(name: str, turn: int, ids: list[int]) -> dict[str, Any]:
        shared = {}
        if kept is not None:  # one prefill for both paths
            shared["shared_prefill_tokens"] = _dflash(target, drafter, tokenizer, ids, max_tokens=1,
                                                      **dflash_kwargs)["prefilled_tokens"]
            kept.adopt(dflash_kwargs["cache"].target, dflash_kwargs["cache"].tokens)
        record = _record(name, turn, ids, _alternating(paths, ids, repeats), temperature) | shared
        records.append(record)
        on_record(record)
        return record

    for conv in conversations:
        if conv.token_ids is not None:
            paired(conv.name, 0, conv.token_ids)
            continue
        history: list[dict[str, str]] = []
        for turn, text in enumerate(conv.turns):  # multi-turn: later turns carry the replies
            history.append({"role": "user", "content": text})
            ids = prompt_ids(tokenizer, history if has_chat_template(tokenizer) else history[-1:])
            record = paired(conv.name, turn, ids)
            history.append({"role": "assistant", "content": tokenizer.decode(record["dflash"]["tokens"])})
    return records


def _alternating(paths: dict[str, Run], ids: list[int], repeats: int) -> list[dict[str, dict[str, Any]]]:
    """Each path on ``ids`` ``repeats`` times, plain first on even repeats and DFlash first on odd: drift cancels."""
    return [{path: paths[path](ids) for path in (("plain", "dflash") if r % 2 == 0 else ("dflash", "plain"))}
            for r in range(repeats)]


def _median_of(runs: list[dict[str, Any]], path: str) -> dict[str, Any]:
    first = dict(runs[0][path])
    for key in ("ttft_s", "prefill_tps", "decode_tps", "peak_memory_gb"):
        first[key] = statistics.median(run[path][key] for run in runs)
    return first


def _record(name: str, turn: int, ids: list[int], runs: list[dict[str, Any]], temperature: float) -> dict[str, Any]:
    plain, dflash = _median_of(runs, "plain"), _median_of(runs, "dflash")
    longest, distinct = repetition(dflash["tokens"])
    identical = plain["tokens"] == dflash["tokens"] if temperature == 0 else None
    flags = []
    if identical is False:
        flags.append("differs from plain")
    if degenerate(dflash["tokens"]):
        flags.append("degenerate loop")
    return {
        "prompt": name, "turn": turn, "prompt_tokens": len(ids), "generated_tokens": len(dflash["tokens"]),
        "plain": plain, "dflash": dflash,
        "speedup": dflash["decode_tps"] / plain["decode_tps"] if plain["decode_tps"] else 0.0,
        "tau": dflash["tau"], "acceptance_histogram": dflash["histogram"], "depth_histogram": dflash["depth_histogram"],
        "sources": dflash["sources"], "from_prompt": from_prompt(ids, dflash["tokens"]), "identical": identical,
        "longest_repeat": longest, "distinct_4gram_ratio": distinct,
        "flagged": flags,
    }
