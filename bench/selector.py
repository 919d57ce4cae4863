"""DFlash2's candidate-path selector against the drafter pass, and which runtime block pays.

1. At the published Qwen3.8-27B-DFlash2 shapes (hidden 5120, 5 layers, heads 32/8/128,
   intermediate 17408, vocab 248,320, selector rank 256, top-16, block 8: 7 drafted
   positions; random bf16 weights), time one drafter pass (the block with 5 new context
   positions, through the target's LM head) and the selector: its parallel part (top-k,
   gate) and its sequential walk over the 7 positions. The cycle is estimated as the pass,
   the selector and the target's verify; the verify of the 54 GB target cannot run here, so
   it is the measured pass scaled by the weight bytes the two passes read (both process
   8 tokens). The script also checks that the selector is one lazy graph with no read-back
   to the host: it compiles (mx.compile refuses any evaluation inside), and gives the
   same tokens compiled and not.
2. On the CPU pair of long_context.py (build_models(512, 4): a random qwen3 target) with a
   DFlash2 drafter written for it (block 8), the cycle time of drafting k = 0..7 tokens
   (k = 0: a plain step) through ``dflash_mlx.decode.generate`` with a fixed-depth policy, and
   for per-position acceptance alpha the k that maximises expected tokens per second,
   E[k] / t(k) with E[k] = sum_{i=0..k} alpha^i.

    python bench/selector.py [--layers 5] [--context 256] [--reps 3]
                             [--prompt-tokens 1024] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

from common import CACHE, build_models, median_time, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.models import fixtures  # noqa: E402
from dflash_mlx.models.dflash2 import CODEBOOKS, DFlash2Args, DFlash2Drafter  # noqa: E402
from dflash_mlx.models.caches import trim_to  # noqa: E402
from dflash_mlx.decode.policy import DRAFTER, Plan  # noqa: E402

# The Qwen3.8-27B-DFlash2 column of the reference table (and its 64-layer target's count).
PUBLISHED = dict(hidden=5120, intermediate=17408, heads=32, kv_heads=8, head_dim=128, vocab=248320, layers=5,
                 target_layers=64, target_layer_ids=[5, 19, 33, 47, 61], mask=248070, block=8, rank=256, top_k=16)
TARGET_GB = 54.0  # Qwen3.8-27B in bf16


class HeadOnly:
    """The two target parts a drafter pass uses: the token embedding and the LM head (one matrix here)."""

    def __init__(self, weight: mx.array):
        self.weight = weight

    @property
    def dtype(self) -> mx.Dtype:
        return self.weight.dtype

    def embed(self, tokens: mx.array) -> mx.array:
        return self.weight[tokens]

    def lm_head(self, h: mx.array) -> mx.array:
        return h @ self.weight.T


def uniform(shape: tuple[int, ...], scale: float) -> mx.array:
    """Random bf16 weights (uniform: a third of the time normal draws take on this CPU)."""
    return mx.random.uniform(-scale, scale, shape).astype(mx.bfloat16)


def published_drafter(layers: int) -> DFlash2Drafter:
    """A random bf16 DFlash2 drafter at the published shapes, evaluated one layer at a time."""
    p = PUBLISHED
    target = dict(hidden_size=p["hidden"], num_hidden_layers=p["target_layers"], intermediate_size=p["intermediate"],
                  num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], vocab_size=p["vocab"],
                  rope_theta=1e7, max_position_embeddings=262144)
    config = fixtures.dflash2_config(target, layers, block_size=p["block"], sliding_window=2048, conv_group_size=16,
                                     selector_rank=p["rank"], selector_top_k=p["top_k"],
                                     target_layer_ids=p["target_layer_ids"], head_dim=p["head_dim"])
    config["dflash_config"]["mask_token_id"] = p["mask"]
    drafter = DFlash2Drafter(DFlash2Args.from_dict(config))  # parameters are lazy until evaluated
    drafter.set_dtype(mx.bfloat16)
    for part in [*drafter.layers, drafter.fc, drafter.hidden_norm, drafter.norm]:
        mx.eval(part.parameters())
    selector = drafter.candidate_selector
    for name in CODEBOOKS:  # random, so that the walk reorders candidates as a trained one does
        setattr(selector, name.split(".")[-1], uniform((p["vocab"], p["rank"]), 1.0))
    mx.eval(selector.parameters())
    return drafter


def walk(selector, candidates: mx.array, unary: mx.array, successors: mx.array, anchor: mx.array) -> mx.array:
    """The greedy walk alone, as ``CandidateSelector`` runs it, from its precomputed parallel part."""
    previous, drafts = anchor[0], []
    for j in range(candidates.shape[0]):
        scores = unary[j] + successors[j] @ selector.predecessor_codebook[previous].astype(mx.float32)
        previous = candidates[j, mx.argmax(scores)]
        drafts.append(previous)
    return mx.stack(drafts)


def published_shapes(args: argparse.Namespace) -> None:
    p = PUBLISHED
    n, new_context = p["block"] - 1, 5
    print(f"== 1. selector walk vs drafter pass at the published Qwen3.8-27B-DFlash2 shapes ==\n"
          f"hidden {p['hidden']}, {args.layers} layers, heads {p['heads']}/{p['kv_heads']}/{p['head_dim']}, "
          f"vocab {p['vocab']:,}, rank {p['rank']}, top-{p['top_k']}, block {p['block']} ({n} drafted), bf16, "
          f"random weights; context {args.context} positions, {new_context} new per pass", flush=True)
    tic = time.perf_counter()
    mx.random.seed(0)
    drafter = published_drafter(args.layers)
    head = HeadOnly(uniform((p["vocab"], p["hidden"]), 0.05))
    mx.eval(head.weight)
    params = dict(tree_flatten(drafter.parameters()))
    pass_bytes = sum(v.nbytes for k, v in params.items() if k not in CODEBOOKS) + head.weight.nbytes
    print(f"built in {time.perf_counter() - tic:.0f} s: drafter {sum(v.size for v in params.values()) / 1e9:.2f} B "
          f"params, {sum(v.nbytes for v in params.values()) / 1e9:.2f} GB (+ LM head {head.weight.nbytes / 1e9:.2f} GB)",
          flush=True)

    width = len(drafter.target_layer_ids) * p["hidden"]
    cache = drafter.make_cache(block_size=p["block"])
    for start in range(0, args.context, 128):
        drafter.add_context(mx.random.normal((1, min(128, args.context - start), width), dtype=mx.bfloat16), cache)
        mx.eval([c.state for c in cache])
    features = mx.random.normal((1, new_context, width), dtype=mx.bfloat16)
    anchor = mx.array([17])

    out: list[mx.array] = []

    def drafter_pass() -> None:
        h = drafter.draft_hidden(head, anchor, features, cache, n)
        logits = drafter.compute_logits(head.lm_head(h))
        mx.eval(h, logits)
        trim_to(cache, cache[0].offset - new_context)  # every repetition sees the same context
        out[:] = [h, logits]

    t_pass = median_time(drafter_pass, args.reps)
    h, logits = out
    selector = drafter.candidate_selector

    def parallel() -> tuple[mx.array, ...]:
        candidates = mx.argpartition(-logits, kth=selector.top_k - 1, axis=-1)[:, : selector.top_k]
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        gate = selector.hidden_projection(h).astype(mx.float32)
        successors = selector.successor_codebook[candidates].astype(mx.float32) * gate[:, None, :]
        mx.eval(candidates, unary, successors)
        return candidates, unary, successors

    parts = parallel()
    key = mx.random.key(1)
    t_parallel = median_time(parallel, 20)
    t_walk = median_time(lambda: mx.eval(walk(selector, *parts, anchor)), 20)
    t_greedy = median_time(lambda: mx.eval(selector(h, logits, anchor, 0.0, None).tokens), 20)
    t_sampled = median_time(lambda: mx.eval(selector(h, logits, anchor, 1.0, key).logprobs), 20)

    # One lazy graph: compiling traces the selector with placeholders, where any .item()/.tolist() would raise.
    eager = selector(h, logits, anchor, 0.0, None).tokens.tolist()
    greedy = mx.compile(lambda h, logits, anchor: selector(h, logits, anchor, 0.0, None).tokens)
    sampled = mx.compile(lambda h, logits, anchor, key: selector(h, logits, anchor, 1.0, key).tokens)
    assert greedy(h, logits, anchor).tolist() == eager == walk(selector, *parts, anchor).tolist()
    assert sampled(h, logits, anchor, key).tolist() == selector(h, logits, anchor, 1.0, key).tokens.tolist()
    print("one graph: the selector compiles (no host read inside the walk); compiled and eager tokens agree")

    ms = 1e3
    verify = t_pass * (TARGET_GB * 1e9 - head.weight.nbytes) / pass_bytes
    cycle = t_pass + t_greedy + verify
    print(f"drafter pass          {t_pass * ms:9.1f} ms  (block of {p['block']} + {new_context} context positions, LM head; "
          f"{pass_bytes / 1e9:.2f} GB of weights: {pass_bytes / t_pass / 1e9:.1f} GB/s on this CPU)")
    print(f"selector, T=0         {t_greedy * ms:9.2f} ms  (top-k + gate {t_parallel * ms:.2f} ms, walk {t_walk * ms:.2f} ms)")
    print(f"selector, T=1         {t_sampled * ms:9.2f} ms  (softmax and a draw per position)")
    print(f"walk / pass           {t_walk / t_pass:9.4%}   selector / pass {t_greedy / t_pass:.3%}")
    print(f"target verify (est.)  {verify * ms:9.1f} ms  = pass x {(TARGET_GB * 1e9 - head.weight.nbytes) / 1e9:.1f} GB "
          f"/ {pass_bytes / 1e9:.2f} GB (weights each 8-token pass reads; the embedding is gathered, not read)")
    print(f"walk / cycle          {t_walk / cycle:9.4%}   selector / cycle {t_greedy / cycle:.3%}  "
          f"(cycle = pass + selector + verify = {cycle * ms:.0f} ms)\n", flush=True)


class Depth:
    """A policy drafting exactly ``k`` tokens every cycle, keeping each full cycle's seconds."""

    def __init__(self, k: int):
        self.k, self.seconds = k, []

    def start(self) -> None:
        pass

    def plan(self, history) -> Plan:
        return Plan(self.k)

    def observe(self, plan: Plan, drafted: int, accepted: int, seconds: float, source: str = DRAFTER) -> None:
        if drafted == self.k:
            self.seconds.append(seconds)


