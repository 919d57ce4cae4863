"""What machine we run on: the facts a benchmark must report and a ``doctor`` command checks.

On Linux the ``mlx-cpu`` wheel bundles netlib's reference BLAS, under which a
16-token verify costs as much as 16 decoding steps, so speculative decoding
cannot win there. Preloading OpenBLAS fixes that; this module finds out which
BLAS is in use and can re-exec a benchmark with OpenBLAS preloaded.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional

_REEXEC_GUARD = "DFLASH_MLX_BLAS_REEXEC"

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
]


class _DlInfo(ctypes.Structure):  # glibc's Dl_info, filled in by dladdr()
    _fields_ = [
        ("fname", ctypes.c_char_p),
        ("fbase", ctypes.c_void_p),
        ("sname", ctypes.c_char_p),
        ("saddr", ctypes.c_void_p),
    ]


def _is_reference(path: str) -> bool:
    return os.path.basename(path).startswith("libblas") and "openblas" not in path


def blas_library() -> Optional[str]:
    """The library that serves MLX's float32 matmuls (``cblas_sgemm``) on Linux; None elsewhere.

    Scanning the mapped libraries is not enough: the wheel's reference libblas
    stays mapped under an LD_PRELOADed OpenBLAS, and numpy maps its own BLAS.
    So ask the dynamic linker, in its binding order: the global scope (where
    LD_PRELOAD wins) first, then mlx's own dependencies.
    """
    if sys.platform != "linux":
        return None
    import mlx.core as mx

    libc = ctypes.CDLL(None)
    for lib in (libc, ctypes.CDLL(mx.__file__, mode=os.RTLD_NOLOAD)):
        fn = getattr(lib, "cblas_sgemm", None)
        info = _DlInfo()
        if fn is not None and libc.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
            return os.path.realpath(os.fsdecode(info.fname))
    return None


def is_reference_blas() -> bool:
    """True on Linux when matmuls go through netlib's reference BLAS (~8 GFLOP/s)."""
    lib = blas_library()
    return lib is not None and _is_reference(lib)


def find_openblas() -> Optional[str]:
    """The first installed OpenBLAS from ``OPENBLAS_CANDIDATES``, or None."""
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def _cpu_model() -> str:
    if sys.platform == "linux":
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "Hardware"):
                return line.split(":", 1)[1].strip()
    elif sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return platform.processor() or platform.machine()


def _version(dist: str) -> Optional[str]:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_description() -> dict[str, Any]:
    """Everything a benchmark number depends on besides the code, for its report."""
    import mlx.core as mx

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "backend": "metal" if mx.metal.is_available() else "cpu",
        "mlx": _version("mlx"),
        "mlx-lm": _version("mlx-lm"),
        "dflash-mlx": _version("dflash-mlx"),
    }
    if sys.platform == "linux":
        info["blas"] = blas_library()
    return info


def reexec_with_openblas() -> None:
    """Restart this process with OpenBLAS preloaded when it would run on the reference BLAS.

    For benchmark scripts: call it first thing. Does nothing off Linux, when
    OpenBLAS is not installed (the caller warns), or after one re-exec already.
    """
    openblas = find_openblas()
    preload = os.environ.get("LD_PRELOAD", "")
    if os.environ.get(_REEXEC_GUARD) or openblas is None or openblas in preload or not is_reference_blas():
        return
    env = dict(os.environ, LD_PRELOAD=f"{openblas} {preload}".strip(), **{_REEXEC_GUARD: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
