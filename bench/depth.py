"""Speculation against context depth on the real pair: agent-sized prompts of real text, with and without a drafter
context window.

Prompts of about 256, 1k, 2k, 4k and 8k tokens (SmolLM2 holds 8,192 positions: the deepest is 8,000) of three kinds,
each followed by a request, through the chat template: a source file (Python's own ``argparse.py``), a long
conversation (questions about standard-library functions answered with their docstrings) and a tool's output (a
``grep -n "def "`` over standard-library packages). Python's own files, so every machine with the same Python builds
the same prompts.

At each depth and kind, side by side in one process (BLAS named first):
  - plain: mlx-lm's decoding of the same target; its prefill is the baseline of the prefill ratios;
  - the drafter at full blocks (``--block-size 16``) with its whole context and with the default window, one run;
  - auto: the default settings (the adaptive policy, the default drafter window), ``--rounds`` runs paired with
    plain's, the median ratio shown;
  each decode's tokens compared with plain's, tok/s as the ratio to plain, and the prefill's time to mlx-lm's.
Then, without timing, a trace of every depth, kind and window (``eval.traces``): the acceptance of each draft position
at full blocks, and the policies replayed on them under this machine's costs measured at each depth and under the
Mac profiles (estimates, from published figures): auto against plain and the best fixed depth at every depth, one
policy carried from the shallowest prompts to the deepest as one process serves them.

    python bench/depth.py [--depths 256,1024,2048,4096,8000] [--windows 0,512,1024,2048,4096] [--max-tokens 64]
                          [--kinds file,conversation,tool] [--timed-kinds file] [--rounds 3] [--prefill-rounds N]
                          [--hogs N] [--no-timing] [--replay]
"""

from __future__ import annotations

from common import CACHE, cpu_hogs, plain, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx import make_cache  # noqa: E402
from dflash_mlx.chat_template import render  # noqa: E402
from dflash_mlx.decode.policy import AdaptiveDepth  # noqa: E402
from dflash_mlx.eval import replay, traces  # noqa: E402
from dflash_mlx.eval.replay import CostProfile, Trace  # noqa: E402
from dflash_mlx.sampling import Sampling  # noqa: E402

PAIR = CACHE / "smollm2" / "bundle"
OUT = CACHE / "traces" / "depth"
LIB = Path(sysconfig.get_paths()["stdlib"])
REQUESTS = {
    "file": "Summarize what the file above does, then name its three most important classes.",
    "conversation": "Thanks. Of all the functions we discussed, which would you use to read a settings file, and why?",
    "tool": "Which of the functions above handle errors? Name five and say what each does.",
}


def _file_body() -> list[str]:
    return ["Here is a file from our repository:\n\n```python\n", (LIB / "argparse.py").read_text(), "\n```\n\n"]


def _docstring_turns() -> list[tuple[str, str]]:
    """(question, answer) pairs: a standard-library function and its docstring."""
    import collections as c
    import functools
    import itertools
    import json as j
    import os
    import re
    import shutil
    import textwrap

    turns = []
    for module in (j, os.path, re, textwrap, shutil, functools, itertools, c):
        for name, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if doc and len(doc) > 80:
                turns.append((f"What does `{module.__name__}.{name}` do?", doc))
    return turns


def _tool_body() -> list[str]:
    lines = []
    for package in ("json", "email", "http", "logging", "xml", "importlib", "concurrent", "urllib"):
        for path in sorted((LIB / package).rglob("*.py")):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if line.lstrip().startswith("def "):
                    lines.append(f"{path.relative_to(LIB)}:{n}:{line}\n")
    return ['I ran `grep -rn "def " json email http logging xml importlib concurrent urllib` and got:\n\n```\n',
            "".join(lines), "```\n\n"]


def build_prompt(tokenizer, kind: str, depth: int) -> list[int]:
    """The longest prompt of this kind within ``depth`` tokens (its body cut by characters, found by bisection)."""
    if kind == "conversation":
        turns = _docstring_turns()

        def messages(chars: int) -> list[dict]:
            out, left = [], chars
            for question, answer in turns:
                if left <= 0:
                    break
                out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer[:left]}]
                left -= len(question) + len(answer)
            return out + [{"role": "user", "content": REQUESTS[kind]}]

        total = sum(len(q) + len(a) for q, a in turns)
    else:
        head, body, tail = _file_body() if kind == "file" else _tool_body()

        def messages(chars: int) -> list[dict]:
            return [{"role": "user", "content": head + body[:chars] + tail + REQUESTS[kind]}]

        total = len(body)
    lo, hi = 0, total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(render(tokenizer, messages(mid))) <= depth:
            lo = mid
        else:
            hi = mid - 1
    ids = render(tokenizer, messages(lo))
    assert len(ids) <= depth and (lo < total or depth > len(ids)), (kind, depth, len(ids))
    return ids


