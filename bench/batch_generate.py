"""Rows decoded together in one process: dflash's batch_generate against mlx-lm's, side by side.

No server, no HTTP: what the batched pass and the policy cost, apart from what serving costs.
Three runs of the same prompts, in rotating order each round: ``batch_generate`` with plain
steps (``block_size=1``), with the adaptive policy (the default), and mlx-lm's
``batch_generate`` (its batched plain decoding) on the target alone. A first untimed round
warms every path up (the adaptive policy and the batch planner carry what they measured
over to the next call, as in a server). The figure is mlx-lm's time over ours, per round:
above 1, ours is faster. Greedy; the tokens of the three are compared.

    python bench/batch_generate.py [--pair DIR] [--prompts 4] [--max-tokens 96] [--rounds 5]
"""

from __future__ import annotations

from common import build_models, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from importlib import resources  # noqa: E402
from pathlib import Path  # noqa: E402

from mlx_lm.generate import batch_generate as mlx_lm_batch_generate  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.decode.generate import batch_generate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, default=None, help="a folder with draft/ and target/ "
                        "[default: the random pair, hidden 1024, 8 layers]")
    parser.add_argument("--prompts", type=int, default=4, help="rows decoded together")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print_machine()
    pair = args.pair or build_models(1024, 8)
    target, drafter, tokenizer = dflash_mlx.load(str(pair / "draft"), str(pair / "target"))
    chat = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())["chat"]
    prompts = [tokenizer.encode(chat[i % len(chat)]) for i in range(args.prompts)]
    n = args.max_tokens
    runs = {
        "plain steps": lambda: [r.tokens for r in batch_generate(target, drafter, tokenizer, prompts, max_tokens=n,
                                                                 block_size=1)],
        "adaptive": lambda: [r.tokens for r in batch_generate(target, drafter, tokenizer, prompts, max_tokens=n)],
        "mlx-lm": lambda: mlx_lm_batch_generate(target.model, tokenizer, prompts, max_tokens=n,
                                                return_token_ids=True).token_ids,
    }
    print(f"{pair.name}: {args.prompts} rows of {n} tokens, greedy, {args.rounds} rounds in rotating order")
    outputs = {name: run() for name, run in runs.items()}  # the warm-up round
    assert outputs["plain steps"] == outputs["adaptive"], "plain steps and the adaptive policy decoded differently"
    assert outputs["plain steps"] == [list(t) for t in outputs["mlx-lm"]], "dflash and mlx-lm decoded differently"
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[: r % 3]:
            tic = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - tic)
    for name in ("plain steps", "adaptive"):
        ratios = [theirs / ours for ours, theirs in zip(seconds[name], seconds["mlx-lm"])]
        print(f"{name:12s}: mlx-lm's time / ours {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
              f"seconds {' '.join(f'{s:.2f}' for s in seconds[name])}")
    print(f"{'mlx-lm':12s}: seconds {' '.join(f'{s:.2f}' for s in seconds['mlx-lm'])}; tokens identical")


if __name__ == "__main__":
    main()
