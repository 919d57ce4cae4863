"""The ``dflash-mlx`` command line: a thin layer over the library API."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__
from .errors import DFlashError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="DFlash block-diffusion speculative decoding on Apple Silicon, in pure MLX.",
)
err = Console(stderr=True, highlight=False)


def fail(message: str) -> None:
    """One clear line on stderr, exit status 2."""
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)
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


@app.command()
@user_errors
def generate(
    draft: str = typer.Argument(..., help="DFlash drafter: Hugging Face repo id or local folder."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target model: repo id or local folder."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt ('-' reads stdin)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate."),
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b", help="Draft block size (default: the drafter's)."),
    window: Optional[int] = typer.Option(None, "--window", "-w", help="Attend to the last N positions only (bounded memory)."),
    sinks: int = typer.Option(0, "--sinks", help="With --window: first positions that are never evicted."),
    prefill_step_size: Optional[int] = typer.Option(
        None, "--prefill-step", help="Prefill this many tokens at a time [default: 2048, window/16 with --window]."
    ),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate a reply to one prompt, losslessly, with DFlash speculative decoding."""
    from .generate import GenerationResponse
    from .generate import generate as run
    from .loader import load

    if block_size is not None and block_size < 1:
        raise DFlashError(f"--block-size must be >= 1, got {block_size}")
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1, got {max_tokens}")
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
