"""Many short requests on one cache, as a server sees them: does handing MLX's buffers back after each pay?

Runs 200 short generations (a new prompt each, a few tokens, one DFlashCache carried
across them as `serve` does) twice in one process, alternating in blocks of 20: with
``mx.clear_cache()`` where the library calls it, and with it doing nothing (MLX keeps
freed buffers for reuse, up to its cache limit). Prints the median request time of
each, the ratio, and MLX's active and cached memory after each block (flat or not).

    python bench/soak.py [--requests 200] [--hidden 1024] [--layers 8] [--max-tokens 4]
"""

from __future__ import annotations

from common import build_models, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

import dflash_mlx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--block", type=int, default=20, help="requests per block before switching variant")
    args = parser.parse_args()
    print_machine()
    folder = build_models(args.hidden, args.layers)
    target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
    cache = dflash_mlx.make_cache(target, drafter)
    clear = mx.clear_cache
    times: dict[str, list[float]] = {"clear_cache": [], "keep": []}
    memory: dict[str, list[tuple[int, int]]] = {"clear_cache": [], "keep": []}
    dflash_mlx.generate(target, drafter, tokenizer, "warm up", max_tokens=args.max_tokens, cache=cache)
    try:
        for start in range(0, 2 * args.requests, args.block):
            variant = ("clear_cache", "keep")[(start // args.block) % 2]
            mx.clear_cache = clear if variant == "clear_cache" else (lambda: None)
            for i in range(start, start + args.block):
                prompt = f"Request number {i}: tell me something about the number {i * 7919 % 1000}."
                tic = time.perf_counter()
                dflash_mlx.generate(target, drafter, tokenizer, prompt, max_tokens=args.max_tokens, cache=cache)
                times[variant].append(time.perf_counter() - tic)
            memory[variant].append((mx.get_active_memory(), mx.get_cache_memory()))
    finally:
        mx.clear_cache = clear
    for variant in times:
        active = [a / 2**20 for a, _ in memory[variant]]
        cached = [c / 2**20 for _, c in memory[variant]]
        print(f"{variant:12s} median request {statistics.median(times[variant]) * 1e3:.1f} ms over "
              f"{len(times[variant])}; active MiB first/last block {active[0]:.0f}/{active[-1]:.0f}, "
              f"cached MiB {cached[0]:.0f}/{cached[-1]:.0f}")
    ratio = statistics.median(times["keep"]) / statistics.median(times["clear_cache"])
    print(f"request time, buffers kept / cleared after each generation: {ratio:.3f}")


if __name__ == "__main__":
    main()
