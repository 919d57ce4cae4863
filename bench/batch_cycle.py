"""What a batch cycle costs against a row alone, and how much of each is host work: in process, no server.

One pair, rows prefilled on the same prompt, then ``Scheduler`` cycles timed after a warm-up: a row alone
(its own caches) and ``--rows`` rows together (ragged caches, one verify), plain steps (block 1) and full
blocks (block 16). The figures: ms per cycle and per row-cycle, the batch's throughput over one row's, and
from a profile of the plain cycles the host time spent building each cycle's graph (everything
``Batch._start`` calls but the asynchronous evaluation, which on MLX's CPU backend is the compute itself).
A server adds its own host work per row on top (detokenizing, stop strings, each piece reported).

    python bench/batch_cycle.py [--hidden 256] [--layers 4] [--rows 4] [--cycles 300]
"""

from __future__ import annotations

from common import build_models, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

from dflash_mlx import load  # noqa: E402
from dflash_mlx.decode.batch import Batch  # noqa: E402
from dflash_mlx.decode.cycle import Row, prefill  # noqa: E402
from dflash_mlx.decode.generate import keyword_settings, setup  # noqa: E402
from dflash_mlx.decode.scheduler import Scheduler  # noqa: E402


def rows(pair: tuple, ids: list[int], n: int, block: int) -> list[Row]:
    target, drafter, tokenizer = pair
    made = []
    for _ in range(n):
        settings = keyword_settings(max_tokens=10**6, eos_token_ids=[], block_size=block)
        row = setup(target, drafter, tokenizer, ids, *settings).row
        row.policy.start()
        row.first(prefill(target, drafter, row.cache, ids, 2048, lambda done, total: None))
        made.append(row)
    return made


def timed(pair: tuple, ids: list[int], n: int, block: int, cycles: int, profile: bool = False
          ) -> tuple[float, float]:
    """(seconds per cycle, host seconds per cycle building graphs; 0 unless ``profile``)."""
    scheduler = Scheduler(Batch(pair[0], alone=n == 1))
    for row in rows(pair, ids, n, block):
        scheduler.add(row)
    for _ in range(20):  # warm-up: buffers, compiled kernels
        scheduler.advance()
        scheduler.read()
    profiler = cProfile.Profile() if profile else None
    tic = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(cycles):
        scheduler.advance()
        scheduler.read()
    if profiler is not None:
        profiler.disable()
    seconds = (time.perf_counter() - tic) / cycles
    scheduler.close()
    if profiler is None:
        return seconds, 0.0
    start = next(v for k, v in pstats.Stats(profiler).stats.items() if k[2] == "_start")  # type: ignore[attr-defined]
    _, _, own, total, _ = start
    return seconds, (total - own) / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    args = parser.parse_args()
    print_machine()
    folder = build_models(args.hidden, args.layers)
    pair = load(str(folder / "draft"), str(folder / "target"))
    ids = prompt_ids(pair[2], args.prompt_tokens)
    print(f"pair: random qwen3, hidden {args.hidden}, {args.layers} layers; {args.prompt_tokens}-token prompt; "
          f"{args.cycles} cycles each after 20 of warm-up")
    for block in (1, 16):
        alone, _ = timed(pair, ids, 1, block, args.cycles)
        together, _ = timed(pair, ids, args.rows, block, args.cycles)
        print(f"block {block:2d}: alone {alone * 1e3:6.2f} ms/cycle; {args.rows} rows {together * 1e3:6.2f} ms/cycle "
              f"({together * 1e3 / args.rows:5.2f} ms per row-cycle): throughput {args.rows * alone / together:.2f}x "
              "one row's")
    (alone, host_alone), (together, host_together) = (timed(pair, ids, n, 1, args.cycles, profile=True)
                                                      for n in (1, args.rows))
    print(f"plain cycles, graph building on the host (profiled): alone {host_alone * 1e3:.2f} ms of "
          f"{alone * 1e3:.2f}; {args.rows} rows {host_together * 1e3:.2f} ms of {together * 1e3:.2f}")


if __name__ == "__main__":
    main()
