"""Sampling at temperature > 0 that keeps the target's exact output distribution.

The transforms (temperature, top-p, min-p, top-k) mean what they mean in mlx-lm's
sampler: the filters act on the untempered log-probabilities, then the survivors
are sampled at the temperature. Draft and target distributions go through the same
transforms, and verification is speculative sampling (Leviathan et al. 2023; Chen
et al. 2023) adapted to a block: draft token i is kept with probability
min(1, p/q); at the first rejection a token is drawn from the normalised residual
max(0, p - q); a fully accepted block adds a bonus token drawn from p. The emitted
sequence is distributed exactly as the target's own sampling.

``verify="match"`` is the simpler exact scheme of the reference implementations:
sample the target, keep drafts only while they equal those samples. Seeded, it
draws each position's token with a key of that position's own (``position_keys``),
so the output is the same whatever the cycles drafted: plain sampling with those
keys, which lets a seeded run keep the adaptive depth.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import DFlashError

# "auto": rejection sampling (it accepts more), but match with a seed, where a key per position lets the seeded
# run keep the adaptive depth (bench/sampling.py: 0.86-0.90x plain against 0.36-0.38x for seeded full blocks).
VERIFY_MODES = ("auto", "rejection", "match")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    verify: str = "auto"

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # nan fails too
            raise DFlashError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DFlashError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise DFlashError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise DFlashError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        if self.verify not in VERIFY_MODES:
            raise DFlashError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def positional(self) -> bool:
        """Seeded match sampling: each position's draw has its own key, so any depth gives the same tokens."""
        return not self.greedy and self.seed is not None and self.mode == "match"

    @property
    def mode(self) -> str:
        """The verification that runs: ``verify``, with "auto" resolved (match when seeded, else rejection)."""
        if self.verify == "auto":
            return "match" if self.seed is not None else "rejection"
        return self.verify

    def key(self) -> mx.array:
        """The generation's PRNG key: from ``seed``, or fresh each run."""
        return mx.random.key(self.seed if self.seed is not None else time.time_ns() % 2**63)

    def logprobs(self, logits: mx.array) -> mx.array:
        """Normalised log-probabilities of the distribution tokens are drawn from (last axis)."""
        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if self.top_p < 1:
            x = apply_top_p(x, self.top_p)
        if self.min_p > 0:
            x = apply_min_p(x, self.min_p)
        if 0 < self.top_k < x.shape[-1]:
            x = apply_top_k(x, self.top_k)
        x = x / self.temperature
        return x - mx.logsumexp(x, axis=-1, keepdims=True)


class Proposal(NamedTuple):
    """What a drafter proposes for one cycle: the drafted tokens and the distribution they came from.

    ``logprobs`` [k, V] are the log-probabilities of the distribution each token
    was actually drawn from (None at temperature 0, where drafts are argmaxes).
    Rejection sampling is exact only against that distribution, which need not be
    a softmax of the drafter's logits (DFlash2's selector draws from a few
    candidates), so the drafter, not the loop, says what it was.
    """

    tokens: mx.array  # [k] drafted ids
    logprobs: Optional[mx.array] = None


def copy_proposal(tokens: list[int], sampling: Sampling, vocab: int) -> Proposal:
    """A copy draft as a proposal: a point mass on each copied token.

    Rejection sampling then keeps a token x with probability p(x) and otherwise
    draws from p with x removed (the residual of a point mass): exact, as for any
    proposal. Only that verification reads the distribution.
    """
    ids = mx.array(tokens)
    if sampling.greedy or sampling.positional or sampling.mode != "rejection":
        return Proposal(ids)
    point = mx.arange(vocab)[None, :] == ids[:, None]
    return Proposal(ids, mx.where(point, 0.0, -mx.inf))


class Scores(NamedTuple):
    """Log-probabilities of a block's tokens and of each row's most likely tokens, as plain decoding reports them."""

    chosen: mx.array  # [n] of each row's token
    top_ids: Optional[mx.array]  # [n, k], most likely first (None when k = 0)
    top_logprobs: Optional[mx.array]


