"""Train a DFlash drafter for a target, in MLX: the published recipe, both published bugs avoided.

Pipeline. Prompts (a JSONL file or ``prompt_count`` built-in ones) are split once into training and
held-out sets. The target answers each training prompt greedily; those token ids are cached
in ``OUT/data.json``, so a resumed run never regenerates them. The frozen target's features of
every sequence are computed once into ``OUT/features.npy`` (``features``). Each step reads
a few sequences' features and optimizes ``objective``: many blocks [anchor token, MASK x (B-1)] cut
out of each response, drafted in one pass of the very ``Drafter`` inference uses (an explicit mask per
layer window keeps blocks apart and hides the context from the anchor on), block positions 1..B-1
scored through the target's frozen LM head. The result is a z-lab layout checkpoint in OUT, measured by
tau on the held-out prompts.

Choices the paper leaves open (initialisation and the mask token: see ``drafter_init``):

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

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.generate import BatchGenerator, generate_step

from ..decode.generate import generate
from ..errors import DFlashError
from ..eval.bench import degenerate
from ..files import write_atomic
from ..models.drafter import Drafter, DrafterArgs, default_target_layer_ids
from ..models.loader import cast_floats, check_pair, load_drafter, load_target, resolve
from ..models.target import Target
from ..models.vocabulary import CONFIG_KEY as VOCAB_CONFIG
from ..models.vocabulary import DRAFT_VOCAB, DraftVocabulary
from .data import Keep, Sequences, data_key, prepare_data, read_prompts, split_prompts, training_sequences
from .drafter_init import draft_config, init_from_target, pick_mask_token
from .features import FeatureStore, feature_store
from .objective import (
    FEATURE_NOISE,
    Batch,
    Head,
    block_loss,
    learning_rate,
    make_batch,
    perturb_features,
    position_weights,
)
from .prompts import synthetic_prompts

Progress = Callable[[dict[str, Any]], None]

GRAD_CLIP = 1.0
CHECKPOINT = "checkpoint"
REPLY_BATCH = 64  # replies generated at once (on 2 CPU cores: 133 tok/s against 107 at 32)


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


# --- the replies ----------------------------------------------------------------------------


def respond(
    model: nn.Module, prompts: list[list[int]], max_tokens: int, eos: frozenset[int], progress: Progress, keep: Keep
) -> None:
    """The target's greedy replies, EOS included so the drafter also learns to end a reply, each handed to
    ``keep(index, reply)`` as it is done (``data.prepare_data`` keeps them through an interruption).

    Generated in batches by mlx-lm's ``BatchGenerator`` (several times the throughput of
    one prompt at a time) where the model takes its batches: the first prompt is decoded alone first and
    the batch's replies are held until its reply to that prompt agrees, and a model whose attention
    does not take a batch's padded masks (Gemma 2's, for one) answers one prompt at a time.
    """
    if not prompts:
        return
    alone = _respond_alone(model, prompts[0], max_tokens, eos)
    try:
        if _respond_batched(model, prompts, max_tokens, eos, progress, keep, alone):
            return
    except (ValueError, RuntimeError):  # what MLX raises where the model's shapes do not take the batch's
        pass
    keep(0, alone)
    progress({"phase": "generate", "done": 1, "total": len(prompts)})
    for done, prompt in enumerate(prompts[1:], 2):
        keep(done - 1, _respond_alone(model, prompt, max_tokens, eos))
        progress({"phase": "generate", "done": done, "total": len(prompts)})


def _respond_batched(model: nn.Module, prompts: list[list[int]], max_tokens: int, eos: frozenset[int],
                     progress: Progress, keep: Keep, alone: list[int]) -> bool:
    """False, having kept nothing, where the batch's reply to the first prompt is not ``alone``."""
    generator = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[t] for t in sorted(eos)],
                               completion_batch_size=REPLY_BATCH)
    try:
        uids = generator.insert(prompts)
        index = {uid: i for i, uid in enumerate(uids)}
        replies: dict[int, list[int]] = {uid: [] for uid in uids}
        held: Optional[list[int]] = []  # the replies done before the first prompt's, until it agrees
        done = 0
        while responses := generator.next_generated():
            for r in responses:
                replies[r.uid].append(int(r.token))  # on a "stop" finish this is the EOS token
                if r.finish_reason is None:
                    continue
                done += 1
                if held is None:
                    keep(index[r.uid], replies[r.uid])
                else:
                    held.append(r.uid)
                    if index[r.uid] == 0:
                        if replies[r.uid] != alone:
                            return False
                        for uid in held:
                            keep(index[uid], replies[uid])
                        held = None
                progress({"phase": "generate", "done": done, "total": len(prompts)})
    finally:
        generator.close()
    return True