def run_dflash(target, drafter, tokenizer, ids: list[int], max_tokens: int, **settings) -> dict:
    mx.clear_cache()
    r = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, eos_token_ids=[], **settings)
    return {"tokens": r.tokens, "decode": r.generation_tps, "prefill": r.prompt_tps, "tau": r.tau,
            "depths": r.depth_histogram, "cached": r.prompt_cached}


def run_plain(target, tokenizer, ids: list[int], max_tokens: int, prompt_cache=None) -> dict:
    mx.clear_cache()
    tokens, decode, prefill = plain(target.model, ids, max_tokens, prompt_cache=prompt_cache, tokenizer=tokenizer)
    return {"tokens": tokens, "decode": decode, "prefill": prefill}


def _label(window: int) -> str:
    return "whole" if window == 0 else f"w{window}"


def record_traces(target, drafter, tokenizer, prompts: dict, windows: list[int], max_tokens: int
                  ) -> dict[int, list[Trace]]:
    """Per window, the traces of every prompt (shallowest first), written to bench/.cache/traces/depth/; the
    target's output is mlx-lm's greedy decoding, timed on the way (the plain column of the timed table)."""
    OUT.mkdir(parents=True, exist_ok=True)
    by_window: dict[int, list[Trace]] = {w: [] for w in windows}
    print(f"\nplain decoding (mlx-lm), {max_tokens} tokens: prefill tok/s, decode tok/s", flush=True)
    for (depth, kind), ids in prompts.items():
        p = run_plain(target, tokenizer, ids, max_tokens)
        print(f"  {len(ids):>6} {kind:>12}: {p['prefill']:6.0f} {p['decode']:6.2f}", flush=True)
        recorded = traces.record_windows(target, drafter, tokenizer, f"{kind}-{depth}", ids, max_tokens, Sampling(),
                                         windows, output=p["tokens"])
        for w, trace in zip(windows, recorded):
            by_window[w].append(trace)
    for w, recorded in by_window.items():
        traces.write(str(OUT / f"{_label(w)}.jsonl"), recorded, {"pair": str(PAIR), "draft_window": w})
    return by_window


def read_traces(windows: list[int]) -> dict[int, list[Trace]]:
    return {w: traces.read(str(OUT / f"{_label(w)}.jsonl"))[1] for w in windows}


def acceptance_table(by_window: dict[int, list[Trace]], depths: list[int]) -> None:
    """Per depth and window: P(draft position j accepted) at full blocks for j = 1, 2, 4, 8, 15, and tau."""
    print("\nacceptance at full blocks (all kinds): P(drafted position j accepted) for j = 1 2 4 8 15; tau")
    print(f"{'depth':>6} | " + " | ".join(f"{_label(w):>26}" for w in by_window))
    for depth in depths:
        cells = []
        for recorded in by_window.values():
            runs = np.concatenate([t.accepted[:, -1] for t in recorded if t.name.endswith(f"-{depth}")])
            rates = " ".join(f"{(runs >= j).mean():.2f}".lstrip("0") for j in (1, 2, 4, 8, 15))
            cells.append(f"{rates} {1 + runs.mean():5.2f}")
        print(f"{depth:>6} | " + " | ".join(f"{c:>26}" for c in cells))


