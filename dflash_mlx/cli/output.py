"""What the commands print around the reply: figure lines, JSON objects, tables and reports.

Kept apart from the commands so that each reads as what it does; the wording here is
what users and the tests read, so it changes only on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape

from .. import distributed


def generation_stats(result: Any) -> str:
    """generate's figures on one line (rich markup): speeds, tau, copies when any were drafted, peak memory."""
    copy = result.by_source["copy"]
    copied = f" | copied {copy['accepted']}/{copy['drafted']}" if copy["drafted"] else ""
    return (f"[dim]prompt {result.prompt_tokens} tok @ {result.prompt_tps:.1f} tok/s | "
            f"generated {result.generation_tokens} tok @ {result.generation_tps:.1f} tok/s | "
            f"tau {result.tau:.2f}{copied} | peak {result.peak_memory:.2f} GB | {result.finish_reason}[/]")


def generation_json(result: Optional[Any], interrupted: bool, peaks: list[float]) -> str:
    """generate --json: the result (an empty one if Ctrl-C came first) with every rank's peak memory."""
    from ..decode.generate import INTERRUPTED

    figures = result.to_dict() if result else {"text": "", "tokens": [], "finish_reason": INTERRUPTED}
    return json.dumps(figures | {"interrupted": interrupted, "group_size": len(peaks), "rank_peak_memory_gb": peaks})


def rank_peaks(peak: float, interrupted: bool) -> list[float]:
    """Every rank's peak memory for the JSON (the reason to shard is memory); after Ctrl-C this rank's alone,
    as the ranks stop apart."""
    return [peak] if interrupted else distributed.gather(peak)


