"""What the target's own forward costs against the hand-written one it replaced, per verify and per cycle.

The adapter runs mlx-lm's own ``model(tokens, cache)`` and taps its decoder layers and final
norm for the drafter's features (``dflash_mlx.models.target``). Before, it re-implemented
each family's forward (embedding, masks, layer loop, norm, head) to reach them. This script
keeps that hand-written loop as the baseline (``HandWritten``, the old ``Target.__call__``,
calling each layer's own class, untapped) and times both on the same loaded model, paired
and alternating in one process, for qwen3, llama and qwen3_5 (the hybrid keeps its
GatedDeltaNet layers run by hand in both):

  verify   one 16-token verify over a prompt, then the rollback to 6 kept tokens (the
           pass every cycle makes), repeated; median of each, and the median ratio of pairs
  cycle    a decode with a random drafter (mostly rejected: a cycle per token or two), block
           16, its seconds per cycle after the first token; median of each, and the median
           ratio of paired rounds

    python bench/target_path.py [--hidden 1024] [--layers 8] [--prompt-tokens 256] [--reps 40] [--rounds 8]
"""

from __future__ import annotations

from common import CACHE, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generation_stream  # noqa: E402
from mlx_lm.models.base import create_attention_mask  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.models import fixtures  # noqa: E402
from dflash_mlx.models.target import Target, _gated_delta_net  # noqa: E402


class HandWritten(Target):
    """The adapter before this change: the family's forward written out (embedding, masks by layer kind, the layer
    loop with GatedDeltaNet layers by hand, final norm, head), each layer called as its own class."""

    def __call__(self, tokens: mx.array, cache: list[Any], last_logits_only: bool = False, undoable: bool = True
                 ) -> tuple[mx.array, mx.array]:
        h = self.embedding(tokens)
        masks: dict[str, Any] = {}
        for i, kind in enumerate(self.kinds):
            if kind not in masks:
                masks[kind] = None if kind == "linear" else create_attention_mask(h, cache[i])
        captured = {}
        for i, (layer, c, kind) in enumerate(zip(self.layers, cache, self.kinds)):
            if kind == "linear":
                h = h + _gated_delta_net(layer.linear_attn, layer.input_layernorm(h), c, undoable)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = type(layer)._dflash_base.__call__(layer, h, masks[kind], c)
            if i in self._capture:
                captured[i] = h
        norm = type(self.norm)._dflash_base.__call__
        h = norm(self.norm, h[:, -1:] if last_logits_only else h)
        logits = self.lm_head(h)
        return logits, mx.concatenate([captured[i] for i in self.layer_ids], axis=-1)


def build(model_type: str, hidden: int, layers: int) -> Path:
    folder = CACHE / f"path-{model_type}-h{hidden}-l{layers}"
    if folder.is_dir():
        return folder
    heads = hidden // 64
    extra: dict[str, Any] = {}
    if model_type == "qwen3_5":
        extra = dict(linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2), linear_key_head_dim=128,
                     linear_value_head_dim=128, full_attention_interval=4, head_dim=128)
    config = fixtures.target_config(model_type, hidden_size=hidden, num_hidden_layers=layers,
                                    intermediate_size=3 * hidden, num_attention_heads=heads,
                                    num_key_value_heads=max(1, heads // 2), vocab_size=32000,
                                    tie_word_embeddings=model_type == "llama", **extra)
    draft = fixtures.drafter_config(config, 2, target_layer_ids=[1, layers - 2], head_dim=64)
    print(f"building random {model_type} models in {folder} ...", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        fixtures.write_target(Path(tmp) / "pair" / "target", config, tokenizer_vocab=512)
        fixtures.write_drafter(Path(tmp) / "pair" / "draft", draft, dtype=mx.float32)
        (Path(tmp) / "pair").rename(folder)
    return folder


def verify_pass(target: Target, ids: list[int]) -> Callable[[], None]:
    """One 16-token verify on the caches and the rollback to 6 of its tokens (the context grows by 6 a pass)."""
    cache = target.make_cache()
    with mx.stream(generation_stream):
        target(mx.array(ids)[None], cache, last_logits_only=True, undoable=False)
    mx.eval([c.state for c in cache])
    block = mx.array(ids[-16:])[None]

    def run() -> None:
        length = cache[0].offset
        with mx.stream(generation_stream):
            logits, features = target(block, cache)
            verdict = mx.argmax(logits[0], axis=-1)
        mx.eval(verdict, features)
        target.rewind(cache, length + 6)
        mx.eval([c.state for c in cache])
    return run


def timed(fn: Callable[[], None]) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--models", default="qwen3,llama,qwen3_5")
    args = parser.parse_args()
    print_machine()
    print(f"float32 random models, hidden {args.hidden}, {args.layers} layers, {args.prompt_tokens}-token prompt\n")
    print(f"{'model':<9} {'verify own':>11} {'hand':>9} {'own/hand':>9}   {'cycle own':>10} {'hand':>9} {'own/hand':>9}")
    for model_type in args.models.split(","):
        folder = build(model_type, args.hidden, args.layers)
        own, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
        hand = HandWritten(own.model, drafter.target_layer_ids)
        ids = prompt_ids(tokenizer, args.prompt_tokens)
        passes = {"own": verify_pass(own, ids), "hand": verify_pass(hand, ids)}
        for fn in passes.values():
            fn()
        times: dict[str, list[float]] = {"own": [], "hand": []}
        for rep in range(args.reps):
            for name in (("own", "hand") if rep % 2 else ("hand", "own")):
                times[name].append(timed(passes[name]))
        pair_ratio = statistics.median(a / b for a, b in zip(times["own"], times["hand"]))
        cycles: dict[str, list[float]] = {"own": [], "hand": []}
        outputs = {}
        for r in range(args.rounds):
            for name, target in ((("own", own), ("hand", hand)) if r % 2 else (("hand", hand), ("own", own))):
                cycles[name].append(seconds_per_cycle(target, drafter, tokenizer, ids, args.max_tokens, outputs, name))
        assert outputs["own"] == outputs["hand"], "the two paths decoded different tokens"
        cycle_ratio = statistics.median(a / b for a, b in zip(cycles["own"], cycles["hand"]))
        v, c = {k: statistics.median(t) for k, t in times.items()}, {k: statistics.median(t) for k, t in cycles.items()}
        print(f"{model_type:<9} {v['own'] * 1e3:>9.2f}ms {v['hand'] * 1e3:>7.2f}ms {pair_ratio:>9.3f}   "
              f"{c['own'] * 1e3:>8.2f}ms {c['hand'] * 1e3:>7.2f}ms {cycle_ratio:>9.3f}")
    print("\nown/hand: the median ratio of paired runs (verify+rollback passes; whole decodes, prefill left out).")


def seconds_per_cycle(target: Target, drafter: Any, tokenizer: Any, ids: list[int], max_tokens: int,
                      outputs: dict[str, list[int]], name: str) -> float:
    """A decode's seconds per cycle after its first token (the prefill left out); its tokens go to ``outputs``."""
    tokens, first, cycles = [], 0.0, 0
    for response in dflash_mlx.stream_generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=16,
                                               eos_token_ids=[]):
        if not tokens:
            first = time.perf_counter()
        else:
            cycles += 1
        tokens.extend(response.tokens)
    outputs[name] = tokens
    return (time.perf_counter() - first) / cycles


if __name__ == "__main__":
    main()
