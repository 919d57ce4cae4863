"""What every tested architecture must do, on a tiny checkpoint built through mlx-lm's own model class and loaded
back through the same path a download takes (``test_architectures_*.py`` run it, split so two workers share it)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Callable

from conftest import PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, batch_generate, generate, load
from dflash_mlx.decode.batch import Batch
from dflash_mlx.decode.transaction import make_cache
from dflash_mlx.models import fixtures

N = 64  # tokens a run decodes: many times any sliding window (8) and the --window below
WINDOW = 24

# The caches each architecture's fixture takes over, by kind (Target.kinds): the rollback chosen by cache type.
KINDS = {
    "llama": ["full"] * 4, "mistral": ["full"] * 4, "qwen2": ["full"] * 4, "qwen3": ["full"] * 4,
    "qwen3_moe": ["full"] * 4, "phi3": ["full"] * 4, "olmo2": ["full"] * 4, "granite": ["full"] * 4,
    "smollm3": ["full"] * 4, "glm4": ["full"] * 4, "minimax_m2": ["full"] * 4, "gemma2": ["full"] * 6,
    "deepseek_v2": ["full"] * 4, "deepseek_v3": ["full"] * 4, "kimi_k25": ["full"] * 4,
    "gpt_oss": ["sliding", "full"] * 2, "ministral3": ["sliding", "full"] * 2,
    "gemma3": ["sliding", "sliding", "full"] * 2, "gemma3_text": ["sliding", "sliding", "full"] * 2,
    "gemma4": ["sliding", "sliding", "full"], "gemma4_text": ["sliding", "sliding", "full"],  # 3 KV-shared layers
    "olmo3": ["sliding"] * 3 + ["full"], "exaone4": ["sliding"] * 3 + ["full"], "laguna": ["sliding"] * 3 + ["full"],
    "muse_glimmer": ["sliding"] * 3 + ["full"], "cohere2": ["sliding"] * 3 + ["full"] + ["sliding"] * 2,
    "qwen3_5": ["linear", "full"] * 2, "qwen3_5_moe": ["linear", "full"] * 2, "qwen3_next": ["linear", "full"] * 2,
    "lfm2": ["recurrent", "full"] * 2, "granitemoehybrid": ["recurrent", "full"] * 2,
    "nemotron_h": ["recurrent", "full", "recurrent"], "mamba2": ["recurrent"] * 4,
    "glm_moe_dsa": ["group"] * 4, "falcon_h1": ["group"] * 4,
}

# Attention layers only, yet decoded one request at a time: Gemma 2's attention reshapes its queries by KV head and
# broadcasts the mask against that, which a batch's per-row mask does not survive (``batch.batches`` finds it out).
UNBATCHED = {"gemma2"}


def build(root: Path, name: str) -> dict:
    """The architecture's target, a random drafter, and a looping copy of the target with a drafter of its most
    repeated token (drafts partly accepted)."""
    config = fixtures.target_config(name)
    layers = fixtures.text_config(config)["num_hidden_layers"]
    draft = fixtures.drafter_config(config, 2, target_layer_ids=[0, layers - 2])
    fixtures.write_target(root / name, config, seed=7)
    fixtures.write_drafter(root / f"{name}-random", draft)
    pair = load(str(root / f"{name}-random"), str(root / name))
    fixtures.write_target(root / f"{name}-loop", config, seed=7, init_scale=1.0)
    target, _, tokenizer = load(str(root / f"{name}-random"), str(root / f"{name}-loop"))
    ids = tokenizer.encode(PROMPTS[1])
    token = collections.Counter(plain_greedy(target.model, ids, N)).most_common(1)[0][0]
    fixtures.write_constant_drafter(root / f"{name}-constant", draft, root / f"{name}-loop", token)
    return {"random": pair, "constant": load(str(root / f"{name}-constant"), str(root / f"{name}-loop"))}


def on_demand(root: Path) -> Callable[[str], dict]:
    """``build`` each architecture's pair the first time a test asks for it, in ``root``."""
    built: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in built:
            built[name] = build(root, name)
        return built[name]
    return get


def check(pairs: dict, name: str) -> None:
    """Greedy dflash equals mlx-lm's greedy decoding: blocks of 4 and 16 rejected at once and partly accepted, a
    --window (or its one-line refusal), and rows decoded together (or one after another where the target does not
    batch)."""
    target, drafter, tokenizer = pairs["random"]
    assert target.kinds == KINDS[name]
    ids = tokenizer.encode(PROMPTS[0])
    ref = plain_greedy(target.model, ids, N)
    assert len(set(ref)) > 4, "a fixture that loops at once tests little"
    for block_size in (4, 16):
        out = generate(target, drafter, tokenizer, ids, max_tokens=N, block_size=block_size, eos_token_ids=[])
        assert out.tokens == ref, f"{name}: random drafter, block {block_size}"

    looping, constant, _ = pairs["constant"]
    loop_ids = tokenizer.encode(PROMPTS[1])
    loop_ref = plain_greedy(looping.model, loop_ids, N)
    for block_size in (4, 16):
        out = generate(looping, constant, tokenizer, loop_ids, max_tokens=N, block_size=block_size, eos_token_ids=[])
        assert out.tokens == loop_ref, f"{name}: partly accepted drafts, block {block_size}"
        assert max(out.acceptance) >= 1 and min(out.acceptance) < block_size - 1  # kept a part, rolled back the rest

    if "group" in target.kinds:
        try:
            generate(target, drafter, tokenizer, ids, max_tokens=4, window=WINDOW)
        except DFlashError as e:
            assert "--window" in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(f"{name}: --window was not refused")
    else:
        window_ref = plain_greedy(target.model, ids, N, prompt_cache=target.make_cache(WINDOW, 0, 1))
        out = generate(target, drafter, tokenizer, ids, max_tokens=N, block_size=16, eos_token_ids=[], window=WINDOW)
        assert out.tokens == window_ref, f"{name}: --window {WINDOW}"

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    together = batch_generate(target, drafter, tokenizer, prompts, max_tokens=N // 2, block_size=16, eos_token_ids=[])
    for prompt, result in zip(prompts, together):
        assert result.tokens == plain_greedy(target.model, prompt, N // 2), f"{name}: batched"
    batched = Batch.fits(target, make_cache(target, drafter))
    assert batched == (all(kind in ("full", "sliding", "linear") for kind in target.kinds) and name not in UNBATCHED)
