"""Every decision the adaptive policy makes, replayed: one digest per case, to compare two checkouts.

``replay.py`` judges a policy by its speed; this says whether a change to the policy's code changed what
it decides at all. Each case replays the default policy (and its variants: without copies, a target alone)
over the recorded traces (bench/trace.py) and synthetic ones of several acceptances, under every cost
profile, quiet and under a synthetic load of spikes, alone and as rows of a batch, and prints the digest
of its plans (depth, source, fallback, in order) with how many there were. No timing runs here: the same
code and files give the same digests. Run it in two checkouts and diff the outputs:

    python bench/decisions.py bench/.cache/traces/*.jsonl > after.txt
    (cd ../before && python bench/decisions.py ../main/bench/.cache/traces/*.jsonl) > before.txt
    diff before.txt after.txt && echo identical
"""

from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_mlx.decode.policy import AdaptiveDepth
from dflash_mlx.eval import replay, traces

VARIANTS: dict[str, dict[str, Any]] = {"default": {}, "no copies": {"copies": False}, "alone": {"drafter": False}}


def recording(log: list[tuple[int, str, int]], **settings: Any) -> Callable[[Sequence[replay.Trace]], AdaptiveDepth]:
    """The default policy for the traces (``replay.adaptive``), its plans written to ``log`` as they are made (a
    subclass: the batch planner still sees an AdaptiveDepth)."""

    class Recorded(AdaptiveDepth):
        def plan(self, history: Any) -> Any:
            plan = super().plan(history)
            log.append((plan.depth, plan.source, plan.fallback))
            return plan

    return lambda traces: replay.adaptive(traces, Recorded, **settings)


def synthetic_load(seed: int = 0) -> replay.Load:
    """A quiet machine with spikes: mostly 1x, now and then 2-6x for a while (as a browser or a build does)."""
    rng, factors = random.Random(seed), []
    while len(factors) < 4000:
        factors += [1.0] * rng.randint(20, 200) + [rng.uniform(2, 6)] * rng.randint(1, 30)
    return replay.Load(factors, 0.01)


def digest(log: list[tuple[int, str, int]]) -> str:
    return f"{hashlib.sha256(repr(log).encode()).hexdigest()[:16]} ({len(log)} plans)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", type=Path, help="bench/trace.py's files (synthetic ones are added)")
    args = parser.parse_args()
    sets: list[tuple[str, list[replay.Trace], list[replay.CostProfile]]] = []
    for path in args.traces:
        _, recorded = traces.read(str(path))
        sets.append((path.name, recorded, traces.profiles(str(path), recorded[0].max_depth)))
    synthetic = [replay.synthetic(f"a{a}", 256, 400, a, 15, seed=i) for i, a in enumerate((0.05, 0.5, 0.8, 0.95))]
    sets.append(("synthetic", synthetic, [replay.mac_profile(name, 15) for name in replay.MAC_PROFILES]))
    load = synthetic_load()
    for name, recorded, costs in sets:
        for profile in costs:
            for variant, settings in VARIANTS.items():
                for loaded in (None, load):
                    log: list[tuple[int, str, int]] = []
                    replay.simulate(recording(log, **settings)(recorded), recorded, profile, load=loaded)
                    print(f"{name} | {profile.name} | {variant} | {'load' if loaded else 'quiet'} | alone | "
                          f"{digest(log)}")
                log = []
                make = recording(log, **settings)
                replay.simulate_batch(lambda: make(recorded), recorded[:8], profile)
                print(f"{name} | {profile.name} | {variant} | quiet | batch | {digest(log)}")


if __name__ == "__main__":
    main()