def dflash2_pair(hidden: int, layers: int) -> tuple[Path, Path]:
    """build_models' random target and a DFlash2 drafter (block 8, published conv and selector sizes) for it."""
    folder = build_models(hidden, layers)
    draft = CACHE / f"random-h{hidden}-l{layers}-dflash2"
    if not draft.is_dir():
        config = json.loads((folder / "target" / "config.json").read_text())
        d2 = fixtures.dflash2_config(config, 2, block_size=8, sliding_window=2048, conv_group_size=16,
                                     selector_rank=256, selector_top_k=16, target_layer_ids=[1, layers - 2])
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # an interrupted build leaves no half cache
            fixtures.write_dflash2_drafter(Path(tmp) / "draft", d2)
            (Path(tmp) / "draft").rename(draft)
    return draft, folder / "target"


def runtime_block(args: argparse.Namespace) -> None:
    hidden, layers, depths = 512, 4, range(8)
    print(f"== 2. cycle time by drafted tokens k on the CPU pair (build_models({hidden}, {layers}), float32) ==")
    draft, target_path = dflash2_pair(hidden, layers)
    target, drafter, tokenizer = dflash_mlx.load(str(draft), str(target_path))
    assert isinstance(drafter, DFlash2Drafter) and drafter.block_size == 8
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    seconds: dict[int, list[float]] = {k: [] for k in depths}
    tokens: dict[int, list[int]] = {}

    def run(k: int, max_tokens: int) -> None:
        policy = Depth(k)
        out = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, eos_token_ids=[],
                                  policy=policy)
        seconds[k].extend(policy.seconds[2:])  # the first cycles warm up
        tokens[k] = out.tokens

    for k in depths:  # warm-up
        run(k, 8)
    for k in depths:
        seconds[k].clear()
    for r in range(args.repeats):
        for k in depths if r % 2 == 0 else reversed(depths):
            run(k, args.max_tokens)
    assert all(tokens[k] == tokens[0] for k in depths), "a depth changed the greedy output"
    t = {k: statistics.median(seconds[k]) for k in depths}
    print(f"prompt {args.prompt_tokens} tokens, {args.max_tokens} new, {args.repeats} run(s) per k in alternating order; "
          f"median cycle time; every k gave the same tokens")
    print("k              " + "".join(f"{k:>7}" for k in depths))
    print("cycle ms       " + "".join(f"{t[k] * 1e3:7.2f}" for k in depths))
    print("x plain step   " + "".join(f"{t[k] / t[0]:7.2f}" for k in depths))
    print("\nexpected tok/s relative to plain decoding, E[k] / t(k) x t(0), E[k] = sum_{i=0..k} alpha^i:")
    print("alpha          " + "".join(f"{k:>7}" for k in depths) + "   best k")
    for alpha in (0.5, 0.7, 0.85, 0.9):
        rate = {k: sum(alpha**i for i in range(k + 1)) / t[k] * t[0] for k in depths}
        best = max(rate, key=rate.get)
        print(f"{alpha:<15}" + "".join(f"{rate[k]:7.2f}" for k in depths) + f"   {best} ({rate[best]:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=PUBLISHED["layers"], help="draft layers at the published shapes")
    parser.add_argument("--context", type=int, default=256, help="context positions in the drafter's cache")
    parser.add_argument("--reps", type=int, default=3, help="timed drafter passes (medians)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per depth k (medians)")
    args = parser.parse_args()
    print_machine()
    print()
    published_shapes(args)
    mx.clear_cache()  # the 6 GB of section 1 went with its function
    runtime_block(args)


if __name__ == "__main__":
    main()
