"""The default against plain decoding on long prompts holding source code: the median and the worst prompt per depth.

Chats whose one user message holds a file of Python's standard library and a request about it (what agents send),
cut to about 1k, 2k, 4k and 8k tokens through the chat template (SmolLM2 holds 8,192 positions). Every prompt runs
mlx-lm's plain decoding and dflash-mlx's default (the adaptive policy, the bundle's drafter window) side by side in
one process, ``--rounds`` times in alternating order (``eval.bench.measure``), tokens compared; per depth the median
and the worst speedup (decode tok/s over plain's) and tau. ``--weak`` names a second drafter (an earlier checkpoint
of the same run, say) measured on the same prompts.

    python bench/long_prompts.py [--pair BUNDLE] [--weak DRAFTER] [--depths 1024,2048,4096,8000] [--per-depth 4]
                                 [--max-tokens 96] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.chat_template import render  # noqa: E402
from dflash_mlx.eval.bench import measure  # noqa: E402
from dflash_mlx.eval.prompts import Conversation  # noqa: E402

PAIR = CACHE / "smollm2" / "bundle"
LIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["argparse.py", "textwrap.py", "json/decoder.py", "functools.py", "shutil.py", "configparser.py",
         "dataclasses.py", "csv.py"]
ASKS = [
    "Summarize what the file above does, then name its three most important functions or classes.",
    "Find one bug or risky spot in the code above and show the fixed lines.",
    "Write a short docstring for the first function defined above.",
    "Explain how the main class above is meant to be used, with a small example.",
]


def conversation(tokenizer, path: str, ask: str, depth: int) -> list[int]:
    """The longest chat of ``path`` (cut by characters, found by bisection) and ``ask`` within ``depth`` tokens."""
    body = (LIB / path).read_text(errors="replace")

    def ids(chars: int) -> list[int]:
        content = f"Here is `{path}` from our repository:\n\n```python\n{body[:chars]}\n```\n\n{ask}"
        return render(tokenizer, [{"role": "user", "content": content}])

    lo, hi = 0, len(body)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(ids(mid)) <= depth:
            lo = mid
        else:
            hi = mid - 1
    return ids(lo)


def prompts(tokenizer, depths: list[int], per_depth: int) -> dict[int, list[Conversation]]:
    """``per_depth`` chats at each depth, each of another file and ask (the same ones at every depth)."""
    out = {}
    for depth in depths:
        out[depth] = [Conversation(f"{FILES[i % len(FILES)]}:{i % len(ASKS)}", [],
                                   token_ids=conversation(tokenizer, FILES[i % len(FILES)], ASKS[i % len(ASKS)], depth))
                      for i in range(per_depth)]
    return out


def run(name: str, pair: tuple, by_depth: dict[int, list[Conversation]], args: argparse.Namespace) -> dict:
    target, drafter, tokenizer = pair
    table = {}
    for depth, convs in by_depth.items():
        tic = time.perf_counter()
        records = measure(target, drafter, tokenizer, convs, max_tokens=args.max_tokens, repeats=args.rounds)
        speedups, taus = [r["speedup"] for r in records], [r["tau"] for r in records]
        worst = min(records, key=lambda r: r["speedup"])
        table[depth] = {"records": records, "median": statistics.median(speedups), "worst": worst["speedup"],
                        "worst_prompt": worst["prompt"], "tau_median": statistics.median(taus),
                        "identical": all(r["identical"] for r in records)}
        print(f"{name:>8} {depth:>6} | {statistics.median(speedups):>6.2f}x | {worst['speedup']:>6.2f}x "
              f"({worst['prompt']:<22}) | {statistics.median(taus):>5.2f} | {min(taus):>5.2f} | "
              f"{'all' if table[depth]['identical'] else 'NO':>9} | {time.perf_counter() - tic:>5.0f}s", flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(PAIR), help="the pair's bundle [default: the real pair, make pair]")
    parser.add_argument("--weak", help="a second drafter for the same target, measured on the same prompts")
    parser.add_argument("--depths", default="1024,2048,4096,8000")
    parser.add_argument("--per-depth", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each path per prompt, alternating order")
    parser.add_argument("--json", help="write every record here")
    args = parser.parse_args()
    print_machine()
    bundle = Path(args.pair)
    if not (bundle / "dflash.json").is_file():
        raise SystemExit(f"no bundle at {bundle}: `make pair` builds the real pair")
    pairs = {"default": dflash_mlx.load(str(bundle))}
    if args.weak:
        pairs["weak"] = dflash_mlx.load(args.weak, str(bundle / "target"))
        pairs["weak"][1].context_window = pairs["default"][1].context_window  # the bundle's drafter window
    tokenizer = pairs["default"][2]
    depths = [int(d) for d in args.depths.split(",")]
    by_depth = prompts(tokenizer, depths, args.per_depth)
    print(f"\n{args.per_depth} prompts per depth (Python {sysconfig.get_python_version()}'s {', '.join(FILES)}), "
          f"{args.max_tokens} tokens each, {args.rounds} paired rounds; speedup = default / plain decode tok/s\n")
    print(f"{'drafter':>8} {'depth':>6} | {'median':>7} | {'worst':>7} {'(prompt)':<24} | {'tau':>5} | {'min':>5} | "
          f"{'identical':>9} | time")
    results = {name: run(name, pair, by_depth, args) for name, pair in pairs.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({name: {str(d): t for d, t in table.items()}
                                               for name, table in results.items()}, indent=1))


if __name__ == "__main__":
    main()
