"""The DFlash decode loop: draft a block in one pass, verify it in one pass, keep the agreeing prefix.

Each cycle is built as one lazy graph (draft -> verify -> argmax) and evaluated
asynchronously; the previous cycle's tokens are detokenized and handed to the
caller while the device works (on Metal; MLX's CPU backend does most of the
work inside ``async_eval`` itself). The host reads the device once per cycle:
the drafted and verified token ids, from which the accepted length follows.

A cycle is a transaction on the ``DFlashCache``: the loop asks its policy how many
tokens to draft and from where, the drafter proposes them (``Drafter.propose``) or
the history does (a copy draft, ``Repeats.continuation``: no drafter pass), the
target verifies (``sampling.verify``), and the cycle ends in ``cache.commit``; if
the caller leaves while a cycle is in flight, ``cache.abandon`` undoes it. A cycle
without a drafter pass (plain or copy) still commits its features to the drafter's
pending context, so drafting resumes as if the drafter had run all along.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..errors import DFlashError
from ..models.drafter import Drafter
from ..models.target import Target
from ..sampling import Proposal, Sampling, Scores, copy_proposal, position_keys, sample_rows, scores, verify
from .policy import COPY, DRAFTER, PLAIN, DraftPolicy, Plan
from .settings import LogitsProcessor
from .transaction import DFlashCache

# While decoding plainly, the drafter's context catches up in passes of this many
# positions: one pass per 64 plain steps costs far less per position than one per
# block (fixed costs per pass; measured 23 us/position at 16, 11 at 128 on a CPU),
# and the next draft's pass takes at most 63 positions along with its block.
CATCH_UP = 64


def _cut(tokens: list[int], eos: frozenset[int], budget: int) -> tuple[list[int], Optional[str]]:
    """Tokens up to (not including) the first EOS, and at most ``budget`` of them."""
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j], "stop"
    if len(tokens) >= budget:
        return tokens[:budget], "length"
    return tokens, None


class _Drafted(NamedTuple):
    """A cycle's input, built lazily: [last ; drafts], where the drafts came from, and the keys its verdict uses."""

    proposal: Optional[Proposal]
    source: str  # of the proposal
    block: mx.array  # [n]: the last token and the drafts
    absorbed: list[Any]  # drafter context states computed along (evaluated with the cycle)
    key: Optional[mx.array]  # the verdict's
    row_keys: Optional[mx.array]  # seeded match sampling: a key per block position
    plan: Plan = PLAIN  # what the cycle was planned as: its policy settles it with the outcome


class InFlight(NamedTuple):
    """A cycle the device is computing: the drafter's proposal and the target's verdict on it."""

    proposal: Optional[Proposal]
    source: str  # of the proposal
    accept: Optional[mx.array]  # per drafted token: does the target agree
    target_tokens: mx.array  # per block position: the target's token if the cycle stops there
    features: mx.array  # the target's features of [last ; drafts], for the drafter's next context
    scores: Optional[Scores]  # per block position, of the token the cycle emits there (asked for: logprobs)
    plan: Plan = PLAIN  # what the cycle was planned as

    def arrays(self) -> list[Any]:
        """What the one read of the cycle needs evaluated."""
        return [x for x in (self.proposal and self.proposal.tokens, self.accept, self.target_tokens) if x is not None] + [
            x for x in self.scores or () if x is not None]


def _draft(
    target: Target, drafter: Drafter, cache: DFlashCache, sampling: Sampling, last: mx.array, n_draft: int,
    copied: list[int], key: Optional[mx.array],
) -> _Drafted:
    """Draft ``n_draft`` tokens after ``last`` (lazily); with ``copied`` (a copy draft) those, and no drafter pass."""
    k_draft = k_verify = row_keys = None
    if key is not None:
        k_draft, k_verify = mx.random.split(key)
    if copied:
        n_draft = len(copied)
    if sampling.positional:  # the block's positions follow the committed history and ``last``
        row_keys = position_keys(sampling.seed, len(cache.tokens) + 1, n_draft + 1)
    proposal = None
    if copied:
        proposal = copy_proposal(copied, sampling, target.vocab_size)
    elif n_draft:
        proposal = cache.draft(drafter, target, last, n_draft, sampling, k_draft)
    block = last if proposal is None else mx.concatenate([last, proposal.tokens])
    absorbed = []
    if (copied or proposal is None) and cache.pending >= CATCH_UP:  # the drafter not running: its context
        cache.absorb_context(drafter)  # keeps up, computed now, so that the next draft does not pay for the run
        absorbed = [c.state for c in cache.drafter]
    return _Drafted(proposal, COPY if copied else DRAFTER, block, absorbed, k_verify, row_keys)


