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

from ..errors import DFlashError
from .target import check_model_type, is_tested, mlx_lm_model_type

MANIFEST = "dflash.json"  # marks a converted bundle folder


@dataclass(frozen=True)
class Pair:
    drafter: str
    target: str
    model_type: str
    thinking: str  # "off", "on", "none" (no such mode) or "unknown": the mode the drafter was trained for
    memory_gb: float
    gated: bool = False  # the drafter repo needs its terms accepted on Hugging Face
    notes: str = ""  # what could not be verified
    aliases: tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        """Its target architecture is an mlx-lm model (dflash-mlx runs any)."""
        return mlx_lm_model_type(self.model_type) is not None

    @property
    def tested(self) -> bool:
        """Its target architecture is tested lossless here on tiny checkpoints."""
        return is_tested(self.model_type)

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


def gguf_hint(path: Path) -> str:
    """What to add where a GGUF file is given for a model folder."""
    if path.suffix.lower() != ".gguf":
        return ""
    return f" (a GGUF file is converted first: dflash-mlx convert {path} -o FOLDER)"


def is_bundle(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def read_manifest(path: Path) -> dict:
    """A bundle's manifest, refused when it is not one: a bundle is trusted to hold what its manifest says."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"bundle {path}: its {MANIFEST} is unreadable ({e}); convert it again with --force") from None
    if not isinstance(manifest, dict) or manifest.get("format") != 1:
        raise DFlashError(f"bundle {path}: {MANIFEST} is not a dflash-mlx manifest; convert it again with --force")
    return manifest


def looks_like_a_bundle(path: Path) -> bool:
    """draft/ and target/ without the manifest: a bundle whose convert did not finish, or a copy that lost it."""
    return not is_bundle(path) and (path / "draft").is_dir() and (path / "target").is_dir()


def check_bundle(path: Path) -> None:
    """A folder that is or looks like a bundle: refused unless its manifest is readable."""
    if looks_like_a_bundle(path):
        raise DFlashError(f"{path} holds draft/ and target/ but no {MANIFEST}: not a finished bundle (convert it "
                          "again with --force)")
    if is_bundle(path):
        read_manifest(path)


def _bundle_list() -> Path:
    return Path.home() / ".cache" / "dflash-mlx" / "bundles.json"


def remember_bundle(path: Path) -> None:
    """Note where ``convert`` wrote a bundle (or a model folder from a GGUF file), so that ``models`` and
    ``doctor`` find it from anywhere.

    A failure to note it (read-only home, a corrupt list) costs only that: the bundle is written.
    """
    from ..files import write_atomic

    listed = sorted({str(path.resolve()), *map(str, _remembered())})
    try:
        _bundle_list().parent.mkdir(parents=True, exist_ok=True)
        write_atomic(_bundle_list(), json.dumps(listed, indent=1))
    except (OSError, DFlashError):
        pass


def _remembered() -> list[Path]:
    try:
        return [Path(p) for p in json.loads(_bundle_list().read_text())]
    except (OSError, ValueError, TypeError):
        return []


def known_bundles() -> list[Path]:
    """Bundles that ``convert`` wrote and that still exist, plus any in the current folder."""
    here = [p for p in Path.cwd().iterdir() if p.is_dir()] if Path.cwd().is_dir() else []
    return sorted({p.resolve() for p in [*_remembered(), *here] if is_bundle(p)})


def converted_models() -> list[Path]:
    """Model folders ``convert`` wrote from GGUF files that still exist (a target alone, or one to train for)."""
    return sorted({p for p in _remembered() if not is_bundle(p) and (p / "config.json").is_file()})


def resolve(model: str, target: Optional[str] = None) -> tuple[str, Optional[str], Optional[Pair]]:
    """(drafter source, target source, registry pair) for what the user typed.

    A bundle folder needs nothing else; a drafter folder or a drafter repo not in the
    registry needs ``target`` (a repo without it may be a model alone: loading says which);
    a registry name brings its published target unless ``target`` overrides it (e.g. an
    mlx-community 4-bit conversion).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return model, target, None
    if path.exists():
        raise DFlashError(f"{model} is a file; expected a model folder, a bundle or a registry name{gguf_hint(path)}")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise DFlashError(f"{model}: no such folder")
    pair = find(model)
    if pair is None:
        if target is not None:
            return model, target, None
        hint = suggestions(model)
        near = f"; did you mean {' or '.join(hint)}?" if hint else ""
        if "/" not in model or path.parent.is_dir():  # "qwen-drafter" or "models/qwen" with ./models: a folder
            raise DFlashError(f"{model}: no such folder or registry name{near} (dflash-mlx models lists the names)")
        return model, None, None  # a repo: a model alone, or a drafter whose config then asks for --target
    if not pair.supported and target is None:
        check_model_type(pair.model_type)
    return pair.drafter, target or pair.target, pair


def default_pair(memory_bytes: int) -> Pair:
    """The largest Qwen3 pair whose weights fit comfortably in memory (Qwen3-4B at the least)."""
    qwen3 = sorted((p for p in pairs() if p.model_type == "qwen3"), key=lambda p: p.memory_gb)
    fitting = [p for p in qwen3 if p.memory_gb * 1.5 * 2**30 <= memory_bytes]
    return fitting[-1] if fitting else qwen3[0]
