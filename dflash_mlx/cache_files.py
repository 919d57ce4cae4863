"""Caches as files: one safetensors file per ``CacheState``, fingerprinted and checksummed.

The server's prompt cache (``server.prompt_cache``) keeps conversations here across
restarts, and chat's ``/save`` keeps one beside the conversation it saves. The header
names what a file belongs to (``fingerprint``: the target's and drafter's files, dtype
and quantization, window, sinks, block size and this format's version) and carries a
checksum of every array; a file that is truncated, corrupted, from another model or
another version is refused with a ValueError that says why, never loaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .caches import CacheState
from .errors import DFlashError

FORMAT = 1  # of the files: a change to what they hold gets a new number, and old files are left alone


def fingerprint(target: Any, drafter: Any, window: Optional[int], sinks: int, block_size: int) -> str:
    """What a cache belongs to: the pair's files (configs, weight files' names and sizes), the target's dtype and
    feature layers, and the cache settings. Caches of another model, or other settings, never match."""
    def files(folder: Optional[Path], what: str) -> dict[str, Any]:
        if folder is None:
            raise DFlashError(f"a cache on disk needs to know the {what}'s files: load the pair with dflash_mlx.load")
        weights = sorted(folder.glob("*.safetensors"))
        return {"config": (folder / "config.json").read_text(), "weights": [(f.name, f.stat().st_size) for f in weights]}

    parts = {"format": FORMAT, "target": files(getattr(target, "source", None), "target"),
             "drafter": files(getattr(drafter, "source", None), "drafter"), "layers": list(target.layer_ids),
             "dtype": str(target.dtype), "window": window, "sinks": sinks, "block_size": block_size}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _checksum(a: mx.array) -> int:
    """A position-weighted sum of an array's bytes (mod 2^32), on the device: it catches corrupted data."""
    flat = a.reshape(-1)
    words = mx.view(flat, mx.uint32) if flat.nbytes % 4 == 0 else mx.view(flat, mx.uint8).astype(mx.uint32)
    weights = mx.arange(words.size, dtype=mx.uint32) * mx.array(2654435761, dtype=mx.uint32) + mx.array(1, dtype=mx.uint32)
    return int(mx.sum(words * weights).item())


def _names(state: CacheState) -> dict[str, mx.array]:
    arrays = {f"t{i}.{j}": a for i, (_, arrays, _) in enumerate(state.target) for j, a in enumerate(arrays)}
    arrays |= {f"d{i}.{j}": a for i, (_, arrays, _) in enumerate(state.drafter) for j, a in enumerate(arrays)}
    return arrays | ({"context": state.context} if state.context is not None else {})


def write_state(path: Path, state: CacheState, print_: str, extra: Optional[dict[str, Any]] = None) -> int:
    """``state`` as one safetensors file at ``path``, atomically; its size in bytes."""
    arrays = _names(state)
    mx.eval(list(arrays.values()))
    header = {
        "format": FORMAT, "fingerprint": print_, "window": state.window, "sinks": state.sinks,
        "block_size": state.block_size, "layout": {"target": [[k, m, len(a)] for k, a, m in state.target],
                                                   "drafter": [[k, m, len(a)] for k, a, m in state.drafter]},
        "checksums": {name: _checksum(a) for name, a in arrays.items()}, "extra": extra or {},
    }
    tokens = base64.b64encode(np.asarray(state.tokens, dtype="<i4").tobytes()).decode()
    tmp = path.with_name(f".{path.name}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata={"dflash": json.dumps(header), "tokens": tokens})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_header(path: Path, print_: str) -> tuple[list[int], dict[str, Any]]:
    """The history and header of a cache file, reading only its header; ValueError says why it is not ours."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 2**30:
            raise ValueError("not a safetensors file")
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError("truncated")
    try:
        metadata = json.loads(raw)["__metadata__"]
        header = json.loads(metadata["dflash"])
        tokens = np.frombuffer(base64.b64decode(metadata["tokens"]), dtype="<i4").tolist()
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a dflash-mlx cache file ({type(e).__name__})") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"written by another version (format {header.get('format')}, this one reads {FORMAT})")
    if header.get("fingerprint") != print_:
        raise ValueError("made for another model or other settings")
    return tokens, header


def read_state(path: Path, print_: str) -> tuple[CacheState, dict[str, Any]]:
    """A cache file whole, checked: its state, and what was stored with it; ValueError says why it cannot be used."""
    tokens, header = read_header(path, print_)
    try:
        arrays = mx.load(str(path))
    except Exception as e:  # noqa: BLE001 (mlx raises several kinds on a damaged file)
        raise ValueError(f"unreadable ({' '.join(str(e).split())[:120]})") from None
    sums = header["checksums"]
    if set(arrays) != set(sums) or any(_checksum(arrays[name]) != value for name, value in sums.items()):
        raise ValueError("corrupted (its arrays do not match their checksums)")

    def layers(part: str, prefix: str) -> list:
        return [(kind, [arrays[f"{prefix}{i}.{j}"] for j in range(n)], {k: int(v) for k, v in meta.items()})
                for i, (kind, meta, n) in enumerate(header["layout"][part])]

    state = CacheState(tokens, layers("target", "t"), layers("drafter", "d"), arrays.get("context"), header["window"],
                       header["sinks"], header["block_size"])
    return state, header["extra"]


def cache_file(conversation: Path) -> Path:
    """Where a saved conversation's caches go: beside it."""
    return conversation.with_name(conversation.name + ".cache.safetensors")
