"""A quantized KV cache (``--kv-bits``): memory and speed at long contexts, against mlx-lm with the same cache.

For each prompt length and each cache (full precision, then ``--kv-bits`` 8 and 4, quantized
from ``--quantized-kv-start`` on), plain mlx-lm decoding and DFlash (the default adaptive
policy) run on the same target, side by side in one process; the script prints prefill and
decode tok/s, the peak memory, the KV cache's bytes at the end, DFlash over plain, and whether
the tokens are identical (they must be: DFlash with a quantized cache equals mlx-lm's decoding
with the same quantized cache). With ``--repeats R`` each path runs R times in alternating
order and the figures are medians (this machine's speed drifts between runs).

    python bench/kv_bits.py [--lengths 8192,32768] [--hidden 512] [--layers 4] [--max-tokens 64]
                            [--quantized-kv-start 5000] [--repeats 1]
"""

from __future__ import annotations

from common import build_models, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.models.caches import KVQuantization  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quantized-kv-start", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=1, help="runs per path (medians)")
    args = parser.parse_args()

    print_machine()
    folder = build_models(args.hidden, args.layers)
    target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
    N, start = args.max_tokens, args.quantized_kv_start
    print(f"hidden {args.hidden}, layers {args.layers}, {N} new tokens per prompt, quantized from {start} tokens, "
          f"{args.repeats} run(s) per path\n")

    def run_plain(ids: list[int], kv: dict) -> dict:
        mx.clear_cache()
        mx.reset_peak_memory()
        cache = target.make_cache(None, 0, slack=1)
        stamps, tokens = [], []
        tic = time.perf_counter()
        for token, _ in generate_step(mx.array(ids), target.model, max_tokens=N, prompt_cache=cache, **kv):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
        return {"prefill": len(ids) / (stamps[0] - tic), "decode": (N - 1) / (stamps[-1] - stamps[0]),
                "peak": mx.get_peak_memory() / 2**30, "cache": sum(c.nbytes for c in cache) / 2**30, "tokens": tokens}

    def run_dflash(ids: list[int], kv: dict) -> dict:
        mx.clear_cache()
        cache = dflash_mlx.make_cache(target, drafter, kv=KVQuantization.of(**kv))
        r = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=N, eos_token_ids=[], cache=cache, **kv)
        return {"prefill": r.prompt_tps, "decode": r.generation_tps, "peak": r.peak_memory * 1e9 / 2**30,
                "cache": sum(c.nbytes for c in cache.target) / 2**30, "tokens": r.tokens}

    caches = {"full": {}, "8-bit": {"kv_bits": 8, "quantized_kv_start": start},
              "4-bit": {"kv_bits": 4, "quantized_kv_start": start}}
    run_dflash(prompt_ids(tokenizer, 64), {})  # warm-up: the adaptive policy measures this machine's costs
    print(f"{'tokens':>7} {'cache':>6} {'path':>6} {'prefill':>9} {'decode':>8} {'peak GB':>8} {'KV GB':>7}"
          f" {'dflash/plain':>13} {'identical':>9}")
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = prompt_ids(tokenizer, length)
        for name, kv in caches.items():
            runs: dict[str, list[dict]] = {"plain": [], "dflash": []}
            for i in range(args.repeats):
                order = ["plain", "dflash"] if i % 2 == 0 else ["dflash", "plain"]
                for path in order:
                    runs[path].append((run_plain if path == "plain" else run_dflash)(ids, kv))
            figures = {path: {k: statistics.median(r[k] for r in rs) for k in ("prefill", "decode", "peak", "cache")}
                       for path, rs in runs.items()}
            same = all(p["tokens"] == d["tokens"] for p, d in zip(runs["plain"], runs["dflash"]))
            ratio = figures["dflash"]["decode"] / figures["plain"]["decode"]
            for path, f in figures.items():
                tail = f" {ratio:>12.2f}x {str(same):>9}" if path == "dflash" else ""
                print(f"{length:>7} {name:>6} {path:>6} {f['prefill']:>9.0f} {f['decode']:>8.1f} {f['peak']:>8.2f}"
                      f" {f['cache']:>7.3f}{tail}", flush=True)


if __name__ == "__main__":
    main()
