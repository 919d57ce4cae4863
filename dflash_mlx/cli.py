"""The ``dflash-mlx`` command line: a thin layer over the library API."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__
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
    """One clear line on stderr, exit status 2."""
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
    pass


TARGET = typer.Option(None, "--target", "-t", help="Target: repo id or folder (original, converted or quantized).")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate (per reply).")
BLOCK_SIZE = typer.Option(None, "--block-size", "-b", help="Draft a full block of N every cycle [default: adaptive, up to the drafter's block].")
WINDOW = typer.Option(None, "--window", "-w", help="Attend to the last N positions only (bounded memory).")
SINKS = typer.Option(0, "--sinks", help="With --window: first positions that are never evicted.")
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 decodes greedily.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the smallest set with this much mass.")
TOP_K = typer.Option(0, "--top-k", help="Sample from the k most likely tokens only (0: all).")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top token's probability.")
SEED = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
VERIFY = typer.Option("rejection", "--verify", help="Sampled verification: rejection (accepts more) or match.")


def _check_options(block_size: Optional[int], max_tokens: int, window: Optional[int], sinks: int, **sampling: Any) -> None:
    """Fail on bad flag values before loading gigabytes of weights."""
    from .caches import check_window
    from .sampling import Sampling

    if block_size is not None and block_size < 1:
        raise DFlashError(f"--block-size must be >= 1, got {block_size}")
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1, got {max_tokens}")
    if window is not None:
        check_window(window, sinks, block_size or 1)
    Sampling(**sampling)


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
    prefill_step_size: Optional[int] = typer.Option(
        None, "--prefill-step", help="Prefill this many tokens at a time [default: 2048, window/16 with --window]."
    ),
    temperature: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: Optional[int] = SEED,
    verify: str = VERIFY,
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate a reply to one prompt, losslessly, with DFlash speculative decoding."""
    from .generate import GenerationResponse
    from .generate import generate as run
    from .loader import load

    _check_options(block_size, max_tokens, window, sinks, temperature=temperature, top_p=top_p, top_k=top_k,
                   min_p=min_p, seed=seed, verify=verify)
    if prompt == "-":
        prompt = sys.stdin.read()
    tgt, drafter, tokenizer = load(draft, target)
    ids: Any = prompt
    if chat_template and tokenizer.has_chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)

    def show(response: GenerationResponse) -> None:
        if not as_json:
            sys.stdout.write(response.text)
            sys.stdout.flush()

    with prefill_progress() as progress:
        result = run(
            tgt, drafter, tokenizer, ids, on_response=show, max_tokens=max_tokens, block_size=block_size,
            window=window, sinks=sinks, prefill_step_size=prefill_step_size, prompt_progress_callback=progress,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, verify=verify,
        )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    sys.stdout.write("\n")
    err.print(
        f"[dim]prompt {result.prompt_tokens} tok @ {result.prompt_tps:.1f} tok/s | "
        f"generated {result.generation_tokens} tok @ {result.generation_tps:.1f} tok/s | "
        f"tau {result.tau:.2f} | peak {result.peak_memory:.2f} GB | {result.finish_reason}[/]",
        soft_wrap=True,
    )


def _converted_bundles() -> list[Path]:
    """Bundles in the current folder and in ~/.cache/dflash-mlx (where users keep them)."""
    from .registry import is_bundle

    places = [Path.cwd(), Path.home() / ".cache" / "dflash-mlx"]
    return sorted({p.resolve() for place in places if place.is_dir() for p in place.iterdir() if p.is_dir() and is_bundle(p)})


