"""The chat command's loop: read a line, carry out a slash command or stream the reply and its figures.

The same loop serves a terminal (a "> " prompt, line editing, Ctrl-C handling) and a pipe
(plain lines in, replies out), so that a chat can be scripted.
"""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.markup import escape

from ..decode.chat import ChatSession, line_editing, run_command, stats_line
from ..decode.generate import GenerationResponse
from ..errors import DFlashError


def converse(session: ChatSession, model: str, err: Console) -> None:
    """Until Ctrl-D, /quit or two Ctrl-C in a row at the prompt; a Ctrl-C during a reply stops that reply alone."""
    interactive = sys.stdin.isatty()
    out = Console(highlight=False)
    if interactive:
        out.print(f"[dim]{escape(model)} — /help for commands, Ctrl-C stops a reply[/]")
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
            _reply(session, text, err)


def _reply(session: ChatSession, text: str, err: Console) -> None:
    """Stream the reply to stdout, then its figures to stderr; a message that cannot be answered is one error line."""
    try:
        session.reply(text, on_response=_show)
    except KeyboardInterrupt:
        pass  # the reply stops; its figures so far follow, marked interrupted
    except DFlashError as e:  # this message cannot be answered (too long, say); the chat goes on
        err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = stats_line(session) if session.last else "interrupted before the first token"
    err.print(f"[dim]{escape(stats)}[/]", soft_wrap=True)


def _show(response: GenerationResponse) -> None:
    sys.stdout.write(response.text)
    sys.stdout.flush()
