"""Where a drafter training step's time goes, and positions a second before and after, side by side.

On the real pair's stored features (after `make pair`: bench/.cache/smollm2/draft), with make pair's recipe
(8 sequences a step, 32 blocks of 16 each), the training loop's own pieces time:

- the parts of one step: the batch, the drafter's forward, the loss (head and cross-entropy), the whole
  step with its backward and the optimizer;
- whole steps as they were and as they are, in alternating rounds on the same batches. Before: every block of
  a sequence under one mask over the context and all N*B block rows, and a softmax over every token of the
  training text plus 2,048 sampled others. Now: each block's scores against the context and its own rows
  apart (the same function: the losses agree to ~1e-6), and a softmax over the step's labels' tokens plus
  samples (``objective.Head.sample``). Between them, the attention alone.

    python bench/train_speed.py [--steps 6] [--rounds 3]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402

from dflash_mlx.models.drafter import Attention, Blocks, Drafter, DrafterArgs, block_mask  # noqa: E402
from dflash_mlx.models.loader import load_target  # noqa: E402
from dflash_mlx.models.target import Target  # noqa: E402
from dflash_mlx.training import objective  # noqa: E402
from dflash_mlx.training.data import training_sequences  # noqa: E402
from dflash_mlx.training.drafter_init import draft_config, init_from_target, pick_mask_token  # noqa: E402
from dflash_mlx.training.features import FeatureStore  # noqa: E402

PAIR = CACHE / "smollm2"
LAYERS = [14, 29]  # make pair's feature layers
BATCH, ANCHORS, BLOCK = 8, 32, 16  # make pair's recipe


def dense_attention(attn: Attention, x: mx.array, context: mx.array, blocks: Blocks) -> mx.array:
    """The attention before: keys [context ; every block of the sequence] under one [N*B, L + N*B] mask."""
    S, T, H = x.shape
    n, b = T // blocks.block_size, blocks.block_size
    offsets = mx.array(blocks.anchors.reshape(-1))
    per_block = x.reshape(S * n, b, H)

    def merge(t: mx.array) -> mx.array:  # [S*n, heads, b, d] -> [S, heads, n*b, d]
        return t.reshape(S, n, t.shape[1], b, -1).transpose(0, 2, 1, 3, 4).reshape(S, t.shape[1], n * b, -1)

    q = merge(attn.queries(per_block, offsets))
    block_k, block_v = (merge(t) for t in attn.context_kv(per_block, offsets))
    context_k, context_v = attn.context_kv(context, 0)
    k, v = mx.concatenate([context_k, block_k], axis=2), mx.concatenate([context_v, block_v], axis=2)
    own = np.repeat(np.arange(n), b)
    masks = [np.concatenate([block_mask(a, blocks.context_len, b, attn.window), own[:, None] == own[None, :]], axis=1)
             for a in blocks.anchors]
    out = scaled_dot_product_attention(q, k, v, cache=None, scale=attn.scale, mask=mx.array(np.stack(masks))[:, None])
    return out.transpose(0, 2, 1, 3)


def timed(fn: Callable[[], Any]) -> float:
    tic = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per attention and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be >= 2 and --rounds >= 1")
    if not (PAIR / "draft" / "features.npy").is_file():
        parser.error("no stored features: run `make pair` first")
    print_machine()
    model, tokenizer = load_target(PAIR / "target")
    target = Target(model, LAYERS)
    sequences = training_sequences(json.loads((PAIR / "draft" / "data.json").read_text()), BLOCK)
    store = FeatureStore(np.load(PAIR / "draft" / "features.npy", mmap_mode="r"),
                         [len(p) + len(r) for p, r in sequences])
    mx.random.seed(0)
    drafter = Drafter(DrafterArgs.from_dict(draft_config(target, 1, BLOCK, LAYERS, pick_mask_token(tokenizer, target))))
    init_from_target(drafter, target)
    head = objective.Head.of(target, sequences)
    weights = objective.position_weights(BLOCK)
    loss_and_grad = nn.value_and_grad(drafter, lambda b: objective.block_loss(drafter, target, b, weights))
    optimizer = optim.AdamW(learning_rate=1e-4)

    def batch(i: int) -> objective.Batch:
        rng = np.random.default_rng([0, i])
        picks = rng.choice(len(sequences), size=BATCH, replace=False)
        return objective.make_batch(target, [sequences[j] for j in picks], [store[j] for j in picks], rng, ANCHORS,
                                    BLOCK, drafter.mask_token_id)

    def whole_text(b: objective.Batch, rng: np.random.Generator) -> objective.Columns:
        """The softmax before: every token of the training text, and 2,048 others standing for the rest."""
        others = rng.choice(head.others, size=2048, replace=False)
        return objective.Columns(
            rows=mx.concatenate([head.rows, head.weight(mx.array(others))]),
            shift=mx.array(np.r_[np.zeros(len(head.kept)), np.full(2048, np.log(len(head.others) / 2048))],
                           dtype=mx.float32),
            labels=mx.array(head.lookup[np.array(b.labels)]))

    def step(b: objective.Batch) -> Any:
        loss, grads = loss_and_grad(b)
        optimizer.update(drafter, optim.clip_grad_norm(grads, 1.0)[0])
        return drafter.parameters(), optimizer.state, loss

    batches = [batch(i) for i in range(args.steps)]
    sampled = [head.sample(np.random.default_rng(i), np.array(b.labels)) for i, b in enumerate(batches)]
    before = [whole_text(b, np.random.default_rng(i)) for i, b in enumerate(batches)]
    positions = batches[0].tokens
    print(f"\nrecipe: {BATCH} sequences x {ANCHORS} blocks of {BLOCK} = {positions} supervised positions a step; "
          f"softmax over {head.rows.shape[0] + 2048} columns before, "
          f"{statistics.median(c.rows.shape[0] for c in sampled):.0f} now (median)")
    for b, c in zip(batches, sampled):
        b.columns = c
    parts = {
        "batch (features, embeddings, columns)": lambda i: (lambda b: (b.features, b.embeddings, head.sample(
            np.random.default_rng(i), np.array(b.labels)).rows))(batch(100 + i)),
        "drafter forward": lambda i: drafter(batches[i].embeddings, batches[i].features,
                                             Blocks(batches[i].anchors, batches[i].features.shape[1], BLOCK)),
        "loss forward (drafter, head, cross-entropy)": lambda i: objective.block_loss(drafter, target, batches[i],
                                                                                       weights),
        "loss and gradients": lambda i: loss_and_grad(batches[i]),
        "whole step (and the optimizer)": lambda i: step(batches[i]),
    }
    print("\none step, now (median of the steps after the first):")
    for name, fn in parts.items():
        times = [timed(lambda: fn(i)) for i in range(args.steps)]
        print(f"  {name:<45} {1000 * statistics.median(times[1:]):7.0f} ms")

    attn = drafter.layers[0].self_attn
    dense = lambda x, c, blocks: dense_attention(attn, x, c, blocks)  # noqa: E731
    split = Attention._blocks_attention.__get__(attn)
    variants = {"before": (dense, before), "the attention alone": (split, before), "now": (split, sampled)}
    diffs = []
    for b, c in zip(batches[:2], before):
        b.columns = c
        losses = []
        for fn in (dense, split):
            attn._blocks_attention = fn
            losses.append(objective.block_loss(drafter, target, b, weights).item())
        diffs.append(abs(losses[0] - losses[1]))
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, (fn, columns) in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            attn._blocks_attention = fn
            for b, c in zip(batches, columns):
                b.columns = c
            times = [timed(lambda: step(b)) for b in batches]
            rates[name].append(positions / statistics.median(times[1:]))
    print(f"\nwhole steps, {args.rounds} alternating rounds of {args.steps} (positions a second, median of rounds):")
    for name, values in rates.items():
        print(f"  {name:<22} {statistics.median(values):7.0f}  (rounds: {', '.join(f'{v:.0f}' for v in values)})")
    was = statistics.median(rates["before"])
    print(f"  now / before: {statistics.median(rates['now']) / was:.2f}x, the attention alone "
          f"{statistics.median(rates['the attention alone']) / was:.2f}x; the two attentions' losses differ by at most "
          f"{max(diffs):.1e}")


if __name__ == "__main__":
    main()
