"""Decode speed of this checkout against another one (before/after a change), side by side.

Each run is a fresh process that imports dflash_mlx from one checkout, loads the
pair, warms up, then decodes every prompt with DFlash and with plain mlx-lm
(plain decoding is the same code in both, so it shows machine drift). Runs
alternate between the two checkouts, ``--repeats`` times each. The figures: the
ratio of median DFlash tok/s (after / before), next to the plain ratio, and the
ratio of the paired speedups (DFlash / plain of the same prompt in the same run),
which cancels drift between runs.
Tokens must be identical across checkouts at temperature 0.

    git worktree add /tmp/before HEAD~3
    python bench/revisions.py /tmp/before [--pair bench/.cache/pair-... | bench/.cache/smollm2] [--repeats 3]
                              [--block-size 0 (the adaptive policy; default 16)]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first (children inherit it)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
import dflash_mlx
from dflash_mlx import generate, load
sys.path.insert(0, sys.argv[1] + "/bench")
from common import plain
draft, target, prompts, max_tokens, block = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]) or None
t, d, tok = load(draft, target)
generate(t, d, tok, prompts[0], max_tokens=16, eos_token_ids=[], block_size=block)  # warm-up
plain(t.model, tok.encode(prompts[0]), 16)
out = []
for p in prompts:
    r = generate(t, d, tok, p, max_tokens=max_tokens, eos_token_ids=[], block_size=block)
    _, plain_tps, _ = plain(t.model, tok.encode(p), max_tokens)
    out.append({"dflash": r.generation_tps, "plain": plain_tps, "speedup": r.generation_tps / plain_tps,
                "tau": r.tau, "tokens": r.tokens})
print(json.dumps({"file": dflash_mlx.__file__, "runs": out}))
"""


def run(tree: Path, pair: Path, prompts: list[str], max_tokens: int, block: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = [sys.executable, "-c", CHILD, str(tree), str(pair / "draft"), str(pair / "target"), json.dumps(prompts),
            str(max_tokens), str(block)]
    done = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the other checkout (e.g. a git worktree of the base commit)")
    parser.add_argument("--pair", type=Path, default=None, help="folder with draft/, target/ [default: newest pair-*]")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts to decode")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="0: the default adaptive policy")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print_machine()
    pair = args.pair or max(CACHE.glob("pair-*"), key=lambda p: p.stat().st_mtime, default=None)
    if pair is None:
        sys.exit("no trained pair: run python bench/build_pair.py first (or pass --pair)")
    pair = pair.resolve()  # the runs start in each checkout's folder
    if (pair / "heldout.jsonl").is_file():  # the toy pair's held-out code
        prompts = [json.loads(line)["prompt"] for line in (pair / "heldout.jsonl").read_text().splitlines()]
    else:  # the built-in math, code and chat prompts, in turn (as raw text: the same in both checkouts)
        sets = json.loads((HERE / "dflash_mlx" / "data" / "prompts.json").read_text())
        prompts = [p for row in zip(sets["math"], sets["code"], sets["chat"]) for p in row]
    prompts = prompts[: args.prompts]
    trees = {"before": args.before.resolve(), "after": HERE}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.repeats):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
            r = run(trees[name], pair, prompts, args.max_tokens, args.block_size)
            assert Path(r["file"]).resolve().is_relative_to(trees[name]), f"{name} imported {r['file']}"
            results[name].append(r)
            print(f"  repeat {i + 1} {name:>6}: dflash {statistics.median(x['dflash'] for x in r['runs']):.1f} tok/s, "
                  f"plain {statistics.median(x['plain'] for x in r['runs']):.1f} tok/s", flush=True)

    def median(name: str, key: str) -> float:  # per-prompt median over repeats, then median over prompts
        per_prompt = zip(*[[x[key] for x in r["runs"]] for r in results[name]])
        return statistics.median(statistics.median(v) for v in per_prompt)

    same = all(a["tokens"] == b["tokens"] for a, b in zip(results["before"][0]["runs"], results["after"][0]["runs"]))
    print(f"\npair {pair.name}, {len(prompts)} held-out prompts, {args.max_tokens} tokens, block {args.block_size}, "
          f"greedy, {args.repeats} alternating repeats per checkout")
    for name in ("before", "after"):
        print(f"  {name:>6}: dflash {median(name, 'dflash'):.1f} tok/s, plain {median(name, 'plain'):.1f} tok/s, "
              f"paired speedup {median(name, 'speedup'):.3f}, tau {median(name, 'tau'):.2f}")
    print(f"  dflash after/before {median('after', 'dflash') / median('before', 'dflash'):.3f}  "
          f"(plain, same code in both: {median('after', 'plain') / median('before', 'plain'):.3f}); "
          f"paired speedup after/before {median('after', 'speedup') / median('before', 'speedup'):.3f}; "
          f"tokens {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