def _respond_alone(model: nn.Module, prompt: list[int], max_tokens: int, eos: frozenset[int]) -> list[int]:
    reply = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        reply.append(int(token))
        if reply[-1] in eos:
            break
    return reply


# --- checkpoints and evaluation -------------------------------------------------------------


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
    """config.json and model.safetensors in the published layout, weights in the target's dtype; the drafter's
    vocabulary (``models.vocabulary``) beside them, declared in the config."""
    dtype = getattr(mx, config["dtype"])
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in drafter.tensors().items()}
    if drafter.vocabulary is not None:
        config = {**config, "dflash_config": {**config["dflash_config"], VOCAB_CONFIG: len(drafter.vocabulary)}}
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
    eval_prompts: int, checkpoint_every: int, loss_gamma: Optional[float], feature_noise: float,
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
    for name, value in (("--batch-size", batch_size), ("--blocks", anchors), ("checkpoint_every", checkpoint_every)):
        if value < 1:
            raise DFlashError(f"{name} must be >= 1, got {value}")
    if response_tokens < block_size:
        raise DFlashError(f"response_tokens ({response_tokens}) must be at least the block size ({block_size})")
    if eval_prompts < 0:
        raise DFlashError(f"eval_prompts must be >= 0, got {eval_prompts}")
    if not lr > 0:
        raise DFlashError(f"--lr must be positive, got {lr}")
    if loss_gamma is not None and not loss_gamma > 0:
        raise DFlashError(f"--loss-gamma must be positive, got {loss_gamma}")
    if not feature_noise >= 0:
        raise DFlashError(f"--feature-noise must be >= 0, got {feature_noise}")
    return steps


FLAGS = {"layers": "--layers", "block_size": "--block-size", "target_layer_ids": "--target-layer-ids",
         "batch_size": "--batch-size", "lr": "--lr", "anchors": "--blocks", "loss_gamma": "--loss-gamma",
         "feature_noise": "--feature-noise"}
# Settings added since checkpoints were first made, with the value those checkpoints were trained with.
ADDED = {"feature_noise": 0.0}


def _setting(name: str, value: Any) -> str:
    """A saved setting as the user gave it: a flag where the CLI has one, else the train() argument."""
    if name == "prompts":
        return "other --prompts"
    if name == "target":
        return "another target"
    if name in FLAGS and value is None:
        return f"the default {FLAGS[name]}"
    if name in FLAGS:
        return f"{FLAGS[name]} {','.join(map(str, value)) if isinstance(value, list) else value}"
    return f"{name}={value!r}"


def saved_step(out: str) -> Optional[int]:
    """The step of OUT's training checkpoint (None: there is none): what --resume would continue from."""
    checkpoint = Path(out).expanduser() / CHECKPOINT
    return read_checkpoint_state(checkpoint)["step"] if (checkpoint / "state.json").is_file() else None


