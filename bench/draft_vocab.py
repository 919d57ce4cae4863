"""A drafter's own vocabulary against the target's whole one, on the real pair, side by side in one run.

The bundle's drafter is loaded twice: as exported (its head cut to its own vocabulary, ``models.vocabulary``) and
with the target's whole head. Every prompt of each dataset runs both, in alternating order, each against mlx-lm's
plain decoding of the same prompt (``eval.bench.measure``, ``--rounds`` runs a prompt, tokens compared), with the
default adaptive policy; each drafter keeps its own policy for the whole run, as one process of ``bench`` would.
First it times one draft pass's head both ways, and compares what each drafts, teacher-forced on the target's own
replies to the same prompts (``eval.traces``: E[accepted] of a draft of k tokens at every position).

    python bench/draft_vocab.py [--pair BUNDLE] [--datasets math,chat,code,edit] [--prompts 6] [--max-tokens 128]
                                [--rounds 1]
"""

from __future__ import annotations

from common import CACHE, median_time, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.chat_template import prompt_ids  # noqa: E402
from dflash_mlx.eval import traces  # noqa: E402
from dflash_mlx.eval.bench import measure  # noqa: E402
from dflash_mlx.eval.prompts import builtin  # noqa: E402
from dflash_mlx.models.loader import cast_floats, load_drafter  # noqa: E402

PAIR = CACHE / "smollm2" / "bundle"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(PAIR), help="a bundle whose drafter has its own vocabulary")
    parser.add_argument("--datasets", default="math,chat,code,edit")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each prompt and path, alternating")
    args = parser.parse_args()
    print_machine()
    target, cut, tokenizer = dflash_mlx.load(args.pair)
    if cut.vocabulary is None:
        sys.exit(f"error: the drafter of {args.pair} drafts from the target's whole vocabulary (train it again, or "
                 "--resume its training, to export one with its own)")
    whole = load_drafter(cut.source)
    whole.update(cast_floats(whole.parameters(), target.dtype))
    whole.vocabulary, whole.context_window = None, cut.context_window
    drafters = {"whole": whole, "own": cut}
    print(f"pair: {args.pair}; the drafter's own vocabulary: {len(cut.vocabulary):,} of {target.vocab_size:,} tokens")

    h = mx.random.normal((cut.block_size - 1, target.hidden_size)).astype(target.dtype)
    heads = {name: median_time(lambda d=d: mx.eval(d.head_logits(target, h))) for name, d in drafters.items()}
    print(f"a draft pass's head ({cut.block_size - 1} rows): whole {heads['whole'] * 1e3:.2f} ms, "
          f"own {heads['own'] * 1e3:.2f} ms ({heads['whole'] / heads['own']:.1f}x)\n")

    print(f"{'prompt':<10} | E[accepted] at k = 1, 4, {cut.block_size - 1}: whole | own")
    sums = {name: [] for name in drafters}
    for dataset in args.datasets.split(","):
        for conv in builtin(dataset)[: args.prompts]:
            ids = prompt_ids(tokenizer, [{"role": "user", "content": conv.turns[0]}])
            output = None
            cells = []
            for name, d in drafters.items():
                trace = traces.record(target, d, tokenizer, conv.name, ids, args.max_tokens, output=output)
                output = trace.output
                sums[name].append(trace.accepted)
                cells.append("  ".join(f"{trace.accepted[:, k].mean():.2f}" for k in (1, 4, trace.max_depth)))
            print(f"{conv.name:<10} | {cells[0]} | {cells[1]}", flush=True)
    depths = (1, 4, cut.block_size - 1)
    means = {name: np.concatenate(rows).mean(axis=0)[list(depths)] for name, rows in sums.items()}
    print("all positions: " + " | ".join(f"{name} " + "  ".join(f"{m:.3f}" for m in means[name]) for name in drafters)
          + "\n")

    print(f"{'prompt':<10} | {'whole: speedup':>14} | {'tau':>5} | {'own: speedup':>12} | {'tau':>5} | same tokens")
    summary = {}
    for dataset in args.datasets.split(","):
        rows: dict[str, list[dict]] = {name: [] for name in drafters}
        for i, conv in enumerate(builtin(dataset)[: args.prompts]):
            order = list(drafters) if i % 2 == 0 else list(reversed(drafters))
            for name in order:
                rows[name] += measure(target, drafters[name], tokenizer, [conv], max_tokens=args.max_tokens,
                                      repeats=args.rounds)
            a, b = rows["whole"][-1], rows["own"][-1]
            same = a["dflash"]["tokens"] == a["plain"]["tokens"] and b["dflash"]["tokens"] == b["plain"]["tokens"]
            print(f"{conv.name:<10} | {a['speedup']:>13.2f}x | {a['dflash']['tau']:>5.2f} | {b['speedup']:>11.2f}x | "
                  f"{b['dflash']['tau']:>5.2f} | {'yes' if same else 'NO'}", flush=True)
        summary[dataset] = {name: ([r["speedup"] for r in rs], [r["dflash"]["tau"] for r in rs]) for name, rs in rows.items()}

    print(f"\n{'dataset':<8} | {'whole: median, worst':>20} | {'tau':>5} | {'own: median, worst':>18} | {'tau':>5}")
    for dataset, by in summary.items():
        cells = [f"{statistics.median(s):.2f}x, {min(s):.2f}x | {statistics.median(t):>5.2f}" for s, t in by.values()]
        print(f"{dataset:<8} | {cells[0]:>28} | {cells[1]:>26}")


if __name__ == "__main__":
    main()
