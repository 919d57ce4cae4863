"""Shared pieces of the benchmark scripts: the BLAS check, the random model pair, plain decoding.

Importing this module first re-execs the script with OpenBLAS preloaded on Linux
(see platform-notes: MLX's CPU wheel bundles the reference BLAS).
"""

from __future__ import annotations

from dflash_mlx.system import blas_library, is_reference_blas, machine_description, reexec_with_openblas

reexec_with_openblas()  # before any work: it may restart this process

import contextlib  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, Optional  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step, stream_generate  # noqa: E402

from dflash_mlx.models import fixtures  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step, and every long program starts with a short function. "
)


def build_models(hidden: int, layers: int) -> Path:
    """A random float32 target + drafter pair, built once per shape and reused."""
    folder = CACHE / f"random-h{hidden}-l{layers}"
    if folder.is_dir():
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    heads = max(1, hidden // 64)
    config = fixtures.target_config(
        "qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=32000,
        max_position_embeddings=40960,
    )
    draft_config = fixtures.drafter_config(config, num_hidden_layers=2, target_layer_ids=[1, layers - 2])
    print(f"building random models in {folder} ...", flush=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # an interrupted build leaves no half cache
        fixtures.write_target(Path(tmp) / "pair" / "target", config, tokenizer_vocab=512)
        fixtures.write_drafter(Path(tmp) / "pair" / "draft", draft_config, dtype=mx.float32)
        (Path(tmp) / "pair").rename(folder)
    return folder


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * (1 + n // 8), add_special_tokens=False)
    assert len(ids) >= n, "prompt text too short"
    return ids[:n]


def plain(
    model, ids: list[int], max_tokens: int, prompt_cache: Optional[list[Any]] = None, sampler: Any = None,
    tokenizer: Any = None,
) -> tuple[list[int], float, float]:
    """Greedy mlx-lm decoding: tokens, decode tok/s (tokens after the first, from the first), prefill tok/s.

    ``prompt_cache`` (e.g. ``target.make_cache(window)``) gives it the same attention
    window as the dflash run it is compared with. With ``tokenizer`` it decodes
    through ``mlx_lm.stream_generate``, text included, as a user of mlx-lm runs it
    and as dflash-mlx's own loop does (EOS ignored, like the dflash runs of these
    scripts); without, through bare ``generate_step`` (token ids only, no text).
    """
    tokens, stamps = [], []
    tic = time.perf_counter()
    if tokenizer is None:
        steps = generate_step(mx.array(ids), model, max_tokens=max_tokens, prompt_cache=prompt_cache, sampler=sampler)
        for token, _ in steps:
            stamps.append(time.perf_counter())
            tokens.append(int(token))
        return tokens, (len(tokens) - 1) / (stamps[-1] - stamps[0]), len(ids) / (stamps[0] - tic)
    eos, tokenizer.eos_token_ids = tokenizer.eos_token_ids, []
    try:
        for response in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, prompt_cache=prompt_cache,
                                        sampler=sampler):
            stamps.append(time.perf_counter())
            tokens.append(response.token)
    finally:
        tokenizer.eos_token_ids = eos
    return tokens, (len(tokens) - 1) / (stamps[-1] - stamps[0]), response.prompt_tps


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """``n`` busy loops (a process each) beside what runs inside: a laptop with a browser and an editor open."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in procs:
            hog.kill()
            hog.wait()


def print_machine() -> dict[str, Any]:
    """Say which BLAS runs (loudly when it is the reference one) and describe the machine."""
    print(f"BLAS: {blas_library() or 'platform default (not Linux)'}")
    if is_reference_blas():
        print(
            "WARNING: MLX is using the REFERENCE BLAS: a B-token verify costs ~B decoding steps, "
            "so speculation cannot win and these numbers mean nothing. "
            "Fix: apt-get install libopenblas0-pthread (this script then preloads it)."
        )
    info = machine_description()
    shown = dict(info, memory_bytes=f"{info['memory_bytes'] / 2**30:.1f} GiB")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return info


def median_time(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median wall time of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def start_server(pair: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``dflash-mlx serve`` of a pair folder (draft/, target/) on a free loopback port; (process, URL) once it answers."""
    return serve_on_free_port(lambda port: [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "serve",
                                            str(pair / "draft"), "--target", str(pair / "target"), "--port", str(port),
                                            *extra], "/health")


def serve_on_free_port(command: Callable[[int], list[str]], ready: str) -> tuple[subprocess.Popen, str]:
    """A server process started on a free loopback port (``command(port)``); (process, URL) once ``ready`` answers."""
    import httpx2 as httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(command(port), stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}{ready}", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None:
                sys.exit(f"the server exited ({proc.returncode}): {' '.join(command(port)[:6])} ...")
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, not SIGINT: a script run in the background hands its children SIGINT ignored."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
