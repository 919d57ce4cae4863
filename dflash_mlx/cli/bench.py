"""The bench command's steps around eval.bench's measurements: which prompts, a progress bar, the report, scoring.

None of them exits: the command decides the exit status from what they return.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

from rich.console import Console
from rich.progress import Progress

from .. import distributed
from ..files import write_atomic
from .output import rank_peaks

if TYPE_CHECKING:
    from ..eval.prompts import Conversation


def listed_prompts(dataset: str, num_prompts: int) -> Optional[list[Conversation]]:
    """A file's or a built-in set's prompts, read before the model loads so that a bad --dataset fails first.

    None for a Hub data set: it is fetched after the cheap checks.
    """
    from ..eval import prompts

    if dataset.endswith(".jsonl"):
        return prompts.read_jsonl(dataset)
    if dataset in prompts.BUILTIN_SETS or dataset == "all":
        return prompts.builtin(dataset)
    if dataset not in prompts.DATASETS:
        prompts.fetch(dataset, num_prompts)  # raises the unknown-dataset error
    return None


def bench_prompts(listed: Optional[list[Conversation]], lengths: Optional[list[int]], dataset: str, num_prompts: int,
                  tokenizer: Any, max_positions: Optional[int]) -> list[Conversation]:
    """The prompts to measure: --prompt-tokens' lengths (made with the tokenizer), the Hub set, or the first listed."""
    from ..eval.prompts import context_prompts, fetch

    if lengths is not None:
        return context_prompts(tokenizer, lengths, max_positions)
    if listed is None:
        return fetch(dataset, num_prompts)
    return listed[:num_prompts]


def measure(console: Console, target: Any, drafter: Any, tokenizer: Any, conversations: list[Conversation],
            **options: Any) -> tuple[list[dict[str, Any]], int, bool]:
    """(records, turns planned, interrupted): bench.measure under a progress bar; Ctrl-C keeps the records so far."""
    from ..eval import bench

    planned = sum(max(1, len(c.turns)) for c in conversations)
    records: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench", total=planned)

        def done(record: dict[str, Any]) -> None:
            records.append(record)
            progress.advance(task)

        try:
            bench.measure(target, drafter, tokenizer, conversations, on_record=done, **options)
        except KeyboardInterrupt:  # minutes of measurements are worth keeping
            return records, planned, True
    return records, planned, False


def report(model: str, target: Optional[str], dataset: str, drafter: Any, records: list[dict[str, Any]], planned: int,
           interrupted: bool, options: dict[str, Any], console: Console) -> dict[str, Any]:
    """The report as printed and written: the settings, the figures, and the group with every rank's peak memory."""
    from ..eval.report import print_report
    from ..eval.report import report as summary
    from ..models.caches import copy_block
    from ..models.drafter import NoDrafter

    block_size = options["block_size"]
    draft_window = options.get("draft_window")
    settings = {"model": model, "target": target, "window": options["window"], "sinks": options["sinks"],
                "draft_window": getattr(drafter, "context_window", 0) if draft_window is None else draft_window,
                "block_size": block_size or copy_block(drafter), "policy": "fixed" if block_size else "adaptive",
                "draft_source": options["draft_source"], "max_tokens": options["max_tokens"],
                "temperature": options["temperature"], "repeats": options["repeats"], "dataset": dataset,
                "drafter": not isinstance(drafter, NoDrafter), "kv_bits": options.get("kv_bits"),
                "kv_group_size": options.get("kv_group_size"), "quantized_kv_start": options.get("quantized_kv_start")}
    result = summary(settings, records, planned, interrupted)
    print_report(result, console)
    peak = max((r["dflash"]["peak_memory_gb"] for r in records), default=0.0)
    result["group"] = distributed.describe()
    result["rank_peak_memory_gb"] = rank_peaks(peak, interrupted)
    return result


def score(report: dict[str, Any], records: list[dict[str, Any]], conversations: list[Conversation], tokenizer: Any,
          timeout: float, unconfined: bool, temperature: float, out: Console, err: Console) -> Optional[bool]:
    """--score: run the completions' tests into the report and print pass@1.

    Whether the scores say DFlash is lossless; None when Ctrl-C stopped the tests (the measurements are still written).
    """
    from ..eval.report import print_score
    from ..eval.report import score as pass_at_1
    from ..eval.score import unisolated

    try:
        with err.status("running the completions' tests"), unisolated(unconfined):
            report["score"] = pass_at_1(records, conversations, tokenizer, timeout)
        return print_score(report["score"], temperature, out)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/] while scoring: no pass@1")
        return None


def write(report: dict[str, Any], json_out: Optional[str], plot_out: Optional[str]) -> None:
    """--json and --plot, from rank 0 alone."""
    from ..eval.report import plot

    if json_out and distributed.is_main():
        write_atomic(json_out, json.dumps(report, indent=1))
    if plot_out and distributed.is_main():
        plot(report, plot_out)
