"""Transient progress bars for the long phases, prefill and training: shown while they run, gone after."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Column


@contextlib.contextmanager
def prefill_progress(console: Console) -> Iterator[Callable[[int, int], None]]:
    """A bar for prompts that take more than one prefill chunk (a shorter one shows none)."""
    bar = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=console, transient=True)
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


def _text(template: str) -> TextColumn:
    return TextColumn(template, table_column=Column(no_wrap=True))


def _clock(seconds: Optional[float]) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=round(seconds)))


@contextlib.contextmanager
def training_progress(console: Console, budget: Optional[float]) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A bar per phase of train() (generate, features, train, eval), fed its progress events; ``budget``: seconds of --time."""
    # The texts never wrap; the bar takes the width left over, so "step N/total" and the time fit in 80 columns.
    bar = Progress(_text("{task.description}"), _text("{task.fields[count]}"), BarColumn(bar_width=None),
                   _text("{task.fields[time]}"), _text("{task.fields[info]}"), console=console, transient=True)
    tasks: dict[str, TaskID] = {}

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
                count, timing = f"step {step}/{event['steps']}", f"ETA {_clock(spent / step * (event['steps'] - step))}"
            else:
                count, timing = f"step {step}", f"{_clock(spent)} elapsed, {_clock(max(0.0, budget - spent))} left"
            info = f"loss {event['loss']:.3f} | {event['tokens_per_s']:.0f} tok/s"
            bar.update(task, completed=event["progress"], count=count, time=timing, info=info)
        else:  # generate, features, eval: rich estimates the time left from the pace so far
            bar.update(task, completed=event["done"], count=f"{event['done']}/{event['total']}")
            bar.update(task, time=f"ETA {_clock(bar.tasks[task].time_remaining)}")

    try:
        yield show
    finally:
        if tasks:  # started by the first progress event: stopping an unstarted bar prints a blank line
            bar.stop()
