"""What a training step optimizes: blocks cut from the target's own replies, scored through its frozen LM head.

Each step cuts many blocks [anchor token, MASK x (B-1)] out of a few responses and drafts all blocks
of a sequence in one pass of the very ``Drafter`` inference uses (``drafter.Blocks``). Block position k
predicts the token k after the anchor, weighted exp(-(k-1)/gamma) (acceptance stops at the first miss).
The features are seen with noise (``perturb_features``), as the drafter otherwise memorises its data.
The softmax runs over a few columns of the head (``Head.sample``) rather than the whole vocabulary. The
learning rate follows the share of training done: linear warmup, then cosine to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.drafter import Blocks, Drafter
from ..models.target import Target
from .data import Sequences

WARMUP = 0.04  # share of training spent warming up
FEATURE_NOISE = 0.3  # std of the noise on the target features, a share of their scale (``perturb_features``)


def loss_gamma(block_size: int) -> float:
    """Decay of the position weights: the published 4, 5, 7 at B = 8, 10, 16, linear between, held beyond."""
    return float(np.interp(block_size, [8, 10, 16], [4.0, 5.0, 7.0]))


def position_weights(block_size: int, gamma: Optional[float] = None) -> mx.array:
    """exp(-(k-1)/gamma) for k = 1..B-1 (gamma None: ``loss_gamma``): early positions matter most, as acceptance
    stops at the first miss."""
    k = mx.arange(1, block_size, dtype=mx.float32)
    return mx.exp(-(k - 1) / (loss_gamma(block_size) if gamma is None else gamma))


def sample_anchors(rng: np.random.Generator, prompt_len: int, seq_len: int, block_size: int, n: int) -> np.ndarray:
    """``n`` sorted anchors in the response whose whole block fits (a + B - 1 < seq_len).

    Without replacement when the response has room for ``n``, else with (short replies
    still give full-sized batches).
    """
    valid = np.arange(prompt_len, seq_len - block_size + 1)
    return np.sort(rng.choice(valid, size=n, replace=len(valid) < n))


def block_labels(seq: Sequence[int], anchors: Sequence[int], block_size: int) -> np.ndarray:
    """[N, B-1]: block position k (1..B-1) predicts seq[anchor + k] (not anchor + k + 1)."""
    return np.asarray(seq)[np.asarray(anchors)[:, None] + np.arange(1, block_size)]


@dataclass
class Batch:
    features: mx.array  # [S, L, F] frozen target features, zero-padded to the longest sequence
    embeddings: mx.array  # [S, N*B, H] the target's embeddings of the blocks
    anchors: np.ndarray  # [S, N] each block's first position
    labels: mx.array  # [S, N, B-1]
    columns: Optional[Columns] = None  # the head columns this step's softmax runs over (None: the whole head)

    @property
    def tokens(self) -> int:
        return self.labels.size


def make_batch(
    target: Target, sequences: list[tuple[list[int], list[int]]], stored: list[mx.array], rng: np.random.Generator,
    anchors: int, block_size: int, mask_token: int,
) -> Batch:
    """Blocks cut from (prompt, response) pairs, with the target's stored features of each whole sequence.

    Padding never leaks: it lies beyond every anchor, so the mask hides it.
    """
    length = max(len(p) + len(r) for p, r in sequences)
    features, blocks, rows, labels = [], [], [], []
    for (prompt, response), f in zip(sequences, stored):
        seq = prompt + response
        features.append(mx.pad(f, [(0, length - len(seq)), (0, 0)]))
        a = sample_anchors(rng, len(prompt), len(seq), block_size, anchors)
        block = np.full((anchors, block_size), mask_token)
        block[:, 0] = np.asarray(seq)[a]
        blocks.append(block.reshape(-1))
        rows.append(a)
        labels.append(block_labels(seq, a, block_size))
    return Batch(
        features=mx.stack(features).astype(mx.float32),
        embeddings=mx.stop_gradient(target.embed(mx.array(np.stack(blocks)))).astype(mx.float32),
        anchors=np.stack(rows),
        labels=mx.array(np.stack(labels)),
    )


LABELLED_WITH = 1024  # tokens of the training text, besides a step's labels, sampled into each step's softmax
NEGATIVES = 512  # tokens never in the training text sampled into each step's softmax


@dataclass
class Columns:
    """The head columns of one step's softmax: the tokens its labels hold, then samples that stand for the rest."""

    rows: mx.array  # [C, H] the head's rows
    shift: mx.array  # [C] log(tokens a column stands for): 0 for the labels' own, log(pool / drawn) for a sample
    labels: mx.array  # [S, N, B-1] each label's column


