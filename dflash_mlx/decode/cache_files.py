"""Caches as files: one safetensors file per ``CacheState``, fingerprinted and checksummed.

The server's prompt cache (``server.prompt_cache``) keeps conversations here across
restarts, and chat's ``/save`` keeps one beside the conversation it saves. The header
names what a file belongs to (``fingerprint``: the target's and drafter's configs and
weight files, read far enough to tell a rewrite from the original, dtype and
quantization, window, sinks, block size and this format's version) and carries a
checksum of every array and one of itself and the token history; a file that is
truncated, corrupted, from another model or another version is refused with a
ValueError that says why, never loaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import textwrap
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from ..models.drafter import NoDrafter
from .settings import CacheLayout
from .transaction import CacheState

FORMAT = 2  # of the files: a change to what they hold gets a new number, and old files are left alone
TEMPORARY = ".tmp.safetensors"  # how the name of a file being written ends (it starts with a dot)
SAMPLES, SAMPLE_BYTES = 8, 1 << 16  # blocks of each weight file's data that its fingerprint reads


def fingerprint(target: Any, drafter: Any, layout: CacheLayout) -> str:
    """What a cache belongs to: the pair's files (configs, weight files, a LoRA adapter's), the target's dtype and
    feature layers, and the cache settings. Caches of another model, of other weights in the same folder, or of
    other settings never match. Tokenizer files are left out: a cache maps token ids to the model's state, whatever text made them."""
    def files(folder: Optional[Path], what: str, config: str = "config.json") -> dict[str, Any]:
        if folder is None:
            raise DFlashError(f"a cache on disk needs to know the {what}'s files: load the pair with dflash_mlx.load")
        weights = sorted(folder.glob("*.safetensors"))
        return {"config": (folder / config).read_text(), "weights": [_weight_file(f) for f in weights]}

    parts = {"format": FORMAT, "target": files(getattr(target, "source", None), "target"),
             "drafter": None if isinstance(drafter, NoDrafter) else files(getattr(drafter, "source", None), "drafter"),
             "layers": list(target.layer_ids),
             "dtype": str(target.dtype), "window": layout.window, "sinks": layout.sinks,
             "block_size": layout.block_size}
    if layout.draft_window:  # a drafter window's entries fit only runs with it (absent otherwise, as below)
        parts["draft_window"] = layout.draft_window
    if (kv := layout.kv) is not None:  # a quantized cache's entries fit only runs quantized alike (absent otherwise, as below)
        parts["kv"] = [kv.bits, kv.group_size, kv.start]
    if (adapter := getattr(target, "adapter", None)) is not None:  # absent otherwise: caches saved before still match
        parts["adapter"] = files(adapter, "adapter", "adapter_config.json")
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _weight_file(path: Path) -> list[Any]:
    """A weight file as far as a fingerprint can afford to read it (a few blocks, even of 100 GB of weights): its
    name, size, mtime and inode (any rewrite changes one), and a hash of its safetensors header and of ``SAMPLES``
    blocks of its data at fixed offsets (a fine-tune copied over it with its mtime kept, ``cp -p``, still differs)."""
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        start = start if start <= stat.st_size else 0  # not safetensors after all: sample the whole file
        f.seek(0)
        digest.update(f.read(start))
        span = max(stat.st_size - start - SAMPLE_BYTES, 0)
        for k in range(SAMPLES):
            f.seek(start + span * k // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return [path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino, digest.hexdigest()]


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a file ``write_state`` is writing (or a writer that died left behind)."""
    return path.name.startswith(".") and path.name.endswith(TEMPORARY)


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
    """``state`` as one safetensors file at ``path``, atomically; its size in bytes.

    The temporary file's name is this process's own (pid and a random part): two servers sharing a folder may
    write the same entry at once, and neither must rename or remove the other's half-written file."""
    arrays = _names(state)
    mx.eval(list(arrays.values()))
    header = {
        "format": FORMAT, "fingerprint": print_, "window": state.window, "sinks": state.sinks,
        "block_size": state.block_size, "draft_window": state.draft_window, "layout": {"target": [[k, m, len(a)] for k, a, m in state.target],
                                                   "drafter": [[k, m, len(a)] for k, a, m in state.drafter]},
        "checksums": {name: _checksum(a) for name, a in arrays.items()}, "extra": extra or {},
    }
    history = np.asarray(state.tokens, dtype="<i4").tobytes()
    header["checksum"] = _sign(header, history)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMPORARY}")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata={"dflash": json.dumps(header),
                                                        "tokens": base64.b64encode(history).decode()})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def _sign(header: dict[str, Any], history: bytes) -> str:
    """The header's own checksum (over all of it but this field) and the token history's: one flipped bit in either
    would otherwise resume a request from caches of other tokens."""
    fields = json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(fields.encode() + history).hexdigest()


