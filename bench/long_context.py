"""Long contexts in bounded memory: a prompt-length sweep under a sliding window.

For each prompt length, plain mlx-lm decoding, DFlash with a fixed block and DFlash
with the adaptive policy (the default) run on the same target with the same window
semantics (the same WindowKVCache), side by side in one process, and the script
prints prefill tok/s, decode tok/s, tau and peak memory. With ``--repeats R`` the
three paths run R times per length in alternating order and the figures are
medians (this machine's speed drifts by 5-10% between runs). The targets: peak
memory at 32k within 10% of 8k, fixed-block decode tok/s at 32k at least 0.9x its
value at 8k, and adaptive at least 0.97x plain decoding at every length.

    python bench/long_context.py [--window 8192] [--lengths 1024,4096,8192,16384,32768]
                                 [--hidden 512] [--layers 4] [--max-tokens 64] [--block-size 16]
                                 [--repeats 1]
"""

from __future__ import annotations

from common import build_models, plain, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402

import mlx.core as mx  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.eval.report import depths_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument("--lengths", default="1024,4096,8192,16384,32768")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs per path and length (medians)")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    print_machine()
    folder = build_models(args.hidden, args.layers)
    target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
    W, N, B = args.window, args.max_tokens, args.block_size
    print(f"hidden {args.hidden}, layers {args.layers}, window {W}, block {B}, {N} new tokens per prompt, "
          f"{args.repeats} run(s) per path\n")

    def run_plain(ids: list[int]) -> dict:
        mx.clear_cache()
        mx.reset_peak_memory()
        tokens, decode, prefill = plain(target.model, ids, N, prompt_cache=target.make_cache(W, 0, slack=1))
        return {"prefill": prefill, "decode": decode, "peak": mx.get_peak_memory() / 2**30, "tokens": tokens}

    def run_dflash(ids: list[int], block: int | None) -> dict:
        mx.clear_cache()
        r = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=N, block_size=block, eos_token_ids=[], window=W)
        return {"prefill": r.prompt_tps, "decode": r.generation_tps, "peak": r.peak_memory * 1e9 / 2**30,
                "tau": r.tau, "tokens": r.tokens, "depths": r.depth_histogram}

    def median_run(runs: list[dict]) -> dict:
        """Medians of the numbers, the first run's tokens (every run must give the same)."""
        assert all(r["tokens"] == runs[0]["tokens"] for r in runs), "a path gave different tokens on a rerun"
        return {k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[0].items()}

    warm = prompt_ids(tokenizer, 256)
    run_plain(warm), run_dflash(warm, B), run_dflash(warm, None)
    print(f"{'prompt':>7} | {'prefill tok/s':>14} | {'decode tok/s':>25} | {'ratio to plain':>14} | {'tau':>4} | "
          f"{'peak GiB':>13} | same | adaptive depths")
    print(f"{'':>7} | {'plain':>6} {'dflash':>7} | {'plain':>7} {f'block {B}':>8} {'adapt':>8} | {f'block {B}':>8} {'adapt':>5} | "
          f"{'':>4} | {'plain':>6} {'dflash':>6} |")
    rows = {}
    for n in lengths:
        ids = prompt_ids(tokenizer, n)
        runs: dict[str, list[dict]] = collections.defaultdict(list)
        paths = {"plain": run_plain, "block": lambda i: run_dflash(i, B), "adaptive": lambda i: run_dflash(i, None)}
        for r in range(args.repeats):
            for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
                runs[name].append(paths[name](ids))
        depths = collections.Counter()
        for run in runs["adaptive"]:
            depths.update(dict(enumerate(run["depths"])))
        p, d, a = (median_run(runs[name]) for name in paths)
        a["depths"] = [depths.get(k, 0) for k in range(max(depths, default=0) + 1)]
        rows[n] = (p, d, a)
        same = p["tokens"] == d["tokens"] == a["tokens"]
        print(f"{n:>7} | {p['prefill']:>6.0f} {d['prefill']:>7.0f} | {p['decode']:>7.1f} {d['decode']:>8.1f} "
              f"{a['decode']:>8.1f} | {d['decode'] / p['decode']:>8.2f} {a['decode'] / p['decode']:>5.2f} | "
              f"{d['tau']:>4.2f} | {p['peak']:>6.2f} {d['peak']:>6.2f} | {'OK' if same else 'MISMATCH':>4} | "
              f"{depths_text(a['depths'])}", flush=True)
    if 8192 in rows and 32768 in rows:
        (_, d8, _), (_, d32, _) = rows[8192], rows[32768]
        mem, speed = d32["peak"] / d8["peak"], d32["decode"] / d8["decode"]
        print(f"\npeak memory 32k/8k: {mem:.3f} ({'PASS' if mem <= 1.10 else 'FAIL'}, target <= 1.10)")
        print(f"dflash decode 32k/8k: {speed:.3f} ({'PASS' if speed >= 0.90 else 'FAIL'}, target >= 0.90)")
    worst = min(a["decode"] / p["decode"] for p, _, a in rows.values())
    print(f"adaptive / plain, worst length: {worst:.3f} ({'PASS' if worst >= 0.97 else 'FAIL'}, target >= 0.97)")


if __name__ == "__main__":
    main()
