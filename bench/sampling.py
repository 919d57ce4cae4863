"""Sampled decoding: speculative-sampling verification against exact-match verification.

On the same pair and prompts, at temperatures 0.6 and 1.0, prints tau and decode tok/s for
``verify="rejection"`` (accept with min(1, p/q), residual on rejection) and ``verify="match"``
(keep drafts equal to target samples), plus plain sampled decoding for reference. Both are
exact; rejection sampling should accept more.

    python bench/sampling.py --draft bench/.cache/pair-.../draft --target bench/.cache/pair-.../target
"""

from __future__ import annotations

from common import plain, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402

from mlx_lm.sample_utils import make_sampler  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx import bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", default=None, help="JSONL of prompts [default: the built-in code set]")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print_machine()
    target, drafter, tokenizer = dflash_mlx.load(args.draft, args.target)
    conversations = bench.read_jsonl(args.prompts) if args.prompts else bench.builtin("code")
    prompts = [tokenizer.encode(c.turns[0]) for c in conversations[: args.num_prompts]]
    dflash_mlx.generate(target, drafter, tokenizer, prompts[0], max_tokens=8, temperature=1.0)  # warm-up
    print(f"\n{len(prompts)} prompts, {args.max_tokens} tokens each, block {args.block_size}; medians over prompts")
    print(f"{'temp':>5} | {'verify':>9} | {'tau':>5} | {'decode tok/s':>12} | {'plain tok/s':>11} | {'speedup':>7}")
    for temperature in (0.6, 1.0):
        plain_tps = statistics.median(
            plain(target.model, ids, args.max_tokens, sampler=make_sampler(temp=temperature))[1] for ids in prompts
        )
        for verify in ("rejection", "match"):
            runs = [dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=args.max_tokens, eos_token_ids=[],
                                        block_size=args.block_size, temperature=temperature, verify=verify, seed=i)
                    for i, ids in enumerate(prompts)]
            tau = statistics.median(r.tau for r in runs)
            tps = statistics.median(r.generation_tps for r in runs)
            print(f"{temperature:>5} | {verify:>9} | {tau:>5.2f} | {tps:>12.1f} | {plain_tps:>11.1f} | {tps / plain_tps:>6.2f}x")


if __name__ == "__main__":
    main()
