"""MODEL as the commands take it: a name, a folder or none, and the published pairs as this machine has them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape

from ..errors import DFlashError


def load_model(model: Optional[str], target: Optional[str], chat_template: Optional[str],
               note: Console, adapter_path: Optional[str] = None) -> tuple[str, Any, Any, Any]:
    """(name, target, drafter, tokenizer) of MODEL, or of the published pair that fits this machine.

    ``chat_template`` is the --chat-template value (a file or the text), ``adapter_path`` the
    --adapter-path one (a LoRA adapter folder for the target); ``note`` says which
    pair was picked when none was named. Offline, the default pair cannot be downloaded: the
    error then says how to build and use a local one.
    """
    from ..chat_template import read_template
    from ..errors import DownloadError
    from ..models.loader import load
    from ..models.registry import default_pair
    from ..system import machine_description

    template = read_template(chat_template) if chat_template is not None else None
    default = model is None
    if default:
        model = default_pair(machine_description()["memory_bytes"]).drafter
        note.print(f"[dim]no model given: using {escape(model)} (fits this machine's memory)[/]")
    try:
        return (model, *load(model, target, template, adapter_path))
    except DownloadError as e:
        if not default:
            raise
        raise DFlashError(f"{e}; offline, `make pair` builds a real pair here (SmolLM2-135M-Instruct and a drafter "
                          "trained for it, about an hour; `make pair-quick`: a toy pair in a minute) and prints the "
                          "command to chat with it (`make chat MODEL=FOLDER`)") from None


def thinking_mismatch(model: str, think: Optional[bool]) -> Optional[str]:
    """Why --think/--no-think against the mode the registry's drafter was trained in lowers acceptance."""
    from ..models.registry import find

    pair = find(model)
    if pair is not None and think is not None and pair.thinking in ("on", "off") and think != (pair.thinking == "on"):
        return (f"{pair.drafter} was trained with thinking {pair.thinking}; "
                f"--{'think' if think else 'no-think'} will lower acceptance")
    return None


def bundle_manifests() -> dict[Path, dict[str, Any]]:
    """The converted bundles this machine knows, each with its manifest (what it was converted from, and how)."""
    from ..models.registry import known_bundles, read_manifest

    manifests = {}
    for bundle in known_bundles():
        try:
            manifests[bundle] = read_manifest(bundle)
        except DFlashError:
            continue  # listed elsewhere as it is; loading it says what is wrong
    return manifests


def pair_rows(manifests: dict[Path, dict[str, Any]]) -> list[dict[str, Any]]:
    """The registry's pairs, each with whether it is downloaded and the bundles converted from it."""
    from huggingface_hub import constants, scan_cache_dir

    from ..models.registry import pairs

    try:
        cached = {repo.repo_id for repo in scan_cache_dir(constants.HF_HUB_CACHE).repos}  # read now, as downloads do
    except Exception:  # noqa: BLE001 no cache folder yet, or an unreadable one
        cached = set()
    converted: dict[Any, list[str]] = {}
    for bundle, manifest in manifests.items():
        converted.setdefault(manifest.get("drafter"), []).append(str(bundle))
    return [
        dict(name=min(p.names, key=len), drafter=p.drafter, target=p.target, architecture=p.model_type,
             supported=p.supported, tested=p.tested,
             thinking=p.thinking, memory_gb=p.memory_gb, gated=p.gated, notes=p.notes,
             downloaded=p.drafter in cached and p.target in cached, converted=converted.get(p.drafter, []))
        for p in pairs()
    ]
