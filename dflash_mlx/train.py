"""Train a DFlash drafter for a target, in MLX: the published recipe, both published bugs avoided.

Pipeline. Prompts (a JSONL file or the built-in list) are split once into training and
held-out sets. The target answers each training prompt greedily; those token ids are cached
in ``OUT/data.json``, so a resumed run never regenerates them. Each step runs the frozen
target over a few sequences for their features, cuts many blocks [anchor token, MASK x (B-1)]
out of each response, drafts all blocks of a sequence in one pass of the very ``Drafter``
inference uses (``drafter.Blocks``: an explicit mask per layer window keeps blocks apart and
hides the context from the anchor on), and scores block positions 1..B-1 through the target's frozen LM head. The result is a
z-lab layout checkpoint in OUT, measured by tau on the held-out prompts.

Choices the paper leaves open:

- Initialisation. The drafter's output goes through the target's LM head and its context K/V
  come from normalised target features, so the draft layers start as copies of the target
  layers right after the last feature layer (the last ``layers`` layers when fewer follow),
  by parameter name where shapes fit (quantized weights dequantized; an MoE MLP or a
  linear-attention block does not fit and keeps MLX's default init). ``hidden_norm`` copies
  the first source layer's ``input_layernorm``: with one feature layer the context K/V then
  start out exactly as that target layer computes them. ``fc`` starts as the average of the
  feature slices, ``norm`` as the target's final norm (the LM head reads its output).
- Mask token. A special token named like a mask, else the pad token, else one named
  unused/reserved, else the last vocabulary id; never an EOS id, and never a token whose
  embedding is all zeros (RMSNorm keeps zeros zero: every MASK position would get the same
  query and the block could not tell its positions apart).
- RoPE. Each block is rotated by the drafter's own rope module with its anchor as offset
  (``mx.fast.rope`` takes one offset per batch row, so blocks become rows), and context keys
  from 0: positions are the inference positions by construction.
- Schedule. The learning rate is a function of the fraction of training done (steps done /
  steps, or seconds spent / time_budget): linear warmup from 10% over the first 4%, then
  cosine to 0. One rule serves step and time budgets alike.
- Determinism. Each step draws its sequences and anchors from a generator seeded by
  (seed, step), so a checkpoint needs only its step count to resume the same stream.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.generate import BatchGenerator

from .drafter import Blocks, Drafter, DrafterArgs, default_target_layer_ids
from .chat_template import prompt_ids, user
from .errors import DFlashError
from .files import write_atomic
from .bench import degenerate
from .generate import generate
from .loader import cast_floats, check_pair, load_drafter, load_target, resolve
from .target import Target

Prompt = Union[str, list[dict[str, str]]]
Progress = Callable[[dict[str, Any]], None]

BUILTIN_PROMPTS: tuple[str, ...] = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Implement binary search in JavaScript and explain its complexity.",
    "What does the `git rebase` command do, and when should I avoid it?",
    "Write a bash one-liner that counts the lines of every .py file in a directory tree.",
    "Write a C function that reverses a linked list in place.",
    "How do I read a CSV file with pandas and compute the mean of one column?",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h?",
    "What is the derivative of x^3 * sin(x)?",
    "Prove that the sum of two even numbers is even.",
    "If a shirt costs $40 after a 20% discount, what was the original price?",
    "How many ways can 5 books be arranged on a shelf?",
    "Compute the integral of 1/(1 + x^2) from 0 to 1.",
    "Give me three tips for staying focused while working from home.",
    "Write a short, friendly email declining a meeting invitation.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "What are the main differences between a cold and the flu?",
    "Suggest a three-day itinerary for a first visit to Rome.",
    "Write a haiku about autumn rain.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What is the capital of Australia, and why was it chosen?",
    "Translate 'Where is the nearest train station?' into French and Spanish.",
)

WARMUP = 0.04  # share of training spent warming up
GRAD_CLIP = 1.0
CHECKPOINT = "checkpoint"
REPLY_BATCH = 32  # replies generated at once


@dataclass
class TrainResult:
    loss: Optional[float]  # the last step's loss (None if no step ever ran)
    steps: int  # steps done in total, across resumes
    tokens_per_s: float  # supervised block positions per second of training, this call
    tau: Optional[float]  # tokens per verify cycle on held-out prompts (None: not measured)
    output: Path  # the drafter folder, loadable with dflash_mlx.load(output, target)
    losses: list[float] = field(default_factory=list)  # every step's loss, across resumes
    looping: int = 0  # held-out replies that loop on a short span, where tau measures the loop, not the drafter
    evaluated: int = 0  # held-out replies measured


# --- data -----------------------------------------------------------------------------------


def _parse_prompt(row: Any, where: str) -> Prompt:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return row["prompt"]
    messages = row.get("messages") if isinstance(row, dict) else None
    if isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        # A trailing assistant turn is dropped: the target writes its own reply.
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if messages:
            return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise DFlashError(
        f'{where}: expected {{"prompt": "..."}} or {{"messages": [{{"role": ..., "content": ...}}, ...]}}'
    )


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts from a JSONL file, one ``{"prompt": ...}`` or ``{"messages": [...]}`` per line."""
    if not path.is_file():
        raise DFlashError(f"prompt file {path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DFlashError(f"prompt file {path} is not UTF-8 text ({e.reason})") from None
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path} line {n} is not valid JSON ({e.msg})") from None
        prompts.append(_parse_prompt(row, f"{path} line {n}"))
    if not prompts:
        raise DFlashError(f"prompt file {path} is empty: expected one JSON object per line")
    return prompts


