"""Record what drafting would do at every position of the target's own output, and what cycles cost here.

The evidence ``replay.py`` judges draft policies on. For a prompt, the target's output
comes from the decode loop at block 1 (plain steps: mlx-lm's greedy tokens, or, seeded,
its position-keyed draws). One pass of the target over prompt + output gives every
position's features; the drafter then drafts at every output position at once, as
training does (``drafter.Blocks``: each block sees only the context before its anchor,
exactly what the decode loop's cache holds there), once per block length 2..B, and
each draft's agreeing prefix with the output is what the target would accept.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..decode.generate import generate
from ..decode.policy import FixedBlock
from ..decode.settings import PREFILL_STEP
from ..decode.transaction import make_cache
from ..errors import DFlashError
from ..files import write_atomic
from ..models.drafter import Blocks, Drafter
from ..models.target import Target
from ..sampling import Sampling, position_keys, sample_rows
from .replay import MAC_PROFILES, CostProfile, Trace, mac_profile

log = logging.getLogger(__name__)

ANCHORS_PER_PASS = 64  # blocks per drafter pass: bounds the [rows, context + rows] attention


def _drafts(drafter: Drafter, target: Target, features: mx.array, seq: list[int], anchors: np.ndarray, b: int,
            sampling: Sampling, window: Optional[int] = None) -> np.ndarray:
    """[len(anchors), b - 1]: the drafter's tokens for blocks [seq[anchor], MASK x (b - 1)]."""
    block = np.full((len(anchors), b), drafter.mask_token_id)
    block[:, 0] = np.asarray(seq)[anchors]
    embeddings = drafter.embed_blocks(target, mx.array(block.reshape(1, -1)))
    h = drafter(embeddings, features, Blocks(anchors[None], features.shape[1], b, window))
    h = h.reshape(len(anchors), b, -1)[:, 1:]
    logits = drafter.head_logits(target, h).astype(mx.float32)
    if sampling.greedy:
        return np.array(drafter.tokens(mx.argmax(logits, -1)))
    # one draw per drafted position, keyed by its position and the block length, apart from the target's keys
    rows = []
    for i, anchor in enumerate(anchors.tolist()):
        keys = position_keys((sampling.seed + b) % 2**64, anchor + 1, b - 1)
        rows.append(drafter.tokens(sample_rows(sampling.logprobs(logits[i]), keys)))
    return np.array(mx.stack(rows))


def target_features(target: Target, seq: list[int]) -> mx.array:
    """[1, len(seq), F]: the drafter's features of every position of ``seq``, from one pass of the target."""
    cache, parts = target.make_cache(), []
    for start in range(0, len(seq), PREFILL_STEP):  # chunks: no [heads, L, L] scores for an agent-sized prompt
        parts.append(target(mx.array(seq[start : start + PREFILL_STEP])[None], cache, last_logits_only=True,
                            undoable=False)[1])
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=1)


def record(target: Target, drafter: Drafter, tokenizer: Any, name: str, prompt: list[int], max_tokens: int,
           sampling: Sampling = Sampling(), draft_window: Optional[int] = None,
           output: Optional[list[int]] = None) -> Trace:
    """The trace of one prompt: ``max_tokens`` of the target's own output and every depth's acceptance; drafts
    within a drafter context window of ``draft_window`` positions (None or 0: the whole context). ``output``: the
    target's own output, decoded already."""
    return record_windows(target, drafter, tokenizer, name, prompt, max_tokens, sampling, [draft_window], output)[0]


def record_windows(target: Target, drafter: Drafter, tokenizer: Any, name: str, prompt: list[int], max_tokens: int,
                   sampling: Sampling, draft_windows: Sequence[Optional[int]],
                   output: Optional[list[int]] = None) -> list[Trace]:
    """``record``'s trace for each drafter window, from one decode and one pass of the target."""
    if type(drafter) is not Drafter:
        raise DFlashError("traces need a DFlash drafter (drafts of one pass per block)")
    if not sampling.greedy and sampling.seed is None:
        raise DFlashError("a sampled trace needs a seed (the target's draws are keyed by position)")
    if output is None:
        output = generate(target, drafter, tokenizer, prompt, max_tokens=max_tokens, block_size=1, eos_token_ids=[],
                          temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p, seed=sampling.seed, verify="match").tokens
    seq = prompt + output
    features = target_features(target, seq)
    n, B = len(output), drafter.block_size
    labels = np.full((n - 1, B - 1), -1)
    for p in range(n - 1):
        following = output[p + 1 : p + B]
        labels[p, : len(following)] = following
    anchors = np.arange(len(prompt), len(prompt) + n - 1)
    recorded = []
    for window in draft_windows:
        drafts = np.full((n - 1, B, B - 1), -1, dtype=np.int64)
        accepted = np.zeros((n - 1, B), dtype=np.int64)
        for b in range(2, B + 1):
            for start in range(0, n - 1, ANCHORS_PER_PASS):
                rows = slice(start, start + ANCHORS_PER_PASS)
                drafted = _drafts(drafter, target, features, seq, anchors[rows], b, sampling, window or None)
                drafts[rows, b - 1, : b - 1] = drafted
                accepted[rows, b - 1] = np.cumprod(drafted == labels[rows, : b - 1], axis=1).sum(1)
        recorded.append(Trace(name, prompt, output, drafts, accepted))
    return recorded


