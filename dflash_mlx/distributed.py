"""A target sharded over several machines with MLX's distributed backend (``mlx.launch``).

Every rank runs the same program on the same prompt: the drafter replicated, the
target split by mlx-lm's own tensor parallelism (``model.shard``), whose
collectives hand every rank the same logits. So every rank drafts the same tokens
and reaches the same accept/reject decision without a message of its own. Only
what a rank measures or draws by itself could differ, and is taken from rank 0:
the adaptive policy's cycle costs (shared every few cycles, see
``policy.AdaptiveDepth.agree``) and a sampled run's seed. Only rank 0 prints,
serves or writes files.

A single process (no ``mlx.launch``) never initialises the distributed backend.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import subprocess
import sys
from typing import Any, Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from .errors import DFlashError

# Families whose sharded run is tested lossless here (tests/test_distributed.py); mlx-lm shards more.
SHARDED_MODEL_TYPES = ("qwen3", "qwen3_5", "qwen3_5_moe")
# Set by the launchers of MLX's backends (ring and JACCL: mlx.launch; MPI: mpirun; NCCL: mlx.launch).
_LAUNCH_VARIABLES = ("MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_SIZE", "MLX_WORLD_SIZE")


def launched() -> bool:
    """Whether this process was started as one rank of a group."""
    return any(v in os.environ for v in _LAUNCH_VARIABLES)


_WATCHDOG = """import os, signal, sys, time
time.sleep(float(sys.argv[1]))
sys.stderr.write("error: " + sys.argv[3] + "\\n")
os.kill(int(sys.argv[2]), signal.SIGTERM)
"""


@contextlib.contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """End this process with one line if the block has not finished in ``seconds``.

    A collective waits for every rank; a rank that never started would leave the
    others waiting forever, inside C code that holds the interpreter, where no
    timer thread or exception gets a turn: the watchdog is a process of its own.
    """
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(seconds), str(os.getpid()), message])
    try:
        yield
    finally:
        watchdog.kill()
        watchdog.wait()


@functools.lru_cache(maxsize=None)
def group() -> Optional[mx.distributed.Group]:
    """The group this process was launched in, once every rank has joined; None for a single process."""
    if not launched():
        return None
    try:
        seconds = float(os.environ.get("DFLASH_MLX_GROUP_TIMEOUT", "60"))
    except ValueError:
        raise DFlashError(f"DFLASH_MLX_GROUP_TIMEOUT must be a number of seconds, got "
                          f"{os.environ['DFLASH_MLX_GROUP_TIMEOUT']!r}") from None
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    with deadline(seconds, f"rank {rank}: the distributed group did not form within {seconds:g} s: a rank failed "
                           "to start or cannot be reached (check the hosts and that each runs the same dflash-mlx)"):
        try:
            g = mx.distributed.init(strict=True)
        except RuntimeError as e:
            raise DFlashError(f"rank {rank}: cannot join the distributed group ({str(e).splitlines()[0]})") from None
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=g, stream=mx.cpu))  # every rank is there
    return g if g.size() > 1 else None


def rank() -> int:
    g = group()
    return 0 if g is None else g.rank()


def is_main() -> bool:
    """Rank 0, or a single process: the one that prints, serves and writes files."""
    return rank() == 0


def from_main(values: list[float], g: mx.distributed.Group) -> list[float]:
    """Rank 0's ``values`` (float32), on every rank.

    On the generation stream, so that it takes its place among the collectives of
    the cycles in flight in the same order on every rank.
    """
    mine = mx.array(values if g.rank() == 0 else [0.0] * len(values), dtype=mx.float32)
    return mx.distributed.all_sum(mine, group=g, stream=generation_stream).tolist()


def from_main_bytes(data: bytes, g: mx.distributed.Group) -> bytes:
    """Rank 0's ``data`` on every rank (what the others pass is ignored): its length, then its bytes."""
    size = int(from_main([float(len(data))], g)[0])  # exact in float32 below 16 MiB (requests are <= 4)
    if size == 0:
        return b""
    mine = mx.array(np.frombuffer(data, np.uint8)) if g.rank() == 0 else mx.zeros((size,), mx.uint8)
    return bytes(np.array(mx.distributed.all_sum(mine, group=g, stream=generation_stream)))


def shared_seed(g: mx.distributed.Group) -> int:
    """A fresh seed drawn by rank 0, for a sampled run without ``seed``: every rank must draw the same."""
    return int(from_main([float(random.randrange(2**24))], g)[0])  # exact in float32


def gather(value: float) -> list[float]:
    """``value`` of every rank, in rank order (a collective: every rank must call it)."""
    g = group()
    if g is None:
        return [value]
    return mx.distributed.all_gather(mx.array([value], dtype=mx.float32), group=g, stream=mx.cpu).tolist()


def check_shardable(config: dict[str, Any], ranks: int) -> None:
    """Refuse, in one line, a target that does not shard, or whose heads or widths do not split over ``ranks``.

    mlx-lm's ``shard`` splits heads and matrix rows evenly and does not check it:
    a remainder would give wrong results, not an error.
    """
    model_type = config.get("model_type")
    if model_type not in SHARDED_MODEL_TYPES:
        raise DFlashError(
            f"a {model_type} target does not run sharded yet (sharded: {', '.join(SHARDED_MODEL_TYPES)}); "
            "run it on one machine, without mlx.launch"
        )
    text = {**config, **(config.get("text_config") or {})}
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    sizes = {"attention heads": heads}
    for key, what in (("intermediate_size", "MLP width"), ("moe_intermediate_size", "expert MLP width"),
                      ("shared_expert_intermediate_size", "shared expert MLP width")):
        if text.get(key):
            sizes[what] = text[key]
    if model_type in ("qwen3_5", "qwen3_5_moe"):  # repeats key/value heads when there are fewer than ranks
        sizes |= {"linear-attention key heads": text["linear_num_key_heads"],
                  "linear-attention value heads": text["linear_num_value_heads"]}
        if kv % ranks and ranks % kv:
            sizes["key/value heads"] = kv
        if not text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
            sizes["vocabulary"] = text["vocab_size"]  # its LM head is split by vocabulary rows
    else:
        sizes["key/value heads"] = kv
    for what, n in sizes.items():
        if n % ranks:
            raise DFlashError(f"this {model_type} target cannot be split over {ranks} ranks: its {what} ({n}) "
                              f"is not a multiple of {ranks}")


def describe() -> Optional[dict[str, Any]]:
    """The group for ``doctor`` and the JSON reports: size, this rank, backend and each rank's host."""
    g = group()
    if g is None:
        return None
    hosts: list[str] = []
    backend = "mpi" if "OMPI_COMM_WORLD_SIZE" in os.environ else "nccl" if "MLX_WORLD_SIZE" in os.environ else "ring"
    if any(v in os.environ for v in ("MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")):
        backend = "jaccl"
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            with open(hostfile) as f:
                entries = json.load(f)
            hosts = [str(e[0] if isinstance(e, list) else e).rsplit(":", 1)[0] for e in entries]
    return {"size": g.size(), "rank": g.rank(), "backend": backend, "hosts": hosts}
