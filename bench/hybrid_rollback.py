"""Rolling back GatedDeltaNet state after a verify: three exact methods, timed against the verify itself.

Hybrid targets (Qwen3.5/3.6, Qwen3-Next) keep a recurrent state per linear-attention
layer that cannot be trimmed. After a verify of B tokens keeps k, each state must
equal the state after exactly those k tokens. Methods:

  per-step   keep the state after every verify step and pick the k-th: the verify's
             recurrence runs one token at a time (as mlx-lm's ops path does anyway).
             Used where the recurrence runs as ops (CPU).
  replay     rerun only the recurrence over the k kept tokens from the previous state,
             with the q/k/v/gates the verify already computed. Used with mlx-lm's fused
             Metal kernel, where one kernel call over k tokens is cheap.
  relayer    restore a snapshot and run the layer's own GatedDeltaNet over the k kept
             inputs: projections, conv and recurrence again.

Each method's cost is (its verify + its rollback) minus mlx-lm's own verify forward,
as a fraction of the latter. The conv state is a slice of the conv input in all three.

It also measures the peak memory of a chunked prefill with and without replay
buffers (a prefill chunk is never rolled back, so the engine keeps none), and runs
plain decoding and DFlash side by side on the same hybrid target.

    python bench/hybrid_rollback.py [--hidden 1024] [--layers 8] [--block-size 16] [--max-tokens 64]
"""

from __future__ import annotations

from common import CACHE, median_time, plain, print_machine, prompt_ids  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.models import fixtures  # noqa: E402
from dflash_mlx.models.caches import RecurrentCache, trim_to  # noqa: E402


def build_hybrid(hidden: int, layers: int) -> Path:
    folder = CACHE / f"hybrid-h{hidden}-l{layers}"
    if folder.is_dir():
        return folder
    heads = hidden // 64
    config = fixtures.target_config(
        "qwen3_5", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=3 * hidden,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=32000,
        linear_num_value_heads=hidden // 64, linear_num_key_heads=hidden // 128, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, head_dim=128,
    )
    draft = fixtures.drafter_config(config, 2, target_layer_ids=[1, layers - 2], head_dim=hidden // heads)
    print(f"building random hybrid models in {folder} ...", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        fixtures.write_target(Path(tmp) / "pair" / "target", config, tokenizer_vocab=512)
        fixtures.write_drafter(Path(tmp) / "pair" / "draft", draft, dtype=mx.float32)
        (Path(tmp) / "pair").rename(folder)
    return folder


def prefill_peak(target, ids: list[int], chunk: int, undoable: bool) -> float:
    """Peak memory (GB) of prefilling ``ids`` in chunks, keeping each chunk's replay buffers or not."""
    cache = target.make_cache()
    mx.clear_cache()
    mx.reset_peak_memory()
    for start in range(0, len(ids), chunk):
        target(mx.array(ids[start : start + chunk])[None], cache, last_logits_only=True, undoable=undoable)
        mx.eval([c.state for c in cache])
    peak = mx.get_peak_memory() / 1e9
    del cache
    mx.clear_cache()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print_machine()
    folder = build_hybrid(args.hidden, args.layers)
    target, drafter, tokenizer = dflash_mlx.load(str(folder / "draft"), str(folder / "target"))
    B = args.block_size
    ids = prompt_ids(tokenizer, 256)
    block = mx.array([ids[:B]])
    linear = [i for i, k in enumerate(target.kinds) if k == "linear"]
    print(f"hybrid target: hidden {args.hidden}, {args.layers} layers ({len(linear)} GatedDeltaNet), block {B}\n")

    def prefilled(step_states: bool) -> tuple[list, list]:
        cache = target.make_cache(slack=B)
        for c in cache:
            if isinstance(c, RecurrentCache):
                c.step_states = step_states
        target(mx.array([ids]), cache)
        mx.eval([c.state for c in cache])
        return cache, [c.state for c in cache]

    def restore(cache: list, snapshot: list) -> None:
        for c, s in zip(cache, snapshot):
            c.state = s
            c.offset = len(ids)

    model_cache = target.model.make_cache()
    target.model(mx.array([ids]), cache=model_cache)
    mx.eval([c.state for c in model_cache])
    model_snapshot = [c.state for c in model_cache]

    def baseline() -> None:
        for c, s in zip(model_cache, model_snapshot):
            c.state = s
            if hasattr(c, "offset"):
                c.offset = len(ids)
        mx.eval(target.model(block, cache=model_cache), [c.state for c in model_cache])

    t_base = median_time(baseline)
    caches = {flag: prefilled(flag) for flag in (True, False)}
    linear_inputs = {i: mx.random.normal((1, B, args.hidden)) for i in linear}
    mx.eval(linear_inputs)
    rows = []
    for keep in (1, B // 2, B - 1):
        costs = {}
        for name, flag in (("per-step", True), ("replay", False)):
            cache, snapshot = caches[flag]

            def cycle() -> None:
                restore(cache, snapshot)
                logits, _ = target(block, cache)
                trim_to(cache, cache[0].offset - (B - keep))
                mx.eval(logits, [c.state for c in cache])

            costs[name] = median_time(cycle) - t_base
        cache, snapshot = caches[False]

        def relayer() -> None:
            restore(cache, snapshot)
            for i in linear:
                target.body.layers[i].linear_attn(linear_inputs[i][:, :keep], None, cache[i])
            mx.eval([cache[i].state for i in linear])

        costs["relayer"] = median_time(relayer) - median_time(lambda: restore(cache, snapshot))
        rows.append((keep, costs))

    print(f"mlx-lm verify forward over {B} tokens: {t_base * 1e3:.2f} ms")
    names = ("per-step", "replay", "relayer")
    print(f"{'kept':>5} | " + " | ".join(f"{n:>18}" for n in names))
    for keep, costs in rows:
        print(f"{keep:>5} | " + " | ".join(f"{costs[n] * 1e3:7.2f} ms {costs[n] / t_base:7.1%}" for n in names))

    long_ids = prompt_ids(tokenizer, 4096)
    kept, dropped = (prefill_peak(target, long_ids, 1024, undoable) for undoable in (True, False))
    print(f"\nprefill of {len(long_ids)} tokens in chunks of 1024, peak memory: replay buffers kept {kept:.3f} GB, "
          f"not kept (the engine) {dropped:.3f} GB ({dropped / kept - 1:+.1%})")

    dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=8, block_size=B, eos_token_ids=[])  # warm-up
    tokens, plain_tps, _ = plain(target.model, ids, args.max_tokens)
    result = dflash_mlx.generate(target, drafter, tokenizer, ids, max_tokens=args.max_tokens, block_size=B, eos_token_ids=[])
    print(f"\ndecode tok/s: plain {plain_tps:.1f}, dflash {result.generation_tps:.1f} "
          f"(ratio {result.generation_tps / plain_tps:.2f}, tau {result.tau:.2f}, random drafter); "
          f"tokens {'OK' if result.tokens == tokens else 'MISMATCH'}")


if __name__ == "__main__":
    main()
