"""Find, download and load a drafter/target pair, and check that they belong together."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from .. import distributed
from ..errors import DFlashError, DownloadError
from .dflash2 import DFlash2Args, DFlash2Drafter
from .drafter import Drafter, DrafterArgs, NoDrafter
from .laguna_dflash import LagunaArgs, LagunaDrafter
from .muse_assistant import MuseAssistant, MuseAssistantArgs
from .registry import check_bundle, gguf_hint, is_bundle, read_manifest
from .registry import resolve as registry_resolve
from .target import Target, check_model_type, is_tested
from .vocabulary import CONFIG_KEY as VOCAB_CONFIG
from .vocabulary import TENSOR as VOCAB_TENSOR
from .vocabulary import DraftVocabulary

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What loading reads, as mlx-lm fetches it, plus drafters' weights under other names. Nothing in
# subfolders: repos keep extra copies of the weights there (Llama's original/*.pth, gpt-oss's
# original/ and metal/), two to three times the download.
DOWNLOAD_PATTERNS = [*DEFAULT_ALLOW_PATTERNS, "*.safetensors", "*.safetensors.index.json"]
SKIPPED_PATTERNS = ["*/*"]
# Drafter kinds: z-lab's by the ``architectures`` name in their config.json, other families by their ``model_type``
# (``drafter_kind``: the one place a kind is chosen).
DRAFTER_KINDS = {"DFlashDraftModel": (DrafterArgs, Drafter), "DFlash2DraftModel": (DFlash2Args, DFlash2Drafter),
                 "laguna": (LagunaArgs, LagunaDrafter), "muse_glimmer_assistant": (MuseAssistantArgs, MuseAssistant)}
DRAFTER_MODEL_TYPES = ("laguna", "muse_glimmer_assistant")
# What only a DFlash2 checkpoint has: loading it as v1 would silently drop the conv and the selector.
DFLASH2_TENSORS = (".attention_conv.", ".mlp_conv.", "candidate_selector.")


def resolve(name: str, what: str) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id, downloaded (or taken from the cache)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{what} {name} is a file; expected a model folder{gguf_hint(path)}")
        return path
    if not _REPO_ID.match(name):
        raise DFlashError(f"{what} {name}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS, ignore_patterns=SKIPPED_PATTERNS))
    except GatedRepoError:
        raise DFlashError(
            f"{what} {name} is gated: accept its terms on https://huggingface.co/{name} , then log in with "
            "`hf auth login` and run this again"
        ) from None
    except RepositoryNotFoundError:
        raise DFlashError(f"{what} {name}: no such folder or Hugging Face repo (a private or gated one needs "
                          "`hf auth login`)") from None
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "connect" in reason.lower() or isinstance(e, LocalEntryNotFoundError):
            reason = "offline, or the Hugging Face Hub is unreachable"
        if path.parent.is_dir():  # "models/qwen3" with ./models present: most likely a mistyped folder
            raise DFlashError(f"{what} {name}: no such folder (nor could it be downloaded as a repo: {reason})") from None
        named_as_drafter = what == "model" and re.search(r"dflash|draft|assistant", name, re.IGNORECASE)
        drafter = "; a drafter not in the registry also needs --target TARGET" if named_as_drafter else ""
        raise DownloadError(
            f"cannot download {what} {name} ({reason}); pass a local folder or a converted bundle instead{drafter}"
        ) from None


def cast_floats(tree: Any, dtype: mx.Dtype) -> Any:
    """Floating-point leaves cast to ``dtype``; quantized (integer) weights untouched."""
    return tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, tree)


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DFlashError(f"{path} is not a DFlash drafter: it has no config.json")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{config_file} is not valid JSON ({e})") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise DFlashError(f"{index} is not a valid safetensors index ({e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DFlashError(f"drafter shard missing in {path}: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"no safetensors weights in drafter folder {path}")
    return files


def load_weights(files: list[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # noqa: BLE001 mlx raises bare RuntimeError/ValueError on bad files
            raise DFlashError(f"cannot read {f}: corrupt or not a safetensors file ({e})") from None
    return weights


def _check_tensors(model: Drafter, weights: dict[str, mx.array], path: Path) -> None:
    """Name the first tensor that does not fit the config, with its expected shape, in one line."""
    expected = dict(tree_flatten(model.parameters()))
    prefix = f"drafter weights in {path} do not match its config:"
    for name, value in expected.items():
        if name not in weights:
            raise DFlashError(f"{prefix} {name} is missing (expected shape {list(value.shape)})")
        if weights[name].shape != value.shape:
            raise DFlashError(f"{prefix} {name} has shape {list(weights[name].shape)}, expected {list(value.shape)}")
    if extra := sorted(weights.keys() - expected.keys()):
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise DFlashError(f"{prefix} unexpected tensor {extra[0]}{more}")


def _refuse_dflash2_as_v1(path: Path, architectures: list[str], names: Iterable[str]) -> None:
    """A checkpoint with DFlash2 settings (dflash_config keys) or tensors must not load as v1."""
    if any(n.startswith(("conv_", "selector_")) or any(m in n for m in DFLASH2_TENSORS) for n in names):
        raise DFlashError(
            f"{path} is a DFlash2 drafter (conv/selector settings or tensors) but its config says architectures "
            f"{architectures or 'missing'}: set architectures to [\"DFlash2DraftModel\"]"
        )


def load_drafter(path: Path) -> Drafter:
    """Load a z-lab DFlash or DFlash2 checkpoint folder exactly as published."""
    config = _read_config(path)
    architectures = config.get("architectures") or []
    if not _drafter_config(config):
        raise DFlashError(
            f"{path} is not a DFlash drafter (architectures {architectures or 'missing'}, "
            "no dflash_config)"
        )
    kind = drafter_kind(config)
    unsupported = [a for a in architectures if a not in DRAFTER_KINDS]
    if kind == "DFlashDraftModel" and unsupported and not set(architectures) & set(DRAFTER_KINDS):
        raise DFlashError(
            f"drafter architecture {unsupported[0]} is not supported yet; "
            f"supported: {', '.join(DRAFTER_KINDS)}"
        )
    args_class, model_class = DRAFTER_KINDS[kind]
    if model_class is Drafter:
        _refuse_dflash2_as_v1(path, architectures, config.get("dflash_config") or {})
    try:
        args = args_class.from_dict(config)
        model = model_class(args)
    except TypeError as e:
        raise DFlashError(f"drafter config in {path} is incomplete ({e})") from None
    _ = args.mask_token_id  # fail early when missing
    if model.block_size < 1:
        raise DFlashError(f"drafter block_size must be >= 1, got {model.block_size}")

    weights = load_weights(_weight_files(path))
    if model_class is Drafter:
        _refuse_dflash2_as_v1(path, architectures, weights)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quant := config.get("quantization"):  # written by `dflash-mlx convert --draft-quantize`
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    model.vocabulary = _vocabulary(weights, model_class, args, path)
    _check_tensors(model, weights, path)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def _vocabulary(weights: dict[str, mx.array], model_class: type, args: DrafterArgs,
                path: Path) -> Optional[DraftVocabulary]:
    """The drafter's own vocabulary (``vocabulary``), taken out of ``weights``; its config must declare it."""
    declared, ids = args.dflash_config.get(VOCAB_CONFIG), weights.pop(VOCAB_TENSOR, None)
    if declared is None and ids is None:
        return None
    if model_class is not Drafter:
        raise DFlashError(f"{path}: a draft vocabulary ({VOCAB_TENSOR}) is supported for DFlash drafters only")
    if ids is None or declared is None:
        missing = f"the tensor {VOCAB_TENSOR}" if ids is None else f"dflash_config.{VOCAB_CONFIG}"
        raise DFlashError(f"drafter in {path} has a draft vocabulary without {missing}")
    if ids.ndim != 1 or ids.shape[0] != declared:
        raise DFlashError(f"drafter in {path}: {VOCAB_TENSOR} has shape {list(ids.shape)}, its config says "
                          f"{VOCAB_CONFIG} {declared}")
    try:
        return DraftVocabulary(np.array(ids), args.vocab_size)
    except DFlashError as e:
        raise DFlashError(f"drafter in {path}: {e}") from None


