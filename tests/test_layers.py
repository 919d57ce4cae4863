"""The package's layering: each package imports only the ones below it, and no modules import each other in a circle.

Every import counts, those inside functions and under ``TYPE_CHECKING`` too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_mlx

ROOT = Path(dflash_mlx.__file__).parent
# Lowest first. The shared modules at the top sit below every package.
LAYERS = ["shared", "models", "decode", "eval", "training", "server", "cli"]
# Circles still to end, each with the change that ends it; the test fails when one ends and is still listed.
KNOWN_CIRCLES: set[str] = set()


def module_name(path: Path) -> str:
    parts = ["dflash_mlx", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The package's modules this file imports (``from . import x`` names module x when it is one)."""
    name, package = module_name(path), module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] == "dflash_mlx":
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "dflash_mlx")
    return found - {name}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {d for d in imports(p) if d in modules} for name, p in modules.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else 0


def test_a_package_imports_only_those_below_it():
    upward = [f"{m} imports {d}" for m, deps in graph().items() if m != "dflash_mlx" for d in deps
              if d != "dflash_mlx" and layer(d) > layer(m)]
    assert not upward, "\n".join(upward)


def circles() -> set[str]:
    """Each circle once, written from its smallest module."""
    g = {m: deps - {"dflash_mlx"} for m, deps in graph().items()}
    # a module importing from its own package (``from . import x``) is no circle with the package's __init__
    g = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in g.items()}
    found, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                loop = path[path.index(d):]
                start = loop.index(min(loop))
                found.append(" -> ".join(loop[start:] + loop[:start] + [min(loop)]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return set(found)


def test_no_circle_of_imports():
    assert circles() == KNOWN_CIRCLES


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above are not vacuous: a file importing upward, and two importing each other, are found."""
    (tmp_path / "models").mkdir()
    (tmp_path / "decode").mkdir()
    (tmp_path / "models" / "a.py").write_text("from ..decode import b\n")
    (tmp_path / "decode" / "b.py").write_text("from ..models.a import x\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert graph() == {"dflash_mlx.models.a": {"dflash_mlx.decode.b"}, "dflash_mlx.decode.b": {"dflash_mlx.models.a"}}
    try:
        test_a_package_imports_only_those_below_it()
    except AssertionError as e:
        assert "dflash_mlx.models.a imports dflash_mlx.decode.b" in str(e)
    else:
        raise AssertionError("the upward import was not found")
    assert circles() == {"dflash_mlx.decode.b -> dflash_mlx.models.a -> dflash_mlx.decode.b"}