def print_models(out: Console, rows: list[dict[str, Any]], manifests: dict[Path, dict[str, Any]]) -> None:
    """The pairs as a table that fits 80 columns, a key to it, then the converted bundles and GGUF models."""
    from rich import box
    from rich.table import Table

    from ..models.registry import converted_models

    # 80 columns hold every row unbroken: the short name one types, the target repo, and a status that wraps
    # between its words (a missing architecture, gated terms) instead of inside a name.
    table = Table(title="DFlash drafters on the Hub", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True, show_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("target", no_wrap=True)
    table.add_column("think", no_wrap=True)
    table.add_column("~GB", justify="right", no_wrap=True)
    table.add_column("status", overflow="fold", min_width=len("downloaded"))
    for r in rows:
        status = [] if r["tested"] else ["[dim]untested[/]"] if r["supported"] else ["[dim]not yet[/]"]
        status += ["converted"] if r["converted"] else (["downloaded"] if r["downloaded"] else [])
        status += ["[dim]gated[/]"] if r["gated"] else []
        table.add_row(r["name"], r["target"], r["thinking"], str(r["memory_gb"]), ", ".join(status))
    out.print(table)
    out.print("[dim]chat with a name of the first column (dflash-mlx chat Qwen3-8B). think: the reasoning mode the "
              "drafter was trained for (on, off; none: the model has no such mode; unknown: not stated). untested: "
              "its architecture runs after a self-check on load, untested here; not yet: this mlx-lm has no model "
              "for it; gated: accept the terms on the model's page, then `hf auth login`; --json has every field "
              "(architectures, notes)[/]")
    out.print(f"\nconverted bundles (take one alone: dflash-mlx chat FOLDER){': none' if not manifests else ''}")
    for bundle, manifest in manifests.items():
        quant = manifest.get("quantize") or manifest.get("dtype") or "as published"
        out.print(f"  {escape(str(bundle))}\n    {escape(str(manifest.get('drafter')))} -> "
                  f"{escape(str(manifest.get('target')))} ({quant})", overflow="fold")
    models = converted_models()
    out.print(f"\nmodels converted from GGUF files (a target: --target FOLDER; alone: dflash-mlx chat FOLDER)"
              f"{': none' if not models else ''}")
    for folder in models:
        out.print(f"  {escape(str(folder))}", overflow="fold")


def print_machine(out: Console) -> None:
    """doctor's report: backend and memory, BLAS, versions, install conflicts, the group, the HF cache, bundles."""
    import mlx.core as mx
    from huggingface_hub import constants

    from ..models.registry import converted_models, known_bundles
    from ..system import blas_check, machine_description, name_conflict

    info = machine_description()
    backend = "Metal GPU" if info["backend"] == "metal" else "CPU"
    memory = info["memory_bytes"] / 2**30
    if info["backend"] == "metal":
        memory = mx.device_info().get("memory_size", info["memory_bytes"]) / 2**30
    out.print(f"MLX backend   {backend} ({info['processor']}), {memory:.1f} GiB memory")
    if (blas := blas_check()) is not None:
        verdict, line = blas
        style = {"reference": "bold red", "spins": "yellow"}.get(verdict)
        out.print(f"BLAS          {f'[{style}]{escape(line)}[/]' if style else escape(line)}")
    out.print(f"versions      mlx {info['mlx']}, mlx-lm {info['mlx-lm']}, dflash-mlx {info['dflash-mlx']}")
    if conflict := name_conflict():
        out.print(f"[bold red]install[/]       {escape(conflict)}")
    group = distributed.describe()
    if group is not None:
        hosts = ", ".join(f"{r}={h}" for r, h in enumerate(group["hosts"])) or "not named by the launcher"
        out.print(f"group         {group['size']} ranks over {group['backend']} (rank hosts: {hosts}); "
                  f"sharded targets: {', '.join(distributed.SHARDED_MODEL_TYPES)}")
    out.print(f"targets       {escape(targets_line())}")
    out.print(f"HF cache      {constants.HF_HUB_CACHE}")
    bundles = known_bundles()
    out.print("bundles       " + (", ".join(map(str, bundles)) if bundles else "none found (converted ones are listed here)"))
    models = converted_models()
    out.print("from GGUF     " + (", ".join(map(str, models)) if models else "none (models `convert` makes of GGUF files "
                                                                          "are listed here)"))


def targets_line() -> str:
    """Which targets run: by their caches' types, and the architectures tested lossless here."""
    from ..models.target import TESTED_MODEL_TYPES

    return ("any mlx-lm causal LM whose caches roll back: KVCache, RotatingKVCache, QuantizedKVCache (--kv-bits), "
            "CacheList, ArraysCache (recurrent state, saved and replayed); refused in one line otherwise (e.g. Llama "
            f"4's ChunkedKVCache). Tested lossless here: {', '.join(TESTED_MODEL_TYPES)}; any other runs after a "
            "self-check on load")


def print_selftest(out: Console, model: str, result: Any, tokenizer: Any, max_tokens: int) -> None:
    """doctor --selftest's report: a line per prompt (where it diverged, and whether that is a near-tie), a verdict."""
    from ..eval.selftest import EXIT_IDENTICAL, EXIT_NEAR_TIE

    dtype, limit = str(result.dtype).rsplit(".", 1)[-1], f"{result.threshold:g}"
    out.print(f"selftest      {escape(model)}: plain vs DFlash greedy, {max_tokens} tokens per prompt; "
              f"{dtype} logits: a divergence within {limit} of the top logit is a near-tie")
    for p in result.prompts:
        loop = " (degenerate loop)" if p.looping else ""
        line = f"  {p.name:<11} plain {p.plain_tps:.1f} tok/s, DFlash {p.dflash_tps:.1f} tok/s, {p.speedup:.2f}x{loop}  "
        d = p.divergence
        if d is None:
            out.print(line + "identical")
            continue
        plain_token, dflash_token = (escape(f"{t} {tokenizer.decode([t])!r}") for t in (d.plain_token, d.dflash_token))
        verdict = f"< {limit}: near-tie" if d.near_tie else f">= {limit}: [bold red]real divergence[/]"
        out.print(line + f"differs at token {d.position}: plain {plain_token}, DFlash {dflash_token}; target logits: "
                  f"top-1 - top-2 = {d.margin:.3g}, top-1 - lower of the two = {d.gap:.3g} {verdict}")
    looping = sum(p.looping for p in result.prompts)
    if result.speedup is None:
        out.print(f"speedup       n/a: all {looping} replies of the target are degenerate loops, whose speed measures "
                  "the loop, not the drafter (is the target trained enough?)")
    else:
        left_out = f"; {looping} looping replies left out, a loop inflates it" if looping else ""
        out.print(f"speedup       {result.speedup:.2f}x overall (decode tok/s, DFlash over plain{left_out})")
    if result.exit_code == EXIT_IDENTICAL:
        out.print(f"verdict       lossless: identical to plain greedy decoding on all {len(result.prompts)} prompts")
    elif result.exit_code == EXIT_NEAR_TIE:
        out.print("verdict       near-ties only: a verify block and a one-token step run kernels of different "
                  "shapes (on Metal in particular), whose rounding can flip logits this close; not a DFlash bug")
    else:
        out.print("verdict       [bold red]real divergence[/]: DFlash emitted a token the target did not prefer; "
                  "this is a bug, please report it with this output")


def training_summary(result: Any, block_size: int) -> str:
    """train's closing line: where the drafter is and how it trained and drafts."""
    tau = f"{result.tau:.2f}" if result.tau is not None else "n/a"
    return (f"{result.output}: {result.steps} steps, final loss {result.loss:.3f}, "
            f"{result.tokens_per_s:.0f} tok/s, held-out tau {tau} (block {block_size})")


def looping_note(result: Any) -> Optional[str]:
    """A warning (rich markup) when held-out replies of the target loop: a loop inflates tau."""
    if result.looping and result.looping == result.evaluated:
        return (f"[bold red]warning:[/] all {result.evaluated} held-out replies of the target loop on a short span: "
                "that tau measures the loop, not the drafter (is the target trained enough?)")
    if result.looping:
        return f"[yellow]note:[/] {result.looping} of {result.evaluated} held-out replies loop, which inflates tau"
    return None


def serving_line(model: str, host: str, port: int) -> str:
    """serve's line once it listens (rich markup): what, where, which APIs."""
    return (f"serving [bold]{escape(model)}[/] at http://{host}:{port}/v1 (OpenAI's chat and Responses APIs, "
            "Anthropic's at /v1/messages; Ctrl-C stops)")