def split_prompts(prompts: Sequence[Prompt], eval_prompts: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held-out): a seeded shuffle, with max(eval_prompts, 10%) prompts held out."""
    held = max(eval_prompts, math.ceil(0.1 * len(prompts)))
    if held >= len(prompts):
        raise DFlashError(
            f"{len(prompts)} prompts leave none to train on once {held} are held out for evaluation: "
            f"give more than {held} prompts (or, from Python, a lower eval_prompts)"
        )
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order[held:]], [prompts[i] for i in order[:held]]


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids as the target is asked it: through its chat template when it has one."""
    return prompt_ids(tokenizer, user(prompt) if isinstance(prompt, str) else prompt)


def respond(
    model: nn.Module, prompts: list[list[int]], max_tokens: int, eos: frozenset[int], progress: Progress
) -> list[list[int]]:
    """The target's greedy replies, EOS included so the drafter also learns to end a reply.

    Generated in batches by mlx-lm's ``BatchGenerator`` (several times the throughput of
    one prompt at a time; same tokens on the fixture pair).
    """
    generator = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[t] for t in sorted(eos)],
                               completion_batch_size=REPLY_BATCH)
    try:
        uids = generator.insert(prompts)
        replies: dict[int, list[int]] = {uid: [] for uid in uids}
        done = 0
        while responses := generator.next_generated():
            for r in responses:
                replies[r.uid].append(int(r.token))  # on a "stop" finish this is the EOS token
                if r.finish_reason is not None:
                    done += 1
                    progress({"phase": "generate", "done": done, "total": len(prompts)})
    finally:
        generator.close()
    return [replies[uid] for uid in uids]


def prepare_data(
    out: Path, model: nn.Module, tokenizer: Any, train_prompts: list[Prompt], held_out: list[Prompt],
    response_tokens: int, key: dict[str, Any], progress: Progress,
) -> dict[str, Any]:
    """Training sequences (prompt and response ids) and held-out prompt ids, cached in OUT/data.json.

    ``key`` names everything the data depends on; a cache made under another key is remade.
    """
    path = out / "data.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached
    ids = [encode(tokenizer, p) for p in train_prompts]
    replies = respond(model, ids, response_tokens, frozenset(tokenizer.eos_token_ids), progress)
    train = [{"prompt": p, "response": r} for p, r in zip(ids, replies)]
    data = {"key": key, "train": train, "eval": [encode(tokenizer, p) for p in held_out]}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data))
    return data


# --- the objective --------------------------------------------------------------------------


