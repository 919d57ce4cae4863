"""The coding agents people run, end to end: Claude Code, Codex CLI and Qwen Code, installed from npm at the versions
`make agents` pins, against a real `serve` process on a loopback port.

The target is the scripted agent fixture (conftest.agent_dir): its tokenizer compresses an agent's 40-80k characters
of tools and instructions into 11-20k tokens, and it has Qwen3-8B's 40,960 positions, which each agent asks more of
than it holds (Claude Code 128,000 output tokens, Qwen Code 32,000). Asked to run "echo dflash-ok", it calls the
agent's own shell tool; the agent runs the command and sends its output back; only an output holding the marker
makes it answer "The command printed dflash-ok." So each tool loop below proves the whole round trip.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import finish, start_server

BIN = Path(__file__).resolve().parent.parent / ".agents" / "node_modules" / ".bin"
KEY = "sk-agents"
HELLO = "Hello! I am a scripted model."
RUN = "Run echo dflash-ok with your shell tool."
ECHOED = "The command printed dflash-ok."


def _cli(name: str) -> Path:
    if not (BIN / name).exists():
        pytest.skip(f"{name} is not installed: `make agents` installs the agent CLIs (needs npm)")
    return BIN / name


@pytest.fixture(scope="module")
def server(agent_dir):
    proc, url = start_server(agent_dir / "draft", agent_dir / "target", "--api-key", KEY)
    yield url
    proc.send_signal(2)
    _, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err


def _run(cmd: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "OPENAI", "CODEX", "CLAUDE"))}
    done = subprocess.run([str(c) for c in cmd], env={**base, "HOME": str(cwd), **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return done


def _claude(url: str, home: Path, prompt: str, *extra: str) -> dict:
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
    done = _run([_cli("claude"), "-p", prompt, "--output-format", "json", "--max-turns", "4", *extra], env, home)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_claude_code_answers(server, tmp_path):
    """Its first request: a system message after the user's, adaptive thinking, 12+ tools, max_tokens 128000."""
    result = _claude(server, tmp_path, "say hi")
    assert not result["is_error"], result
    assert result["result"].strip() == HELLO and result["terminal_reason"] == "completed"


def test_claude_code_runs_a_tool_loop(server, tmp_path):
    """It runs `echo` with its own Bash tool and sends the output back; the answer needs that output."""
    result = _claude(server, tmp_path, RUN, "--allowedTools", "Bash(echo:*)")
    assert not result["is_error"], result
    assert result["result"].strip() == ECHOED and result["num_turns"] == 2 and not result["permission_denials"]


def _codex(url: str, home: Path, prompt: str) -> subprocess.CompletedProcess:
    config = home / "codex"
    config.mkdir()
    (config / "config.toml").write_text(
        'model = "local"\nmodel_provider = "local"\n[model_providers.local]\nname = "local"\n'
        f'base_url = "{url}/v1"\nenv_key = "LOCAL_KEY"\nwire_api = "responses"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n")
    env = {"CODEX_HOME": str(config), "LOCAL_KEY": KEY}
    return _run([_cli("codex"), "exec", "--skip-git-repo-check", "-s", "danger-full-access", prompt], env, home)


def test_codex_answers(server, tmp_path):
    """The Responses API as Codex speaks it: developer messages, function and namespace tools, a hosted web_search."""
    done = _codex(server, tmp_path, "say hi")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == HELLO


def test_codex_runs_a_tool_loop(server, tmp_path):
    """Its exec_command call, the command's output as a function_call_output, and the answer."""
    done = _codex(server, tmp_path, RUN)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ECHOED
    assert "echo dflash-ok" in done.stderr and "succeeded" in done.stderr  # Codex logs the command it ran


def _qwen(url: str, home: Path, prompt: str, *extra: str) -> subprocess.CompletedProcess:
    env = {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": KEY, "OPENAI_MODEL": "local"}
    return _run([_cli("qwen"), "-p", prompt, *extra], env, home)


def test_qwen_code_answers(server, tmp_path):
    """Chat completions with 10 tools and max_tokens 32000 on a 40,960-position model: clamped, not refused."""
    done = _qwen(server, tmp_path, "say hi")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == HELLO


def test_qwen_code_runs_a_tool_loop(server, tmp_path):
    done = _qwen(server, tmp_path, RUN, "--allowed-tools", "run_shell_command")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ECHOED
