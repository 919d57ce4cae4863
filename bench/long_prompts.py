"""The default against plain decoding on long prompts holding source code: the median and the worst prompt per depth.

Chats whose one user message holds a file of Python's standard library and a request about it (what agents send),
cut to about 1k, 2k, 4k and 8k tokens through the chat template (SmolLM2 holds 8,192 positions). Every prompt runs
mlx-lm's plain decoding and dflash-mlx's default (the adaptive policy, the bundle's drafter window) side by side in
one process, ``--rounds`` times in alternating order (``eval.bench.measure``), tokens compared; per depth the median
and the worst speedup (decode tok/s over plain's) and tau. A file's prompts run one after another in growing depth,
each prefilled once for both paths and only where the one before did not reach (a prefill at 8k tokens takes ~90 s
on 2 cores, a reply ~25 s). ``--weak`` names a second drafter (an earlier checkpoint
of the same run, say) measured on the same prompts.

``--replay`` looks for the cause without timing noise: each prompt's trace (``eval.traces``: what a draft of every
depth would have had accepted at every position of the target's own reply, within the bundle's drafter window), this
machine's cycle costs at each depth (measured once, then reused), and the default policy replayed over the traces in
the order the timed runs take them, as one process. Per prompt: the replay against plain, the oracle's (the best
schedule in hindsight), and the plain steps each kind of cycle lost against plain decoding of the same tokens (the
warm-up, drafter cycles the costs chose, probes, copies the costs chose, copy retries).

    python bench/long_prompts.py [--pair BUNDLE] [--weak DRAFTER] [--depths 1024,2048,4096,8000] [--per-depth 3]
                                 [--max-tokens 96] [--rounds 2] [--json OUT] [--replay [--no-timing]]
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
from dflash_mlx.decode.policy import COPY, AdaptiveDepth, Decision, Plan  # noqa: E402
from dflash_mlx.eval import replay, traces  # noqa: E402
from dflash_mlx.eval.bench import measure  # noqa: E402
from dflash_mlx.eval.prompts import Conversation  # noqa: E402
from dflash_mlx.eval.replay import CostProfile, Trace  # noqa: E402
from dflash_mlx.files import write_atomic  # noqa: E402

PAIR = CACHE / "smollm2" / "bundle"
TRACES = CACHE / "traces" / "long_prompts"
COST_CONTEXTS = [256, 1024, 2048, 4096, 8000]
KINDS = ("warm-up", "drafter", "probe", "copy", "copy retry")  # the cycles --replay charges losses to
LIB = Path(sysconfig.get_paths()["stdlib"])
# Each holds over 9k tokens of SmolLM2's tokenizer, so that every depth up to 8k is a cut of it.
FILES = ["argparse.py", "shutil.py", "dataclasses.py", "functools.py", "configparser.py", "pathlib.py",
         "subprocess.py", "logging/__init__.py"]
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
    """``per_depth`` chats at each depth, each of another file and ask (the same ones at every depth); a file too
    short to fill a depth is refused (its whole text would be measured as that depth)."""
    out = {}
    for depth in depths:
        out[depth] = []
        for i in range(per_depth):
            path, ask = FILES[i % len(FILES)], ASKS[i % len(ASKS)]
            ids = conversation(tokenizer, path, ask, depth)
            if len(ids) < 0.95 * depth:
                raise SystemExit(f"{path} fills only {len(ids)} of the {depth} tokens asked: choose smaller --depths")
            out[depth].append(Conversation(f"{path}:{i % len(ASKS)}", [], token_ids=ids))
    return out


def timed_order(by_depth: dict[int, list[Conversation]]) -> list[tuple[int, Conversation]]:
    """(depth, prompt) in the order the timed runs take them: each file's prompts in growing depth."""
    return [(d, by_depth[d][i]) for i in range(min(map(len, by_depth.values()))) for d in sorted(by_depth)]


def run(name: str, pair: tuple, by_depth: dict[int, list[Conversation]], args: argparse.Namespace) -> dict:
    """Each prompt timed against plain; a file's prompts in growing depth one after another, so that each prefills
    only what the one before did not hold (``measure``'s ``reuse_prefix``: one prefill per file)."""
    target, drafter, tokenizer = pair
    order = timed_order(by_depth)
    tic = time.perf_counter()

    def show(r: dict) -> None:
        print(f"  {name} {r['prompt_tokens']:>5} tokens {r['prompt']:<22} {r['speedup']:>5.2f}x, tau {r['tau']:.2f}, "
              f"{r['generated_tokens']} tokens{'' if r['identical'] else ', DIFFERS FROM PLAIN'}", flush=True)

    records = measure(target, drafter, tokenizer, [c for _, c in order], max_tokens=args.max_tokens,
                      repeats=args.rounds, on_record=show, reuse_prefix=True)
    table = {}
    for depth in by_depth:
        mine = [r for (d, _), r in zip(order, records) if d == depth]
        speedups, taus = [r["speedup"] for r in mine], [r["tau"] for r in mine]
        worst = min(mine, key=lambda r: r["speedup"])
        table[depth] = {"records": mine, "median": statistics.median(speedups), "worst": worst["speedup"],
                        "worst_prompt": worst["prompt"], "tau_median": statistics.median(taus), "tau_min": min(taus),
                        "identical": all(r["identical"] for r in mine)}
    table["seconds"] = time.perf_counter() - tic
    return table


