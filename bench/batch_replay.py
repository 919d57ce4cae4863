"""Speculation inside a batch, replayed: a batch's speed against the same requests one at a time and against
mlx-lm's batched plain decoding, on this CPU (measured) and on Apple Silicon (derived from published figures).

A batch cycle's cost is modelled from a row's own cycles (``CostProfile.batch_seconds``): a
plain step, what each further row adds, a drafter pass per drafting row and a verified
position per padded draft position. On this CPU the model is checked against batch cycles
timed here (``traces.measure_batch_cycles``), and what a further row adds is measured; on a
Mac it is taken as one more verified position (a memory-bound step reads the weights once
for every row), which the published batching figures (agent-api.md) are set beside.

The rows are traces: drafters whose every next token is accepted with the probability
published for them (86%: Qwen3.5-4B on an M5 Max; 60%: Qwen3.8-27B sampled with DFlash2),
and one never accepted (a random pair: the batch should decode plainly). Each row
plans its source with its own adaptive policy and the batch's planner chooses their depth,
as ``serve`` runs; beside it, the best depth for every row fixed in hindsight. No timing
but the cost check: the same profile gives the same table.

    python bench/batch_replay.py [--rows 1,2,4,8] [--tokens 1024] [--remeasure]
"""

from __future__ import annotations

from common import CACHE, build_models, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

from dflash_mlx.eval import replay, traces  # noqa: E402
from dflash_mlx.decode.policy import DRAFTER, AdaptiveDepth, FixedBlock  # noqa: E402

CASES = (("published 4B drafter, 86% a token", 0.86), ("published DFlash2 27B sampled, 60% a token", 0.60),
         ("a drafter never accepted (random pair)", 0.0))
CONTEXT = 256


def cpu_profile(rows: list[int], remeasure: bool) -> replay.CostProfile:
    """This CPU's profile (random pair, hidden 1024, 8 layers), what a further row adds to a batch step, and the
    batch-cost model against timed batch cycles; kept in bench/.cache and reused unless ``remeasure``."""
    import dflash_mlx

    kept = CACHE / "batch-profile.json"
    if kept.exists() and not remeasure:
        profile = replay.CostProfile.from_dict(json.loads(kept.read_text()))
        print(f"\nthis CPU: the profile measured before ({kept}; --remeasure measures again)")
        return profile

    pair = build_models(1024, 8)
    target, drafter, tokenizer = dflash_mlx.load(str(pair / "draft"), str(pair / "target"))
    profile = traces.measure_costs(target, drafter, tokenizer, [CONTEXT], steps=16, repeats=3, name="this CPU")
    top = drafter.block_size - 1
    timed = {(b, k): traces.measure_batch_cycles(target, drafter, tokenizer, b, k, CONTEXT)
             for b in rows for k in (0, top)}
    slope = float(np.polyfit([b - 1 for b in rows], [timed[(b, 0)] for b in rows], 1)[0])  # seconds a row adds
    profile.row = max(slope, 0.0) / profile.plain_seconds(CONTEXT)
    print(f"\nthis CPU at {CONTEXT} tokens: plain step {1e3 * profile.plain_seconds(CONTEXT):.1f} ms, a further row "
          f"adds {profile.row:.2f} plain steps (the slope of plain batch cycles over {', '.join(map(str, rows))} rows)")
    print("batch cycle, timed / modelled (ms):")
    for b in rows:
        cells = [f"{'plain' if k == 0 else f'{k} drafted'} {1e3 * timed[(b, k)]:6.1f} / "
                 f"{1e3 * profile.batch_seconds([(k, DRAFTER)] * b, CONTEXT):6.1f}" for k in (0, top)]
        print(f"  {b} rows: " + " | ".join(cells))
    kept.write_text(json.dumps(profile.to_dict()))
    return profile


def table(profile: replay.CostProfile, rows: list[int], tokens: int) -> None:
    print(f"\n{profile.name} ({profile.source})")
    print(f"  {'case':44} {'rows':>4} {'batched/one at a time':>22} {'batched/mlx-lm batched':>23} "
          f"{'of best fixed depth':>20} {'drafting':>9}")
    for name, acceptance in CASES:
        rowset = [replay.synthetic(f"{name} {i}", CONTEXT, tokens, acceptance, 15, seed=i) for i in range(max(rows))]
        for b in rows:
            run = replay.simulate_batch(lambda: AdaptiveDepth(15), rowset[:b], profile)
            fixed = [(k, replay.simulate_batch(lambda: FixedBlock(k + 1), rowset[:b], profile)) for k in range(16)]
            k, best = min(fixed, key=lambda kr: kr[1].seconds)  # the same tokens: the least seconds is the fastest
            print(f"  {name:44} {b:4d} {run.vs_fifo:21.2f}x {run.vs_plain_batch:22.2f}x "
                  f"{best.seconds / run.seconds:14.2f} (k {k:2d}) {run.drafting_cycles / max(run.cycles, 1):8.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8", help="batch sizes")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens each row generates")
    parser.add_argument("--remeasure", action="store_true", help="measure this CPU's costs again")
    args = parser.parse_args()
    rows = sorted({int(b) for b in args.rows.split(",")} | {1})
    print_machine()
    CACHE.mkdir(exist_ok=True)
    profiles = [cpu_profile(rows, args.remeasure)] + [replay.mac_profile(name, 15) for name in replay.MAC_PROFILES]
    for profile in profiles:
        table(profile, rows, args.tokens)


if __name__ == "__main__":
    main()
