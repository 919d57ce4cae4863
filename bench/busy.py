"""The adaptive policy on a busy machine: auto vs copy vs drafter, each run a fresh process, quiet and under load.

A laptop with a browser and an editor open is a busy machine. The load here is one CPU hog
per core (a Python busy loop each). The pair is the tests' looping one (a small random qwen3
target that falls into greedy loops, a random drafter: the drafter is never right, copies
are). Cases: its greedy continuation of "hello world" without the chat template, a loop
copies take nearly whole (copy-only tau 11.7); its chat reply to "hello" (about 1,250 tokens
of varied text before its loop: copy-only tau 5.1); and the built-in prompts (math, code,
chat), new text and loops by turns. Every (source, run) is a
fresh process, as `dflash-mlx generate` is: the policy learns from nothing each time. The
figure is decode tokens per second over the case's prompts; the ratio is auto against the
best of the three sources in the same round (the sources run back to back, in rotating order).

    python bench/busy.py [--runs 5] [--loop-tokens 2000] [--prompt-tokens 256] [--hogs N]
"""

from __future__ import annotations

from common import CACHE, cpu_hogs, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib import resources  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional, Union  # noqa: E402

from dflash_mlx.eval import replay  # noqa: E402

SOURCES = ("auto", "copy", "drafter")


def looping_pair() -> Path:
    """The tests' looping pair (conftest.looping_dir), built once into bench/.cache."""
    from dflash_mlx.models import fixtures

    folder = CACHE / "looping-pair"
    if not (folder / "random" / "config.json").exists():
        config = fixtures.target_config("qwen3")
        fixtures.write_target(folder / "target", config, seed=0, init_scale=1.0)
        fixtures.write_drafter(folder / "random", fixtures.drafter_config(config))
    return folder


Prompt = Union[str, dict]  # a user message (through the chat template), or {"raw": text} tokenized as it is


def encode(tokenizer, prompt: Prompt) -> list[int]:
    from dflash_mlx.chat_template import prompt_ids, user

    return tokenizer.encode(prompt["raw"]) if isinstance(prompt, dict) else prompt_ids(tokenizer, user(prompt))


def child(pair: Path, source: str, prompts: list[Prompt], max_tokens: int) -> None:
    """One fresh process: decode the prompts with one draft source; print tokens and decode seconds as JSON."""
    import dflash_mlx
    target, drafter, tokenizer = dflash_mlx.load(str(pair / "random"), str(pair / "target"))
    tokens, seconds, copies, cycles = 0, 0.0, 0, 0
    for text in prompts:
        run = dflash_mlx.generate(target, drafter, tokenizer, encode(tokenizer, text), max_tokens=max_tokens,
                                  draft_source=source)
        decoded = len(run.tokens) - 1
        tokens, seconds = tokens + decoded, seconds + decoded / max(run.generation_tps, 1e-9)
        copies += run.by_source.get("copy", {}).get("cycles", 0)
        cycles += run.cycles
    print(json.dumps({"tokens": tokens, "seconds": seconds, "copy_cycles": copies, "tau": tokens / max(cycles, 1)}))