def _layout_names(layout: dict[str, Any]) -> set[str]:
    """The arrays a layout says the file holds (``context`` apart)."""
    return {f"{prefix}{i}.{j}" for part, prefix in (("target", "t"), ("drafter", "d"))
            for i, (_, _, n) in enumerate(layout[part]) for j in range(n)}


def _check_fields(header: dict[str, Any]) -> None:
    """ValueError unless every field ``read_state`` uses has its type and the layout names the stored arrays: a
    crafted file, or one of a buggy writer, is refused here rather than failing (or worse) wherever it is used."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_layers(layers: Any) -> bool:
        return isinstance(layers, list) and all(
            isinstance(layer, list) and len(layer) == 3 and isinstance(layer[0], str) and isinstance(layer[1], dict)
            and all(isinstance(k, str) and is_int(v) for k, v in layer[1].items())
            and is_int(layer[2]) and layer[2] >= 0
            for layer in layers)

    layout, sums = header.get("layout"), header.get("checksums")
    checks = {"window": header.get("window") is None or is_int(header.get("window")),
              "sinks": is_int(header.get("sinks")), "block_size": is_int(header.get("block_size")),
              "draft_window": is_int(header.get("draft_window", 0)),
              "extra": isinstance(header.get("extra"), dict),
              "layout": isinstance(layout, dict) and all(is_layers(layout.get(part)) for part in ("target", "drafter")),
              "checksums": isinstance(sums, dict) and all(is_int(v) for v in sums.values())}
    if bad := [name for name, ok in checks.items() if not ok]:
        raise ValueError(f"damaged header (its {', '.join(bad)})")
    if set(sums) - {"context"} != _layout_names(layout):
        raise ValueError("damaged header (its layout does not name the arrays it holds)")


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
        history = base64.b64decode(metadata["tokens"])
        tokens = np.frombuffer(history, dtype="<i4").tolist()
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a dflash-mlx cache file ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"not a dflash-mlx cache file (its header is a JSON {type(header).__name__}, not an object)")
    if header.get("format") != FORMAT:
        raise ValueError(f"written by another version (format {header.get('format')}, this one reads {FORMAT})")
    if header.get("checksum") != _sign(header, history):
        raise ValueError("corrupted (its header or token history does not match its checksum)")
    _check_fields(header)
    if header.get("fingerprint") != print_:
        raise ValueError("made for another model or other settings")
    return tokens, header


def read_state(path: Path, print_: str) -> tuple[CacheState, dict[str, Any]]:
    """A cache file whole, checked: its state, and what was stored with it; ValueError says why it cannot be used."""
    tokens, header = read_header(path, print_)
    try:
        arrays = mx.load(str(path))
    except Exception as e:  # noqa: BLE001 (mlx raises several kinds on a damaged file)
        raise ValueError(f"unreadable ({textwrap.shorten(str(e), 120, placeholder=' ...')})") from None
    sums = header["checksums"]
    if set(arrays) != set(sums) or any(_checksum(arrays[name]) != value for name, value in sums.items()):
        raise ValueError("corrupted (its arrays do not match their checksums)")

    def layers(part: str, prefix: str) -> list:
        return [(kind, [arrays[f"{prefix}{i}.{j}"] for j in range(n)], meta)
                for i, (kind, meta, n) in enumerate(header["layout"][part])]

    state = CacheState(tokens, layers("target", "t"), layers("drafter", "d"), arrays.get("context"), header["window"],
                       header["sinks"], header["block_size"], header.get("draft_window", 0))
    return state, header["extra"]


def cache_file(conversation: Path) -> Path:
    """Where a saved conversation's caches go: beside it."""
    return conversation.with_name(conversation.name + ".cache.safetensors")