def timing(target, drafter, tokenizer, prompts: dict, kinds: list[str], max_tokens: int, default_window: int,
           rounds: int) -> None:
    """Side by side: plain, the drafter at full blocks with its whole context and with the default window, and
    auto (the defaults: adaptive depth, the default window); tokens compared, decode tok/s as ratios to plain's,
    prefill as time over mlx-lm's.

    Each is prefilled once (the prefill ratios: one run each), then decoded ``rounds`` times from its own cache
    returned to the prompt: auto and plain every round in alternating order, each ratio against the same round's
    plain, the median shown (this machine drifts 10-30% between runs: one run of 64 tokens each once put auto at
    0.54x plain where paired runs of the same prompt give 1.04-1.15x); the full blocks, slow at depth, in the first
    round only.
    """
    from mlx_lm.models.cache import trim_prompt_cache

    print(f"\ntimed, {max_tokens} tokens: decode tok/s over plain's (tau); auto: median of {rounds} paired runs "
          f"(lowest-highest); full blocks: one run; prefill: time over mlx-lm's (one run)")
    print(f"{'prompt':>6} {'kind':>12} {'plain':>6} | {'whole':>11} {_label(default_window):>11} | "
          f"{'auto':>18} | {'prefill':>6} {_label(default_window):>6} | same")
    for (depth, kind), ids in prompts.items():
        if kind not in kinds:
            continue
        plain_cache = target.make_cache()
        cache = make_cache(target, drafter, draft_window=default_window)

        def plain_run(first: bool) -> dict:
            if not first:  # mlx-lm's cache back to the prompt but its last token, which it then takes first
                trim_prompt_cache(plain_cache, plain_cache[0].offset - (len(ids) - 1))
            return run_plain(target, tokenizer, ids if first else ids[-1:], max_tokens, prompt_cache=plain_cache)

        p, a = plain_run(True), run_dflash(target, drafter, tokenizer, ids, max_tokens, cache=cache)
        whole = run_dflash(target, drafter, tokenizer, ids, max_tokens, block_size=16, draft_window=0)
        windowed = whole if default_window == 0 else run_dflash(
            target, drafter, tokenizer, ids, max_tokens, block_size=16, draft_window=default_window, cache=cache)
        plains, autos, ratios = [p], [a], [a["decode"] / p["decode"]]
        for r in range(1, rounds):
            if r % 2:
                a = run_dflash(target, drafter, tokenizer, ids, max_tokens, cache=cache)
                p = plain_run(False)
            else:
                p = plain_run(False)
                a = run_dflash(target, drafter, tokenizer, ids, max_tokens, cache=cache)
            plains.append(p), autos.append(a), ratios.append(a["decode"] / p["decode"])
        same = all(x["tokens"] == plains[0]["tokens"] for x in plains + autos + [whole, windowed])
        first = plains[0]
        cells = " ".join(f"{g['decode'] / first['decode']:>5.2f} ({g['tau']:>3.1f})" for g in (whole, windowed))
        tau = float(np.median([x["tau"] for x in autos]))
        auto = f"{np.median(ratios):>4.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if rounds > 1 else \
            f"{ratios[0]:>4.2f}"
        print(f"{len(ids):>6} {kind:>12} {np.median([x['decode'] for x in plains]):>6.2f} | {cells} | "
              f"{auto:>11} ({tau:>3.1f}) | {first['prefill'] / whole['prefill']:>6.2f} "
              f"{first['prefill'] / autos[0]['prefill']:>6.2f} | {'OK' if same else 'MISMATCH'}", flush=True)


def prefill_rounds(target, drafter, tokenizer, prompts: dict, kinds: list[str], default_window: int,
                   rounds: int) -> None:
    """Prefill alone, fresh caches, ``rounds`` times in rotating order: mlx-lm's, ours with the drafter's whole
    context and with the default window; each ratio is our time over mlx-lm's in the same round, the median shown
    (one prefill of each, as in the timed table, moves 10-25% from run to run here)."""
    print(f"\nprefill time over mlx-lm's: median of {rounds} rounds (lowest-highest), fresh caches")
    print(f"{'prompt':>6} {'kind':>12} | {'whole':>17} {_label(default_window):>17}")
    windows = [0] if default_window == 0 else [0, default_window]
    for (depth, kind), ids in prompts.items():
        if kind not in kinds:
            continue
        ratios: dict[int, list[float]] = {w: [] for w in windows}
        for r in range(rounds):
            order = ["plain", *windows]
            order = order[r % len(order):] + order[: r % len(order)]
            seconds = {}
            for who in order:
                if who == "plain":
                    seconds[who] = len(ids) / run_plain(target, tokenizer, ids, 2)["prefill"]
                else:
                    seconds[who] = len(ids) / run_dflash(target, drafter, tokenizer, ids, 2, draft_window=who)["prefill"]
            for w in windows:
                ratios[w].append(seconds[w] / seconds["plain"])
        cells = [f"{np.median(v):4.2f} ({min(v):.2f}-{max(v):.2f})" for v in ratios.values()]
        print(f"{len(ids):>6} {kind:>12} | " + " ".join(f"{c:>17}" for c in cells), flush=True)


