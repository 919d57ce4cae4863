"""The published drafter -> target pairs, and turning what a user typed into the two sources to load.

The pairs live in ``data/registry.json`` so that a new drafter is one entry. A
drafter's config does not name its target, hence the registry (and ``--target``).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Optional

from .errors import DFlashError
from .target import SUPPORTED_MODEL_TYPES

MANIFEST = "dflash.json"  # marks a converted bundle folder


@dataclass(frozen=True)
class Pair:
    drafter: str
    target: str
    model_type: str
    thinking: str  # "off", "on" or "none": the mode the drafter was trained for
    block_size: int
    memory_gb: float
    aliases: tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        """Its target architecture is tested lossless here."""
        return self.model_type in SUPPORTED_MODEL_TYPES

    @property
    def names(self) -> tuple[str, ...]:
        return (self.drafter, self.drafter.split("/")[-1], *self.aliases)


@lru_cache(maxsize=1)
def pairs() -> tuple[Pair, ...]:
    data = json.loads(resources.files("dflash_mlx").joinpath("data/registry.json").read_text())
    return tuple(Pair(**dict(p, aliases=tuple(p.get("aliases", ())))) for p in data["pairs"])


def find(name: str) -> Optional[Pair]:
    """The pair a name denotes: a drafter repo id, its short name or an alias (any case)."""
    wanted = name.lower()
    hits = {p for p in pairs() for n in p.names if n.lower() == wanted}
    return hits.pop() if len(hits) == 1 else None


def suggestions(name: str) -> list[str]:
    names = [n for p in pairs() for n in p.names]
    lowered = {n.lower(): n for n in names}
    return [lowered[m] for m in difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.5)]


def is_bundle(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def resolve(model: str, target: Optional[str] = None) -> tuple[str, Optional[str], Optional[Pair]]:
    """(drafter source, target source, registry pair) for what the user typed.

    A bundle folder needs nothing else; a drafter folder or an unknown repo needs
    ``target``; a registry name brings its published target unless ``target``
    overrides it (e.g. an mlx-community 4-bit conversion).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return model, target, None
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise DFlashError(f"drafter {model}: no such folder")
    pair = find(model)
    if pair is None:
        if target is not None:
            return model, target, None
        hint = suggestions(model)
        near = f"did you mean {', '.join(hint)}? " if hint else ""
        raise DFlashError(
            f"unknown drafter {model!r}: {near}Pass --target TARGET for a drafter outside the registry "
            "(dflash-mlx models lists it)"
        )
    if not pair.supported and target is None:
        raise DFlashError(
            f"{pair.drafter} needs a {pair.model_type} target, an architecture dflash-mlx does not run yet; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return pair.drafter, target or pair.target, pair


def default_pair(memory_bytes: int) -> Pair:
    """The largest Qwen3 pair whose weights fit comfortably in memory (Qwen3-4B at the least)."""
    qwen3 = sorted((p for p in pairs() if p.model_type == "qwen3"), key=lambda p: p.memory_gb)
    fitting = [p for p in qwen3 if p.memory_gb * 1.5 * 2**30 <= memory_bytes]
    return fitting[-1] if fitting else qwen3[0]
