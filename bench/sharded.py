"""Sharded targets: 1 vs 2 local ranks, plain sharded decoding vs DFlash, and collectives per token.

The script runs itself twice: as one process, and as two ranks of
``mlx.launch -n 2 --backend ring`` on this machine, with the target split by
mlx-lm's ``model.shard`` (ranks talk over TCP on the loopback, as Macs do over
Ethernet or Thunderbolt, with a far smaller latency). In each run, per prompt
and in alternating order: plain mlx-lm decoding of the (sharded) target and
DFlash, tokens checked identical. Two random qwen3 targets (hidden 512, 4 layers,
8 heads): one with the random drafter (tau ~1: the adaptive policy decodes
plainly), and one with small weights, which falls into repeating a token, with a
drafter that always drafts that token (acceptance by construction, the stand-in
for a drafter that agrees), at a fixed block of 16. Collectives are counted in the graphs MLX builds: one
plain step, one verify of a block, one drafter pass.

    python bench/sharded.py [--max-tokens 96] [--prompts 3] [--repeats 2]
"""

from __future__ import annotations

from common import CACHE, build_models, plain, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx import distributed
from dflash_mlx.models import fixtures  # noqa: E402

HIDDEN, LAYERS = 512, 4
PROMPT_LENGTHS = (64, 96, 128, 160)


def looping_pair() -> Path:
    """A random target that falls into repeating one token (small weights), and a drafter that drafts it."""
    folder = CACHE / f"looping-h{HIDDEN}-l{LAYERS}"
    if folder.is_dir():
        return folder
    config = fixtures.target_config("qwen3", hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=3 * HIDDEN,
                                    num_attention_heads=HIDDEN // 64, num_key_value_heads=HIDDEN // 128,
                                    vocab_size=32000, max_position_embeddings=40960)
    draft_config = fixtures.drafter_config(config, num_hidden_layers=2, target_layer_ids=[1, LAYERS - 2])
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp) / "pair"
        fixtures.write_target(root / "target", config, init_scale=1.0, tokenizer_vocab=512)
        fixtures.write_drafter(root / "random", draft_config, dtype=mx.float32)
        target, _, tokenizer = dflash_mlx.load(str(root / "random"), str(root / "target"))
        counts: collections.Counter = collections.Counter()
        for n in PROMPT_LENGTHS:
            counts.update(plain(target.model, prompt_ids(tokenizer, n), 96)[0])
        fixtures.write_constant_drafter(root / "draft", draft_config, root / "target", counts.most_common(1)[0][0])
        shutil.rmtree(root / "random")
        root.rename(folder)
    return folder


