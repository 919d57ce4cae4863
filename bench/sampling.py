"""Sampled decoding: the two exact verifiers, and what a seed costs.

On the same pair and prompts, at temperatures 0.6 and 1.0:

1. Acceptance, full blocks: tau and the share of drafted tokens accepted for
   ``verify="rejection"`` (speculative sampling: accept with min(1, p/q), residual on
   rejection) and ``verify="match"`` (keep drafts equal to target samples).
2. What a user gets by default, with and without ``--seed``: unseeded runs of both
   verifiers use the adaptive depth; a seeded rejection run drafts full blocks (its draw
   depends on the depths), a seeded match run draws each position with a key of its own
   and stays adaptive. Decode tok/s against plain sampled decoding of the same target,
   medians over prompts, the paths in alternating order per prompt.

    python bench/sampling.py --draft bench/.cache/pair-.../draft --target bench/.cache/pair-.../target \
        [--prompts FILE.jsonl] [--num-prompts 8] [--max-tokens 128] [--block-size 16]
"""

from __future__ import annotations

from common import plain, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402

from mlx_lm.sample_utils import make_sampler  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.eval.prompts import builtin, read_jsonl  # noqa: E402

VERIFIERS = ("rejection", "match")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", default=None, help="JSONL of prompts [default: the built-in code set]")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="the full block of part 1")
    args = parser.parse_args()
    print_machine()
    target, drafter, tokenizer = dflash_mlx.load(args.draft, args.target)
    conversations = read_jsonl(args.prompts) if args.prompts else builtin("code")
    prompts = [tokenizer.encode(c.turns[0]) for c in conversations[: args.num_prompts]]
    dflash_mlx.generate(target, drafter, tokenizer, prompts[0], max_tokens=8, temperature=1.0)  # warm-up

    def run(ids: list[int], i: int, **options) -> dflash_mlx.GenerationResult:
        return dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=args.max_tokens, eos_token_ids=[],
                                   **options)

    print(f"\n{len(prompts)} prompts, {args.max_tokens} tokens each; medians over prompts")
    print(f"\n1. acceptance at full blocks of {args.block_size}")
    print(f"{'temp':>5} | {'verify':>9} | {'tau':>5} | {'accepted':>8}")
    for temperature in (0.6, 1.0):
        for verify in VERIFIERS:
            runs = [run(ids, i, block_size=args.block_size, temperature=temperature, verify=verify, seed=i)
                    for i, ids in enumerate(prompts)]
            print(f"{temperature:>5} | {verify:>9} | {statistics.median(r.tau for r in runs):>5.2f} | "
                  f"{statistics.median(r.acceptance_rate for r in runs):>8.1%}")

    print("\n2. the defaults, with and without a seed (decode tok/s; ratio to plain sampled decoding)")
    print(f"{'temp':>5} | {'verify':>9} | {'seed':>4} | {'depths':>11} | {'tau':>5} | {'tok/s':>7} | {'plain':>7} | "
          f"{'ratio':>5}")
    for temperature in (0.6, 1.0):
        paths = [(verify, seeded) for verify in VERIFIERS for seeded in (False, True)]
        tps: dict = {p: [] for p in paths}
        taus: dict = {p: [] for p in paths}
        plain_tps = []
        for i, ids in enumerate(prompts):
            order = paths if i % 2 == 0 else paths[::-1]
            plain_tps.append(plain(target.model, ids, args.max_tokens, sampler=make_sampler(temp=temperature))[1])
            for verify, seeded in order:
                r = run(ids, i, temperature=temperature, verify=verify, seed=i if seeded else None)
                tps[verify, seeded].append(r.generation_tps)
                taus[verify, seeded].append(r.tau)
        base = statistics.median(plain_tps)
        for verify, seeded in paths:
            depths = "full blocks" if seeded and verify == "rejection" else "adaptive"
            speed = statistics.median(tps[verify, seeded])
            print(f"{temperature:>5} | {verify:>9} | {'yes' if seeded else 'no':>4} | {depths:>11} | "
                  f"{statistics.median(taus[verify, seeded]):>5.2f} | {speed:>7.1f} | {base:>7.1f} | {speed / base:>5.2f}")


if __name__ == "__main__":
    main()
