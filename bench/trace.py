"""Record draft traces and this machine's cycle costs for a pair (the evidence bench/replay.py judges policies on).

For each prompt: the target's own output (greedy, or sampled with --temp and a seed) and,
at every position of it, how many tokens a draft of each depth 1..B-1 would have had
accepted (``dflash_mlx.eval.traces``). Then this machine's seconds per cycle at each depth and
at each --contexts length, and mlx-lm's plain step's. Written as OUT.jsonl (traces) and
OUT.profile.json (costs), atomically.

    python bench/trace.py --pair bench/.cache/pair-... [--prompts 16] [--max-tokens 192] [--temp 1]
    python bench/trace.py --pair ... --context-tokens 3072 --contexts 256,3328   # long contexts
    python bench/trace.py --pair bench/.cache/smollm2 --dataset all   # the real pair: math, code, chat
    python bench/trace.py --random        # the random hidden 1024 x 8 pair: no depth pays
"""

from __future__ import annotations

from common import CACHE, build_models, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from dflash_mlx import load  # noqa: E402
from dflash_mlx.eval import traces  # noqa: E402
from dflash_mlx.eval.prompts import builtin, context_prompts, read_jsonl  # noqa: E402
from dflash_mlx.chat_template import has_chat_template, prompt_ids  # noqa: E402
from dflash_mlx.files import write_atomic  # noqa: E402
from dflash_mlx.sampling import Sampling  # noqa: E402
from dflash_mlx.system import machine_description  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, help="a folder with draft/ and target/ (and heldout.jsonl: code prompts)")
    ap.add_argument("--random", action="store_true", help="the random hidden 1024 x 8 pair of the engine benchmarks")
    ap.add_argument("--prompts", type=int, default=16, help="prompts (half held-out code, half chat, when the pair has them)")
    ap.add_argument("--dataset", default=None, help="a built-in set instead ('all': math, code and chat in turn)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context-tokens", type=int, default=0,
                    help="put this many tokens of natural text before every prompt (long-context traces)")
    ap.add_argument("--contexts", default="256,2048", help="context lengths at which cycle costs are measured")
    ap.add_argument("--out", type=Path, help="OUT.jsonl and OUT.profile.json (default: bench/.cache/traces/NAME)")
    ap.add_argument("--costs-only", action="store_true", help="keep OUT.jsonl, measure the costs again (a quiet machine)")
    args = ap.parse_args()
    if args.random == (args.pair is not None):
        ap.error("give --pair DIR or --random")
    pair = build_models(1024, 8) if args.random else args.pair
    name = f"{pair.name}-t{args.temp:g}" + (f"-c{args.context_tokens}" if args.context_tokens else "")
    out = args.out or CACHE / "traces" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    traces_file, profile_file = out.parent / f"{out.name}.jsonl", out.parent / f"{out.name}.profile.json"
    print_machine()

    target, drafter, tokenizer = load(str(pair / "draft"), str(pair / "target"))
    if not args.costs_only:
        record(args, pair, target, drafter, tokenizer, traces_file)
    contexts = [int(c) for c in args.contexts.split(",")]
    profile = traces.measure_costs(target, drafter, tokenizer, contexts, name="this machine (measured)")
    write_atomic(str(profile_file), json.dumps(profile.to_dict(), indent=1))
    for c, plain, row in zip(profile.contexts, profile.plain, profile.cycle):
        print(f"context {c:>6}: mlx-lm step {1e3 * plain:.2f} ms; cycle at k = 0, 1, 4, {len(row) - 1}: "
              + ", ".join(f"{row[k] / plain:.2f}" for k in (0, 1, 4, len(row) - 1)) + " plain steps")
    print(f"costs -> {profile_file}")


def record(args: argparse.Namespace, pair: Path, target: Any, drafter: Any, tokenizer: Any, traces_file: Path) -> None:
    """The traces of the chosen prompts, written to ``traces_file``."""
    conversations = builtin("chat")
    if args.dataset:
        conversations = builtin(args.dataset)
    elif (pair / "heldout.jsonl").is_file():
        code = read_jsonl(str(pair / "heldout.jsonl"))
        conversations = [c for row in zip(code, conversations) for c in row]
    conversations = conversations[: args.prompts]
    sampling = Sampling(temperature=args.temp, seed=args.seed if args.temp else None)
    context = context_prompts(tokenizer, [args.context_tokens], None)[0].token_ids if args.context_tokens else []
    recorded = []
    tic = time.perf_counter()
    for conv in conversations:
        history = [{"role": "user", "content": conv.turns[0]}]
        ids = prompt_ids(tokenizer, history) if has_chat_template(tokenizer) else tokenizer.encode(conv.turns[0])
        trace = traces.record(target, drafter, tokenizer, conv.name, context + ids, args.max_tokens, sampling)
        recorded.append(trace)
        print(f"{conv.name:<16} {len(context + ids):>5} prompt tokens  E[accepted] at k=1,4,{trace.max_depth}: "
              + "  ".join(f"{trace.accepted[:, k].mean():.2f}" for k in (1, 4, trace.max_depth)), flush=True)
    meta = {"pair": str(pair), "context_tokens": args.context_tokens, "temperature": args.temp, "seed": sampling.seed,
            "max_tokens": args.max_tokens, "block_size": drafter.block_size, "machine": machine_description()}
    traces.write(str(traces_file), recorded, meta)
    print(f"traces: {len(recorded)} prompts in {time.perf_counter() - tic:.0f} s -> {traces_file}")


if __name__ == "__main__":
    main()