def judge(by_window: dict[int, list[Trace]], depths: list[int], profiles: list[CostProfile], default_window: int
          ) -> None:
    """Auto (one policy through every depth, shallow to deep, as a process serves them) against plain and the best
    fixed depth of its window's traces, per depth; and the best fixed depth of any window."""
    recorded = by_window[default_window]
    for profile in profiles:
        print(f"\nreplay under {profile.name} ({profile.source}), auto with drafter window "
              f"{_label(default_window)}: auto / plain, auto / best fixed depth, best fixed of any window / plain")
        policy, worst = AdaptiveDepth(15), []
        for depth in depths:
            at = [t for t in recorded if t.name.endswith(f"-{depth}")]
            auto = replay.simulate(policy, at, profile)
            k, best = replay.best_fixed(at, profile)
            anywhere = max((replay.best_fixed([t for t in ts if t.name.endswith(f"-{depth}")], profile)[1].vs_plain, w)
                           for w, ts in by_window.items())
            ratio = auto.tokens_per_second / best.tokens_per_second
            worst.append((auto.vs_plain, ratio))
            print(f"  {depth:>6}: {auto.vs_plain:5.2f}x plain, {ratio:5.2f}x best fixed (depth {k}, "
                  f"{best.vs_plain:4.2f}x plain); any window {anywhere[0]:4.2f}x ({_label(anywhere[1])}); "
                  f"auto's depths {_depths(auto.depths)}")
        low_plain, low_best = min(w[0] for w in worst), min(w[1] for w in worst)
        ok = low_plain >= 0.97 and low_best >= 0.97
        print(f"  worst depth: {low_plain:.3f}x plain, {low_best:.3f}x best fixed ({'PASS' if ok else 'FAIL'}, "
              "target >= 0.97 both)")


def _depths(histogram: list[int]) -> str:
    total = sum(histogram) or 1
    return " ".join(f"{k}:{n / total:.0%}" for k, n in enumerate(histogram) if n / total >= 0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, default=PAIR, help="a bundle (default: the real pair, `make pair`)")
    ap.add_argument("--depths", default="256,1024,2048,4096,8000")
    ap.add_argument("--windows", default="0,512,1024,2048,4096", help="drafter windows traced (0: the whole context)")
    ap.add_argument("--kinds", default="file,conversation,tool")
    ap.add_argument("--timed-kinds", default="file", help="kinds timed side by side (each depth costs 3 prefills)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="paired decodes of auto and plain per timed prompt")
    ap.add_argument("--prefill-rounds", type=int, default=0,
                    help="then prefill alone this many times per timed prompt (ours over mlx-lm's, paired)")
    ap.add_argument("--hogs", type=int, default=0, help="time beside N CPU busy loops (a busy machine)")
    ap.add_argument("--replay", action="store_true", help="no decoding: the saved traces and costs, replayed")
    ap.add_argument("--no-timing", action="store_true", help="traces, acceptance and replay only")
    ap.add_argument("--no-replay", action="store_true", help="no cost profile, no replay")
    ap.add_argument("--retrace", action="store_true", help="record the traces again, though saved ones exist")
    ap.add_argument("--profile", type=Path, default=OUT / "costs.profile.json",
                    help="this machine's costs at each depth: measured once, then reused")
    ap.add_argument("--profile-contexts", default="256,2048,8000", help="where the costs are measured (linear between)")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    print_machine()
    target, drafter, tokenizer = dflash_mlx.load(str(args.pair))
    default_window = drafter.context_window
    if default_window not in windows:
        windows.append(default_window)
    if args.replay:
        by_window = read_traces(windows)
    else:
        prompts = {(d, k): build_prompt(tokenizer, k, d) for d in depths for k in args.kinds.split(",")}
        print(f"pair {args.pair}; prompts (tokens): " + ", ".join(f"{k} {len(ids)}" for (_, k), ids in prompts.items()))
        warm = prompts[min(prompts)]
        run_plain(target, tokenizer, warm, 8), run_dflash(target, drafter, tokenizer, warm, 8, block_size=16)
        saved = all((OUT / f"{_label(w)}.jsonl").is_file() for w in windows) and not args.retrace
        by_window = read_traces(windows) if saved else record_traces(target, drafter, tokenizer, prompts, windows,
                                                                      args.max_tokens)
    acceptance_table(by_window, depths)
    if not args.replay and not args.no_timing:
        if args.hogs:
            print(f"\nthe timed runs beside {args.hogs} CPU busy loop(s)")
        with cpu_hogs(args.hogs):
            timing(target, drafter, tokenizer, prompts, args.timed_kinds.split(","), args.max_tokens, default_window,
                   args.rounds)
            if args.prefill_rounds:
                prefill_rounds(target, drafter, tokenizer, prompts, args.timed_kinds.split(","), default_window,
                               args.prefill_rounds)
    if args.no_replay:
        return
    if args.profile.is_file():
        profile = CostProfile.from_dict(json.loads(args.profile.read_text()))
    else:
        contexts = [int(c) for c in args.profile_contexts.split(",")]
        print(f"\nmeasuring this machine's cycle costs at {contexts} tokens ...", flush=True)
        profile = traces.measure_costs(target, drafter, tokenizer, contexts, steps=12, repeats=2,
                                       name="this machine (measured)")
        args.profile.write_text(json.dumps(profile.to_dict(), indent=1))
    profiles = [profile] + [replay.mac_profile(name, 15) for name in replay.MAC_PROFILES]
    judge(by_window, depths, profiles, default_window)


if __name__ == "__main__":
    main()
