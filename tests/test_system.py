"""The machine facts benchmarks report."""

from __future__ import annotations

import os
import sys

import pytest

from dflash_mlx.system import blas_library, is_reference_blas, machine_description


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