def verdict_of(
    sampling: Sampling, drafted: _Drafted, logits: mx.array, features: mx.array, logprobs: Optional[int]
) -> InFlight:
    """The target's verdict on a drafted block from its logits [n, V] (lazily).

    With ``logprobs`` (alternatives per token) the verify's own logits also score the
    token each position emits: an accepted draft before the first rejection, the
    target's token from there. No pass runs for them; they travel with the one read.
    """
    proposal = drafted.proposal
    accept, target_tokens = verify(sampling, proposal, logits, drafted.key, drafted.row_keys)
    scored = None
    if logprobs is not None:
        emitted = target_tokens
        if proposal is not None:
            kept = mx.cumprod(accept.astype(mx.int32)) > 0
            emitted = mx.concatenate([mx.where(kept, proposal.tokens, target_tokens[:-1]), target_tokens[-1:]])
        scored = scores(logits, emitted, logprobs)
    return InFlight(proposal, drafted.source, accept, target_tokens, features, scored, drafted.plan)


def processed(processors: Sequence[LogitsProcessor], tokens: mx.array, start: int, logits: mx.array) -> mx.array:
    """Logits [n, V] through ``processors``, row j given the tokens before it, ``tokens[: start + j]``: at every
    position of a verified block with that position's own history, as mlx-lm applies them at every step. Drafts
    are judged against the processed distribution, so greedy output is mlx-lm's with the same processors."""
    if not processors:
        return logits
    rows = []
    for j in range(logits.shape[0]):
        row = logits[j : j + 1]
        for processor in processors:
            row = processor(tokens[: start + j], row)
        rows.append(row)
    return mx.concatenate(rows)


def _read(cycle: InFlight) -> tuple[list[int], int, list[int]]:
    """(drafted tokens, how many the target accepted, the target's tokens): the one host read per cycle."""
    target_tokens = cycle.target_tokens.tolist()
    drafted = cycle.proposal.tokens.tolist() if cycle.proposal is not None else []
    accepts = cycle.accept.tolist() if cycle.accept is not None else []
    accepted = next((i for i, ok in enumerate(accepts) if not ok), len(accepts))
    return drafted, accepted, target_tokens


def _read_scores(scored: Optional[Scores], n: int) -> tuple[Optional[list[float]], Optional[list[list[tuple[int, float]]]]]:
    """The first ``n`` positions' log-probabilities and alternatives, as lists (None when not asked for)."""
    if scored is None:
        return None, None
    chosen = scored.chosen[:n].tolist()
    if scored.top_ids is None:
        return chosen, [[] for _ in chosen]
    return chosen, [list(zip(i, v)) for i, v in zip(scored.top_ids[:n].tolist(), scored.top_logprobs[:n].tolist())]


def prefill(
    target: Target, drafter: Drafter, cache: DFlashCache, prompt: list[int], chunk: int,
    progress: Callable[[int, int], None],
) -> mx.array:
    """Run ``prompt`` (the tokens the cache lacks) through the target in chunks; the last position's logits."""
    for logits in prefill_steps(target, drafter, cache, prompt, chunk, progress):
        pass
    return logits


