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

# This project's name for pip. Not "dflash-mlx": on PyPI that is another DFlash port (bstnxbt/dflash-mlx),
# which `pip install -U dflash-mlx` would swap in. Both import as `dflash_mlx`, so one environment holds one.
DISTRIBUTION = "dflash-mlx-lossless"
OTHER_PROJECT = "dflash-mlx"

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
]


# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each call before they sleep. Beside
# MLX's own threads that takes a core from them: on 2 cores a small model's plain steps ran ~10%
# slower and the adaptive policy's ~25% (bench/adaptive.py pair). 2^4 cycles: they sleep at once.
OPENBLAS_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4"}
OPENBLAS_FIX = " ".join(f"{k}={v}" for k, v in OPENBLAS_ENV.items())  # as a user types it


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


def name_conflict() -> Optional[str]:
    """What to do when a distribution named ``dflash-mlx`` is installed here too, or None.

    It is PyPI's other project (whose files overwrite this one's ``dflash_mlx``), or an
    install of this project from before its rename (a second record of the same files).
    """
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        meta = metadata(OTHER_PROJECT)
    except PackageNotFoundError:
        return None
    if "bstnxbt" in f"{meta.get('Author')} {meta.get_all('Project-URL')}":
        return (f"PyPI's other dflash-mlx {meta['Version']} (bstnxbt) is installed here too and overwrites this "
                "project's dflash_mlx package: pip uninstall dflash-mlx, then reinstall this project")
    return (f"an install of this project from before its rename to {DISTRIBUTION} is still recorded: "
            "pip uninstall dflash-mlx (the files stay this project's)")


def install_hint(extra: str, *packages: str) -> str:
    """How to install what an optional feature needs.

    Never ``pip install 'dflash-mlx[...]'``: on PyPI that name is another DFlash port's,
    which pip would install instead of (or over) this one.
    """
    return f"pip install {' '.join(packages)} (or, in a dflash-mlx checkout, pip install -e '.[{extra}]')"


def _blas_env() -> str:
    """The OpenBLAS settings of this process, as a user types them."""
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("OPENBLAS_"))


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
        "dflash-mlx": _version(DISTRIBUTION),
    }
    if sys.platform == "linux":
        info["blas"] = blas_library()
        info["blas_env"] = _blas_env()
    return info


def openblas_spins() -> bool:
    """True when OpenBLAS serves MLX and its idle threads keep spinning (none of its thread settings made)."""
    lib = blas_library() or ""
    return "openblas" in lib and not any(k in os.environ for k in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS"))


def blas_check() -> Optional[tuple[str, str]]:
    """What MLX's BLAS means for speed here: (verdict, one line with the fix); None off Linux.

    The verdict is "reference" (netlib's reference BLAS: a 16-token verify costs 16 plain
    steps, so speculation cannot win), "spins" (OpenBLAS with idle threads that take a
    core from MLX's own) or "ok". Every command that decodes warns on the first two.
    """
    if sys.platform != "linux":
        return None
    lib = blas_library() or "unknown"
    if is_reference_blas():
        openblas = find_openblas()
        fix = (f"run with LD_PRELOAD={openblas} {OPENBLAS_FIX}" if openblas
               else "apt-get install libopenblas0-pthread, then preload it (dflash-mlx doctor says how)")
        return "reference", f"MLX runs on the reference BLAS {lib}: speculative decoding cannot win; {fix}"
    if openblas_spins():
        return "spins", f"OpenBLAS's idle threads spin and slow MLX's own ({lib}): set {OPENBLAS_FIX}"
    return "ok", f"{lib} ({_blas_env() or 'default settings'})"


def reexec_with_openblas() -> None:
    """Restart this process with OpenBLAS preloaded, its idle threads sleeping at once (``OPENBLAS_ENV``).

    For benchmark scripts: call it first thing. Re-execs when MLX would run on the
    reference BLAS and OpenBLAS is installed, or when OpenBLAS runs with spinning
    threads. Does nothing off Linux, when OpenBLAS is not installed (the caller
    warns), or after one re-exec already. Settings the user made are kept.
    """
    if os.environ.get(_REEXEC_GUARD) or sys.platform != "linux":
        return
    env = dict(os.environ, **{_REEXEC_GUARD: "1"})
    openblas, preload = find_openblas(), os.environ.get("LD_PRELOAD", "")
    if is_reference_blas() and openblas is not None and openblas not in preload:
        env["LD_PRELOAD"] = f"{openblas} {preload}".strip()
    elif not openblas_spins():
        return
    for key, value in OPENBLAS_ENV.items():
        env.setdefault(key, value)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
