"""The ``dflash-mlx`` command line: a thin layer over the library API."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__, distributed
from .errors import DFlashError
from .files import write_atomic

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="DFlash block-diffusion speculative decoding on Apple Silicon, in pure MLX.",
)
err = Console(stderr=True, highlight=False)


def fail(message: str) -> None:
    """One clear line on stderr, exit status 2 (from every rank of a group: it may be this rank's alone)."""
    if err.quiet:
        sys.stderr.write(f"rank {distributed.rank()}: error: {message}\n")
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DFlashError into one line and exit 2; Ctrl-C into exit 130 without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            fail(str(e))
        except KeyboardInterrupt:
            err.print("\n[yellow]interrupted[/]")
            raise typer.Exit(130)

    return wrapper


@contextlib.contextmanager
def prefill_progress() -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on stderr for prompts that take more than one prefill chunk."""
    bar = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err, transient=True)
    task = None

    def update(done: int, total: int) -> None:
        nonlocal task
        if task is None and 0 < done < total:
            bar.start()
            task = bar.add_task("prefill", total=total)
        if task is not None:
            bar.update(task, completed=done)

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Under ``mlx.launch`` every rank runs the command; only rank 0 speaks (errors aside)."""
    try:
        quiet = not distributed.is_main()
    except DFlashError as e:
        fail(str(e))
    if quiet:
        err.quiet = True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops


TARGET = typer.Option(None, "--target", "-t", help="Target: repo id or folder (original, converted or quantized).")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate (per reply).")
BLOCK_SIZE = typer.Option(None, "--block-size", "-b", help="Draft a full block of N every cycle \\[default: adaptive, up to the drafter's block].")
WINDOW = typer.Option(None, "--window", "-w", help="Attend to the last N positions only (bounded memory).")
SINKS = typer.Option(0, "--sinks", help="With --window: first positions that are never evicted.")
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 decodes greedily.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the smallest set with this much mass.")
TOP_K = typer.Option(0, "--top-k", help="Sample from the k most likely tokens only (0: all).")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top token's probability.")
SEED = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
VERIFY = typer.Option("auto", "--verify", help="Sampled verification: rejection (accepts more), match, or auto: "
                                                "rejection, match with --seed (which keeps the adaptive depth).")


PREFILL_STEP = typer.Option(
    None, "--prefill-step", help="Prefill this many tokens at a time \\[default: 2048, window/16 with --window]."
)
TEMPLATE = typer.Option(
    None, "--chat-template", help="A chat template, as a Jinja file or its text, for a model without one (or instead of its own)."
)
STOP = typer.Option(None, "--stop", help="End the reply before this text (repeatable); it is never printed.")
SOURCE = typer.Option("auto", "--draft-source", help="Where drafts come from: auto (each cycle, the drafter or a copy "
                                                      "of text the context already holds), drafter, or copy only.")


def _check_options(block_size: Optional[int], max_tokens: int, window: Optional[int], sinks: int,
                   prefill_step_size: Optional[int] = None, draft_source: str = "auto", **sampling: Any) -> None:
    """Fail on bad flag values before loading gigabytes of weights (the window against the drafter's block after)."""
    from .caches import check_window
    from .policy import check_source
    from .sampling import Sampling

    check_source(draft_source)
    if block_size is not None and block_size < 1:
        raise DFlashError(f"--block-size must be >= 1, got {block_size}")
    if prefill_step_size is not None and prefill_step_size < 1:
        raise DFlashError(f"--prefill-step must be >= 1, got {prefill_step_size}")
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1, got {max_tokens}")
    if window is not None:
        check_window(window, sinks, block_size or 1)
    Sampling(**sampling)


def _check_loaded(window: Optional[int], sinks: int, block_size: Optional[int], drafter: Any) -> None:
    """Once the drafter is loaded: a block it was trained for, and a window that holds it."""
    from .caches import check_block_size, check_window

    if block_size is not None:
        check_block_size(block_size, drafter)
    if window is not None:
        check_window(window, sinks, block_size or drafter.block_size)


def _load(model: Optional[str], target: Optional[str], chat_template: Optional[str] = None) -> tuple[str, Any, Any, Any]:
    """(name, target, drafter, tokenizer) of MODEL, or of the published pair that fits this machine.

    ``chat_template`` is the --chat-template value (a file or the text). Offline, the
    default pair cannot be downloaded: the error then says how to build and use a local one.
    """
    from .chat_template import read_template
    from .errors import DownloadError
    from .loader import load
    from .registry import default_pair
    from .system import machine_description

    template = read_template(chat_template) if chat_template is not None else None
    default = model is None
    if default:
        model = default_pair(machine_description()["memory_bytes"]).drafter
        err.print(f"[dim]no model given: using {escape(model)} (fits this machine's memory)[/]")
    try:
        return (model, *load(model, target, template))
    except DownloadError as e:
        if not default:
            raise
        raise DFlashError(f"{e}; offline, `make pair` builds a small local pair and prints the command to chat "
                          "with it (`make chat MODEL=FOLDER`)") from None


def _warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def _warn_blas() -> None:
    """Every command that decodes says when this machine's BLAS will make it slow (Linux only).

    ``DFLASH_MLX_BLAS_WARNING=0`` silences it, for those who know (the test suite, which
    checks what else the commands print).
    """
    from .system import blas_check

    verdict = blas_check()
    if verdict is not None and verdict[0] != "ok" and os.environ.get("DFLASH_MLX_BLAS_WARNING") != "0":
        _warn(verdict[1])


@app.command()
@user_errors
def generate(
    draft: str = typer.Argument(..., help="Drafter: registry name, Hub repo id, drafter folder or converted bundle."),
    target: Optional[str] = TARGET,
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt ('-' reads stdin)."),
    max_tokens: int = MAX_TOKENS,
    block_size: Optional[int] = BLOCK_SIZE,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prefill_step_size: Optional[int] = PREFILL_STEP,
    temperature: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: Optional[int] = SEED,
    verify: str = VERIFY,
    stop: Optional[list[str]] = STOP,
    draft_source: str = SOURCE,
    chat_template: Optional[str] = TEMPLATE,
    raw: bool = typer.Option(False, "--no-chat-template", help="Send the prompt as raw text, without the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate a reply to one prompt, losslessly, with DFlash speculative decoding."""
    from .chat_template import has_chat_template, render, user
    from .generate import INTERRUPTED, GenerationResponse, GenerationResult, check_context, encode_prompt
    from .generate import generate as run

    _check_options(block_size, max_tokens, window, sinks, prefill_step_size, draft_source, temperature=temperature,
                   top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, verify=verify)
    if raw and chat_template is not None:
        raise DFlashError("--chat-template and --no-chat-template contradict each other: pass one")
    if prompt == "-":
        prompt = sys.stdin.read()
    _, tgt, drafter, tokenizer = _load(draft, target, chat_template)
    _check_loaded(window, sinks, block_size, drafter)
    _warn_blas()
    ids = encode_prompt(tokenizer, prompt) if raw or not has_chat_template(tokenizer) else render(tokenizer, user(prompt))
    if warning := check_context(tgt.max_positions, len(ids), max_tokens):
        _warn(warning)

    responses: list[GenerationResponse] = []

    def show(response: GenerationResponse) -> None:
        responses.append(response)
        if not as_json:
            sys.stdout.write(response.text)
            sys.stdout.flush()

    interrupted = False
    try:
        with prefill_progress() as progress:
            run(tgt, drafter, tokenizer, ids, on_response=show, max_tokens=max_tokens, block_size=block_size,
                window=window, sinks=sinks, prefill_step_size=prefill_step_size, prompt_progress_callback=progress,
                temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, verify=verify, stop=stop,
                draft_source=draft_source)
    except KeyboardInterrupt:  # what was generated is kept: printed, and in the JSON marked interrupted
        interrupted = True
    result = GenerationResult.from_responses(responses, INTERRUPTED if interrupted else None) if responses else None
    if as_json:
        figures = result.to_dict() if result else {"text": "", "tokens": [], "finish_reason": INTERRUPTED}
        peak = result.peak_memory if result else 0.0
        peaks = [peak] if interrupted else distributed.gather(peak)  # every rank's: the reason to shard is memory
        typer.echo(json.dumps(figures | {"interrupted": interrupted, "group_size": len(peaks),
                                         "rank_peak_memory_gb": peaks}))
    else:
        sys.stdout.write("\n")
    if result is None:
        err.print("[yellow]interrupted[/] before the first token")
    else:
        copy = result.by_source["copy"]
        copied = f" | copied {copy['accepted']}/{copy['drafted']}" if copy["drafted"] else ""
        err.print(f"[dim]prompt {result.prompt_tokens} tok @ {result.prompt_tps:.1f} tok/s | "
                  f"generated {result.generation_tokens} tok @ {result.generation_tps:.1f} tok/s | "
                  f"tau {result.tau:.2f}{copied} | peak {result.peak_memory:.2f} GB | {result.finish_reason}[/]",
                  soft_wrap=True)
    if interrupted:
        raise typer.Exit(130)


@app.command()
@user_errors
def models(as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON.")) -> None:
    """List the published drafter -> target pairs, which are downloaded or converted, and the converted bundles."""
    from huggingface_hub import constants, scan_cache_dir
    from rich import box
    from rich.table import Table

    from .registry import known_bundles, pairs

    try:
        cached = {repo.repo_id for repo in scan_cache_dir(constants.HF_HUB_CACHE).repos}  # read now, as downloads do
    except Exception:  # no cache folder yet, or an unreadable one
        cached = set()
    converted = {}
    for bundle in known_bundles():
        manifest = json.loads((bundle / "dflash.json").read_text())
        converted.setdefault(manifest.get("drafter"), []).append(str(bundle))
    rows = [
        dict(name=min(p.names, key=len), drafter=p.drafter, target=p.target, architecture=p.model_type,
             supported=p.supported,
             thinking=p.thinking, memory_gb=p.memory_gb, gated=p.gated, notes=p.notes,
             downloaded=p.drafter in cached and p.target in cached, converted=converted.get(p.drafter, []))
        for p in pairs()
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    out = Console(highlight=False)
    # 80 columns hold every row unbroken: the short name one types, the target repo, and a status that wraps
    # between its words (a missing architecture, gated terms) instead of inside a name.
    table = Table(title="DFlash drafters on the Hub (z-lab/...)", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True, show_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("target", no_wrap=True)
    table.add_column("think", no_wrap=True)
    table.add_column("~GB", justify="right", no_wrap=True)
    table.add_column("status", overflow="fold", min_width=len("downloaded"))
    for p, r in zip(pairs(), rows):
        status = [] if r["supported"] else ["[dim]not yet[/]"]
        status += ["converted"] if r["converted"] else (["downloaded"] if r["downloaded"] else [])
        status += ["[dim]gated[/]"] if r["gated"] else []
        table.add_row(r["name"], r["target"], r["thinking"], str(r["memory_gb"]), ", ".join(status))
    out.print(table)
    out.print("[dim]chat with a name of the first column (dflash-mlx chat Qwen3-8B). not yet: dflash-mlx does not "
              "run the target's architecture; gated: accept the terms on the model's page, then `hf auth login`; "
              "--json has every field (architectures, notes)[/]")
    bundles = known_bundles()
    out.print(f"\nconverted bundles (take one alone: dflash-mlx chat FOLDER){': none' if not bundles else ''}")
    for bundle in bundles:
        manifest = json.loads((bundle / "dflash.json").read_text())
        quant = manifest.get("quantize") or manifest.get("dtype") or "as published"
        out.print(f"  {escape(str(bundle))}\n    {escape(str(manifest.get('drafter')))} -> "
                  f"{escape(str(manifest.get('target')))} ({quant})", overflow="fold")


@app.command()
@user_errors
def convert(
    source: str = typer.Argument(..., help="Drafter: registry name, Hub repo id or folder."),
    out: str = typer.Option(..., "--out", "-o", help="Bundle folder to write."),
    target: Optional[str] = TARGET,
    quantize: Optional[str] = typer.Option(None, "--quantize", "-q", help="Target quantization: 4bit, 8bit, mixed_4_6, ..."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Float dtype: bfloat16, float16 or float32."),
    draft_quantize: str = typer.Option("none", "--draft-quantize", help="Drafter quantization: none, 8bit or 4bit."),
    quantize_fc: bool = typer.Option(False, "--quantize-fc", help="With --draft-quantize: quantize fc too."),
    force: bool = typer.Option(False, "--force", help="Replace an existing OUT."),
) -> None:
    """Convert a drafter and its target into one offline MLX bundle (optionally quantized)."""
    from .convert import convert as run
    from .convert import summary

    if not distributed.is_main():  # it writes files and shards nothing: under mlx.launch rank 0 runs it alone
        return

    with err.status("checking the pair") as status:  # transient: only the result or one error line stays
        path = run(source, out, target=target, quantize=quantize, q_group_size=q_group_size, dtype=dtype,
                   draft_quantize=draft_quantize, quantize_fc=quantize_fc, force=force, log=status.update)
    typer.echo(summary(path))


@app.command()
@user_errors
def doctor(
    model: Optional[str] = typer.Argument(
        None, help="With --selftest: registry name, drafter repo/folder or bundle \\[default: fits this machine]."
    ),
    target: Optional[str] = TARGET,
    selftest: bool = typer.Option(False, "--selftest", help="Prove DFlash lossless on MODEL, on this machine."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m", help="With --selftest: tokens to decode per prompt."),
) -> None:
    """Check the MLX backend, the BLAS, versions, the Hugging Face cache and converted bundles.

    --selftest then decodes a math, a code and a chat prompt greedily with plain decoding and with
    DFlash, and compares them token for token. Exit status: 0 identical everywhere; 1 near-ties only
    (logits closer than the threshold it prints, which kernel rounding can flip); 3 a real divergence
    (a bug: please report it with the output).
    """
    import mlx.core as mx
    from huggingface_hub import constants

    from .system import blas_check, machine_description, name_conflict

    if selftest:
        from .selftest import EXIT_IDENTICAL, EXIT_NEAR_TIE, check_max_tokens
        from .selftest import selftest as run

        check_max_tokens(max_tokens)
    elif model is not None or target is not None:
        raise DFlashError("MODEL and --target are for the selftest: dflash-mlx doctor --selftest MODEL")

    info = machine_description()
    out = Console(highlight=False, soft_wrap=True)
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
    out.print(f"HF cache      {constants.HF_HUB_CACHE}")
    from .registry import known_bundles

    bundles = known_bundles()
    out.print("bundles       " + (", ".join(map(str, bundles)) if bundles else "none found (converted ones are listed here)"))
    if not selftest:
        return
    model, tgt, drafter, tokenizer = _load(model, target)
    with err.status("selftest: plain and DFlash greedy decoding") as status:
        result = run(tgt, drafter, tokenizer, max_tokens=max_tokens,
                     on_prompt=lambda record: status.update(f"selftest: {record['prompt']} done"))
    dtype, limit = str(result.dtype).rsplit(".", 1)[-1], f"{result.threshold:g}"
    out.print(f"selftest      {escape(model)}: plain vs DFlash greedy, {max_tokens} tokens per prompt; "
              f"{dtype} logits: a divergence within {limit} of the top logit is a near-tie")
    for p in result.prompts:
        line = f"  {p.name:<11} plain {p.plain_tps:.1f} tok/s, DFlash {p.dflash_tps:.1f} tok/s, {p.speedup:.2f}x  "
        d = p.divergence
        if d is None:
            out.print(line + "identical")
            continue
        plain_token, dflash_token = (escape(f"{t} {tokenizer.decode([t])!r}") for t in (d.plain_token, d.dflash_token))
        verdict = f"< {limit}: near-tie" if d.near_tie else f">= {limit}: [bold red]real divergence[/]"
        out.print(line + f"differs at token {d.position}: plain {plain_token}, DFlash {dflash_token}; target logits: "
                  f"top-1 - top-2 = {d.margin:.3g}, top-1 - lower of the two = {d.gap:.3g} {verdict}")
    out.print(f"speedup       {result.speedup:.2f}x overall (decode tok/s, DFlash over plain)")
    if result.exit_code == EXIT_IDENTICAL:
        out.print(f"verdict       lossless: identical to plain greedy decoding on all {len(result.prompts)} prompts")
    elif result.exit_code == EXIT_NEAR_TIE:
        out.print("verdict       near-ties only: a verify block and a one-token step run kernels of different "
                  "shapes (on Metal in particular), whose rounding can flip logits this close; not a DFlash bug")
    else:
        out.print("verdict       [bold red]real divergence[/]: DFlash emitted a token the target did not prefer; "
                  "this is a bug, please report it with this output")
    raise typer.Exit(result.exit_code)


@app.command()
@user_errors
def chat(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle \\[default: fits this machine]."),
    target: Optional[str] = TARGET,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    block_size: Optional[int] = BLOCK_SIZE,
    temperature: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: Optional[int] = SEED,
    verify: str = VERIFY,
    stop: Optional[list[str]] = STOP,
    draft_source: str = SOURCE,
    chat_template: Optional[str] = TEMPLATE,
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Most tokens per reply."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's thinking mode."),
) -> None:
    """Chat interactively; each turn prefills only the new message. Pipe lines in to script it."""
    from .chat import ChatSession, line_editing, run_command, stats_line
    from .generate import GenerationResponse
    from .registry import find

    _check_options(block_size, max_tokens, window, sinks, draft_source=draft_source, temperature=temperature,
                   top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, verify=verify)
    model, tgt, drafter, tokenizer = _load(model, target, chat_template)
    pair = find(model)
    if pair is not None and think is not None and pair.thinking in ("on", "off") and think != (pair.thinking == "on"):
        err.print(f"[yellow]warning:[/] {pair.drafter} was trained with thinking {pair.thinking}; "
                  f"--{'think' if think else 'no-think'} will lower acceptance")
    _check_loaded(window, sinks, block_size, drafter)
    _warn_blas()
    session = ChatSession(tgt, drafter, tokenizer, system=system, think=think, window=window, sinks=sinks,
                          block_size=block_size, options=dict(max_tokens=max_tokens, temperature=temperature,
                                                              top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                                              verify=verify, stop=stop, draft_source=draft_source))
    interactive = sys.stdin.isatty()
    out = Console(highlight=False)
    if interactive:
        out.print(f"[dim]{escape(model)} — /help for commands, Ctrl-C stops a reply[/]")

    def show(response: GenerationResponse) -> None:
        sys.stdout.write(response.text)
        sys.stdout.flush()

    interrupts = 0
    # The prompt stays plain "> ": readline counts every character of it as a column, escapes included.
    with line_editing() if interactive else contextlib.nullcontext():
        while True:
            try:
                line = input("> " if interactive else "")
                interrupts = 0
            except EOFError:
                if interactive:  # Ctrl-D leaves the cursor after "> "; the shell's prompt starts on a fresh line
                    sys.stdout.write("\n")
                break
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts >= 2:
                    sys.stdout.write("\n")
                    break
                out.print("\n[dim](Ctrl-C again or /quit to leave)[/]")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not run_command(session, text, out):
                    break
                continue
            try:
                session.reply(text, on_response=show)
            except KeyboardInterrupt:
                pass  # the reply stops; its figures so far follow, marked interrupted
            except DFlashError as e:  # this message cannot be answered (too long, say); the chat goes on
                err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            stats = stats_line(session) if session.last else "interrupted before the first token"
            err.print(f"[dim]{escape(stats)}[/]", soft_wrap=True)


@app.command()
@user_errors
def bench(
    model: str = typer.Argument(..., help="Registry name, drafter repo/folder or bundle."),
    target: Optional[str] = TARGET,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prompt_tokens: Optional[str] = typer.Option(None, "--prompt-tokens", help="Context sweep: prompt lengths, e.g. 1024,4096,8192."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Tokens to decode per prompt."),
    dataset: str = typer.Option("all", "--dataset", help="math, code, chat, all (built in: the three interleaved), edit (a file asked back with one change), gsm8k, math500, humaneval, mbpp, mt-bench, or FILE.jsonl."),
    num_prompts: int = typer.Option(12, "--num-prompts", help="Most prompts to run."),
    block_size: Optional[int] = BLOCK_SIZE,
    draft_source: str = SOURCE,
    temperature: float = TEMP,
    repeats: int = typer.Option(1, "--repeats", help="Runs per prompt; the order of the two paths alternates."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write every figure, the machine and versions here."),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="Write speedup and tau vs context and the acceptance histogram (PNG)."),
    force: bool = typer.Option(False, "--force", help="Replace existing --json and --plot files."),
    score: bool = typer.Option(False, "--score", help="HumanEval/MBPP: run each completion's tests and report pass@1, "
                               "plain and dflash. This EXECUTES MODEL-WRITTEN CODE on this machine, each program in the "
                               "operating system's sandbox (bubblewrap or unshare, sandbox-exec): no network, no "
                               "writes outside an empty folder, a timeout; see the README for what remains)."),
    score_timeout: float = typer.Option(10.0, "--score-timeout", help="Seconds each program may run under --score."),
    score_unisolated: bool = typer.Option(False, "--score-unisolated", help="Where no sandbox works (bubblewrap or "
                                          "unshare on Linux, sandbox-exec on macOS), run --score's programs anyway, "
                                          "unconfined but for a timeout and limits."),
) -> None:
    """Measure DFlash against plain decoding of the same target, prompt by prompt, side by side.

    Ctrl-C stops early and keeps (prints and writes) the prompts measured so far.
    """
    from rich.progress import Progress

    from . import bench as b
    from .loader import load
    from .score import confinement, unisolated

    _check_options(block_size, max_tokens, window, sinks, draft_source=draft_source, temperature=temperature)
    if repeats < 1 or num_prompts < 1:
        raise DFlashError("--repeats and --num-prompts must be >= 1")
    if score and (dataset not in ("humaneval", "mbpp") or prompt_tokens):
        raise DFlashError("--score needs --dataset humaneval or mbpp (their prompts carry tests), without --prompt-tokens")
    if score_timeout <= 0:
        raise DFlashError(f"--score-timeout must be above 0, got {score_timeout:g}")
    if score and distributed.is_main():  # the only rank that runs the programs
        confinement(score_unisolated)  # refuses before minutes of decoding
    if distributed.is_main():  # the only rank that writes
        b.check_outputs({"--json": json_out, "--plot": plot_out}, force)
    if plot_out:
        b.require_matplotlib()
    lengths = None
    if prompt_tokens:
        try:
            lengths = [int(x) for x in prompt_tokens.split(",") if x.strip()]
        except ValueError:
            raise DFlashError(f"--prompt-tokens takes comma-separated integers, got {prompt_tokens!r}") from None
    if dataset.endswith(".jsonl"):
        conversations = b.read_jsonl(dataset)
    elif dataset in b.BUILTIN_SETS or dataset == "all":
        conversations = b.builtin(dataset)
    elif dataset in b.DATASETS:
        conversations = None  # fetched after the cheap checks
    else:
        b.fetch(dataset, num_prompts)  # raises the unknown-dataset error
    tgt, drafter, tokenizer = load(model, target)
    _check_loaded(window, sinks, block_size, drafter)
    _warn_blas()
    if lengths is not None:
        conversations = b.context_prompts(tokenizer, lengths, tgt.max_positions)
    elif conversations is None:
        conversations = b.fetch(dataset, num_prompts)
    else:
        conversations = conversations[:num_prompts]

    planned = sum(max(1, len(c.turns)) for c in conversations)
    records: list[dict[str, Any]] = []
    interrupted = False
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("bench", total=planned)

        def done(record: dict[str, Any]) -> None:
            records.append(record)
            progress.advance(task)

        try:
            b.measure(tgt, drafter, tokenizer, conversations, max_tokens=max_tokens, block_size=block_size,
                      draft_source=draft_source, window=window, sinks=sinks, temperature=temperature, repeats=repeats,
                      on_record=done)
        except KeyboardInterrupt:  # minutes of measurements are worth keeping
            interrupted = True
    if interrupted and not records:
        err.print("[yellow]interrupted[/] before the first prompt was measured; nothing written")
        raise typer.Exit(130)

    settings = {"model": model, "target": target, "window": window, "sinks": sinks,
                "block_size": block_size or drafter.block_size, "policy": "fixed" if block_size else "adaptive",
                "draft_source": draft_source,
                "max_tokens": max_tokens, "temperature": temperature, "repeats": repeats, "dataset": dataset}
    report = b.report(settings, records, planned, interrupted)
    console = Console(highlight=False, soft_wrap=True)  # long lines wrap instead of being cut
    b.print_report(report, console)
    peak = max((r["dflash"]["peak_memory_gb"] for r in records), default=0.0)
    report["group"] = distributed.describe()
    report["rank_peak_memory_gb"] = [peak] if interrupted else distributed.gather(peak)  # ranks stop apart on Ctrl-C
    lossless = True
    if score and distributed.is_main():  # after the gather: a Ctrl-C here stops this rank alone
        try:
            with err.status("running the completions' tests"), unisolated(score_unisolated):
                report["score"] = b.score(records, conversations, tokenizer, score_timeout)
            lossless = b.print_score(report["score"], temperature, console)
        except KeyboardInterrupt:  # the measurements are still written
            interrupted = True
            err.print("[yellow]interrupted[/] while scoring: no pass@1")
    if json_out and distributed.is_main():
        write_atomic(json_out, json.dumps(report, indent=1))
    if plot_out and distributed.is_main():
        b.plot(report, plot_out)
    if interrupted:
        kept = " and ".join(p for p in (json_out, plot_out) if p)
        err.print(f"[yellow]interrupted:[/] measured {len(records)} of {planned} prompts"
                  + (f"; written to {escape(kept)}" if kept else ""), soft_wrap=True)
        raise typer.Exit(130)
    if not lossless:
        raise typer.Exit(1)


def _size(text: str, flag: str) -> int:
    """'8GB', '512MiB', '1.5G' or plain bytes, in bytes."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    value = text.strip().upper().removesuffix("B")
    number = value.rstrip("KMGTI")
    try:
        size = float(number) * units[value[len(number):]]
    except (ValueError, KeyError):
        raise DFlashError(f"{flag} takes a size like 8GB, 512MiB or a number of bytes, got {text!r}") from None
    if size <= 0:
        raise DFlashError(f"{flag} must be above 0, got {text!r}")
    return int(size)


def _cache_dir(path: str) -> Path:
    """A folder for the prompt cache: made if missing, refused in one line if it cannot be written."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise DFlashError(f"--prompt-cache-dir {path} is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"--prompt-cache-dir {path}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK):
        raise DFlashError(f"--prompt-cache-dir {path} is not writable")
    return folder


def _duration(text: str) -> float:
    """'90', '90s', '15m' or '1.5h' in seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise DFlashError(f"--time takes a duration like 90s, 15m or 1.5h, got {text!r}") from None


@app.command()
@user_errors
def train(
    target: str = typer.Argument(..., help="Target to train a drafter for: repo id or folder."),
    out: str = typer.Option(..., "--out", "-o", help="Folder for the drafter (z-lab layout) and its checkpoint."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL of prompts \\[default: a small built-in set]."),
    layers: int = typer.Option(1, "--layers", help="Draft layers."),
    block_size: int = typer.Option(16, "--block-size", help="Block size to train for."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Comma-separated target layers to read."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Training steps \\[default: 200]."),
    time_budget: Optional[str] = typer.Option(None, "--time", help="Training time instead of steps, e.g. 15m."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, cosine, 4% warmup)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT's last checkpoint."),
) -> None:
    """Train a DFlash drafter for TARGET on the target's own outputs, on this machine."""
    if not distributed.is_main():  # it writes files and shards nothing: under mlx.launch rank 0 runs it alone
        return
    from datetime import timedelta

    from rich.table import Column

    from .train import CHECKPOINT, saved_step
    from .train import train as run

    if steps is not None and time_budget is not None:
        raise DFlashError("pass --steps or --time, not both")
    ids = None
    if target_layer_ids:
        try:
            ids = [int(x) for x in target_layer_ids.split(",")]
        except ValueError:
            raise DFlashError(f"--target-layer-ids takes comma-separated integers, got {target_layer_ids!r}") from None
    budget = _duration(time_budget) if time_budget else None

    def text(template: str) -> TextColumn:
        return TextColumn(template, table_column=Column(no_wrap=True))

    # The texts never wrap; the bar takes the width left over, so "step N/total" and the time fit in 80 columns.
    bar = Progress(text("{task.description}"), text("{task.fields[count]}"), BarColumn(bar_width=None),
                   text("{task.fields[time]}"), text("{task.fields[info]}"), console=err, transient=True)
    tasks: dict[str, Any] = {}

    def clock(seconds: Optional[float]) -> str:
        return "-:--:--" if seconds is None else str(timedelta(seconds=round(seconds)))

    def show(event: dict[str, Any]) -> None:
        phase = event["phase"]
        if phase == "done":
            return
        if not tasks:
            bar.start()
        if phase not in tasks:  # the fields exist from the start: the bar renders in its own thread
            tasks[phase] = bar.add_task(phase, total=1.0 if phase == "train" else event["total"], count="", time="", info="")
        task = tasks[phase]
        if phase == "train":
            step, spent = event["step"], event["elapsed"]  # seconds of training, resumed runs included
            if budget is None:
                count, timing = f"step {step}/{event['steps']}", f"ETA {clock(spent / step * (event['steps'] - step))}"
            else:
                count, timing = f"step {step}", f"{clock(spent)} elapsed, {clock(max(0.0, budget - spent))} left"
            info = f"loss {event['loss']:.3f} | {event['tokens_per_s']:.0f} tok/s"
            bar.update(task, completed=event["progress"], count=count, time=timing, info=info)
        else:  # generate, eval: rich estimates the time left from the pace so far
            bar.update(task, completed=event["done"], count=f"{event['done']}/{event['total']}")
            bar.update(task, time=f"ETA {clock(bar.tasks[task].time_remaining)}")

    try:
        result = run(target, out, prompts=prompts, layers=layers, block_size=block_size, target_layer_ids=ids,
                     steps=steps, time_budget=budget, lr=lr, batch_size=batch_size, resume=resume, progress=show)
    except KeyboardInterrupt:  # train() has checkpointed the last completed step, if training had begun
        step = saved_step(out)
        if step is None:
            err.print("\n[yellow]interrupted[/] before the first training step; nothing was saved", soft_wrap=True)
        else:
            where = escape(str(Path(out).expanduser() / CHECKPOINT))
            err.print(f"\n[yellow]interrupted:[/] checkpoint of step {step} saved in {where}; "
                      "run the same command with --resume to continue", soft_wrap=True)
        raise typer.Exit(130)
    finally:
        if tasks:  # started by the first progress event: stopping an unstarted bar prints a blank line
            bar.stop()
    tau = f"{result.tau:.2f}" if result.tau is not None else "n/a"
    Console(highlight=False).print(
        f"{result.output}: {result.steps} steps, final loss {result.loss:.3f}, "
        f"{result.tokens_per_s:.0f} tok/s, held-out tau {tau} (block {block_size})",
        soft_wrap=True,
    )
    if result.looping and result.looping == result.evaluated:
        err.print(f"[bold red]warning:[/] all {result.evaluated} held-out replies of the target loop on a short span: "
                  "that tau measures the loop, not the drafter (is the target trained enough?)", soft_wrap=True)
    elif result.looping:
        err.print(f"[yellow]note:[/] {result.looping} of {result.evaluated} held-out replies loop, which inflates tau",
                  soft_wrap=True)


@app.command()
@user_errors
def serve(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle \\[default: fits this machine]."),
    target: Optional[str] = TARGET,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require this key (Authorization: Bearer KEY, or x-api-key: KEY)."),
    block_size: Optional[int] = BLOCK_SIZE,
    draft_source: str = SOURCE,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prefill_step_size: Optional[int] = PREFILL_STEP,
    chat_template: Optional[str] = TEMPLATE,
    temperature: float = typer.Option(0.0, "--temp", help="Temperature of requests that set none (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="top_p of requests that set none."),
    top_k: int = typer.Option(0, "--top-k", help="top_k of requests that set none."),
    min_p: float = typer.Option(0.0, "--min-p", help="min_p of requests that set none."),
    max_tokens: int = typer.Option(4096, "--max-tokens", "-m", help="Token budget of requests that set none."),
    allowed_origins: Optional[str] = typer.Option(
        None, "--allowed-origins", help="CORS: comma-separated origins browser pages may call from ('*': any) \\[default: none]."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info (a line per request), warning or error."),
    cache_entries: int = typer.Option(10, "--prompt-cache-size", help="Conversations' caches kept in memory."),
    cache_bytes: Optional[str] = typer.Option(
        None, "--prompt-cache-bytes", help="Memory cap of the kept caches, e.g. 8GB \\[default: a quarter of memory]."),
    cache_dir: Optional[str] = typer.Option(
        None, "--prompt-cache-dir", help="Keep the caches on disk too, here; a restart resumes from them \\[default: off]."),
    cache_disk_bytes: str = typer.Option("20GB", "--prompt-cache-disk-bytes", help="Size cap of --prompt-cache-dir."),
    keepalive: float = typer.Option(
        15.0, "--keepalive", help="Seconds of silence (queue, prefill) after which a stream carries a keep-alive."),
) -> None:
    """Serve the pair over OpenAI's, Anthropic's and the Responses API (Claude Code, Codex, editors; tools, reasoning)."""
    from .server.request import Defaults
    from .system import install_hint, machine_description

    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise DFlashError(f"serve needs its HTTP stack: {install_hint('serve', 'starlette', 'uvicorn', 'prometheus-client')}"
                          ) from None
    from .server import Engine
    from .server import serve as run

    _check_options(block_size, max_tokens, window, sinks, prefill_step_size, draft_source, temperature=temperature,
                   top_p=top_p, top_k=top_k, min_p=min_p)
    if not 0 < port < 65536:
        raise DFlashError(f"--port must be between 1 and 65535, got {port}")
    if not 0 < keepalive <= 3600:
        raise DFlashError(f"--keepalive must be between 0 and 3600 seconds, got {keepalive}")
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise DFlashError(f"--log-level takes debug, info, warning or error, got {log_level!r}")
    origins = tuple(o.strip() for o in (allowed_origins or "").split(",") if o.strip())
    if cache_entries < 1:
        raise DFlashError(f"--prompt-cache-size must be >= 1, got {cache_entries}")
    memory_cap = _size(cache_bytes, "--prompt-cache-bytes") if cache_bytes else None
    disk_cap = _size(cache_disk_bytes, "--prompt-cache-disk-bytes")
    directory = _cache_dir(cache_dir) if cache_dir is not None else None
    with err.status("loading the model"):
        model, tgt, drafter, tokenizer = _load(model, target, chat_template)
    _check_loaded(window, sinks, block_size, drafter)
    _warn_blas()
    if memory_cap is None and tgt.group is None:
        memory_cap = machine_description()["memory_bytes"] // 4
    engine = Engine(tgt, drafter, tokenizer, name=model, window=window, sinks=sinks, block_size=block_size,
                    draft_source=draft_source, prefill_step_size=prefill_step_size,
                    defaults=Defaults(temperature, top_p, top_k, min_p, max_tokens),
                    cache_entries=cache_entries, cache_bytes=memory_cap, cache_dir=directory,
                    cache_disk_bytes=disk_cap)
    if not distributed.is_main():  # rank 0 listens and hands each request over
        engine.follow()
        return
    run(engine, host, port, api_key, allowed_origins=origins, log_level=log_level, keepalive=keepalive,
        on_ready=lambda: err.print(
            f"serving [bold]{escape(model)}[/] at http://{host}:{port}/v1 (OpenAI's chat and Responses APIs, "
            "Anthropic's at /v1/messages; Ctrl-C stops)", soft_wrap=True))
    err.print("stopped")