def _check_output(out_dir: Path, resume: bool) -> None:
    """Refuse a file, a checkpoint that would be overwritten without --resume, and a resume of nothing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DFlashError(f"output {out_dir} is a file; expected a folder")
    saved = (out_dir / CHECKPOINT / "state.json").is_file()
    if saved and not resume:
        raise DFlashError(
            f"{out_dir} already holds a training checkpoint: add --resume to continue it, or choose another folder"
        )
    if resume and not saved:
        raise DFlashError(f"{out_dir} holds no training checkpoint to resume; run without --resume")


def _feature_target(model: nn.Module, layers: int, target_layer_ids: Optional[list[int]]) -> Target:
    """The target capturing the given feature layers, else the default ones for a drafter of ``layers`` layers."""
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(Target(model, []).num_layers, layers)
    return Target(model, target_layer_ids)


def _saved_state(out_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's state, refused when it was made with other settings: a resume may change the budget only."""
    saved = read_checkpoint_state(out_dir / CHECKPOINT)
    made = {**ADDED, **saved["settings"]}
    changed = [k for k in settings if made.get(k) != settings[k]]
    if changed:
        was = ", ".join(_setting(k, made.get(k)) for k in changed)
        raise DFlashError(f"{out_dir} was trained with {was}: resume with the same settings")
    return saved


def _start(
    target: Target, config: dict[str, Any], checkpoint: Path, resume: bool, settings: dict[str, Any], seed: int,
    lr: float,
) -> tuple[Drafter, optim.Optimizer, dict[str, Any]]:
    """The drafter, its optimizer and the loop state: restored from the checkpoint, else initialised from the target.

    Seeded first, so that what the target's weights do not fill gets the same default init every run.
    """
    mx.random.seed(seed)
    drafter = Drafter(DrafterArgs.from_dict(config))
    optimizer = optim.AdamW(learning_rate=lr)
    if resume:
        return drafter, optimizer, load_checkpoint(checkpoint, drafter, optimizer)
    init_from_target(drafter, target)
    return drafter, optimizer, {"step": 0, "elapsed": 0.0, "losses": [], "settings": settings, "config": config}


class Diverged(Exception):
    """A step whose loss is not finite: the weights it produced are not kept."""


