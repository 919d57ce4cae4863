"""Could the drafter's own confidence choose how much of its block the target verifies? Offline, on the real pair.

A cycle's verify depth is now chosen before the drafter runs (``decode.policy``). The alternative: draft the whole
block, read each position's highest probability (a property of the drafter's distribution, not of the token drawn,
so a depth chosen from it keeps sampling exact), and verify only as deep as that confidence pays. This measures
whether it would, before any of it is built: for each prompt, the target's own greedy reply; the drafter's block at
every position of it (teacher-forced, as ``eval.traces`` does); how often a position is accepted by its
confidence; and the tokens per plain step each rule would reach, walking the reply cycle by cycle with the cycle
costs ``bench/trace.py`` measured here (a block drafted and then not verified costs its pass, timed below).

    python bench/confidence.py [--pair BUNDLE] [--prompts 6] [--max-tokens 128] [--profile NAME.profile.json]
"""

from __future__ import annotations

from common import CACHE, median_time, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.errors import DFlashError  # noqa: E402
from dflash_mlx.chat_template import prompt_ids  # noqa: E402
from dflash_mlx.decode.generate import generate  # noqa: E402
from dflash_mlx.eval.prompts import builtin  # noqa: E402
from dflash_mlx.eval.traces import target_features  # noqa: E402
from dflash_mlx.models.drafter import Blocks  # noqa: E402

BINS = np.array([0, .1, .2, .3, .4, .5, .6, .7, .8, .9, 1.01])


def blocks(target, drafter, features: mx.array, seq: list[int], anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's greedy block at each anchor, and each position's highest probability: both [anchors, B - 1]."""
    B = drafter.block_size
    block = np.full((len(anchors), B), drafter.mask_token_id)
    block[:, 0] = np.asarray(seq)[anchors]
    h = drafter(drafter.embed_blocks(target, mx.array(block.reshape(1, -1))), features,
                Blocks(anchors[None], features.shape[1], B, None))
    probs = mx.softmax(drafter.head_logits(target, h.reshape(len(anchors), B, -1)[:, 1:]).astype(mx.float32), -1)
    return np.array(drafter.tokens(probs.argmax(-1))), np.array(probs.max(-1))


def walk(replies: list[tuple[np.ndarray, np.ndarray]], cost: np.ndarray, wasted: float,
         depth: Callable[[np.ndarray, int], int]) -> float:
    """Tokens per plain step over all replies: from each reply's start, cycles of ``depth(confidence, agreeing)``."""
    tokens = seconds = 0.0
    for agree, conf in replies:
        pos = 0
        while pos < len(agree):
            k = depth(conf[pos], agree[pos])
            accepted = min(agree[pos], k)
            seconds += cost[k] + (wasted if k == 0 else 0)
            tokens += accepted + 1
            pos += accepted + 1
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(CACHE / "smollm2" / "bundle"))
    parser.add_argument("--prompts", type=int, default=6, help="prompts of each of math, chat and code")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profile", default=str(CACHE / "traces" / "smollm2-own.profile.json"),
                        help="cycle costs measured by bench/trace.py (context 256 is used)")
    args = parser.parse_args()
    print_machine()
    target, drafter, tokenizer = dflash_mlx.load(args.pair)
    B = drafter.block_size
    profile = json.loads(open(args.profile).read())
    plain = profile["plain"][0]
    cost = np.array(profile["cycle"][0][:B]) / plain  # k = 0..B-1 drafted, in plain steps

    context = target_features(target, list(range(1, 301)))
    one = np.array([299])
    wasted = median_time(lambda: mx.eval(blocks(target, drafter, context, list(range(1, 301)), one)[0])) / plain
    print(f"a block of {B} drafted at context 300: {wasted:.2f} plain steps; cycle costs k = 0..{B - 1}: "
          f"{' '.join(f'{c:.2f}' for c in cost)}")

    replies, first, later = [], [], []  # per reply: (agreeing prefix, confidences); (confidence, accepted) pairs
    for dataset in ("math", "chat", "code"):
        for conv in builtin(dataset)[: args.prompts]:
            ids = prompt_ids(tokenizer, [{"role": "user", "content": conv.turns[0]}])
            out = generate(target, drafter, tokenizer, ids, max_tokens=args.max_tokens, block_size=1,
                           eos_token_ids=[]).tokens
            seq = ids + out
            drafts, conf = blocks(target, drafter, target_features(target, seq), seq,
                                  np.arange(len(ids), len(seq) - 1))
            labels = np.full_like(drafts, -1)
            for i in range(len(out) - 1):
                following = out[i + 1 : i + B]
                labels[i, : len(following)] = following
            agree = np.cumprod(drafts == labels, axis=1).sum(1)
            replies.append((agree, conf))
            first += [(c[0], a >= 1) for a, c in zip(agree, conf)]
            later += [(c[j], a > j) for a, c in zip(agree, conf) for j in range(1, B - 1) if a >= j]

    print("\nconfidence | first position: blocks, accepted | later positions (those before accepted): n, accepted")
    table = []
    for lo, hi in zip(BINS, BINS[1:]):
        row = [[ok for c, ok in pairs if lo <= c < hi] for pairs in (first, later)]
        table.append([np.mean(r) if r else 0.0 for r in row])
        print(f"{lo:.1f}-{min(hi, 1):.1f}    | {len(row[0]):5} {table[-1][0]:.2f} | {len(row[1]):5} {table[-1][1]:.2f}")

    def expected(conf: np.ndarray, agree: int) -> int:
        """The depth of most expected tokens per cost, acceptance read off the table above (in-sample: a bound)."""
        best, depth, chain, tokens = 1 / cost[0], 0, 1.0, 1.0
        for j in range(B - 1):
            chain *= table[np.searchsorted(BINS, conf[j], side="right") - 1][0 if j == 0 else 1]
            tokens += chain
            if tokens / cost[j + 1] > best:
                best, depth = tokens / cost[j + 1], j + 1
        return depth

    def cumulative(threshold: float) -> Callable[[np.ndarray, int], int]:
        return lambda conf, agree: int((np.cumprod(conf) >= threshold).sum())

    print("\nrule | tokens per plain step (mlx-lm's plain decoding = 1)")
    for k in range(1, B):
        print(f"always {k} | {walk(replies, cost, wasted, lambda conf, agree, k=k: k):.3f}")
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        print(f"as deep as the confidences' product >= {threshold} | {walk(replies, cost, wasted, cumulative(threshold)):.3f}")
    print(f"most expected tokens per cost | {walk(replies, cost, wasted, expected):.3f}")
    oracle = lambda conf, agree: agree if agree and (agree + 1) / cost[agree] > 1 / cost[0] else 0  # noqa: E731
    print(f"the oracle (the accepted length where it pays, nothing wasted) | {walk(replies, cost, 0.0, oracle):.3f}")


if __name__ == "__main__":
    try:
        main()
    except (DFlashError, OSError, json.JSONDecodeError) as e:  # a wrong path, a damaged file: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
