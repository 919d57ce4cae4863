"""A plain `pip install .` must carry every file the package reads: the editable install of `make test`
would hide a missing one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_every_package_file(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".cache", ".pytest_cache", ".hypothesis", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("dflash_mlx-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "dflash_mlx"
    wanted = {f.relative_to(ROOT).as_posix() for f in package.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert {"dflash_mlx/data/text.txt", "dflash_mlx/data/prompts.json", "dflash_mlx/data/registry.json"} <= wanted
    assert wanted <= shipped, sorted(wanted - shipped)
