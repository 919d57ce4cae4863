"""Judge the adaptive policy on recorded traces, deterministically, under each cost profile.

For every trace file (bench/trace.py) and every cost profile (this machine's, measured
with the traces; and the Apple Silicon profiles of ``dflash_mlx.eval.replay.MAC_PROFILES``,
each derived from published figures): the default policy against mlx-lm's plain
decoding, the best fixed depth in hindsight and the oracle (the best depth schedule in
hindsight). Copy drafts (what followed an earlier occurrence of the history's end) are
derived from each trace's own tokens: the table also gives the policy without them
("drafter"), the best fixed copy depth, and how many cycles copied; the oracle chooses
among plain steps, the drafter's depths and copies. Also the mean acceptance of drafting
a block of k + 1 (what the decode loop does) against drafting the whole block and
verifying its first k, and what each is worth to the oracle. No timing runs here: the
same files give the same table.

    python bench/replay.py bench/.cache/traces/*.jsonl
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dflash_mlx.eval import replay, traces
from dflash_mlx.decode.estimates import Acceptance
from dflash_mlx.decode.policy import AdaptiveDepth
from dflash_mlx.decode.repeats import Repeats


def _with(**changes) -> Callable[[Sequence[replay.Trace]], AdaptiveDepth]:
    """The default policy with some of its parts changed (``acceptance``: Acceptance's fields; ``repeats``)."""
    acceptance = changes.pop("acceptance", {})
    repeats = changes.pop("repeats", None)

    def make(recorded: Sequence[replay.Trace]) -> AdaptiveDepth:
        policy = replay.adaptive(recorded, **changes)
        if acceptance:
            policy.by_repeat = [Acceptance(policy.max_depth, **acceptance) for _ in policy.by_repeat]
        if repeats is not None:
            policy.repeats = repeats
        return policy

    return make


# Each tunable of the default policy, removed (or, for a bare number, halved and doubled): what it is worth.
ABLATIONS: dict[str, Callable[[Sequence[replay.Trace]], AdaptiveDepth]] = {
    "no copy drafts (copies)": _with(copies=False),
    "no repeat buckets (Repeats)": _with(repeats=Repeats(n=10**9)),
    "two buckets, no long one (long)": _with(repeats=Repeats(long=10**9)),
    "no acceptance decay (decay 1)": _with(acceptance={"decay": 1.0}),
    "acceptance decay 0.8": _with(acceptance={"decay": 0.8}),
    "acceptance decay 0.95": _with(acceptance={"decay": 0.95}),
    "no lean on the position before (prior)": _with(acceptance={"prior": 1e-6}),
    "no stale fading (stale 1)": _with(stale=1.0),
    "probe spacing by budget only (memory 0)": _with(memory=0.0),
    "no probe brought forward by a new prompt": _with(min_paid=float("inf")),
    "every new prompt brings a probe (min_paid 0)": _with(min_paid=0.0),
    "probe_budget halved": _with(probe_budget=0.0025),
    "probe_budget doubled": _with(probe_budget=0.01),
    "no min_probe (1)": _with(min_probe=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--ablate", action="store_true", help="also each tunable removed: its effect on tokens/s")
    ap.add_argument("--drafter-only", action="store_true",
                    help="ablate the policy without copy drafts (where copies would decide everything, e.g. "
                         "degenerate output, the drafter's own tunables are judged apart)")
    ap.add_argument("--mixed", nargs=2, type=Path, metavar=("GREEDY", "SAMPLED"),
                    help="greedy and sampled requests alternating: one policy state for both vs one each")
    args = ap.parse_args()
    for path in [*args.traces, *(args.mixed or [])]:
        if not path.is_file():
            ap.error(f"{path}: no such trace file (write one with bench/trace.py)")
    tic = time.perf_counter()
    for path in args.traces:
        meta, recorded = traces.read(str(path))
        B = recorded[0].max_depth
        positions = sum(len(t.output) - 1 for t in recorded)
        print(f"\n{path.name}: {len(recorded)} prompts, {positions} positions, T={meta['temperature']:g}")
        short, full = replay.mean_acceptance(recorded), replay.mean_acceptance(recorded, full=True)
        ks = sorted({k for k in (1, 2, 4, 8) if k < B} | {B})
        label = f"  E[accepted] at k = {', '.join(map(str, ks))}, block of k + 1: "
        print(label + "  ".join(f"{short[k]:.2f}" for k in ks))
        print(f"{'whole block, first k: ':>{len(label)}}" + "  ".join(f"{full[k]:.2f}" for k in ks))
        offered = sum(int((t.copied >= 0).sum()) for t in recorded)
        deepest = recorded[0].copy_depth
        print(f"  copy drafts offered at {offered / positions:.0%} of positions; E[accepted] of a copy of {deepest} "
              f"there: {np.mean([min(c, deepest) for t in recorded for c in t.copied if c >= 0] or [0]):.2f}")
        print(f"  {'profile':<26} {'policy':>7} {'drafter':>8} {'fixed (k)':>11} {'copy (k)':>11} {'oracle':>7} "
              f"{'of fixed':>8} {'of oracle':>9} {'copies':>6}  {'oracle, whole block':>19}")
        for profile in traces.profiles(str(path), B):
            got = replay.judge(replay.adaptive, recorded, profile)
            alone = replay.simulate(replay.adaptive(recorded, copies=False), recorded, profile)
            whole = replay.oracle_replay(recorded, profile, full=True, copies=False)
            cycles = sum(got["depths"])
            print(f"  {profile.name[:26]:<26} {got['policy_vs_plain']:>6.2f}x {alone.vs_plain:>7.2f}x "
                  f"{got['best_fixed_vs_plain']:>6.2f}x ({got['best_fixed_depth']:>2}) "
                  f"{got['best_copy_vs_plain']:>6.2f}x ({got['best_copy_depth']:>2}) {got['oracle_vs_plain']:>6.2f}x "
                  f"{got['policy_of_best_fixed']:>8.3f} {got['policy_of_oracle']:>9.3f} "
                  f"{got['copies'] / max(cycles, 1):>6.0%}  {whole.vs_plain:>18.2f}x")
        if args.ablate:
            profiles = traces.profiles(str(path), B)

            def policy(make: Callable[[Sequence[replay.Trace]], AdaptiveDepth]) -> AdaptiveDepth:
                made = make(recorded)
                made.copies = made.copies and not args.drafter_only
                return made

            base = [replay.simulate(policy(replay.adaptive), recorded, p).tokens_per_second for p in profiles]
            print(f"  tokens/s with a tunable removed, relative to the default{' without copies' * args.drafter_only}"
                  ", per profile:")
            for label, make in ABLATIONS.items():
                ratios = [replay.simulate(policy(make), recorded, p).tokens_per_second / b for p, b in zip(profiles, base)]
                print(f"    {label:<46} " + "  ".join(f"{r:.3f}" for r in ratios))
    if args.mixed:
        (_, greedy), (_, sampled) = (traces.read(str(p)) for p in args.mixed)
        B = greedy[0].max_depth
        mixed = [t for pair in zip(greedy, sampled) for t in pair]
        print(f"\n{args.mixed[0].name} and {args.mixed[1].name} alternating ({len(mixed)} requests):")
        for profile in traces.profiles(str(args.mixed[0]), B):
            shared = replay.simulate(replay.adaptive(mixed), mixed, profile)
            apart = replay.simulate(replay.adaptive(mixed), greedy[: len(mixed) // 2], profile)
            apart.add(replay.simulate(replay.adaptive(mixed), sampled[: len(mixed) // 2], profile))
            print(f"  {profile.name:<34} one state {shared.vs_plain:.3f}x, one per kind {apart.vs_plain:.3f}x plain: "
                  f"apart / shared {apart.tokens_per_second / shared.tokens_per_second:.3f}")
    print(f"\n(ratios to mlx-lm's plain decoding under each profile; replayed in {time.perf_counter() - tic:.1f} s)")


if __name__ == "__main__":
    main()