@app.command()
@user_errors
def models(as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON.")) -> None:
    """List the published drafter -> target pairs, and which are already downloaded or converted."""
    from huggingface_hub import scan_cache_dir
    from rich.table import Table

    from .registry import pairs

    try:
        cached = {repo.repo_id for repo in scan_cache_dir().repos}
    except Exception:  # no cache folder yet, or an unreadable one
        cached = set()
    converted = {}
    for bundle in _converted_bundles():
        manifest = json.loads((bundle / "dflash.json").read_text())
        converted.setdefault(manifest.get("drafter"), []).append(str(bundle))
    rows = [
        dict(drafter=p.drafter, target=p.target, architecture=p.model_type, supported=p.supported,
             thinking=p.thinking, block_size=p.block_size, memory_gb=p.memory_gb,
             downloaded=p.drafter in cached and p.target in cached, converted=converted.get(p.drafter, []))
        for p in pairs()
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title="DFlash drafters (z-lab/...)", show_lines=False)
    widths = {"runs": 4, "think": 5, "~GB": 4, "local": 10}
    for col in ("drafter", "target", "runs", "think", "~GB", "local"):
        table.add_column(col, overflow="fold", min_width=widths.get(col))
    for r in rows:
        local = "converted" if r["converted"] else ("downloaded" if r["downloaded"] else "")
        runs = "yes" if r["supported"] else f"[dim]not yet ({r['architecture']})[/]"
        table.add_row(r["drafter"].removeprefix("z-lab/"), r["target"], runs, r["thinking"], str(r["memory_gb"]), local)
    blocks = sorted({r["block_size"] for r in rows})
    table.caption = f"block size {', '.join(map(str, blocks))}; --json has every field"
    Console(highlight=False).print(table)


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

    with err.status("checking the pair") as status:  # transient: only the result or one error line stays
        path = run(source, out, target=target, quantize=quantize, q_group_size=q_group_size, dtype=dtype,
                   draft_quantize=draft_quantize, quantize_fc=quantize_fc, force=force, log=status.update)
    typer.echo(str(path))


@app.command()
@user_errors
def doctor() -> None:
    """Check the MLX backend, the BLAS, versions, the Hugging Face cache and converted bundles."""
    import mlx.core as mx
    from huggingface_hub import constants

    from .system import blas_library, find_openblas, is_reference_blas, machine_description

    info = machine_description()
    out = Console(highlight=False, soft_wrap=True)
    backend = "Metal GPU" if info["backend"] == "metal" else "CPU"
    memory = info["memory_bytes"] / 2**30
    if info["backend"] == "metal":
        memory = mx.device_info().get("memory_size", info["memory_bytes"]) / 2**30
    out.print(f"MLX backend   {backend} ({info['processor']}), {memory:.1f} GiB memory")
    if sys.platform == "linux":
        blas = blas_library() or "unknown"
        if is_reference_blas():
            fix = (f"run with LD_PRELOAD={find_openblas()}" if find_openblas()
                   else "apt-get install libopenblas0-pthread, then preload it (the bench scripts do)")
            out.print(f"BLAS          [bold red]reference BLAS[/] {blas}: speculative decoding cannot win; {fix}")
        else:
            out.print(f"BLAS          {blas}")
    out.print(f"versions      mlx {info['mlx']}, mlx-lm {info['mlx-lm']}, dflash-mlx {info['dflash-mlx']}")
    out.print(f"HF cache      {constants.HF_HUB_CACHE}")
    bundles = _converted_bundles()
    out.print("bundles       " + (", ".join(map(str, bundles)) if bundles else "none found (cwd, ~/.cache/dflash-mlx)"))


@app.command()
@user_errors
def chat(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle [default: fits this machine]."),
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
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Most tokens per reply."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's thinking mode."),
) -> None:
    """Chat interactively; each turn prefills only the new message. Pipe lines in to script it."""
    from .chat import ChatSession, run_command, stats_line
    from .generate import GenerationResponse
    from .loader import load
    from .registry import default_pair, find
    from .system import machine_description

    _check_options(block_size, max_tokens, window, sinks, temperature=temperature, top_p=top_p, top_k=top_k,
                   min_p=min_p, seed=seed, verify=verify)
    if model is None:
        model = default_pair(machine_description()["memory_bytes"]).drafter
        err.print(f"[dim]no model given: using {escape(model)} (fits this machine's memory)[/]")
    pair = find(model)
    if pair is not None and think is not None and pair.thinking in ("on", "off") and think != (pair.thinking == "on"):
        err.print(f"[yellow]warning:[/] {pair.drafter} was trained with thinking {pair.thinking}; "
                  f"--{'think' if think else 'no-think'} will lower acceptance")
    tgt, drafter, tokenizer = load(model, target)
    if window is not None:
        _check_options(block_size or drafter.block_size, max_tokens, window, sinks)
    session = ChatSession(tgt, drafter, tokenizer, system=system, think=think, window=window, sinks=sinks,
                          block_size=block_size, options=dict(max_tokens=max_tokens, temperature=temperature,
                                                              top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                                              verify=verify))
    interactive = sys.stdin.isatty()
    out = Console(highlight=False)
    if interactive:
        out.print(f"[dim]{escape(model)} — /help for commands, Ctrl-C stops a reply[/]")
    interrupts = 0
    while True:
        try:
            line = input("> " if interactive else "")
            interrupts = 0
        except EOFError:
            break
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts >= 2:
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
        def show(response: GenerationResponse) -> None:
            sys.stdout.write(response.text)
            sys.stdout.flush()

        try:
            session.reply(text, on_response=show)
        except KeyboardInterrupt:
            out.print("\n[yellow]stopped[/]")
            continue
        sys.stdout.write("\n")
        err.print(f"[dim]{stats_line(session)}[/]", soft_wrap=True)