def measure(pair: Path, source: str, prompts: list[Prompt], max_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(pair), source, json.dumps(prompts), str(max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, DFLASH_MLX_BLAS_WARNING="0"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def rounds(pair: Path, prompts: list[Prompt], max_tokens: int, runs: int) -> list[dict[str, dict]]:
    out = []
    for r in range(runs):
        order = SOURCES[r % 3:] + SOURCES[: r % 3]
        out.append({s: measure(pair, s, prompts, max_tokens) for s in order})
    return out


def report(name: str, results: list[dict[str, dict]]) -> float:
    print(f"\n{name}: decode tok/s per fresh run (auto's tau and copy cycles)")
    ratios = []
    for i, run in enumerate(results):
        speed = {s: r["tokens"] / r["seconds"] for s, r in run.items()}
        ratio = speed["auto"] / max(speed.values())
        ratios.append(ratio)
        print(f"  run {i + 1}: " + " | ".join(f"{s} {speed[s]:7.1f}" for s in SOURCES)
              + f" | auto/best {ratio:.2f} (auto: tau {run['auto']['tau']:.2f}, {run['auto']['copy_cycles']} copies)")
    print(f"  auto / best source: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}")
    return min(ratios)


def record_load(pair: Path, hogs: int, seconds: float, dt: float = 0.005) -> replay.Load:
    """The target's plain steps, quiet (their median) and then beside ``hogs`` CPU hogs for ``seconds``: each busy
    step's slowdown over the quiet median, laid on a grid of ``dt`` seconds of wall time."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import dflash_mlx

    target, _, tokenizer = dflash_mlx.load(str(pair / "random"), str(pair / "target"))
    x = mx.array(tokenizer.encode("hello"))[None, :1]

    def steps(duration: float) -> list[float]:
        took, cache, start = [], make_prompt_cache(target.model), time.perf_counter()
        while time.perf_counter() - start < duration:
            if cache[0].offset >= 256:  # the context stays short: the slowdown is the machine's, not the context's
                cache = make_prompt_cache(target.model)
            tic = time.perf_counter()
            mx.eval(target.model(x, cache=cache))
            took.append(time.perf_counter() - tic)
        return took

    quiet = statistics.median(steps(5.0))
    with cpu_hogs(hogs):
        busy = steps(seconds)
    factors: list[float] = []
    for took in busy:
        factors += [took / quiet] * max(1, round(took / dt))
    return replay.Load(factors, dt)


def recorded_load(pair: Path, hogs: int, seconds: float, keep: Optional[Path]) -> replay.Load:
    """A new recording, or the one kept at ``keep`` (written there when absent): the same load replayed again."""
    if keep is not None and keep.exists():
        saved = json.loads(keep.read_text())
        return replay.Load(saved["factors"], saved["dt"])
    load = record_load(pair, hogs, seconds)
    if keep is not None:
        keep.write_text(json.dumps({"factors": load.factors, "dt": load.dt}))
    return load


def replayed(pair: Path, cases: list[tuple[str, list[Prompt], int]], hogs: int, runs: int, seconds: float,
             keep: Optional[Path] = None) -> None:
    """Traces of the cases and this machine's quiet cycle costs, the slowdown recorded beside the hogs; then auto,
    copy and drafter replayed over them, quiet and from ``runs`` offsets into the load (the same offset for the
    three: the same spikes at the same moments)."""
    import dflash_mlx
    from dflash_mlx.eval import traces
    from dflash_mlx.decode.policy import COPY, AdaptiveDepth, FixedBlock

    load = recorded_load(pair, hogs, seconds, keep)
    target, drafter, tokenizer = dflash_mlx.load(str(pair / "random"), str(pair / "target"))
    profile = traces.measure_costs(target, drafter, tokenizer, [64, 1024, 2048], steps=16, repeats=3)
    factors = sorted(load.factors)
    print(f"load: {hogs} CPU hogs, {seconds:.0f} s of plain steps; slowdown median {statistics.median(factors):.2f}, "
          f"p90 {factors[int(0.9 * len(factors))]:.2f}, max {factors[-1]:.1f}")
    policies = {"auto": lambda: AdaptiveDepth(drafter.block_size - 1),
                "copy": lambda: FixedBlock(drafter.block_size, COPY),
                "drafter": lambda: AdaptiveDepth(drafter.block_size - 1, copies=False)}
    span = len(load.factors) * load.dt
    for name, prompts, max_tokens in cases:
        recorded = [traces.record(target, drafter, tokenizer, str(text), encode(tokenizer, text), max_tokens)
                    for text in prompts]
        print(f"\n{name}: replayed tok/s of a fresh process (auto / best source)")
        for label, offsets in (("quiet", [None]), (f"busy ({hogs} hogs)", [i * span / runs for i in range(runs)])):
            ratios = []
            for offset in offsets:
                speed = {s: replay.simulate(make(), recorded, profile, load=None if offset is None else load,
                                            offset=offset or 0.0).tokens_per_second for s, make in policies.items()}
                ratios.append(speed["auto"] / max(speed.values()))
                print(f"  {label}: " + " | ".join(f"{s} {v:7.1f}" for s, v in speed.items())
                      + f" | auto/best {ratios[-1]:.2f}")
            if len(ratios) > 1:
                print(f"  {label}: auto / best source, min {min(ratios):.2f}, median {statistics.median(ratios):.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--loop-tokens", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy loops beside the runs")
    parser.add_argument("--replay", type=float, default=None, metavar="SECONDS",
                        help="record this long a load's slowdown and replay the policies over traces instead")
    parser.add_argument("--recording", type=Path, default=None, metavar="FILE",
                        help="with --replay: replay the load kept in FILE (recorded into it when absent)")
    args = parser.parse_args()
    print_machine()
    pair = looping_pair()
    builtin = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())
    held_out = [builtin[kind][0] for kind in ("math", "code", "chat")]
    cases = [("pure loop (\"hello world\", no template)", [{"raw": "hello world"}], args.loop_tokens),
             ("loop (\"hello\")", ["hello"], args.loop_tokens), ("built-in prompts", held_out, args.prompt_tokens)]
    if args.replay:
        replayed(pair, cases, args.hogs, args.runs, args.replay, args.recording)
        return
    worst = {}
    for load in ("quiet", "busy"):
        with cpu_hogs(args.hogs if load == "busy" else 0):
            for name, prompts, max_tokens in cases:
                label = f"{name}, {load}" + (f" ({args.hogs} CPU hogs)" if load == "busy" else "")
                worst[label] = report(label, rounds(pair, prompts, max_tokens, args.runs))
    print("\nauto / best source, worst run: " + "; ".join(f"{k} {v:.2f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