def write(path: str, traces: Iterable[Trace], meta: dict[str, Any]) -> None:
    """JSONL: a first line of metadata (pair, sampling, machine), then one trace per line."""
    lines = [json.dumps({"meta": meta})]
    for t in traces:
        lines.append(json.dumps({"name": t.name, "prompt": t.prompt, "output": t.output, "drafts": t.drafts.tolist(),
                                 "accepted": t.accepted.tolist()}))
    write_atomic(path, "\n".join(lines) + "\n")


def read(path: str) -> tuple[dict[str, Any], list[Trace]]:
    lines = Path(path).read_text().splitlines()
    meta = json.loads(lines[0])["meta"]
    traces = []
    for line in lines[1:]:
        row = json.loads(line)
        traces.append(Trace(row["name"], row["prompt"], row["output"], np.array(row["drafts"], dtype=np.int64),
                            np.array(row["accepted"], dtype=np.int64)))
    return meta, traces


def profiles(path: str, max_depth: int) -> list[CostProfile]:
    """The costs bench/trace.py measured beside the traces file ``NAME.jsonl`` (``NAME.profile.json``), if any, then
    the Apple Silicon estimates. A damaged profile is left out with a warning: the estimates still stand."""
    measured = Path(path).with_name(Path(path).name.removesuffix(".jsonl") + ".profile.json")
    own = []
    if measured.is_file():
        try:
            own.append(CostProfile.from_dict(json.loads(measured.read_text())))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the damaged cost profile %s: %s", measured, e)
    return own + [mac_profile(name, max_depth) for name in MAC_PROFILES]


def measure_costs(target: Target, drafter: Drafter, tokenizer: Any, contexts: list[int], steps: int = 24,
                  repeats: int = 3, name: str = "this machine") -> CostProfile:
    """This machine's seconds per cycle at each depth and context length, and mlx-lm's plain step's.

    A cycle's time is its share of a generation's decode time at a fixed depth
    (``FixedBlock(k + 1)``, ``2 * steps`` tokens: ``steps`` to ``2 * steps`` cycles, as
    many as the drafts leave), median of ``repeats`` runs, the depths in interleaved
    order. The prompt is natural text cut to the context length, prefilled once per
    context for every run (a cache that each run returns to the prompt).
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import trim_prompt_cache

    from .prompts import context_prompts

    B = drafter.block_size
    plain, cycle = [], []
    for context in contexts:
        ids = context_prompts(tokenizer, [context], target.max_positions)[0].token_ids
        per_depth: list[list[float]] = [[] for _ in range(B)]
        per_plain: list[float] = []
        cache, plain_cache = make_cache(target, drafter), target.make_cache()
        for start in range(0, len(ids) - 1, PREFILL_STEP):  # mlx-lm's cache over the prompt but its last token, once
            target.model(mx.array(ids[start : min(start + PREFILL_STEP, len(ids) - 1)])[None], cache=plain_cache)
            mx.eval([c.state for c in plain_cache])
        for _ in range(repeats):
            for k in range(B):
                r = generate(target, drafter, tokenizer, ids, max_tokens=2 * steps + 1, policy=FixedBlock(k + 1),
                             eos_token_ids=[], cache=cache)
                decode_seconds = (len(r.tokens) - 1) / r.generation_tps if r.generation_tps else 0.0
                per_depth[k].append(decode_seconds / max(r.cycles, 1))
            stamps = []
            for _ in generate_step(mx.array(ids[-1:]), target.model, max_tokens=steps + 1, prompt_cache=plain_cache):
                stamps.append(time.perf_counter())
            trim_prompt_cache(plain_cache, plain_cache[0].offset - (len(ids) - 1))
            per_plain.append((stamps[-1] - stamps[0]) / steps)
        plain.append(float(np.median(per_plain)))
        cycle.append([float(np.median(v)) for v in per_depth])
    return CostProfile(name, "measured by traces.measure_costs", list(contexts), plain, cycle)


def measure_batch_cycles(target: Target, drafter: Drafter, tokenizer: Any, rows: int, depth: int, context: int,
                         cycles: int = 16, repeats: int = 3) -> float:
    """Seconds of one cycle of a batch of ``rows`` rows, each drafting ``depth`` tokens from the drafter (0: plain
    steps), at about ``context`` tokens each: the median of ``repeats`` runs of ``cycles`` timed cycles."""
    from ..decode.batch import Batch
    from ..decode.cycle import prefill
    from ..decode.generate import setup
    from ..decode.settings import CacheLayout, DecodeSettings, RequestSettings
    from .prompts import context_prompts

    ids = context_prompts(tokenizer, [context], target.max_positions)[0].token_ids
    runs = []
    for _ in range(repeats):
        batch = Batch(target)
        decoding = DecodeSettings(CacheLayout(block_size=depth + 1))
        asked = RequestSettings(max_tokens=cycles * (depth + 1) + 8, eos_token_ids=frozenset())
        requests = [setup(target, drafter, tokenizer, ids, decoding, asked) for _ in range(rows)]
        for request in requests:
            request.row.first(prefill(target, drafter, request.row.cache, ids, 2048, lambda done, total: None))
            batch.join(request.row)
        batch.cycle()  # the first cycle pays for buffers the prefill handed back
        tic = time.perf_counter()
        for _ in range(cycles):
            batch.cycle()
        runs.append((time.perf_counter() - tic) / cycles)
        for request in requests:
            batch.leave(request.row)
            request.row.cache.abandon()
    return float(np.median(runs))

