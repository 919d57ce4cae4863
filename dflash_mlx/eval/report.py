"""What a bench run says, from its records alone: the summary, the table, pass@1 and the plot.

Nothing here runs a model, so a saved ``--json`` report can be summarised and redrawn;
``bench`` measures and re-exports these under its own name.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..errors import DFlashError
from ..files import write_atomic
from ..system import install_hint
from .score import compare

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from rich.console import Console

    from .prompts import Conversation


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
    from ..system import machine_description

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
    alone = "" if report.get("drafter", True) else " (no drafter: copy drafts)"
    table = Table(title=f"dflash{alone} vs plain decoding — {escape(report['model'])}", box=box.SIMPLE_HEAD, show_edge=False,
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
    if summary.get("sources") and summary["prompts"] > summary["flagged"]:
        over = (f" over the {summary['prompts'] - summary['flagged']} prompts not flagged" if summary["flagged"]
                else "")
        out.print(f"drafted (accepted) tokens by source{over}: " + ", ".join(
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

    kept = sorted((r for r in report["records"] if not r["flagged"]), key=lambda r: r["prompt_tokens"])
    dropped = [r for r in report["records"] if r["flagged"]]
    if not kept:
        return _nothing_to_plot(report)
    fig = Figure(figsize=(14, 4.6 if dropped else 4.2), layout="constrained")
    fig.suptitle(_title(report), fontsize=9)
    speed_ax, tau_ax, hist_ax = fig.subplots(1, 3)
    _curves(speed_ax, tau_ax, kept)
    _acceptance(hist_ax, report["summary"], report["block_size"])
    if dropped:  # a point missing from the curves is said, with why
        names = "; ".join(f"{r['prompt']} ({', '.join(r['flagged'])})" for r in dropped[:6])
        more = f"; and {len(dropped) - 6} more" if len(dropped) > 6 else ""
        fig.supxlabel(f"left out, flagged: {len(dropped)} of {len(report['records'])} prompts: {names}{more}",
                      fontsize=8, color="tab:red")
    return fig


def _title(report: dict[str, Any]) -> str:
    """What the numbers depend on: model, window, block policy, machine and BLAS."""
    machine = report["machine"]
    blas = os.path.basename(machine.get("blas") or "") or "n/a"
    window = report["window"] if report["window"] is not None else "off"
    return (f"{report['model']}  |  window {window}  |  block {report['block_size']} ({report['policy']})\n"
            f"{machine['processor']} ({machine['backend']})  |  BLAS {blas}")


def _nothing_to_plot(report: dict[str, Any]) -> "Figure":
    """The title and why there is no curve: an empty plot must not pass for a measurement."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    fig.suptitle(_title(report), fontsize=9)
    why = ("nothing was measured" if not report["records"] else
           f"all {len(report['records'])} prompts were flagged (text differs from plain decoding, or a degenerate "
           "loop),\nso there is nothing honest to plot: see the flags in the table or the JSON")
    fig.text(0.5, 0.45, why, ha="center", va="center", fontsize=11)
    return fig


def _curves(speed_ax: "Axes", tau_ax: "Axes", kept: list[dict[str, Any]]) -> None:
    """Speedup and tau against prompt length."""
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


def _acceptance(hist_ax: "Axes", summary: dict[str, Any], block_size: int) -> None:
    """Cycles per accepted count, plain decoding steps (cycles that drafted nothing) stacked apart at 0."""
    hist = summary["acceptance_histogram"]
    plain = summary.get("plain_steps", 0)
    bins = range(max(block_size, len(hist)))  # a block drafts block_size - 1 tokens: 0..block_size-1 accepted
    counts = [hist[k] if k < len(hist) else 0 for k in bins]
    hist_ax.bar(bins, [c - plain if k == 0 else c for k, c in enumerate(counts)], width=0.8, label="drafting cycles")
    if plain:
        hist_ax.bar([0], [plain], bottom=[counts[0] - plain], width=0.8, color="lightgray", hatch="//",
                    label="plain decoding steps")
        hist_ax.legend(fontsize=8)
    hist_ax.set_xticks(list(bins))
    hist_ax.set_xlim(-0.5, len(bins) - 0.5)
    hist_ax.set(xlabel="accepted drafts per cycle", ylabel="cycles", title="acceptance")


def plot(report: dict[str, Any], path: str) -> None:
    """Write :func:`figure` as a PNG, atomically (optional extra ``plot``)."""
    fig = figure(report)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