def prefill_steps(
    target: Target, drafter: Drafter, cache: DFlashCache, prompt: list[int], chunk: int,
    progress: Callable[[int, int], None],
) -> Iterator[Optional[mx.array]]:
    """The prefill a chunk at a time: None after each chunk but the last, then the last position's logits.

    Each chunk's attention sees only what the caches keep, so no prompt-sized mask
    is ever built. Each chunk is committed as it goes, so an interrupted prefill
    leaves the chunks before it in the cache and the next call resumes there. The
    previous chunk's features enter the drafter's context as the next chunk runs;
    the last chunk's stay pending for the first draft. With a drafter window the
    features wait instead: the cache keeps only those the window still sees, so the
    drafter runs over the prompt's last positions only. A server runs other
    requests' cycles between the chunks.
    """
    total = len(prompt)
    progress(0, total)
    starts = list(range(0, total, chunk))
    if cache.kv is not None and total > 1:  # mlx-lm's chunks, where the KV cache turns quantized: all but the last
        starts = list(range(0, total - 1, chunk)) + [total - 1]  # token, then that token alone
    for start, end in zip(starts, starts[1:] + [total]):
        ids = prompt[start:end]
        with mx.stream(generation_stream):
            if cache.reach is None:
                cache.absorb_context(drafter)
            logits, features = target(mx.array(ids)[None], cache.target, last_logits_only=True, undoable=False)
            cache.commit(ids, features)
        mx.eval(logits, [c.state for c in cache.target + cache.drafter], cache.context)
        progress(end, total)
        if end < total:
            yield None
    mx.clear_cache()  # prefill's temporaries are the largest buffers of the run
    yield logits[0, -1:]


class Emitted(NamedTuple):
    """What the loop hands the caller: one verified cycle's tokens (the prefill's token first)."""

    tokens: list[int]
    drafted: list[int]
    source: str
    accepted: int
    reason: Optional[str]
    cache_bytes: int
    logprobs: Optional[list[float]]  # of each token (when asked for)
    top: Optional[list[list[tuple[int, float]]]]  # each token's most likely alternatives, with theirs