def show_table(results: dict[str, dict]) -> None:
    print(f"\n{'drafter':>8} {'depth':>6} | {'median':>7} | {'worst':>7} {'(prompt)':<24} | {'tau':>5} | {'min':>5} | "
          "identical")
    for name, table in results.items():
        for depth, row in table.items():
            if depth == "seconds":
                continue
            print(f"{name:>8} {depth:>6} | {row['median']:>6.2f}x | {row['worst']:>6.2f}x ({row['worst_prompt']:<22}) | "
                  f"{row['tau_median']:>5.2f} | {row['tau_min']:>5.2f} | {'all' if row['identical'] else 'NO':>9}")
        print(f"{name:>8}: {table['seconds'] / 60:.1f} min")


class Ledger:
    """The default policy, charging each cycle's loss against plain decoding of the same tokens (in plain steps,
    the profile's) to the kind of decision that planned it."""

    def __init__(self, profile: CostProfile, max_depth: int) -> None:
        self.policy, self.profile = AdaptiveDepth(max_depth), profile
        self.repeats, self.lost, self._context = self.policy.repeats, dict.fromkeys(KINDS, 0.0), 0

    def start(self) -> None:
        self.policy.start()
        self.lost = dict.fromkeys(KINDS, 0.0)

    def plan(self, history: list[int]) -> Plan:
        self._context = len(history) + 1
        self._warm = self.policy.warming_up
        return self.policy.plan(history)

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = "drafter") -> None:
        why = plan.why if isinstance(plan.why, Decision) else None
        probing = (drafted > 0 and source != COPY and not self._warm
                   and self.policy.best(why.bucket if why else 0) == 0)
        self.policy.observe(plan, drafted, accepted, seconds, source)
        if drafted == 0:
            return
        kind = ("warm-up" if self._warm else ("copy retry" if why is not None and why.retry else "copy")
                if source == COPY else "probe" if probing else "drafter")
        self.lost[kind] += seconds / self.profile.plain_seconds(self._context) - (accepted + 1)


def traced(name: str, source: str, pair: tuple, by_depth: dict[int, list[Conversation]], max_tokens: int
           ) -> list[Trace]:
    """Every prompt's trace within the drafter's window, cut at the reply's end of sequence (as the timed runs
    stop), recorded once per drafter (``source``) and prompt set."""
    target, drafter, tokenizer = pair
    order = timed_order(by_depth)
    path, names = TRACES / f"{name}.jsonl", [f"{d}:{c.name}" for d, c in order]
    meta = {"drafter": source, "names": names, "max_tokens": max_tokens, "draft_window": drafter.context_window}
    if path.is_file():
        try:
            saved_meta, saved = traces.read(str(path))
            if saved_meta == meta:
                return saved
        except (ValueError, KeyError, IndexError, TypeError) as e:  # a truncated or foreign file: recorded again
            print(f"  {path} is unreadable ({e}); recording the traces again", flush=True)
    recorded = []
    eos = set(tokenizer.eos_token_ids)
    for depth, conv in order:
        t = traces.record(target, drafter, tokenizer, f"{depth}:{conv.name}", conv.token_ids, max_tokens,
                          draft_window=drafter.context_window)
        end = next((i for i, tok in enumerate(t.output) if tok in eos), len(t.output) - 1) + 1
        recorded.append(Trace(t.name, t.prompt, t.output[:end], t.drafts[: end - 1], t.accepted[: end - 1]))
        print(f"  traced {t.name}: {end} tokens, E[accepted] at 1/4/15: "
              + " / ".join(f"{recorded[-1].accepted[:, k].mean():.2f}" for k in (1, 4, t.max_depth)), flush=True)
    TRACES.mkdir(parents=True, exist_ok=True)
    traces.write(str(path), recorded, meta)
    return recorded