def collectives(*outputs: mx.array) -> int:
    """Distributed operations in the (unevaluated) graph of ``outputs``."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return sum(1 for line in f if "label" in line and any(k in line for k in ("AllReduce", "AllGather", "Send", "Recv")))


def graph_counts(target, drafter, tokenizer) -> dict[str, int]:
    """Collectives of one plain step, one verify of 16 tokens, one drafter pass of 16."""
    ids = prompt_ids(tokenizer, 64)
    cache = target.make_cache()
    logits, features = target(mx.array(ids)[None], cache)
    mx.eval(logits, features)
    out = target(mx.array(ids[:1])[None], cache)
    step = collectives(*out)
    mx.eval(out, [c.state for c in cache])  # so that the verify's graph holds the verify alone
    verify = collectives(*target(mx.array(ids[:16])[None], cache))
    draft_cache = drafter.make_cache()
    draft = collectives(drafter.draft_logits(target, mx.array(ids[-1:]), features, draft_cache, 15))
    return {"plain step": step, "verify": verify, "drafter pass": draft}


def worker(args: argparse.Namespace) -> None:
    random, looping = build_models(HIDDEN, LAYERS), looping_pair()
    drafters = {"random drafter, adaptive": (random, None), "agreeing drafter, block 16": (looping, 16)}
    results = {"ranks": 1 if distributed.group() is None else distributed.group().size()}
    for name, (folder, block) in drafters.items():
        target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
        counts = graph_counts(target, drafter, tokenizer)
        speeds: dict[str, list[float]] = {"plain": [], "dflash": []}
        cycles = drafting = tokens = 0
        for n in PROMPT_LENGTHS[: args.prompts]:
            ids = prompt_ids(tokenizer, n)
            runs: dict[str, list[float]] = {"plain": [], "dflash": []}
            for r in range(args.repeats):
                for path in ("plain", "dflash") if r % 2 == 0 else ("dflash", "plain"):
                    if path == "plain":
                        out, tps, _ = plain(target.model, ids, args.max_tokens)
                    else:
                        res = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=args.max_tokens,
                                                  block_size=block, eos_token_ids=[])
                        out, tps = res.tokens, res.generation_tps
                        cycles, tokens = cycles + res.cycles, tokens + len(res.tokens)
                        drafting += sum(1 for k in res.drafted if k)
                    runs[path].append((tps, out))
            assert runs["plain"][0][1] == runs["dflash"][0][1], f"{name}: DFlash tokens differ from plain decoding"
            for path in runs:
                speeds[path].append(statistics.median(t for t, _ in runs[path]))
        syncs = cycles // 32 + 1 if block is None and results["ranks"] > 1 else 0  # the policy's cost agreement
        results[name] = {
            "plain": statistics.median(speeds["plain"]), "dflash": statistics.median(speeds["dflash"]),
            "tau": tokens / cycles, "counts": counts,
            "per token plain": counts["plain step"],
            "per token dflash": (cycles * counts["verify"] + drafting * counts["drafter pass"] + syncs) / tokens,
        }
    peak = distributed.gather(mx.get_peak_memory() / 2**30)
    results["peak GiB per rank"] = peak
    if distributed.is_main():
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    print_machine()
    build_models(HIDDEN, LAYERS)
    looping_pair()
    flags = ["--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts), "--repeats", str(args.repeats)]
    launch = Path(sys.executable).parent / "mlx.launch"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            out = Path(tmp) / f"{ranks}.json"
            command = [sys.executable, __file__, "--worker", "--out", str(out), *flags]
            if ranks > 1:
                command = [str(launch), "-n", str(ranks), "--backend", "ring", "--", *command]
            print(f"running on {ranks} rank(s) ...", flush=True)
            subprocess.run(command, check=True, env=os.environ)
            results[ranks] = json.loads(out.read_text())
    print(f"\nrandom qwen3 targets, hidden {HIDDEN}, {LAYERS} layers; {args.prompts} prompts x {args.repeats} runs, "
          f"{args.max_tokens} tokens; medians of decode tok/s; tokens identical on every path")
    print(f"{'drafter':<27} | {'ranks':>5} | {'plain':>6} | {'dflash':>6} | {'ratio':>5} | {'tau':>5} | "
          f"{'collectives/token':>17}")
    print(f"{'':<27} | {'':>5} | {'':>6} | {'':>6} | {'':>5} | {'':>5} | {'plain':>8} {'dflash':>8}")
    for name in [k for k in results[1] if isinstance(results[1][k], dict)]:
        for ranks, res in results.items():
            r = res[name]
            print(f"{name:<27} | {ranks:>5} | {r['plain']:>6.1f} | {r['dflash']:>6.1f} | {r['dflash'] / r['plain']:>5.2f} | "
                  f"{r['tau']:>5.2f} | {r['per token plain']:>8.1f} {r['per token dflash']:>8.2f}")
    print(f"peak memory per rank (GiB): 1 rank {results[1]['peak GiB per rank']}, 2 ranks {results[2]['peak GiB per rank']}")
    two = results[2]["agreeing drafter, block 16"]
    print(f"graph collectives with 2 ranks: {two['counts']}")


if __name__ == "__main__":
    main()
