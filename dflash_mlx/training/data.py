"""The training corpus: prompts read and split once into training and held-out sets, and the data cache.

Prompts come from a JSONL file or the built-in set (``prompts``). The target's replies to the training
prompts are cached with the prompt ids in ``OUT/data.json`` under a key naming everything they
depend on, so a resumed run never regenerates them. The replies themselves come from the
caller (``train.respond`` runs the target): this module runs no model.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import numpy as np

from ..chat_template import prompt_ids, user
from ..errors import DFlashError
from ..files import write_atomic

if TYPE_CHECKING:
    from ..models.target import Target

Prompt = Union[str, list[dict[str, str]]]
Sequences = list[tuple[list[int], list[int]]]  # (prompt ids, response ids) pairs

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


def data_key(prompts: Sequence[Prompt], eval_prompts: int, seed: int, response_tokens: int,
             target: Target) -> dict[str, Any]:
    """Everything the cached data depends on: the prompts, their split, the reply length and the target's shapes."""
    return {
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "eval_prompts": eval_prompts, "seed": seed, "response_tokens": response_tokens,
        "target": [target.num_layers, target.hidden_size, target.vocab_size],
    }


REPLY_KEYS = ("response_tokens", "target")  # what a reply depends on besides its prompt
DATA = "data.json"  # the cache in OUT
KEEP_EVERY = 64  # replies between two writes of the cache while they are generated
Keep = Callable[[int, list[int]], None]  # (index of a prompt asked, its reply), as each reply is done


def prepare_data(
    out: Path, tokenizer: Any, train_prompts: list[Prompt], held_out: list[Prompt], key: dict[str, Any],
    answer: Callable[[list[list[int]], Keep], None],
) -> dict[str, Any]:
    """Training sequences (prompt and response ids) and held-out prompt ids, cached in OUT/data.json.

    ``key`` names everything the data depends on. A cache made under another key is remade, but
    the replies it holds are kept where what a reply depends on is the same (``REPLY_KEYS``):
    adding prompts to a run, or splitting them anew, costs the new prompts' replies only. ``answer(ids, keep)``
    gives the target's replies to prompt ids, the slow part (an hour for ``make pair``): it runs on what the cache
    lacks only, and hands each reply to ``keep`` as it is done, so the cache holds them every ``KEEP_EVERY``
    replies and when generation stops (Ctrl-C, an error): a run interrupted goes on from the replies it had.
    """
    path = out / DATA
    known: dict[tuple[int, ...], list[int]] = {}
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached
        if all(cached["key"].get(k) == key.get(k) for k in REPLY_KEYS):
            known = {tuple(s["prompt"]): s["response"] for s in cached["train"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or damaged: made again
        pass
    ids = [encode(tokenizer, p) for p in train_prompts]
    missing = [p for p in ids if tuple(p) not in known]
    out.mkdir(parents=True, exist_ok=True)

    def write_partial() -> None:  # under a key that holds REPLY_KEYS but is never a whole key
        partial = {k: key.get(k) for k in REPLY_KEYS}
        write_atomic(path, json.dumps({"key": dict(partial, partial=True), "eval": [],
                                       "train": [{"prompt": list(p), "response": r} for p, r in known.items()]}))

    kept = 0

    def keep(i: int, reply: list[int]) -> None:
        nonlocal kept
        known[tuple(missing[i])] = reply
        kept += 1
        if kept % KEEP_EVERY == 0:
            write_partial()

    if missing:
        try:
            answer(missing, keep)
        except BaseException:
            if kept:
                write_partial()
            raise
    train = [{"prompt": p, "response": known[tuple(p)]} for p in ids]
    data = {"key": key, "train": train, "eval": [encode(tokenizer, p) for p in held_out]}
    write_atomic(path, json.dumps(data))
    return data


def replies_kept(out: Path) -> int:
    """How many replies OUT/data.json holds, whole or as an interrupted run left it (0: none, or damaged)."""
    try:
        return len(json.loads((out / DATA).read_text())["train"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def training_sequences(data: dict[str, Any], block_size: int) -> Sequences:
    """The cached pairs whose reply holds a whole block (an anchor needs B - 1 tokens after it)."""
    sequences = [(s["prompt"], s["response"]) for s in data["train"] if len(s["response"]) >= block_size]
    if not sequences:
        raise DFlashError(
            f"every reply of the target is shorter than the block size ({block_size}): "
            "lower --block-size (or, from Python, raise response_tokens)"
        )
    return sequences
