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
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(tmp_path / "dist"),
                            str(source)], check=True, capture_output=True, text=True, timeout=600)
    warnings = [line for line in (built.stdout + built.stderr).splitlines() if "Warning" in line or "Deprecat" in line]
    assert not warnings, warnings  # the metadata is current: no page of setuptools warnings
    wheel = next((tmp_path / "dist").glob("dflash_mlx_lossless-*.whl"))  # not PyPI's other "dflash-mlx"
    shipped = set(zipfile.ZipFile(wheel).namelist())
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in shipped if n.endswith("entry_points.txt"))).decode()
    assert "dflash-mlx = dflash_mlx.cli.main:app" in entry_points  # the command keeps its name
    package = ROOT / "dflash_mlx"
    wanted = {f.relative_to(ROOT).as_posix() for f in package.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert {"dflash_mlx/data/text.txt", "dflash_mlx/data/prompts.json", "dflash_mlx/data/registry.json"} <= wanted
    assert wanted <= shipped, sorted(wanted - shipped)


def test_every_install_hint_installs_this_project():
    """PyPI's "dflash-mlx" is another project: no hint may send a user there (`pip install 'dflash-mlx[serve]'`
    installs it, or fails on the extra); hints name the plain packages, or this checkout's extras."""
    from dflash_mlx.system import DISTRIBUTION, install_hint

    assert DISTRIBUTION != "dflash-mlx"
    texts = {f: f.read_text() for f in [*(ROOT / "dflash_mlx").rglob("*.py"), ROOT / "README.md", ROOT / "Makefile"]}
    for path, text in texts.items():
        for line in text.splitlines():
            if "pip install" in line and "dflash-mlx" in line.split("pip install", 1)[1]:
                explains = any(word in line for word in ("swap", "other project", "another"))  # says why not to
                assert explains or "-e" in line or "checkout" in line or "uninstall" in line, f"{path.name}: {line}"
    hint = install_hint("serve", "starlette", "uvicorn")
    assert hint.startswith("pip install starlette uvicorn") and "pip install -e '.[serve]'" in hint
