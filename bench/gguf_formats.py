"""Which form of a converted GGUF decodes faster here: its own 4-bit blocks, or dequantized to float32.

``dflash-mlx convert FILE.gguf`` keeps Q4_0/Q4_1/Q8_0 blocks as MLX quantization; ``--dtype float32``
dequantizes them. On Metal the 4-bit model is the fast one (decoding is memory-bound). On MLX's CPU
backend only float32 goes through BLAS, so this script times mlx-lm's plain greedy decoding of both
forms of the same file side by side (alternating, medians), which is what chose ``--dtype float32``
for the CPU pair in bench/real_pair.py.

    python bench/gguf_formats.py [--gguf FILE] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from dflash_mlx.models.convert import convert  # noqa: E402
from real_pair import fetch_gguf  # noqa: E402

PROMPT = "Write a Python function that merges two sorted lists, and explain how it works."


def decode_tps(model, ids: list[int], tokens: int) -> float:
    stamps = []
    for _ in generate_step(mx.array(ids), model, max_tokens=tokens):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="a GGUF file [default: SmolLM2-135M-Instruct Q4_1, as bench/real_pair.py]")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print_machine()
    gguf = Path(args.gguf) if args.gguf else fetch_gguf()
    forms = {}
    for name, dtype in (("as the file (4-bit)", None), ("float32", "float32")):
        folder = CACHE / "gguf-forms" / f"{gguf.stem}-{dtype or 'kept'}"
        if not (folder / "config.json").is_file():
            convert(str(gguf), str(folder), dtype=dtype, force=folder.exists())
        forms[name] = load(str(folder))
    tokenizer = next(iter(forms.values()))[1]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    for model, _ in forms.values():
        decode_tps(model, ids, 8)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(args.rounds):
        for name in (list(forms) if r % 2 == 0 else list(reversed(forms))):
            runs[name].append(decode_tps(forms[name][0], ids, args.tokens))
    for name, values in runs.items():
        print(f"{name:>20}: {statistics.median(values):6.1f} tok/s (min {min(values):.1f}, max {max(values):.1f})")
    a, b = (statistics.median(v) for v in runs.values())
    print(f"float32 / 4-bit: {b / a:.2f}x")


if __name__ == "__main__":
    main()