def check_pair(target: Target, drafter: Drafter) -> None:
    """Refuse a drafter that was not trained for this target, with the reason."""
    args = drafter.args
    if args.hidden_size != target.hidden_size:
        raise DFlashError(
            f"drafter hidden_size {args.hidden_size} does not match the target's "
            f"{target.hidden_size}: this drafter was trained for another model"
        )
    if args.vocab_size != target.vocab_size:
        raise DFlashError(
            f"drafter vocab_size {args.vocab_size} does not match the target's "
            f"{target.vocab_size}: this drafter was trained for another model"
        )
    if args.num_target_layers != target.num_layers:
        raise DFlashError(
            f"drafter expects a {args.num_target_layers}-layer target, "
            f"this target has {target.num_layers}"
        )
    if not 0 <= args.mask_token_id < target.vocab_size:
        raise DFlashError(f"drafter mask_token_id {args.mask_token_id} is outside the vocabulary")


def check_target_folder(path: Path, ranks: int = 1) -> None:
    """A readable config.json of a supported architecture (that shards over ``ranks``), or a one-line error."""
    if not (path / "config.json").is_file():
        raise DFlashError(f"{path} is not a model folder: it has no config.json")
    try:
        config = json.loads((path / "config.json").read_text())
        model_type = config.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise DFlashError(f"{path / 'config.json'} is not a valid model config ({e})") from None
    if any("DFlash" in a for a in config.get("architectures") or []):
        raise DFlashError(f"{path} holds a DFlash drafter, not a target model: give the model it drafts for as the target")
    check_model_type(model_type)
    if ranks > 1:
        distributed.check_shardable(config, ranks)