@dataclass
class Head:
    """The target's LM head as the loss sees it: each step, the columns of its labels and a sample of the others.

    The vocabulary projection of every block position, its softmax and their gradients were most of a
    step over SmolLM2's 49k tokens (exponentials run ~10 ns each on MLX's CPU backend). A step's labels
    hold a few hundred tokens (~280 for ``make pair``'s 3,840 positions), so its softmax runs over those,
    ``LABELLED_WITH`` more tokens of the training text (the likely competitors) and ``NEGATIVES`` tokens
    it never holds, each sample shifted by log(pool / drawn) so that its mass estimates its whole pool's
    (sampled softmax). Without the never-seen sample nothing would push those tokens down, and the full
    head at inference drafts them (measured: first positions 0% right after 25 steps, against 4% with
    every token scored).
    """

    rows: mx.array  # [V', H] the head's weight rows (dequantized) for the tokens of the training text
    lookup: np.ndarray  # token id -> its index in ``rows`` (-1: not in the training text)
    kept: np.ndarray  # the ids in the training text, ascending
    others: np.ndarray  # the ids not in it
    weight: Callable[[mx.array], mx.array]  # the head's rows for any ids, float32

    @classmethod
    def of(cls, target: Target, sequences: Sequences) -> Optional[Head]:
        """The sub-head, or None where the head is not a plain (or quantized) matrix: then the full head scores."""
        module = target.head_module
        if target.head_group is not None or "bias" in module:
            return None
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            biases = module.get("biases")

            def weight(ids: mx.array) -> mx.array:
                return mx.dequantize(module.weight[ids], module.scales[ids], None if biases is None else biases[ids],
                                     module.group_size, module.bits, mode=module.mode).astype(mx.float32)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            def weight(ids: mx.array) -> mx.array:
                return module.weight[ids].astype(mx.float32)
        else:
            return None
        ids = np.unique(np.concatenate([np.asarray(p + r, dtype=np.int64) for p, r in sequences]))
        lookup = np.full(target.vocab_size, -1, dtype=np.int64)
        lookup[ids] = np.arange(len(ids))
        return cls(rows=weight(mx.array(ids)), lookup=lookup, kept=ids, others=np.nonzero(lookup < 0)[0],
                   weight=weight)

    def sample(self, rng: np.random.Generator, labels: np.ndarray) -> Columns:
        """This step's columns for ``labels`` [S, N, B-1] (token ids of the training text)."""
        own = np.unique(labels)
        rest = np.setdiff1d(self.kept, own, assume_unique=True)
        rows, shift = [self.rows[mx.array(self.lookup[own])]], [np.zeros(len(own))]
        for pool, size, fetch in ((rest, LABELLED_WITH, lambda i: self.rows[mx.array(self.lookup[i])]),
                                  (self.others, NEGATIVES, lambda i: self.weight(mx.array(i)))):
            drawn = min(size, len(pool))
            if drawn:
                rows.append(fetch(rng.choice(pool, size=drawn, replace=False)))
                shift.append(np.full(drawn, math.log(len(pool) / drawn)))
        return Columns(rows=mx.concatenate(rows), shift=mx.array(np.concatenate(shift), dtype=mx.float32),
                       labels=mx.array(np.searchsorted(own, labels)))


def perturb_features(features: mx.array, noise: float, layers: int, key: mx.array) -> mx.array:
    """The target features plus Gaussian noise of std ``noise`` x each feature layer's row RMS.

    Hundreds of replies are passed over dozens of times in an hour, and the drafter memorised them: on
    sequences it trained on it accepted 3.5 tokens a block against 0.7 on held-back ones. Noise on its
    inputs narrows that gap (measured in docs/benchmarks.md, "Noise on the features"); each layer's own
    scale sets it, as layers' hidden states differ in size.
    """
    if not noise:
        return features
    S, L, F = features.shape
    x = features.reshape(S, L, layers, F // layers)
    rms = mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True))
    return (x + noise * rms * mx.random.normal(x.shape, key=key)).reshape(S, L, F)


def block_loss(drafter: Drafter, target: Target, batch: Batch, weights: mx.array) -> mx.array:
    """Position-weighted cross-entropy of block positions 1..B-1 through the target's frozen LM head."""
    S, N, k = batch.labels.shape
    blocks = Blocks(batch.anchors, batch.features.shape[1], k + 1)
    h = drafter(batch.embeddings, batch.features, blocks)  # the inference modules, with training's masks
    h = h.reshape(S, N, k + 1, -1)[:, :, 1:]
    if batch.columns is None:
        logits, labels = drafter.compute_logits(target.lm_head(h.astype(target.dtype))), batch.labels
    else:  # the shift after the drafter's transforms (soft-capping): it counts tokens, it is no logit of theirs
        c = batch.columns
        logits, labels = drafter.compute_logits(h @ c.rows.T) + c.shift, c.labels
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), labels)
    return (ce * weights).sum(-1).mean() / weights.sum()


def learning_rate(progress: float, peak: float) -> float:
    """Linear warmup from 10% of ``peak`` over the first 4% of training, then cosine to 0."""
    if progress < WARMUP:
        return peak * (0.1 + 0.9 * progress / WARMUP)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - WARMUP) / (1 - WARMUP))))