class Row:
    """One generation's decoding state between cycles: its cache and lease, sampling, policy, budget and last token.

    The solo loop (``decode``) and a batch of generations (``batch``) drive it alike:
    ``first`` takes the prefill's logits; each cycle is ``plan``, ``draft``, the
    target's pass over the drafted block (alone, or stacked with other rows'),
    ``verdict_of``, one read, and ``finish``, which commits what was kept.
    """

    def __init__(self, target: Target, drafter: Drafter, cache: DFlashCache, lease: object, sampling: Sampling,
                 policy: DraftPolicy, logprobs: Optional[int], eos: frozenset[int], max_tokens: int,
                 processors: Sequence[LogitsProcessor] = ()) -> None:
        self.target, self.drafter, self.cache, self.lease = target, drafter, cache, lease
        self.sampling, self.policy, self.logprobs, self.eos, self.max_tokens = sampling, policy, logprobs, eos, max_tokens
        self.processors = tuple(processors)
        self.key = None if sampling.greedy else sampling.key()
        self.emitted = 0
        self.last: mx.array = mx.array([0])  # the last emitted token, which the target has not consumed yet
        self.last_id: Optional[int] = None
        self.read_at = time.perf_counter()  # when the last cycle was read: a cycle started before waits from there

    def next_key(self) -> Optional[mx.array]:
        """A fresh key for the next draw (None when greedy)."""
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def first(self, logits: mx.array) -> Emitted:
        """The first token, from the prefill's last logits."""
        if self.processors:
            history = mx.array(self.cache.tokens)
            logits = processed(self.processors, history, len(self.cache.tokens), logits)
        last, scored = _first_token(logits, self.sampling, self.next_key(), len(self.cache.tokens), self.logprobs)
        self.last, self.last_id = last, last.item()
        tokens, reason = _cut([self.last_id], self.eos, self.max_tokens)
        lps, top = _read_scores(scored, len(tokens))
        self.emitted = len(tokens)
        return Emitted(tokens, [], DRAFTER, 0, reason, self.cache.nbytes, lps, top)

    def plan(self, emitted: Optional[int] = None) -> Plan:
        """The policy's plan, within the block and what is left of the budget after ``emitted`` tokens."""
        return self.capped(self.policy.plan(self.cache.tokens), emitted)

    def capped(self, plan: Plan, emitted: Optional[int] = None) -> Plan:
        """``plan`` within the block (the drafter's own, for its drafts: a copy may fill a larger verify), what is
        left of the budget after ``emitted`` tokens and the cache's room."""
        emitted = self.emitted if emitted is None else emitted
        cap = min(self.cache.block_size - 1, self.max_tokens - emitted - 1)
        room = self.cache.room()  # a block never straddles the point where the KV cache turns quantized
        cap = cap if room is None else min(cap, room - 1)
        drafts = min(cap, self.drafter.block_size - 1)
        return plan.replace(depth=max(0, min(plan.depth, cap if plan.source == COPY else drafts)),
                            fallback=max(0, min(plan.fallback, drafts)))

    def draft(self, plan: Plan, last: mx.array, last_id: Optional[int]) -> _Drafted:
        """The cycle's input after ``last``; ``last_id`` is its value, None while it is still lazy (a pipelined
        plain step, which copies nothing)."""
        key = self.next_key()
        copied: list[int] = []
        if plan.source == COPY:
            assert last_id is not None, "a copy needs the token it continues"
            copied = self.policy.repeats.continuation(self.cache.tokens, last_id, plan.depth)
        n_draft = plan.fallback if plan.source == COPY else plan.depth  # no copy offered: the drafter's plan
        drafted = _draft(self.target, self.drafter, self.cache, self.sampling, last, n_draft, copied, key)
        return drafted._replace(plan=plan)

    def verdict(self, drafted: _Drafted, logits: mx.array, features: mx.array) -> InFlight:
        """The target's verdict on this row's drafted block from its logits [n, V], through the row's processors."""
        if self.processors:
            tokens = mx.concatenate([mx.array(self.cache.tokens, dtype=drafted.block.dtype), drafted.block])
            logits = processed(self.processors, tokens, len(self.cache.tokens) + 1, logits)
        return verdict_of(self.sampling, drafted, logits, features, self.logprobs)

    def finish(self, cycle: InFlight, started: float, committed: bool = False) -> Emitted:
        """Read a verified cycle, commit what it kept (unless ``committed`` already: a plain step), tell the policy
        what it cost from ``started`` (as a user waits for it: overlap with the previous cycle excluded)."""
        if not self.cache.holds_lease(self.lease):
            raise DFlashError("another generation took over this cache; this one cannot go on")
        drafted, accepted, target_tokens = _read(cycle)
        now = time.perf_counter()
        seconds, self.read_at = now - max(started, self.read_at), now
        tokens, reason = _cut(drafted[:accepted] + [target_tokens[accepted]], self.eos, self.max_tokens - self.emitted)
        lps, top = _read_scores(cycle.scores, len(tokens))
        self.emitted += len(tokens)
        kept = min(accepted, len(tokens))  # never an EOS draft, nor what follows it or the budget
        if not committed:
            self.cache.commit([self.last_id] + drafted[:kept], cycle.features[:, : kept + 1])
        self.policy.observe(cycle.plan, len(drafted), accepted, seconds, cycle.source)
        self.last, self.last_id = cycle.target_tokens[accepted : accepted + 1], target_tokens[accepted]
        return Emitted(tokens, drafted, cycle.source, accepted, reason, self.cache.nbytes, lps, top)


def _first_token(
    logits: mx.array, sampling: Sampling, key: Optional[mx.array], position: int, logprobs: Optional[int]
) -> tuple[mx.array, Optional[Scores]]:
    """The token the prefill's last logits give (lazy), and its scores when asked for."""
    with mx.stream(generation_stream):
        if key is None:
            last = mx.argmax(logits, -1)
        elif sampling.positional:
            last = sample_rows(sampling.logprobs(logits), position_keys(sampling.seed, position, 1))
        else:
            last = mx.random.categorical(sampling.logprobs(logits), key=key)
        return last, scores(logits, last, logprobs) if logprobs is not None else None