LONG_ENOUGH = 2**62  # a tokenizer's model_max_length that no prompt reaches
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken", "tiktoken.model")


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")  # what mlx-lm's LoRA training writes


def check_adapter(path: Path) -> None:
    """An mlx-lm LoRA adapter folder (``mlx_lm.lora``'s output), or a one-line error."""
    if path.is_file():
        raise DFlashError(f"adapter path {path} is a file; expected the folder mlx_lm.lora wrote its adapters to")
    if not path.is_dir():
        raise DFlashError(f"adapter path {path}: no such folder")
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise DFlashError(f"adapter path {path} has no {missing[0]}: give the folder mlx_lm.lora wrote its adapters "
                          "to (a fused model is a target of its own: pass it as --target)")


def load_target(
    path: Path, group: Optional[mx.distributed.Group] = None, chat_template: Optional[str] = None,
    adapter: Optional[Path] = None,
) -> tuple[Any, Any]:
    """The mlx-lm model and tokenizer in ``path``, or a one-line error naming the problem.

    With a ``group``, mlx-lm's sharded load: the weights are read lazily and
    sharded before they are evaluated, so each rank holds only its share.
    ``chat_template`` (Jinja text) replaces the tokenizer's template, or gives one
    to a model that has none, as mlx-lm's ``--chat-template`` does; mlx-lm then
    infers the tool-call format from it. ``adapter``: an mlx-lm LoRA adapter
    folder, applied to the target as mlx-lm's ``load`` does (unfused).
    """
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import sharded_load

    check_target_folder(path, 1 if group is None else group.size())  # before reading gigabytes of weights
    if not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise DFlashError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the tokenizer files of the "
                          "model it was made from into it")
    if adapter is not None:
        check_adapter(adapter)
        if group is not None:
            raise DFlashError("LoRA adapters are not applied to a sharded target: fuse them first "
                              "(mlx_lm.fuse) and pass the fused model as the target")
    extra = {"chat_template": chat_template} if chat_template is not None else None
    try:
        if group is None:
            model, tokenizer = mlx_lm_load(str(path), tokenizer_config=extra,
                                           adapter_path=None if adapter is None else str(adapter))
        else:
            model, tokenizer = sharded_load(str(path), tensor_group=group, tokenizer_config=extra)
        # Transformers warns of a prompt longer than its model_max_length as it encodes it; dflash-mlx says it then,
        # in its own line, against the model's positions (``check_context``).
        tokenizer._tokenizer.model_max_length = LONG_ENOUGH
        return model, tokenizer
    except DFlashError:
        raise
    except Exception as e:  # noqa: BLE001 mlx-lm reports bad folders with many exception types, some over several lines
        reason = textwrap.shorten(str(e), 300, placeholder=" ...") or type(e).__name__
        raise DFlashError(f"cannot load target {path}: {reason}") from None