def scores(logits: mx.array, tokens: mx.array, k: int) -> Scores:
    """``tokens`` [n] scored under the target's own distribution, ``logits`` [n, V]: log-softmax before any
    temperature or filter (what mlx-lm's ``generate_step`` yields), and the ``k`` most likely tokens per row."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if not k:
        return Scores(chosen, None, None)
    ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return Scores(chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1))


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: consecutive inputs give unrelated 64-bit outputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def position_keys(seed: int, first: int, n: int) -> mx.array:
    """[n, 2] PRNG keys for the tokens at positions ``first .. first + n - 1`` of a seeded generation."""
    words = []
    for position in range(first, first + n):
        x = _mix64((seed ^ _mix64(position + 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF)
        words.append([x >> 32, x & 0xFFFFFFFF])
    return mx.array(words, dtype=mx.uint32)


def sample_rows(logprobs: mx.array, keys: mx.array) -> mx.array:
    """One token per row of ``logprobs`` [n, V], row i drawn with ``keys[i]`` (Gumbel-max, as categorical)."""
    noise = mx.stack([mx.random.gumbel(shape=logprobs.shape[-1:], key=keys[i]) for i in range(keys.shape[0])])
    return mx.argmax(logprobs + noise, axis=-1)


def verify(
    sampling: Sampling, proposal: Optional[Proposal], logits: mx.array, key: Optional[mx.array],
    row_keys: Optional[mx.array] = None,
) -> tuple[Optional[mx.array], mx.array]:
    """Check a proposal against the target's ``logits`` [k+1, V] for [last token ; drafts].

    Returns, per draft, whether it is accepted (None without a proposal) and, per
    block position, the target's token if the cycle stops there. The cycle keeps
    the drafts up to the first rejection, then the target's token at that position.
    ``row_keys`` (seeded match sampling) draw each block position with its own key.
    """
    if sampling.greedy:
        target_tokens = mx.argmax(logits, axis=-1)
        return (None if proposal is None else proposal.tokens == target_tokens[:-1]), target_tokens
    p = sampling.logprobs(logits)
    if row_keys is not None:
        sampled = sample_rows(p, row_keys)
        return (None if proposal is None else proposal.tokens == sampled[:-1]), sampled
    if proposal is None:
        return None, mx.random.categorical(p, key=key)
    if sampling.mode == "match":
        return verify_match(proposal.tokens, p, key)
    return verify_rejection(proposal.tokens, proposal.logprobs, p, key)


def verify_rejection(
    drafted: mx.array, q: mx.array, p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative-sampling verification of one block, all on device.

    ``drafted`` [n-1] were drawn from ``q`` [n-1, V] (log-probs); ``p`` [n, V] are the
    target's log-probs at each block position. Returns, per draft position, whether
    it is accepted, and per block position the token to emit if verification stops
    there: a residual sample before the end, a sample of p at the end. The host
    reads both once and takes the first rejection.
    """
    k_accept, k_resid = mx.random.split(key)
    n = p.shape[0]
    p_draft = mx.take_along_axis(p[:-1], drafted[:, None], axis=-1)[:, 0]
    q_draft = mx.take_along_axis(q, drafted[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(n - 1,), key=k_accept)
    accept = mx.log(u) + q_draft < p_draft  # u < p/q, in log space
    residual = mx.maximum(mx.exp(p[:-1]) - mx.exp(q), 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # Where p <= q everywhere (p == q), rejection has probability 0: fall back to p.
    residual = mx.where(mass > 0, mx.log(residual) - mx.log(mx.maximum(mass, 1e-30)), p[:-1])
    target_tokens = mx.random.categorical(mx.concatenate([residual, p[-1:]]), key=k_resid)
    return accept, target_tokens


def verify_match(drafted: mx.array, p: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Exact-match verification: sample the target at every position, keep equal drafts."""
    sampled = mx.random.categorical(p, key=key)
    return drafted == sampled[:-1], sampled