@dataclass
class _Loop:
    """One call's training loop: what every step reads, the budget, and this call's throughput.

    ``state`` is what a checkpoint saves: step, elapsed, losses, settings and config.
    """

    target: Target
    drafter: Drafter
    optimizer: optim.Optimizer
    state: dict[str, Any]
    sequences: Sequences
    features: FeatureStore
    checkpoint: Path
    checkpoint_every: int
    seed: int
    batch_size: int
    anchors: int
    block_size: int
    lr: float
    loss_gamma: Optional[float]
    feature_noise: float
    steps: Optional[int]
    time_budget: Optional[float]
    head: Optional[Head] = None  # the loss's head (``run`` sets it)
    tokens: int = 0  # supervised block positions, this call
    seconds: float = 0.0  # spent in training steps, this call

    def done(self) -> float:
        """The share of the budget spent: the schedule and the stop rule read it alike (see module doc)."""
        if self.steps is not None:
            return self.state["step"] / self.steps
        return self.state["elapsed"] / self.time_budget

    def step(self, loss_and_grad: Callable[[Batch], tuple[mx.array, Any]]) -> float:
        """One optimizer step on sequences and anchors drawn from a generator seeded by (seed, step); returns its lr."""
        tic = time.perf_counter()
        rng = np.random.default_rng([self.seed, self.state["step"]])
        picks = rng.choice(len(self.sequences), size=min(self.batch_size, len(self.sequences)), replace=False)
        batch = make_batch(self.target, [self.sequences[i] for i in picks], [self.features[i] for i in picks], rng,
                           self.anchors, self.block_size, self.drafter.mask_token_id)
        rate = learning_rate(self.done(), self.lr)
        self.optimizer.learning_rate = rate
        if self.head is not None:
            batch.columns = self.head.sample(rng, np.array(batch.labels))
        batch.features = perturb_features(batch.features, self.feature_noise, len(self.target.layer_ids),
                                          mx.random.key(int(rng.integers(2**32))))
        loss, grads = loss_and_grad(batch)
        grads, _ = optim.clip_grad_norm(grads, GRAD_CLIP)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss)
        if not math.isfinite(value := loss.item()):
            raise Diverged(f"training diverged: the loss is {value} at step {self.state['step'] + 1}")
        elapsed = time.perf_counter() - tic
        self.state["step"] += 1
        self.state["elapsed"] += elapsed
        self.state["losses"].append(value)
        self.tokens, self.seconds = self.tokens + batch.tokens, self.seconds + elapsed
        return rate

    def snapshot(self) -> tuple[Any, Any, dict[str, Any]]:
        """Weights, optimizer state and loop state as they are now (arrays are immutable: holding them copies none)."""
        state = json.loads(json.dumps(self.state))
        return self.drafter.parameters(), tree_map(lambda x: x, self.optimizer.state), state

    def run(self, report: Progress) -> None:
        """Steps until the budget is spent, checkpointing every ``checkpoint_every`` steps and after the last.

        Ctrl-C mid-step still checkpoints the last completed step, so an interruption loses nothing.
        """
        weights = position_weights(self.block_size, self.loss_gamma)
        self.head = Head.of(self.target, self.sequences)
        loss_and_grad = nn.value_and_grad(self.drafter,
                                          lambda batch: block_loss(self.drafter, self.target, batch, weights))
        good = self.snapshot()
        try:
            while self.done() < 1:
                rate = self.step(loss_and_grad)
                good = self.snapshot()
                if self.state["step"] % self.checkpoint_every == 0 or self.done() >= 1:
                    save_checkpoint(self.checkpoint, self.drafter, self.optimizer, self.state)
                report({
                    "phase": "train", "step": self.state["step"], "steps": self.steps,
                    "progress": min(1.0, self.done()), "loss": self.state["losses"][-1], "lr": rate,
                    "tokens_per_s": self.tokens / self.seconds, "elapsed": self.state["elapsed"],
                })
        except (KeyboardInterrupt, Diverged) as e:
            self.drafter.update(good[0])
            self.optimizer.state = good[1]
            if isinstance(e, KeyboardInterrupt) or good[2]["step"]:
                save_checkpoint(self.checkpoint, self.drafter, self.optimizer, good[2])
            if isinstance(e, Diverged):
                kept = f"step {good[2]['step']} is kept in {self.checkpoint}" if good[2]["step"] else "nothing was saved"
                raise DFlashError(f"{e} ({kept}): a lower --lr, or the target's features out of range") from None
            raise


def _finish(loop: _Loop, tokenizer: Any, out_dir: Path, held_out: list[list[int]], response_tokens: int,
            report: Progress) -> TrainResult:
    """Export the drafter, measure it on the held-out prompts, and report the result."""
    state = loop.state
    export(out_dir, loop.drafter, state["config"])
    tau, looping = evaluate(loop.target, tokenizer, out_dir, held_out, loop.block_size, response_tokens, report)
    result = TrainResult(
        loss=state["losses"][-1] if state["losses"] else None, steps=state["step"],
        tokens_per_s=loop.tokens / loop.seconds if loop.seconds else 0.0, tau=tau, output=out_dir,
        losses=list(state["losses"]), looping=looping, evaluated=len(held_out),
    )
    report({"phase": "done", "loss": result.loss, "steps": result.steps, "tokens_per_s": result.tokens_per_s,
            "tau": result.tau, "output": str(out_dir)})
    return result


