"""Convert a drafter and its target into one self-contained MLX bundle folder.

Layout: ``OUT/target`` (mlx-lm's own conversion, optionally quantized), ``OUT/draft``
(z-lab layout, optionally quantized), ``OUT/dflash.json`` (the manifest). The bundle
is written in a temporary folder beside OUT and renamed into place, so an
interrupted or failed convert leaves nothing behind and an existing OUT is only
replaced, with ``force``, once the new one is complete.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .. import __version__
from ..errors import DFlashError
from .caches import check_draft_window
from .drafter import DRAFT_WINDOW, Drafter
from .loader import cast_floats, check_pair, check_target_folder, is_drafter, load_drafter, resolve
from .registry import MANIFEST, check_bundle, is_bundle, remember_bundle
from .registry import resolve as registry_resolve
from .target import Target

QUANT_BITS = {"2bit": 2, "3bit": 3, "4bit": 4, "5bit": 5, "6bit": 6, "8bit": 8}
QUANT_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
DTYPES = ("bfloat16", "float16", "float32")
DRAFT_QUANT = {"none": None, "8bit": 8, "4bit": 4}
FLOAT_DFLASH2 = ("attention_conv", "mlp_conv", "candidate_selector")


def _check_options(quantize: Optional[str], dtype: Optional[str], draft_quantize: str, group_size: int) -> None:
    if quantize is not None and quantize not in QUANT_BITS and quantize not in QUANT_RECIPES:
        valid = ", ".join([*QUANT_BITS, *QUANT_RECIPES])
        raise DFlashError(f"invalid --quantize {quantize!r}; choose one of {valid}")
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"invalid --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if draft_quantize not in DRAFT_QUANT:
        raise DFlashError(f"invalid --draft-quantize {draft_quantize!r}; choose one of {', '.join(DRAFT_QUANT)}")
    if group_size not in (32, 64, 128):
        raise DFlashError(f"invalid --q-group-size {group_size}; choose 32, 64 or 128")


def _weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _revision(path: Path) -> str:
    """The Hub commit of a downloaded snapshot, or 'local'."""
    return path.name if path.parent.name == "snapshots" else "local"


def _estimate(target_path: Path, draft_path: Path, quantize: Optional[str], dtype: Optional[str]) -> int:
    """Rough bytes of the bundle: source sizes scaled by the output precision (bf16 sources assumed)."""
    scale = 1.0
    if dtype == "float32":
        scale = 2.0
    if quantize is not None:
        bits = QUANT_BITS.get(quantize, 6)
        scale = (bits + 1) / 16  # weights plus scales and biases
    return int(_weights_bytes(target_path) * scale + _weights_bytes(draft_path) * (2.0 if dtype == "float32" else 1.0))


def _check_pair(target_path: Path, draft_path: Path):
    """Refuse a mismatched pair before converting anything (lazy load: shapes only)."""
    from mlx_lm.utils import load_model

    check_target_folder(target_path)
    drafter = load_drafter(draft_path)
    model, _ = load_model(target_path, lazy=True)
    check_pair(Target(model, drafter.target_layer_ids), drafter)
    return drafter


def _write_drafter(drafter: Drafter, source: Path, out: Path, dtype: Optional[str], bits: Optional[int],
                   group_size: int, quantize_fc: bool) -> None:
    out.mkdir()
    if dtype is not None:
        drafter.update(cast_floats(drafter.parameters(), getattr(mx, dtype)))
    config = json.loads((source / "config.json").read_text())
    if bits is not None:
        # Layers whose input width the group size does not divide stay in float, and so do DFlash2's
        # convolution kernels and selector: small, and their scores choose the drafted path.
        nn.quantize(drafter, group_size=group_size, bits=bits,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and (quantize_fc or p != "fc")
                    and m.weight.shape[-1] % group_size == 0 and not any(k in p for k in FLOAT_DFLASH2))
        config["quantization"] = {"group_size": group_size, "bits": bits}
    mx.save_safetensors(str(out / "model.safetensors"), drafter.tensors(),
                        metadata={"format": "mlx"})
    if dtype is not None:
        config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=1))


def convert(
    source: str,
    out: str,
    target: Optional[str] = None,
    quantize: Optional[str] = None,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    draft_quantize: str = "none",
    quantize_fc: bool = False,
    force: bool = False,
    log: Callable[[str], None] = lambda message: None,
    draft_window: Optional[int] = None,
) -> Path:
    """Write the bundle for ``source`` (registry name, drafter repo or folder) to ``out``; return its path.
    ``draft_window``: the drafter context window its commands use by default (None: this version's default)."""
    _check_options(quantize, dtype, draft_quantize, q_group_size)
    check_draft_window(draft_window)
    out_path = Path(out).expanduser().resolve()
    if out_path.exists() and not force:
        raise DFlashError(f"{out_path} already exists; pass --force to replace it")
    local = Path(source).expanduser()
    if local.suffix.lower() == ".gguf" and not local.exists():
        raise DFlashError(f"{source}: no such file")
    if local.is_file():
        from .from_gguf import is_gguf

        if not is_gguf(local):
            raise DFlashError(f"{source} is a file but not a GGUF model; convert takes a .gguf file, a drafter "
                              "(registry name, repo or folder) or a bundle")
        drafter_only = [name for name, given in (("--target", target is not None),
                                                 ("--draft-window", draft_window is not None),
                                                 ("--draft-quantize", draft_quantize != "none"),
                                                 ("--quantize-fc", quantize_fc)) if given]
        if drafter_only:
            raise DFlashError(f"{drafter_only[0]} is for a drafter; a GGUF file converts alone (train a drafter for it "
                              "with `dflash-mlx train`)")
        return convert_gguf(local, out_path, quantize, q_group_size, dtype, log)
    draft, target = _pair_sources(source, target)
    draft_path = resolve(draft, "drafter")
    target_path = resolve(target, "target")
    drafter = _check_pair(target_path, draft_path)
    check_draft_window(draft_window, drafter.block_size)

    tmp = _workspace(out_path, _estimate(target_path, draft_path, quantize, dtype))
    try:
        log("converting the target with mlx-lm" + (f" ({quantize})" if quantize else ""))
        from mlx_lm.convert import convert as mlx_convert

        with contextlib.redirect_stdout(io.StringIO()):
            mlx_convert(
                str(target_path), str(tmp / "target"),
                quantize=quantize is not None,
                q_group_size=q_group_size,
                q_bits=QUANT_BITS.get(quantize or "", None),
                dtype=dtype,
                quant_predicate=quantize if quantize in QUANT_RECIPES else None,
            )
        log("writing the drafter" + (f" ({draft_quantize})" if draft_quantize != "none" else ""))
        _write_drafter(drafter, draft_path, tmp / "draft", dtype, DRAFT_QUANT[draft_quantize], q_group_size, quantize_fc)
        manifest = {
            "format": 1,
            "drafter": _source(draft), "drafter_revision": _revision(draft_path),
            "target": _source(target), "target_revision": _revision(target_path),
            "target_parameters": _parameter_count(target_path),
            "dtype": dtype, "quantize": quantize, "q_group_size": q_group_size,
            "draft_quantize": draft_quantize, "quantize_fc": quantize_fc,
            "draft_window": DRAFT_WINDOW if draft_window is None else draft_window,
        }
        _write_manifest(tmp, manifest)
        _publish(tmp, out_path)
    except OSError as e:
        raise DFlashError(f"convert failed writing {out_path} ({e.strerror or e}); nothing was written") from None
    except ValueError as e:  # mlx-lm reports bad inputs this way
        raise DFlashError(f"convert failed: {str(e).splitlines()[0]}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remember_bundle(out_path)
    return out_path


def _pair_sources(source: str, target: Optional[str]) -> tuple[str, str]:
    """(drafter, target) of a convert: a drafter and its target (given, or the registry's), never a bundle or a
    model alone."""
    local = Path(source).expanduser()
    check_bundle(local)
    if is_bundle(local):
        raise DFlashError(f"{source} is already a bundle: the commands take it as it is (to convert it again, give "
                          "its draft/ with --target its target/)")
    draft, target, _ = registry_resolve(source, target)
    if target is None:
        local = Path(draft).expanduser()
        if local.is_dir() and not is_drafter(local):
            raise DFlashError(f"{source} is a model without a drafter: the commands take it as it is (convert makes "
                              "drafter + target bundles; `mlx_lm.convert -q` quantizes a model alone)")
        raise DFlashError(f"drafter {source} needs its target: pass --target TARGET")
    return draft, target


def _write_manifest(folder: Path, manifest: dict) -> None:
    """The bundle's manifest: what it was made from and how, when, by which version."""
    stamped = {**manifest, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "dflash_mlx": __version__}
    (folder / MANIFEST).write_text(json.dumps(stamped, indent=1))


def _publish(tmp: Path, out_path: Path) -> None:
    """Move the finished folder ``tmp`` to ``out_path``; an existing one (--force) is swapped out only now."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; the output gets the usual permissions
    if out_path.exists():
        old = out_path.with_name(f".{out_path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out_path.rename(old)
        tmp.rename(out_path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_path)


def _workspace(out_path: Path, need: int) -> Path:
    """A private temporary folder beside ``out_path``, once the disk is known to hold ``need`` bytes."""
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot create {out_path.parent}: {e.strerror or e}") from None
    free = shutil.disk_usage(out_path.parent).free
    if need * 1.1 > free:
        raise DFlashError(f"not enough disk space in {out_path.parent}: need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    return Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", suffix=".partial", dir=out_path.parent))


def convert_gguf(
    source: Path,
    out_path: Path,
    quantize: Optional[str] = None,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    log: Callable[[str], None] = lambda message: None,
) -> Path:
    """Write the GGUF file ``source`` as an mlx-lm model folder at ``out_path`` (see ``from_gguf``)."""
    from .from_gguf import GGUF, write_model

    gguf = GGUF(source)
    size = source.stat().st_size
    scale = {"float32": 8.0, "float16": 4.0, "bfloat16": 4.0}.get(dtype or "", 1.0)  # from ~4.5 bits a weight
    need = int(size * ((QUANT_BITS.get(quantize or "", 6) + 1) / 4.5 if quantize else scale))
    tmp = _workspace(out_path, need)
    try:
        write_model(gguf, tmp, quantize, QUANT_BITS.get(quantize or ""), q_group_size, dtype, log)
        _publish(tmp, out_path)
    except OSError as e:
        raise DFlashError(f"convert failed writing {out_path} ({e.strerror or e}); nothing was written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remember_bundle(out_path)  # listed by `models` and `doctor` beside the bundles
    return out_path


def _source(name: str) -> str:
    """What finds a source again from anywhere: a local folder's absolute path, or the repo id."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def _parameter_count(folder: Path) -> int:
    """Weights in a checkpoint, from its safetensors headers (no tensor is read)."""
    count = 0
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        count += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return count


def summary(bundle: Path) -> str:
    """One line: the bundle's size on disk and the target's bits per weight (a model folder: its size)."""
    size = _size(sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()))
    if not (bundle / MANIFEST).is_file():
        return f"{bundle}: an mlx-lm model, {size} on disk"
    params = json.loads((bundle / MANIFEST).read_text()).get("target_parameters")
    # Scales and biases count (a 4-bit layer at group 64 is 4.5 bits), and so do the tensors left in float
    # (norms; in a small model also layers whose width does not divide into groups).
    bits = (f", target at {8 * _weights_bytes(bundle / 'target') / params:.2f} bits per weight (scales and "
            "unquantized tensors included)" if params else "")
    return f"{bundle}: {size} on disk{bits}"


def _size(n: int) -> str:
    """Bytes as people read them: 1.23 GB, 45.6 MB, 789 KB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{max(1, round(n / 1e3))} KB"
