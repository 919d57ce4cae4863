"""Adaptive depth against plain decoding and fixed blocks, side by side in one process.

Every prompt is decoded by plain mlx-lm, by DFlash with fixed blocks, and by DFlash
with the adaptive policy (the default), in alternating order over the repeats; the
figures are medians of decode tok/s. The adaptive policy keeps what it measured
from one prompt to the next, as it does for a user who keeps the model loaded.
"plain" is ``mlx_lm.stream_generate``, text included, as dflash-mlx produces its
own; "plain ids" is mlx-lm's bare ``generate_step`` (no text), shown for reference.

    python bench/adaptive.py random [--reference-blas --blocks '']   # random pair, tau ~ 1: adaptive vs plain
    python bench/adaptive.py pair [--pair DIR]           # trained pair: vs plain and blocks 4, 8, 16
"""

from __future__ import annotations

import os
import sys

if "--reference-blas" in sys.argv:  # stay on MLX's bundled reference BLAS (no OpenBLAS re-exec)
    os.environ["DFLASH_MLX_BLAS_REEXEC"] = "1"

from common import CACHE, build_models, plain, print_machine  # noqa: E402  (re-execs with OpenBLAS first)

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from importlib import resources  # noqa: E402
from pathlib import Path  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.eval.report import depths_text  # noqa: E402


def measure(target, drafter, tokenizer, prompts: list[list[int]], blocks: list[int], max_tokens: int,
            repeats: int) -> tuple[dict[str, list[float]], collections.Counter]:
    """Per path ('plain', 'plain ids', 'block N', 'adaptive'): median decode tok/s per prompt; the adaptive depths."""
    paths = ["plain", "plain ids"] + [f"block {b}" for b in blocks] + ["adaptive"]
    speeds: dict[str, list[float]] = {p: [] for p in paths}
    depths: collections.Counter = collections.Counter()
    for ids in prompts:
        runs: dict[str, list[float]] = {p: [] for p in paths}
        reference = None
        for r in range(repeats):
            for path in paths if r % 2 == 0 else paths[::-1]:
                if path.startswith("plain"):
                    tokens, tps, _ = plain(target.model, ids, max_tokens, tokenizer=tokenizer if path == "plain" else None)
                else:
                    block = None if path == "adaptive" else int(path.split()[1])
                    out = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=block,
                                              eos_token_ids=[])
                    tokens, tps = out.tokens, out.generation_tps
                    if path == "adaptive":
                        depths.update(out.drafted)
                reference = reference or tokens
                assert tokens == reference, f"{path}: tokens differ from the other paths"
                runs[path].append(tps)
        for p in paths:
            speeds[p].append(statistics.median(runs[p]))
    return speeds, depths


def report(name: str, speeds: dict[str, list[float]], depths: collections.Counter) -> None:
    med = {p: statistics.median(v) for p, v in speeds.items()}
    fair = [p for p in med if p not in ("adaptive", "plain ids")]  # the paths that produce text, as adaptive does
    best = max(fair, key=med.get)
    print(f"\n{name}: median decode tok/s over {len(speeds['plain'])} prompts (tokens identical on every path)")
    print("  " + " | ".join(f"{p} {v:.1f}" for p, v in med.items()))
    per_prompt = [a / max(speeds[p][i] for p in fair) for i, a in enumerate(speeds["adaptive"])]
    print(f"  adaptive / plain {med['adaptive'] / med['plain']:.3f}; adaptive / best fixed-or-plain ({best}) "
          f"{med['adaptive'] / med[best]:.3f}; per prompt vs its best: min {min(per_prompt):.3f}, "
          f"median {statistics.median(per_prompt):.3f}")
    print(f"  adaptive / plain ids (generate_step, no text) {med['adaptive'] / med['plain ids']:.3f}")
    hist = [depths.get(k, 0) for k in range(max(depths, default=0) + 1)]
    print(f"  adaptive depths (depth:cycles): {depths_text(hist)}")


def encoded(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["random", "pair"])
    parser.add_argument("--reference-blas", action="store_true", help="run on MLX's bundled reference BLAS")
    parser.add_argument("--pair", type=Path, default=None, help="trained pair folder [default: newest bench/.cache/pair-*]")
    parser.add_argument("--hidden", type=int, default=1024, help="random pair shape (the one bench/overhead.py uses)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--blocks", default=None,
                        help="fixed blocks to compare, e.g. 4,8,16; '' for none [default: 16 random, 4,8,16 pair]")
    args = parser.parse_args()
    print_machine()
    builtin = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())

    if args.what == "random":
        folder = build_models(args.hidden, args.layers)
        target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
        prompts = encoded(tokenizer, [p for name in ("math", "code", "chat") for p in builtin[name]][: args.prompts])
        sets = {"random pair": prompts}
        blocks = [16]  # (under the reference BLAS a block of 16 costs ~16 steps: --blocks '' skips it)
    else:
        pair = args.pair or max(CACHE.glob("pair-*"), key=lambda p: p.stat().st_mtime, default=None)
        if pair is None:
            sys.exit("no trained pair: run python bench/build_pair.py first (or pass --pair)")
        target, drafter, tokenizer = dflash_mlx.load(str(pair / "draft"), str(pair / "target"))
        held = [json.loads(line)["prompt"] for line in (pair / "heldout.jsonl").read_text().splitlines()]
        sets = {f"{pair.name} held-out code": encoded(tokenizer, held[: args.prompts]),
                f"{pair.name} built-in chat": encoded(tokenizer, builtin["chat"][: args.prompts])}
        blocks = [4, 8, 16]
    if args.blocks is not None:
        blocks = [int(b) for b in args.blocks.split(",") if b]
    warm = next(iter(sets.values()))[0]
    for block in blocks + [None]:  # warm-up; the adaptive policy also measures its first cycles here
        dflash_mlx.generate(target, drafter, tokenizer, warm, max_tokens=32, block_size=block, eos_token_ids=[])
    plain(target.model, warm, 32, tokenizer=tokenizer)
    print(f"{args.max_tokens} tokens per prompt, greedy, {args.repeats} repeats in alternating order")
    for name, prompts in sets.items():
        speeds, depths = measure(target, drafter, tokenizer, prompts, blocks, args.max_tokens, args.repeats)
        report(name, speeds, depths)


if __name__ == "__main__":
    main()
