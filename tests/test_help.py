"""`--help` at 80 columns shows the defaults written into help strings (Rich markup would eat `[default: ...]`)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from dflash_mlx.cli.main import app

COMMANDS = typer.main.get_command(app).commands


def _written_defaults(command) -> list[str]:
    """The `[default: ...]` texts in a command's parameter help, as the user should read them."""
    helps = [getattr(p, "help", None) or "" for p in command.params]
    return [m for h in helps for m in re.findall(r"\[default:[^\]]*\]", h.replace("\\[", "["))]


def _flat(text: str) -> str:
    """Help text without whitespace and box drawing, so a phrase wrapped across lines still matches."""
    return re.sub(r"[\s\u2500-\u257f]", "", text)


def test_some_help_strings_write_their_default():
    assert sum(len(_written_defaults(c)) for c in COMMANDS.values()) >= 5  # the test below is not vacuous


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_written_defaults(name):
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, [name, "--help"])
    assert result.exit_code == 0, result.output
    shown = _flat(result.stdout)
    for default in _written_defaults(COMMANDS[name]):
        assert _flat(default) in shown, f"{name} --help lost {default!r}:\n{result.stdout}"