@app.command()
@user_errors
def bench(
    model: str = typer.Argument(..., help="Registry name, drafter repo/folder or bundle."),
    target: Optional[str] = TARGET,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prompt_tokens: Optional[str] = typer.Option(None, "--prompt-tokens", help="Context sweep: prompt lengths, e.g. 1024,4096,8192."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Tokens to decode per prompt."),
    dataset: str = typer.Option("all", "--dataset", help="math, code, chat, all (built in), gsm8k, math500, humaneval, mbpp, mt-bench, or FILE.jsonl."),
    num_prompts: int = typer.Option(12, "--num-prompts", help="Most prompts to run."),
    block_size: Optional[int] = BLOCK_SIZE,
    temperature: float = TEMP,
    repeats: int = typer.Option(1, "--repeats", help="Runs per prompt; the order of the two paths alternates."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write every figure, the machine and versions here."),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="Write speedup/tau vs context and the acceptance histogram (PNG)."),
) -> None:
    """Measure DFlash against plain decoding of the same target, prompt by prompt, side by side."""
    from rich.progress import Progress
    from rich.table import Table

    from . import bench as b
    from .loader import load
    from .system import find_openblas, is_reference_blas, machine_description

    _check_options(block_size, max_tokens, window, sinks, temperature=temperature)
    if repeats < 1 or num_prompts < 1:
        raise DFlashError("--repeats and --num-prompts must be >= 1")
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
    if is_reference_blas():
        fix = f"LD_PRELOAD={find_openblas()} dflash-mlx bench ..." if find_openblas() else "apt-get install libopenblas0-pthread"
        err.print(f"[bold red]WARNING: MLX runs on the reference BLAS: these numbers are meaningless for speculation. Fix: {fix}[/]",
                  soft_wrap=True)
    tgt, drafter, tokenizer = load(model, target)
    if window is not None:
        _check_options(block_size or drafter.block_size, max_tokens, window, sinks)
    if lengths is not None:
        conversations = b.context_prompts(tokenizer, lengths, getattr(tgt.lm.args, "max_position_embeddings", None))
    elif conversations is None:
        conversations = b.fetch(dataset, num_prompts)
    else:
        conversations = conversations[:num_prompts]

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("bench", total=sum(max(1, len(c.turns)) for c in conversations))
        records = b.measure(tgt, drafter, tokenizer, conversations, max_tokens=max_tokens, block_size=block_size,
                            window=window, sinks=sinks, temperature=temperature, repeats=repeats,
                            on_record=lambda r: progress.advance(task))
    summary = b.summarize(records)
    out = Console(highlight=False)
    table = Table(title=f"dflash vs plain decoding — {model}")
    for col in ("prompt", "tokens", "plain tok/s", "dflash tok/s", "speedup", "tau", "prefill tok/s", "peak GB", "flags"):
        table.add_column(col)
    for r in records:
        table.add_row(f"{r['prompt']}" + (f" t{r['turn']}" if r["turn"] else ""), str(r["prompt_tokens"]),
                      f"{r['plain']['decode_tps']:.1f}", f"{r['dflash']['decode_tps']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['tau']:.2f}", f"{r['dflash']['prefill_tps']:.0f}", f"{r['dflash']['peak_memory_gb']:.2f}",
                      "; ".join(r["flagged"]))
    out.print(table)
    out.print("drafted tokens per cycle (depth:cycles; 0 = plain decoding step):")
    for r in records:
        out.print(f"  {r['prompt']}" + (f" t{r['turn']}" if r["turn"] else "") + f"  {b.depths_text(r['depth_histogram'])}")
    if summary["speedup"] is not None:
        s, t = summary["speedup"], summary["tau"]
        out.print(f"speedup median {s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f}); "
                  f"tau median {t['median']:.2f} over {summary['prompts'] - summary['flagged']} prompts")
    if summary["flagged"]:
        out.print(f"[yellow]{summary['flagged']} flagged prompt(s) left out of the headline figures[/]")
    if json_out:
        report = {"model": model, "target": target, "window": window, "sinks": sinks, "block_size": block_size or drafter.block_size,
                  "policy": "fixed" if block_size else "adaptive",
                  "max_tokens": max_tokens, "temperature": temperature, "repeats": repeats, "dataset": dataset,
                  "machine": machine_description(), "summary": summary, "records": records}
        write_atomic(json_out, json.dumps(report, indent=1))
    if plot_out:
        b.plot(records, summary, plot_out)


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
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL of prompts [default: a small built-in set]."),
    layers: int = typer.Option(1, "--layers", help="Draft layers."),
    block_size: int = typer.Option(16, "--block-size", help="Block size to train for."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Comma-separated target layers to read."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Training steps [default: 200]."),
    time_budget: Optional[str] = typer.Option(None, "--time", help="Training time instead of steps, e.g. 15m."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, cosine, 4% warmup)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT's last checkpoint."),
) -> None:
    """Train a DFlash drafter for TARGET on the target's own outputs, on this machine."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .train import train as run

    if steps is not None and time_budget is not None:
        raise DFlashError("pass --steps or --time, not both")
    ids = None
    if target_layer_ids:
        try:
            ids = [int(x) for x in target_layer_ids.split(",")]
        except ValueError:
            raise DFlashError(f"--target-layer-ids takes comma-separated integers, got {target_layer_ids!r}") from None
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), console=err, transient=True)
    tasks: dict[str, Any] = {}

    def show(event: dict[str, Any]) -> None:
        phase = event.get("phase")
        if phase == "done":
            return
        if not tasks:
            bar.start()
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=event.get("total") or event.get("steps") or 1, info="")
        if phase == "train":
            info = f"loss {event['loss']:.3f} | {event['tokens_per_s']:.0f} tok/s | lr {event['lr']:.1e}"
            done = event["progress"] * bar.tasks[tasks[phase]].total
        else:
            info, done = f"{event.get('done', 0)}/{event.get('total', 0)}", event.get("done", 0)
        bar.update(tasks[phase], completed=done, info=info)

    budget = _duration(time_budget) if time_budget else None
    try:
        result = run(target, out, prompts=prompts, layers=layers, block_size=block_size, target_layer_ids=ids,
                     steps=steps, time_budget=budget, lr=lr, batch_size=batch_size, resume=resume, progress=show)
    finally:
        if tasks:  # started by the first progress event: stopping an unstarted bar prints a blank line
            bar.stop()
    tau = f"{result.tau:.2f}" if result.tau is not None else "n/a"
    Console(highlight=False).print(
        f"{result.output}: {result.steps} steps, final loss {result.loss:.3f}, "
        f"{result.tokens_per_s:.0f} tok/s, held-out tau {tau} (block {block_size})",
        soft_wrap=True,
    )