def pick_mask_token(tokenizer: Any, target: Target) -> int:
    """The MASK id: a mask-like special, pad, an unused/reserved special, else the last id (see module doc)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {i: getattr(t, "content", str(t)).lower() for i, t in added.items()}

    def named(*words: str) -> list[int]:
        return [i for i, name in sorted(specials.items()) if any(w in name for w in words)]

    eos = set(tokenizer.eos_token_ids)
    for token in named("mask") + [tokenizer.pad_token_id] + named("unused", "reserved") + [target.vocab_size - 1]:
        if token is None or token in eos or not 0 <= token < target.vocab_size:
            continue
        if mx.any(target.embed(mx.array([token])) != 0).item():
            return int(token)
    raise DFlashError("found no usable mask token: every candidate is an EOS token or has an all-zero embedding")


def loss_gamma(block_size: int) -> float:
    """Decay of the position weights: the published 4, 5, 7 at B = 8, 10, 16, linear between, held beyond."""
    return float(np.interp(block_size, [8, 10, 16], [4.0, 5.0, 7.0]))


def position_weights(block_size: int) -> mx.array:
    """exp(-(k-1)/gamma) for k = 1..B-1: early positions matter most, as acceptance stops at the first miss."""
    k = mx.arange(1, block_size, dtype=mx.float32)
    return mx.exp(-(k - 1) / loss_gamma(block_size))


def sample_anchors(rng: np.random.Generator, prompt_len: int, seq_len: int, block_size: int, n: int) -> np.ndarray:
    """``n`` sorted anchors in the response whose whole block fits (a + B - 1 < seq_len).

    Without replacement when the response has room for ``n``, else with (short replies
    still give full-sized batches).
    """
    valid = np.arange(prompt_len, seq_len - block_size + 1)
    return np.sort(rng.choice(valid, size=n, replace=len(valid) < n))


def block_labels(seq: Sequence[int], anchors: Sequence[int], block_size: int) -> np.ndarray:
    """[N, B-1]: block position k (1..B-1) predicts seq[anchor + k] (not anchor + k + 1)."""
    return np.asarray(seq)[np.asarray(anchors)[:, None] + np.arange(1, block_size)]


@dataclass
class Batch:
    features: mx.array  # [S, L, F] frozen target features, zero-padded to the longest sequence
    embeddings: mx.array  # [S, N*B, H] the target's embeddings of the blocks
    anchors: np.ndarray  # [S, N] each block's first position
    labels: mx.array  # [S, N, B-1]

    @property
    def tokens(self) -> int:
        return self.labels.size


def make_batch(
    target: Target, sequences: list[tuple[list[int], list[int]]], rng: np.random.Generator,
    anchors: int, block_size: int, mask_token: int,
) -> Batch:
    """Blocks cut from (prompt, response) pairs, with the target's features of each whole sequence.

    Padding never leaks: it lies beyond every anchor, so the mask hides it.
    """
    length = max(len(p) + len(r) for p, r in sequences)
    features, blocks, rows, labels = [], [], [], []
    for prompt, response in sequences:
        seq = prompt + response
        _, f = target(mx.array(seq)[None], target.make_cache(), last_logits_only=True)
        features.append(mx.pad(f[0], [(0, length - len(seq)), (0, 0)]))
        a = sample_anchors(rng, len(prompt), len(seq), block_size, anchors)
        block = np.full((anchors, block_size), mask_token)
        block[:, 0] = np.asarray(seq)[a]
        blocks.append(block.reshape(-1))
        rows.append(a)
        labels.append(block_labels(seq, a, block_size))
    return Batch(
        features=mx.stop_gradient(mx.stack(features)).astype(mx.float32),
        embeddings=mx.stop_gradient(target.embed(mx.array(np.stack(blocks)))).astype(mx.float32),
        anchors=np.stack(rows),
        labels=mx.array(np.stack(labels)),
    )


def block_loss(drafter: Drafter, target: Target, batch: Batch, weights: mx.array) -> mx.array:
    """Position-weighted cross-entropy of block positions 1..B-1 through the target's frozen LM head."""
    S, N, k = batch.labels.shape
    blocks = Blocks(batch.anchors, batch.features.shape[1], k + 1)
    h = drafter(batch.embeddings, batch.features, blocks)  # the inference modules, with training's masks
    h = h.reshape(S, N, k + 1, -1)[:, :, 1:]
    logits = drafter.compute_logits(target.lm_head(h.astype(target.dtype))).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, batch.labels)
    return (ce * weights).sum(-1).mean() / weights.sum()