def costs(pair: tuple, source: str) -> CostProfile:
    """This machine's cycle costs at each depth and context (``traces.measure_costs``), measured once per pair."""
    path, contexts = TRACES / "costs.profile.json", [c for c in COST_CONTEXTS if c + 128 <= pair[0].max_positions]
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("pair") == source and saved.get("contexts") == contexts:
                return CostProfile.from_dict(saved["profile"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # a truncated or foreign file: measured again
            print(f"{path} is unreadable ({e}); measuring again", flush=True)
    print(f"measuring this machine's cycle costs at {contexts} tokens (once) ...", flush=True)
    profile = traces.measure_costs(*pair, contexts, steps=12, repeats=2, name="this machine (measured)")
    TRACES.mkdir(parents=True, exist_ok=True)
    write_atomic(str(path), json.dumps({"pair": source, "contexts": contexts, "profile": profile.to_dict()}, indent=1))
    return profile


def replayed(name: str, recorded: list[Trace], profile: CostProfile) -> None:
    """The default policy over the traces in order, as one process: per prompt against plain, the oracle's, and
    what each kind of cycle lost."""
    print(f"\n{name}: the default policy replayed under {profile.name}; lost = plain steps lost against plain "
          "decoding of the same tokens, by the kind of cycle")
    print(f"{'prompt':>28} | {'tokens':>6} | {'replay':>6} | {'oracle':>6} | " + " | ".join(f"{k:>10}" for k in KINDS))
    ledger, by_depth = Ledger(profile, recorded[0].max_depth), {}
    for t in recorded:
        got = replay.simulate(ledger, [t], profile)
        best = replay.oracle_replay([t], profile)
        by_depth.setdefault(t.name.split(":")[0], []).append(got.vs_plain)
        print(f"{t.name:>28} | {got.tokens:>6} | {got.vs_plain:>5.2f}x | {best.vs_plain:>5.2f}x | "
              + " | ".join(f"{ledger.lost[k]:>10.1f}" for k in KINDS), flush=True)
    for depth, ratios in by_depth.items():
        print(f"  depth {depth:>5}: replay median {statistics.median(ratios):.2f}x, worst {min(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(PAIR), help="the pair's bundle [default: the real pair, make pair]")
    parser.add_argument("--weak", help="a second drafter for the same target, measured on the same prompts")
    parser.add_argument("--depths", default="1024,2048,4096,8000")
    parser.add_argument("--per-depth", type=int, default=3, help="prompts per depth (4: ~22 min on 2 cores, 3: ~16)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each path per prompt, alternating order")
    parser.add_argument("--json", help="write every record here")
    parser.add_argument("--replay", action="store_true", help="then trace every prompt and replay the default policy")
    parser.add_argument("--no-timing", action="store_true", help="with --replay: no timed runs")
    args = parser.parse_args()
    if args.per_depth < 1 or args.rounds < 1:
        parser.error("--per-depth and --rounds must be at least 1")
    if args.no_timing and not args.replay:
        parser.error("--no-timing goes with --replay (without it nothing would run)")
    print_machine()
    bundle = Path(args.pair)
    if not (bundle / "dflash.json").is_file():
        raise SystemExit(f"no bundle at {bundle}: `make pair` builds the real pair")
    pairs = {"default": dflash_mlx.load(str(bundle))}
    sources = {"default": str(bundle.resolve()), "weak": str(Path(args.weak or ".").resolve())}
    if args.weak:
        pairs["weak"] = dflash_mlx.load(args.weak, str(bundle / "target"))
        pairs["weak"][1].context_window = pairs["default"][1].context_window  # the bundle's drafter window
    tokenizer = pairs["default"][2]
    depths = [int(d) for d in args.depths.split(",")]
    by_depth = prompts(tokenizer, depths, args.per_depth)
    if not args.no_timing:
        print(f"\n{args.per_depth} prompts per depth (Python {sysconfig.get_python_version()}'s "
              f"{', '.join(FILES[:args.per_depth])}), {args.max_tokens} tokens each, {args.rounds} paired rounds; "
              "speedup = default / plain decode tok/s\n")
    results = {} if args.no_timing else {name: run(name, pair, by_depth, args) for name, pair in pairs.items()}
    if results:
        show_table(results)
    if args.replay:
        profile = costs(pairs["default"], sources["default"])
        for c, plain, row in zip(profile.contexts, profile.plain, profile.cycle):
            print(f"context {c:>5}: plain step {1e3 * plain:.1f} ms; cycle at k = 0, 1, 4, 15: "
                  + ", ".join(f"{row[k] / plain:.2f}" for k in (0, 1, 4, len(row) - 1)) + " plain steps")
        for name, pair in pairs.items():
            replayed(name, traced(name, sources[name], pair, by_depth, args.max_tokens), profile)
    if args.json:
        Path(args.json).write_text(json.dumps({name: {str(d): t for d, t in table.items()}
                                               for name, table in results.items()}, indent=1))


if __name__ == "__main__":
    main()
