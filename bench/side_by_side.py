"""Drafters of one target side by side in one run: what each drafts, and how fast each decodes against plain.

Each drafter is measured two ways on the same built-in prompts. Teacher-forced on the target's own greedy replies
(``eval.traces``): E[accepted] of a draft of k tokens, at every position of every reply, k = 1, 4 and the block's
last. Then timed: every prompt decoded with each drafter in rotating order, each against mlx-lm's plain decoding
of the same prompt (``eval.bench.measure``, ``--rounds`` runs a prompt, tokens compared), with the default adaptive
policy; each drafter keeps its own policy for the whole run, as one process of ``bench`` would. Replayed traces
judge a policy better (``bench/replay.py``); this is the paired confirmation.

    python bench/side_by_side.py --pair BUNDLE --with NAME=BUNDLE [--with ...] [--datasets math,chat,code]
                                 [--prompts 6] [--max-tokens 128] [--rounds 1] [--hogs 0]

The first bundle's target serves every drafter (the others' targets must be the same model).
"""

from __future__ import annotations

from common import CACHE, cpu_hogs, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.errors import DFlashError  # noqa: E402
from dflash_mlx.chat_template import prompt_ids  # noqa: E402
from dflash_mlx.eval import traces  # noqa: E402
from dflash_mlx.eval.bench import measure  # noqa: E402
from dflash_mlx.eval.prompts import builtin  # noqa: E402

PAIR = CACHE / "smollm2" / "bundle"


def acceptance(target: Any, tokenizer: Any, drafters: dict[str, Any], datasets: list[str], prompts: int,
               max_tokens: int) -> None:
    """Teacher-forced E[accepted] at k = 1, 4 and the block's last, by prompt and over all positions."""
    depths = sorted({1, 4, min(d.block_size - 1 for d in drafters.values())})
    print(f"{'prompt':<10} | E[accepted] at k = {', '.join(map(str, depths))}: " + " | ".join(drafters))
    rows: dict[str, list[np.ndarray]] = {name: [] for name in drafters}
    for dataset in datasets:
        for conv in builtin(dataset)[:prompts]:
            ids = prompt_ids(tokenizer, [{"role": "user", "content": conv.turns[0]}])
            output, cells = None, []
            for name, d in drafters.items():
                trace = traces.record(target, d, tokenizer, conv.name, ids, max_tokens, output=output)
                output = trace.output  # the target's reply, decoded once
                rows[name].append(trace.accepted[:, depths])
                cells.append("  ".join(f"{trace.accepted[:, k].mean():.2f}" for k in depths))
            print(f"{conv.name:<10} | " + " | ".join(cells), flush=True)
    print("all positions: " + " | ".join(
        f"{name} " + "  ".join(f"{m:.3f}" for m in np.concatenate(r).mean(axis=0)) for name, r in rows.items()) + "\n")


def speedups(target: Any, tokenizer: Any, drafters: dict[str, Any], datasets: list[str], prompts: int,
             max_tokens: int, rounds: int) -> None:
    """Every prompt with each drafter, rotating the order, each against plain decoding; then medians and worsts."""
    names = list(drafters)
    print(f"{'prompt':<10} | " + " | ".join(f"{name}: speedup, tau" for name in names) + " | same tokens")
    summary = {}
    for dataset in datasets:
        rows: dict[str, list[dict]] = {name: [] for name in names}
        for i, conv in enumerate(builtin(dataset)[:prompts]):
            for name in names[i % len(names):] + names[: i % len(names)]:
                rows[name] += measure(target, drafters[name], tokenizer, [conv], max_tokens=max_tokens, repeats=rounds)
            last = [rows[name][-1] for name in names]
            same = all(r["dflash"]["tokens"] == r["plain"]["tokens"] for r in last)
            print(f"{conv.name:<10} | " + " | ".join(f"{r['speedup']:.2f}x, {r['dflash']['tau']:.2f}" for r in last)
                  + f" | {'yes' if same else 'NO'}", flush=True)
        summary[dataset] = {name: ([r["speedup"] for r in rs], [r["dflash"]["tau"] for r in rs])
                            for name, rs in rows.items()}
    print(f"\n{'dataset':<8} | " + " | ".join(f"{name}: median, worst, tau" for name in names))
    for dataset, by in summary.items():
        print(f"{dataset:<8} | " + " | ".join(
            f"{statistics.median(s):.2f}x, {min(s):.2f}x, {statistics.median(t):.2f}" for s, t in by.values()))


def prompt_options(parser: argparse.ArgumentParser, datasets: str) -> None:
    """The options of what ``acceptance`` and ``speedups`` run."""
    parser.add_argument("--datasets", default=datasets)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="timed runs of each prompt and drafter")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(PAIR), help="a bundle: its target, and its drafter (named after its folder)")
    parser.add_argument("--with", dest="others", action="append", default=[], metavar="NAME=BUNDLE",
                        help="another bundle's drafter, on the first bundle's target")
    prompt_options(parser, "math,chat,code")
    parser.add_argument("--hogs", type=int, default=0, help="CPU hogs beside the timed runs: a busy machine")
    args = parser.parse_args()
    print_machine()
    target, drafter, tokenizer = dflash_mlx.load(args.pair)
    drafters = {Path(args.pair).name: drafter}
    for other in args.others:
        name, _, path = other.partition("=")
        if not path:
            parser.error(f"--with takes NAME=BUNDLE, got {other!r}")
        drafters[name] = dflash_mlx.load(path)[1]
    for name, d in drafters.items():
        vocabulary = f"{len(d.vocabulary):,} tokens of its own" if d.vocabulary else "the target's whole vocabulary"
        layers = f"{len(d.layers)} layer{'s' * (len(d.layers) != 1)}"
        print(f"{name}: {d.source}, {layers}, block {d.block_size}, {vocabulary}")
    datasets = args.datasets.split(",")
    acceptance(target, tokenizer, drafters, datasets, args.prompts, args.max_tokens)
    if args.hogs:
        print(f"timed beside {args.hogs} CPU hogs")
    with cpu_hogs(args.hogs):
        speedups(target, tokenizer, drafters, datasets, args.prompts, args.max_tokens, args.rounds)


if __name__ == "__main__":
    try:
        main()
    except DFlashError as e:  # a wrong path, a drafter that does not fit: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