def learning_rate(progress: float, peak: float) -> float:
    """Linear warmup from 10% of ``peak`` over the first 4% of training, then cosine to 0."""
    if progress < WARMUP:
        return peak * (0.1 + 0.9 * progress / WARMUP)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - WARMUP) / (1 - WARMUP))))


# --- the drafter ----------------------------------------------------------------------------


def draft_config(target: Target, layers: int, block_size: int, layer_ids: list[int], mask_token: int) -> dict[str, Any]:
    """A z-lab style config.json for a drafter of ``target``'s shapes and rope."""
    a = target.lm.args
    rope_scaling = getattr(a, "rope_scaling", None) or {}
    rope_type = rope_scaling.get("type") or rope_scaling.get("rope_type", "default")
    if rope_type == "dynamic":
        raise DFlashError("targets with dynamic NTK rope scaling cannot be trained for yet (positions vary per block)")
    theta = getattr(a, "rope_theta", None) or (getattr(a, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token, "target_layer_ids": list(layer_ids)},
        "num_target_layers": target.num_layers,
        "num_hidden_layers": layers,
        "hidden_size": target.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": getattr(a, "head_dim", None) or target.hidden_size // a.num_attention_heads,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling if rope_type != "default" else None,
        "max_position_embeddings": getattr(a, "max_position_embeddings", None) or 40960,
        "layer_types": ["full_attention"] * layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": bool(getattr(a, "tie_word_embeddings", False)),
        "dtype": str(target.dtype).split(".")[-1],
    }


