"""The command line's frame: the Typer app, and how errors and Ctrl-C end a command (the options commands share are
in ``options``).

Commands live in ``main`` (and ``serve``, ``train``); every one is wrapped in ``user_errors`` so that a
``DFlashError`` is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from .. import __version__, distributed
from ..errors import DFlashError

if TYPE_CHECKING:
    from ..decode.settings import CacheLayout

err = Console(stderr=True, highlight=False)


# Click's exceptions as the Typer in use raises them (recent Typers carry a click of their own).
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_NoArgsIsHelp = getattr(sys.modules[_UsageError.__module__], "NoArgsIsHelpError", ())


class _OneLineUsageErrors(TyperGroup):
    """Click's usage errors (a mistyped number, an unknown flag, a missing argument) as one ``error:`` line and exit
    status 2, as every other bad input is, rather than a usage block and a boxed panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NoArgsIsHelp as e:  # a bare command: Typer has shown its help
            sys.exit(e.exit_code)
        except _UsageError as e:
            where = f" (see {e.ctx.command_path} --help)" if e.ctx else ""
            err.print(f"[bold red]error:[/] {escape(e.format_message())}{escape(where)}", soft_wrap=True)
            sys.exit(2)
        except _ClickException as e:
            err.print(f"[bold red]error:[/] {escape(e.format_message())}", soft_wrap=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.exit(1)
        sys.exit(code if type(code) is int else 0)  # a command's own return value is not a status

    # Help shows a flag bare: recent Typers label every option with its type, flags too ("--json <bool>", as if it
    # took a value). A flag's metavar set empty leaves the type column blank for it, here and in every command.
    def format_help(self, ctx: Any, formatter: Any) -> None:
        _bare_flags(self, ctx)
        super().format_help(ctx, formatter)

    def get_command(self, ctx: Any, name: str) -> Any:
        command = super().get_command(ctx, name)
        if command is not None:
            _bare_flags(command, ctx)
        return command


def _bare_flags(command: Any, ctx: Any) -> None:
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


app = typer.Typer(
    cls=_OneLineUsageErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="DFlash block-diffusion speculative decoding on Apple Silicon, in pure MLX.",
)


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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Under ``mlx.launch`` every rank runs the command; only rank 0 speaks (errors aside).

    Run as the ``dflash-mlx`` command on Linux, it first restarts itself on OpenBLAS where MLX would
    multiply with the reference BLAS and OpenBLAS is installed (as the bench scripts do): the README's
    commands run at full speed without an LD_PRELOAD to remember. ``DFLASH_MLX_BLAS_WARNING=0`` leaves
    the BLAS as loaded (and silences the warning), which the test suite relies on.
    """
    if Path(sys.argv[0]).name == "dflash-mlx" and os.environ.get("DFLASH_MLX_BLAS_WARNING") != "0":
        from ..system import reexec_with_openblas

        reexec_with_openblas()
    try:
        quiet = not distributed.is_main()
    except DFlashError as e:
        fail(str(e))
    if quiet:
        err.quiet = True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def before_decoding(layout: CacheLayout, target: Any, drafter: Any) -> None:
    """Once the pair is loaded: the flags that depend on it (the layout against the pair), then a warning if this
    machine's BLAS is slow.

    Every command that decodes gives that warning (Linux only). ``DFLASH_MLX_BLAS_WARNING=0``
    silences it, for those who know (the test suite, which checks what else the commands print).
    """
    from ..system import blas_check

    layout.of_pair(target, drafter)
    verdict = blas_check()
    if verdict is not None and verdict[0] != "ok" and os.environ.get("DFLASH_MLX_BLAS_WARNING") != "0":
        warn(verdict[1])
