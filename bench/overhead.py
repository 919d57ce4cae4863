"""How much does a DFlash cycle cost beyond its two forward passes?

A cycle is one drafter pass over a block plus one target pass verifying it. This
script times plain mlx-lm decoding, DFlash decoding, and the two bare forward
passes on a CPU-sized random float32 model pair, and reports the ratio of the
measured cycle time to (bare draft + bare verify): the engine's overhead.
The random drafter rarely agrees with the target (tau ~ 1), so DFlash is not
expected to beat plain decoding here; the overhead ratio is the number to watch.

    python bench/overhead.py [--hidden 1024] [--layers 8] [--block-size 16]
                             [--max-tokens 128] [--prompt-tokens 256] [--repeats 3]
"""

from __future__ import annotations

from common import build_models, median_time, plain, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
from typing import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generation_stream  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.models.caches import trim_to  # noqa: E402


def bare_forwards(target, drafter, ids: list[int], block_size: int, context: int) -> tuple[Callable, Callable]:
    """One bare draft pass and one bare verify pass, built as generate.py builds them.

    Both caches hold the prompt; the draft pass adds ``context`` new feature
    tokens (what a cycle passes: the previous cycle's accepted tokens + 1).
    Each call is rolled back, so every repetition sees the same cache length.
    """
    with mx.stream(generation_stream):
        target_cache, draft_cache = target.make_cache(), drafter.make_cache()
        logits, features = target(mx.array(ids)[None], target_cache, last_logits_only=True)
        last = mx.argmax(logits[0], axis=-1)
        masks = mx.full((block_size - 1,), drafter.mask_token_id, dtype=last.dtype)
        drafter(target.embed(mx.concatenate([last, masks])[None]), features, draft_cache)
        new_features = features[:, -context:]
        block = mx.array(ids[-block_size:])
        mx.eval(last, new_features, [c.state for c in target_cache + draft_cache])

    def draft() -> None:
        with mx.stream(generation_stream):
            h = drafter(target.embed(mx.concatenate([last, masks])[None]), new_features, draft_cache)
            drafted = mx.argmax(target.lm_head(h[:, 1:]), axis=-1)[0]
        mx.eval(drafted)
        trim_to(draft_cache, draft_cache[0].offset - context)

    def verify() -> None:
        with mx.stream(generation_stream):
            logits, _ = target(block[None], target_cache)
            verified = mx.argmax(logits[0], axis=-1)
        mx.eval(verified)
        trim_to(target_cache, target_cache[0].offset - block_size)

    return draft, verify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.block_size < 2:
        parser.error("--block-size must be >= 2: a 1-token block drafts nothing")

    print_machine()

    folder = build_models(args.hidden, args.layers)
    target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    B, N = args.block_size, args.max_tokens

    def dflash():
        return dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=N, block_size=B, eos_token_ids=[])

    plain(target.model, ids, N)  # warm-up
    context = max(1, round(dflash().tau))
    draft, verify = bare_forwards(target, drafter, ids, B, context)
    # Everything is measured in every repeat, so a busy machine skews all columns alike.
    plain_tps, dflash_tps, cycle_s, draft_s, verify_s, overhead = [], [], [], [], [], []
    for _ in range(args.repeats):
        plain_tokens, tps, _ = plain(target.model, ids, N)
        plain_tps.append(tps)
        result = dflash()
        dflash_tps.append(result.generation_tps)
        cycle_s.append((result.generation_tokens - 1) / result.generation_tps / result.cycles)
        draft_s.append(median_time(draft))
        verify_s.append(median_time(verify))
        overhead.append(cycle_s[-1] / (draft_s[-1] + verify_s[-1]))
    same = result.tokens == plain_tokens
    print(f"tokens: {'OK' if same else 'MISMATCH'} ({len(result.tokens)} dflash vs {len(plain_tokens)} plain)")
    if not same:
        first = next((i for i, (a, b) in enumerate(zip(result.tokens, plain_tokens)) if a != b), None)
        print(f"  first difference at token {first}")

    med = statistics.median
    p, d = med(plain_tps), med(dflash_tps)
    rows = [
        ("plain decode tok/s", f"{p:.1f}"),
        ("dflash decode tok/s", f"{d:.1f}"),
        ("ratio dflash/plain", f"{d / p:.2f}"),
        ("tau", f"{result.tau:.2f}  (cycles {result.cycles}, histogram {result.histogram})"),
        ("cycle ms", f"{med(cycle_s) * 1e3:.2f}"),
        (f"bare draft ms (context {context})", f"{med(draft_s) * 1e3:.2f}"),
        ("bare verify ms", f"{med(verify_s) * 1e3:.2f}"),
        ("cycle overhead ratio", f"{med(overhead):.2f}  (per repeat: {', '.join(f'{o:.2f}' for o in overhead)})"),
    ]
    print(f"\nhidden {args.hidden}, layers {args.layers}, block {B}, prompt {len(ids)}, max tokens {N}, "
          f"medians of {args.repeats}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