def _dense_weights(module: nn.Module) -> dict[str, mx.array]:
    """A module's float weights by name, quantized linear layers dequantized."""
    weights = {k: v for k, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    for name, m in module.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            weights[f"{name}.weight"] = mx.dequantize(
                m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode
            )
    return weights


def _copy_matching(dst: nn.Module, src: dict[str, mx.array]) -> None:
    own = tree_flatten(dst.parameters())
    fitting = [(k, src[k].astype(v.dtype)) for k, v in own if k in src and src[k].shape == v.shape]
    dst.load_weights(fitting, strict=False)


def init_from_target(drafter: Drafter, target: Target) -> list[int]:
    """Start from the target's own weights where shapes fit (see module doc); returns the source layers."""
    n, layers = target.num_layers, len(drafter.layers)
    start = max(0, min(drafter.target_layer_ids[-1] + 1, n - layers))
    sources = [min(start + i, n - 1) for i in range(layers)]
    for layer, j in zip(drafter.layers, sources):
        _copy_matching(layer, _dense_weights(target.body.layers[j]))
    first = _dense_weights(target.body.layers[sources[0]])
    if "input_layernorm.weight" in first:
        _copy_matching(drafter.hidden_norm, {"weight": first["input_layernorm.weight"]})
    _copy_matching(drafter.norm, _dense_weights(target.body.norm))
    n_features, hidden = len(drafter.target_layer_ids), drafter.args.hidden_size
    drafter.fc.weight = mx.concatenate([mx.eye(hidden) / n_features] * n_features, axis=1)
    return sources


def save_checkpoint(folder: Path, drafter: Drafter, optimizer: optim.Optimizer, state: dict[str, Any]) -> None:
    """Weights and optimizer state under the step's name, then state.json naming them (the commit point)."""
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{state['step']:08d}"
    write_atomic(folder / f"drafter-{tag}.safetensors",
            lambda p: mx.save_safetensors(str(p), dict(tree_flatten(drafter.parameters()))))
    write_atomic(folder / f"optimizer-{tag}.safetensors",
            lambda p: mx.save_safetensors(str(p), dict(tree_flatten(optimizer.state))))
    write_atomic(folder / "state.json", json.dumps(dict(state, tag=tag)))
    for f in folder.glob("*.safetensors"):
        if not f.name.endswith(f"-{tag}.safetensors"):
            f.unlink()


def read_checkpoint_state(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "state.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"cannot read the checkpoint in {folder} ({e})") from None


def load_checkpoint(folder: Path, drafter: Drafter, optimizer: optim.Optimizer) -> dict[str, Any]:
    """Restore weights and optimizer state (AdamW moments, step) exactly as saved; returns the state."""
    state = read_checkpoint_state(folder)
    tag = state["tag"]
    try:
        drafter.load_weights(str(folder / f"drafter-{tag}.safetensors"), strict=True)
        optimizer.state = tree_unflatten(list(mx.load(str(folder / f"optimizer-{tag}.safetensors")).items()))
    except (OSError, ValueError, RuntimeError) as e:
        raise DFlashError(f"cannot restore the checkpoint in {folder} ({str(e).splitlines()[0]})") from None
    return state


def export(out: Path, drafter: Drafter, config: dict[str, Any]) -> None:
    """config.json and model.safetensors in the published layout, weights in the target's dtype."""
    dtype = getattr(mx, config["dtype"])
    weights = {k: v.astype(dtype) for k, v in tree_flatten(drafter.parameters())}
    write_atomic(out / "model.safetensors", lambda p: mx.save_safetensors(str(p), weights, metadata={"format": "mlx"}))
    write_atomic(out / "config.json", json.dumps(config, indent=1))


def evaluate(
    target: Target, tokenizer: Any, out: Path, prompts: list[list[int]], block_size: int, max_tokens: int,
    progress: Progress,
) -> tuple[Optional[float], int]:
    """tau of the exported drafter on ``prompts`` (None: no cycle ran), loaded as ``dflash_mlx.load`` loads it,
    and how many of the target's replies loop (``bench.degenerate``): drafts of a loop are accepted whatever
    the drafter learnt, so a target that only loops makes any tau look good."""
    drafter = load_drafter(out)
    check_pair(target, drafter)
    drafter.update(cast_floats(drafter.parameters(), target.dtype))
    emitted = cycles = looping = 0
    for i, ids in enumerate(prompts):
        result = generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=block_size)
        emitted += sum(a + 1 for a in result.acceptance)
        cycles += result.cycles
        looping += degenerate(result.tokens)
        progress({"phase": "eval", "done": i + 1, "total": len(prompts)})
    return (emitted / cycles if cycles else None), looping


# --- the entry point ------------------------------------------------------------------------


def _check_args(
    layers: int, block_size: int, target_layer_ids: Optional[list[int]], steps: Optional[int],
    time_budget: Optional[float], lr: float, batch_size: int, anchors: int, response_tokens: int,
    eval_prompts: int, checkpoint_every: int,
) -> Optional[int]:
    """Validate the settings; returns the step budget (200 when neither budget is given)."""
    if steps is not None and time_budget is not None:
        raise DFlashError("give either steps or time_budget, not both")
    if steps is None and time_budget is None:
        steps = 200
    # Settings the CLI has flags for are named by their flags: most users meet these messages there.
    if steps is not None and steps < 1:
        raise DFlashError(f"--steps must be >= 1, got {steps}")
    if time_budget is not None and not time_budget > 0:
        raise DFlashError(f"--time must be a positive duration, got {time_budget:g} seconds")
    if layers < 1:
        raise DFlashError(f"--layers must be >= 1, got {layers}")
    if block_size < 2:
        raise DFlashError(f"--block-size must be >= 2 (an anchor and at least one token to draft), got {block_size}")
    if target_layer_ids is not None and not target_layer_ids:
        raise DFlashError("--target-layer-ids is empty: give at least one target layer")
    for name, value in (("--batch-size", batch_size), ("anchors", anchors), ("checkpoint_every", checkpoint_every)):
        if value < 1:
            raise DFlashError(f"{name} must be >= 1, got {value}")
    if response_tokens < block_size:
        raise DFlashError(f"response_tokens ({response_tokens}) must be at least the block size ({block_size})")
    if eval_prompts < 0:
        raise DFlashError(f"eval_prompts must be >= 0, got {eval_prompts}")
    if not lr > 0:
        raise DFlashError(f"--lr must be positive, got {lr}")
    return steps


FLAGS = {"layers": "--layers", "block_size": "--block-size", "target_layer_ids": "--target-layer-ids",
         "batch_size": "--batch-size", "lr": "--lr"}


def _setting(name: str, value: Any) -> str:
    """A saved setting as the user gave it: a flag where the CLI has one, else the train() argument."""
    if name == "prompts":
        return "other --prompts"
    if name == "target":
        return "another target"
    if name in FLAGS:
        return f"{FLAGS[name]} {','.join(map(str, value)) if isinstance(value, list) else value}"
    return f"{name}={value!r}"


def saved_step(out: str) -> Optional[int]:
    """The step of OUT's training checkpoint (None: there is none): what --resume would continue from."""
    checkpoint = Path(out).expanduser() / CHECKPOINT
    return read_checkpoint_state(checkpoint)["step"] if (checkpoint / "state.json").is_file() else None


def train(
    target: str,
    out: str,
    *,
    prompts: Optional[str] = None,
    layers: int = 1,
    block_size: int = 16,
    target_layer_ids: Optional[list[int]] = None,
    steps: Optional[int] = None,
    time_budget: Optional[float] = None,
    lr: float = 6e-4,
    batch_size: int = 4,
    anchors: int = 32,
    response_tokens: int = 128,
    resume: bool = False,
    seed: int = 0,
    eval_prompts: int = 4,
    checkpoint_every: int = 50,
    progress: Optional[Progress] = None,
) -> TrainResult:
    """Train a DFlash drafter for ``target`` (a folder or Hub repo id) into the folder ``out``.

    ``steps`` or ``time_budget`` (seconds of training, data generation and evaluation not
    counted) is the budget of the whole run, resumes included. Every ``checkpoint_every``
    steps and at the end, ``out/checkpoint`` is rewritten; ``resume=True`` continues it with
    the settings it was made with (changing any but the budget is an error). ``progress``
    receives dicts with a ``phase``: "generate" (done, total), "train" (step, steps, progress,
    loss, lr, tokens_per_s, elapsed), "eval" (done, total) and finally "done" (the result's
    fields).
    """
    steps = _check_args(layers, block_size, target_layer_ids, steps, time_budget, lr, batch_size, anchors,
                        response_tokens, eval_prompts, checkpoint_every)
    report = progress or (lambda info: None)
    out_dir = Path(out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise DFlashError(f"output {out_dir} is a file; expected a folder")
    checkpoint = out_dir / CHECKPOINT
    if (checkpoint / "state.json").is_file() and not resume:
        raise DFlashError(
            f"{out_dir} already holds a training checkpoint: add --resume to continue it, or choose another folder"
        )
    if resume and not (checkpoint / "state.json").is_file():
        raise DFlashError(f"{out_dir} holds no training checkpoint to resume; run without --resume")
    prompt_list = read_prompts(Path(prompts).expanduser()) if prompts is not None else list(BUILTIN_PROMPTS)

    model, tokenizer = load_target(resolve(target, "target"))
    n_layers = Target(model, []).num_layers
    layer_ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(n_layers, layers)
    tgt = Target(model, layer_ids)
    key = {
        "prompts": hashlib.sha256(json.dumps(prompt_list).encode()).hexdigest(),
        "eval_prompts": eval_prompts, "seed": seed, "response_tokens": response_tokens,
        "target": [tgt.num_layers, tgt.hidden_size, tgt.vocab_size],
    }
    settings = dict(key, layers=layers, block_size=block_size, target_layer_ids=layer_ids,
                    batch_size=batch_size, anchors=anchors, lr=lr)
    saved = read_checkpoint_state(checkpoint) if resume else None
    if saved is not None:
        changed = [k for k in settings if saved["settings"].get(k) != settings[k]]
        if changed:
            was = ", ".join(_setting(k, saved["settings"].get(k)) for k in changed)
            raise DFlashError(f"{out_dir} was trained with {was}: resume with the same settings")

    train_prompts, held_out = split_prompts(prompt_list, eval_prompts, seed)
    data = prepare_data(out_dir, model, tokenizer, train_prompts, held_out, response_tokens, key, report)
    sequences = [(s["prompt"], s["response"]) for s in data["train"] if len(s["response"]) >= block_size]
    if not sequences:
        raise DFlashError(
            f"every reply of the target is shorter than the block size ({block_size}): "
            "lower --block-size (or, from Python, raise response_tokens)"
        )

    if saved:
        config = saved["config"]
    else:
        config = draft_config(tgt, layers, block_size, layer_ids, pick_mask_token(tokenizer, tgt))
    mx.random.seed(seed)
    drafter = Drafter(DrafterArgs.from_dict(config))
    optimizer = optim.AdamW(learning_rate=lr)
    if saved:
        state = load_checkpoint(checkpoint, drafter, optimizer)
    else:
        init_from_target(drafter, tgt)
        state = {"step": 0, "elapsed": 0.0, "losses": [], "settings": settings, "config": config}
    mask_token = drafter.mask_token_id

    weights = position_weights(block_size)
    loss_and_grad = nn.value_and_grad(drafter, lambda batch: block_loss(drafter, tgt, batch, weights))

    def done_fraction() -> float:
        return state["step"] / steps if steps is not None else state["elapsed"] / time_budget

    tokens, seconds = 0, 0.0
    # The state after the last completed step (arrays are immutable: holding them costs no copy),
    # so that Ctrl-C mid-step still checkpoints a consistent step and loses nothing.
    good = (drafter.parameters(), tree_map(lambda x: x, optimizer.state), json.loads(json.dumps(state)))
    try:
        while done_fraction() < 1:
            tic = time.perf_counter()
            rng = np.random.default_rng([seed, state["step"]])
            picks = rng.choice(len(sequences), size=min(batch_size, len(sequences)), replace=False)
            batch = make_batch(tgt, [sequences[i] for i in picks], rng, anchors, block_size, mask_token)
            rate = learning_rate(done_fraction(), lr)
            optimizer.learning_rate = rate
            loss, grads = loss_and_grad(batch)
            grads, _ = optim.clip_grad_norm(grads, GRAD_CLIP)
            optimizer.update(drafter, grads)
            mx.eval(drafter.parameters(), optimizer.state, loss)
            elapsed = time.perf_counter() - tic
            state["step"] += 1
            state["elapsed"] += elapsed
            state["losses"].append(loss.item())
            good = (drafter.parameters(), tree_map(lambda x: x, optimizer.state), json.loads(json.dumps(state)))
            tokens, seconds = tokens + batch.tokens, seconds + elapsed
            if state["step"] % checkpoint_every == 0 or done_fraction() >= 1:
                save_checkpoint(checkpoint, drafter, optimizer, state)
            report({
                "phase": "train", "step": state["step"], "steps": steps, "progress": min(1.0, done_fraction()),
                "loss": state["losses"][-1], "lr": rate, "tokens_per_s": tokens / seconds, "elapsed": state["elapsed"],
            })
    except KeyboardInterrupt:
        drafter.update(good[0])
        optimizer.state = good[1]
        save_checkpoint(checkpoint, drafter, optimizer, good[2])
        raise

    export(out_dir, drafter, config)
    held_out = data["eval"][:eval_prompts]
    tau, looping = evaluate(tgt, tokenizer, out_dir, held_out, block_size, response_tokens, report)
    result = TrainResult(
        loss=state["losses"][-1] if state["losses"] else None, steps=state["step"],
        tokens_per_s=tokens / seconds if seconds else 0.0, tau=tau, output=out_dir, losses=list(state["losses"]),
        looping=looping, evaluated=len(held_out),
    )
    report({"phase": "done", "loss": result.loss, "steps": result.steps, "tokens_per_s": result.tokens_per_s,
            "tau": result.tau, "output": str(out_dir)})
    return result