def load(draft: str, target: Optional[str] = None, chat_template: Optional[str] = None,
         adapter_path: Optional[str] = None) -> tuple[Target, Union[Drafter, NoDrafter], Any]:
    """Load a DFlash drafter and its target, or a target alone.

    ``draft`` is a converted bundle folder, a drafter folder, a Hub repo id or a
    registry name (``Qwen3-8B``); ``target`` (a folder or repo id, original or
    already converted/quantized) is needed only where the registry does not know
    the pair, and overrides it otherwise. Returns ``(target, drafter, tokenizer)``.
    A plain mlx-lm model (a folder or repo id whose config is not a drafter's),
    without ``target``, loads alone: its drafter is a ``NoDrafter``, and it decodes
    plainly, with copy drafts where its replies repeat themselves.
    The drafter runs in the target's float dtype, so a bf16 checkpoint drives a
    float32 target without mixed-precision casts. ``chat_template`` (Jinja text)
    replaces the target's chat template, or gives one to a model without.
    ``adapter_path``: an mlx-lm LoRA adapter folder for the target (the drafter
    drafts for the target it was trained for; what the adapter changes, the
    verify follows, so the output is the adapted target's own).
    """
    bundle = Path(draft).expanduser()
    check_bundle(bundle)
    manifest = read_manifest(bundle) if is_bundle(bundle) else {}
    if manifest:
        draft, target = str(bundle / "draft"), target or str(bundle / "target")
    else:
        draft, target, _ = registry_resolve(draft, target)
    draft_path = resolve(draft, "drafter" if target is not None else "model")
    drafter: Union[Drafter, NoDrafter]
    if target is None and not is_drafter(draft_path):  # a plain model: the target alone
        drafter, target_path = NoDrafter(), draft_path
    else:
        drafter = load_drafter(draft_path)
        if target is None:
            raise DFlashError(f"drafter {draft} needs its target: pass --target TARGET (in Python, load's target)")
        drafter.source, target_path = draft_path, resolve(target, "target")
    group = distributed.group()
    adapter = None if adapter_path is None else Path(adapter_path).expanduser()
    model, tokenizer = load_target(target_path, group, chat_template, adapter)
    tgt = Target(model, drafter.target_layer_ids, group)
    if group is None and not is_tested(tgt.model_type):
        tgt.self_check()
    tgt.source, tgt.adapter = target_path, adapter  # what a saved cache records
    if isinstance(drafter, Drafter):
        check_pair(tgt, drafter)
        drafter.update(cast_floats(drafter.parameters(), tgt.dtype))
        mx.eval(drafter.parameters())
        drafter.context_window = manifest.get("draft_window", drafter.context_window)
    return tgt, drafter, tokenizer


def drafter_kind(config: dict[str, Any]) -> str:
    """Which kind of drafter a config describes (a key of ``DRAFTER_KINDS``)."""
    if "DFlash2DraftModel" in (config.get("architectures") or []):
        return "DFlash2DraftModel"
    if config.get("model_type") in DRAFTER_MODEL_TYPES:
        return config["model_type"]
    return "DFlashDraftModel"


def is_drafter(path: Path) -> bool:
    """Whether the folder holds a DFlash drafter (rather than a model to load alone); a folder with no readable
    config is taken for one, so that the drafter's loader names what is wrong with it."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or _drafter_config(config)


def _drafter_config(config: dict[str, Any]) -> bool:
    """A drafter's config: a ``dflash_config``, a drafter kind among its architectures, or a drafter family's
    ``model_type`` (Meta's Muse Glimmer assistant has no ``dflash_config``)."""
    return ("dflash_config" in config or bool(set(config.get("architectures") or []) & set(DRAFTER_KINDS))
            or config.get("model_type") == "muse_glimmer_assistant")
