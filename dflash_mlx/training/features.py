"""The frozen target's features of every training sequence, computed once and kept on disk.

The target never changes during training, so running it again at every step (as the first
trainer did) spent most of a step on work whose answer was already known: offline training,
as SpecForge does it. ``OUT/features.npy`` holds the features of all sequences end to end in
bfloat16 (half the disk and memory; the drafter still trains in float32), read through a
memory map, so a step reads only its sequences. bfloat16, not float16: Gemma's hidden states
pass float16's 65,504 (Gemma 3 270M's reach 65k-300k), and features stored as inf trained a
drafter whose loss was nan from its first step. NumPy has no bfloat16, so the file holds its
bits as uint16. ``OUT/features.json`` names what they were
computed from; a store made from other data, another target or other layers is made again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from ..files import write_atomic
from ..models.target import Target

FEATURES = "features.npy"
INDEX = "features.json"
STORED = "bfloat16"  # in the index: a store of another dtype (float16, before) is made again


class FeatureStore:
    """Features [length, n_layers * hidden] of sequence i, as float32 MLX arrays."""

    def __init__(self, values: np.ndarray, lengths: list[int]):
        self.values = values
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> mx.array:
        bits = mx.array(np.asarray(self.values[self.offsets[i]:self.offsets[i + 1]]))
        return bits.view(mx.bfloat16).astype(mx.float32)


def _width(target: Target) -> int:
    return len(target.layer_ids) * target.hidden_size


def _index(key: dict[str, Any], target: Target, sequences: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(sequences).encode()).hexdigest()
    return {"data": key, "layers": list(target.layer_ids), "sequences": digest, "width": _width(target),
            "dtype": STORED}


def feature_store(
    out: Path, target: Target, sequences: list[tuple[list[int], list[int]]], key: dict[str, Any],
    progress: Callable[[dict[str, Any]], None],
) -> FeatureStore:
    """The store for ``sequences`` (prompt, response) in ``out``: read back when it matches, else computed."""
    lengths = [len(p) + len(r) for p, r in sequences]
    index = _index(key, target, sequences)
    path, index_path = out / FEATURES, out / INDEX
    try:
        if json.loads(index_path.read_text()) == index:
            values = np.load(path, mmap_mode="r")
            if values.shape == (sum(lengths), _width(target)):
                return FeatureStore(values, lengths)
    except (OSError, ValueError, json.JSONDecodeError):
        pass  # absent, partial or foreign: computed again below
    index_path.unlink(missing_ok=True)
    tmp = out / f".{FEATURES}.tmp.npy"
    try:
        values = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16,
                                           shape=(sum(lengths), _width(target)))
        start = 0
        for i, (prompt, response) in enumerate(sequences):
            _, features = target(mx.array(prompt + response)[None], target.make_cache(), last_logits_only=True)
            values[start:start + lengths[i]] = np.array(features[0].astype(mx.bfloat16).view(mx.uint16))
            start += lengths[i]
            progress({"phase": "features", "done": i + 1, "total": len(sequences)})
        values.flush()
        del values
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DFlashError(f"cannot write the feature store {path}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    write_atomic(index_path, json.dumps(index))
    return FeatureStore(np.load(path, mmap_mode="r"), lengths)