def train(
    target: str,
    out: str,
    *,
    prompts: Optional[str] = None,
    prompt_count: int = 600,
    layers: int = 1,
    block_size: int = 8,
    target_layer_ids: Optional[list[int]] = None,
    steps: Optional[int] = None,
    time_budget: Optional[float] = None,
    lr: float = 3e-3,
    batch_size: int = 2,
    anchors: int = 16,
    loss_gamma: Optional[float] = None,
    feature_noise: float = FEATURE_NOISE,
    draft_vocab: int = DRAFT_VOCAB,
    response_tokens: int = 128,
    resume: bool = False,
    seed: int = 0,
    eval_prompts: int = 4,
    checkpoint_every: int = 50,
    progress: Optional[Progress] = None,
) -> TrainResult:
    """Train a DFlash drafter for ``target`` (a folder or Hub repo id) into the folder ``out``.

    A step cuts ``anchors`` blocks from each of ``batch_size`` sequences and weighs block position
    k by exp(-(k-1)/``loss_gamma``) (None: the published 4-7 by block size), and sees the target's
    features with Gaussian noise of ``feature_noise`` x their scale (``objective.perturb_features``). The drafter
    drafts from the ``draft_vocab`` tokens most frequent in its replies (``models.vocabulary``; 0: from the target's
    whole vocabulary); that is a matter of its export, so a resume may change it. ``steps`` or
    ``time_budget`` (seconds of training, data generation and evaluation not counted) is the
    budget of the whole run, resumes included. Every ``checkpoint_every``
    steps and at the end, ``out/checkpoint`` is rewritten; ``resume=True`` continues it with
    the settings it was made with (changing any but the budget is an error). ``progress``
    receives dicts with a ``phase``: "generate" (done, total), "train" (step, steps, progress,
    loss, lr, tokens_per_s, elapsed), "eval" (done, total) and finally "done" (the result's
    fields).
    """
    steps = _check_args(layers, block_size, target_layer_ids, steps, time_budget, lr, batch_size, anchors,
                        response_tokens, eval_prompts, checkpoint_every, loss_gamma, feature_noise)
    if prompts is None and prompt_count < 1:
        raise DFlashError(f"--prompt-count must be >= 1, got {prompt_count}")
    if draft_vocab < 0:
        raise DFlashError(f"--draft-vocab must be >= 0 (0: the target's whole vocabulary), got {draft_vocab}")
    report = progress or (lambda info: None)
    out_dir = Path(out).expanduser()
    _check_output(out_dir, resume)
    prompt_list = read_prompts(Path(prompts).expanduser()) if prompts is not None else synthetic_prompts(prompt_count)

    model, tokenizer = load_target(resolve(target, "target"))
    tgt = _feature_target(model, layers, target_layer_ids)
    key = data_key(prompt_list, eval_prompts, seed, response_tokens, tgt)
    settings = dict(key, layers=layers, block_size=block_size, target_layer_ids=tgt.layer_ids,
                    batch_size=batch_size, anchors=anchors, lr=lr, loss_gamma=loss_gamma, feature_noise=feature_noise)
    saved = _saved_state(out_dir, settings) if resume else None

    train_prompts, held_out = split_prompts(prompt_list, eval_prompts, seed)
    data = prepare_data(out_dir, tokenizer, train_prompts, held_out, key,
                        lambda ids, keep: respond(model, ids, response_tokens, frozenset(tokenizer.eos_token_ids),
                                                  report, keep))
    sequences = training_sequences(data, block_size)
    features = feature_store(out_dir, tgt, sequences, key, report)

    config = saved["config"] if saved else draft_config(tgt, layers, block_size, tgt.layer_ids,
                                                        pick_mask_token(tokenizer, tgt))
    checkpoint = out_dir / CHECKPOINT
    drafter, optimizer, state = _start(tgt, config, checkpoint, saved is not None, settings, seed, lr)
    drafter.vocabulary = DraftVocabulary.from_replies((s["response"] for s in data["train"]),
                                                      (s["prompt"] for s in data["train"]), tgt.vocab_size, draft_vocab)
    loop = _Loop(target=tgt, drafter=drafter, optimizer=optimizer, state=state, sequences=sequences,
                 features=features, checkpoint=checkpoint, checkpoint_every=checkpoint_every, seed=seed, batch_size=batch_size,
                 anchors=anchors, block_size=block_size, lr=lr, loss_gamma=loss_gamma, feature_noise=feature_noise,
                 steps=steps,
                 time_budget=time_budget)
    loop.run(report)
    return _finish(loop, tokenizer, out_dir, data["eval"][:eval_prompts], response_tokens, report)
