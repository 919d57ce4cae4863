"""Shared test helpers: the plain greedy reference decoder, and child processes that stop or are stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import httpx2 as httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step


def plain_greedy(
    model, prompt: list[int], max_tokens: int, eos: Iterable[int] = (), prompt_cache=None, prefill_step_size: int = 2048,
    logits_processors=None,
) -> list[int]:
    """mlx-lm's own greedy decoding, stopped the way dflash stops (EOS not emitted).

    ``prompt_cache`` gives it the same attention semantics as a dflash run with a window.
    """
    eos = set(eos)
    out: list[int] = []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
        logits_processors=logits_processors,
    )
    for token, _ in steps:
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out


def default_sigint() -> None:
    """A ``preexec_fn``: let a child's Ctrl-C (SIGINT) work even when pytest itself runs as a background job.

    A shell starts background jobs with SIGINT ignored; children inherit that, and Python
    then installs no KeyboardInterrupt handler, so SIGINT would silently do nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Wait for ``proc`` to end; its (stdout, stderr). One still running after ``timeout`` is killed, with its
    process group when it leads one (mlx.launch's ranks), so that a failing test leaves no server behind."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.communicate()
        raise


def start_server(draft: Path, target: Optional[Path], *extra: str) -> tuple[subprocess.Popen, str]:
    """``dflash-mlx serve`` in a process of its own on a free loopback port; (process, base URL) once it answers.
    Without ``target``, ``draft`` is served alone (a plain model, or a pair the folder names)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pair = [str(draft)] + ([] if target is None else ["--target", str(target)])
    cmd = [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "serve", *pair, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stderr.read()}")
        time.sleep(0.1)
    pytest.fail("server did not start")
