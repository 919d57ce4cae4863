"""Atomic file writes: a reader never sees half a file, and a failed write leaves the old one intact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union

from .errors import DFlashError


def write_atomic(path: Union[str, Path], content: Union[str, Callable[[Path], None]]) -> Path:
    """Write ``content`` (text, or a function that writes a given path) to ``path`` via a rename.

    The temporary file sits in the same folder (a rename across file systems is not
    atomic) and keeps the suffix, which writers such as ``mx.save_safetensors`` need.
    An OSError (full disk, no permission) becomes a one-line DFlashError.
    """
    target = Path(path).expanduser()
    tmp = target.with_name(f".{target.name}.tmp{target.suffix}")
    try:
        if isinstance(content, str):
            tmp.write_text(content)
        else:
            content(tmp)
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DFlashError(f"cannot write {target}: {e.strerror or e}") from None
        raise
    return target
