"""The machine facts benchmarks report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx.system import OPENBLAS_ENV, blas_library, find_openblas, is_reference_blas, machine_description


def test_machine_description_has_what_a_report_needs():
    info = machine_description()
    for key in ("platform", "processor", "cores", "memory_bytes", "backend", "mlx", "mlx-lm", "dflash-mlx"):
        assert info[key], key
    assert info["backend"] in ("metal", "cpu")


@pytest.mark.skipif(sys.platform != "linux", reason="BLAS detection is a Linux question")
def test_blas_library_is_the_one_mlx_binds():
    lib = blas_library()
    assert lib is not None and os.path.exists(lib)
    preloaded = "openblas" in os.environ.get("LD_PRELOAD", "")
    assert is_reference_blas() == (not preloaded and "openblas" not in lib)


_SHOW = (
    "from dflash_mlx.system import blas_library, machine_description, reexec_with_openblas\n"
    "reexec_with_openblas()\n"
    "import os\n"
    "print(blas_library()); print(os.environ.get('OPENBLAS_THREAD_TIMEOUT')); print(machine_description()['blas_env'])\n"
)


@pytest.mark.skipif(sys.platform != "linux" or find_openblas() is None, reason="needs OpenBLAS installed on Linux")
@pytest.mark.parametrize("preloaded", [False, True])
@pytest.mark.parametrize("timeout", [None, "12"])
def test_benchmarks_run_on_openblas_with_threads_that_sleep(preloaded, timeout):
    """The bench scripts' re-exec: OpenBLAS preloaded, idle threads sleeping, what the user set kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_") and k not in ("LD_PRELOAD",
                                                                                                "DFLASH_MLX_BLAS_REEXEC")}
    if preloaded:
        env["LD_PRELOAD"] = find_openblas()
    if timeout:
        env["OPENBLAS_THREAD_TIMEOUT"] = timeout
    out = subprocess.run([sys.executable, "-c", _SHOW], env=env, capture_output=True, text=True, check=True)
    lib, seen, described = out.stdout.splitlines()
    assert "openblas" in lib
    assert seen == (timeout or OPENBLAS_ENV["OPENBLAS_THREAD_TIMEOUT"])
    assert described == f"OPENBLAS_THREAD_TIMEOUT={seen}"


@pytest.mark.skipif(sys.platform != "linux" or find_openblas() is None, reason="needs OpenBLAS installed on Linux")
@pytest.mark.parametrize("setting,says", [
    ({}, "reference BLAS"),
    ({"LD_PRELOAD": "openblas"}, "idle threads spin"),
    ({"LD_PRELOAD": "openblas", "OPENBLAS_THREAD_TIMEOUT": "4"}, "(OPENBLAS_THREAD_TIMEOUT=4)"),
])
def test_doctor_says_what_the_blas_costs(setting, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_") and k != "LD_PRELOAD"}
    env.update({k: find_openblas() if v == "openblas" else v for k, v in setting.items()})
    env["COLUMNS"] = "200"
    cli = Path(sys.executable).parent / "dflash-mlx"
    run = subprocess.run([str(cli), "doctor"], env=env, capture_output=True, text=True, timeout=120)
    blas = next(line for line in run.stdout.splitlines() if line.startswith("BLAS"))
    assert says in blas, blas
