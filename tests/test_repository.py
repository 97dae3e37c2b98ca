"""The repository itself: nothing in it names one machine's absolute paths (a fresh clone
anywhere must work as it is), no module of the package grows past a few hundred lines, and
no modules of the package import each other in a circle (not even for type checking)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The most lines a module of the package may have (split it by concern beyond that).
MAX_MODULE_LINES = 600
#: Home and work directories of the machines this project was built on.
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|check|Users)/[\w.-]+")


def _tracked() -> list:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (the check reads the tracked files)")
    return [ROOT / p for p in out.decode().split("\0") if p]


@pytest.mark.timeout(60)
def test_no_file_names_an_absolute_path_of_one_machine() -> None:
    found = []
    for path in _tracked():
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not found, "absolute paths of one machine:\n" + "\n".join(found)


def test_no_module_of_the_package_is_over_the_line_limit() -> None:
    package = ROOT / "raycoll"
    lengths = {}
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        lengths[path.relative_to(ROOT).as_posix()] = len(lines)
    assert lengths, f"no modules found under {package}"
    over = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not over, (f"modules over {MAX_MODULE_LINES} lines (split them by concern):\n"
                      + "\n".join(f"{name}: {n} lines" for name, n in
                                   sorted(over.items(), key=lambda kv: -kv[1])))


def _module_names(package: Path) -> dict:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, modules: dict) -> set:
    """The package's modules that module ``name`` imports, at import time, inside a function
    (a lazy import closes a circle as surely) or under ``if TYPE_CHECKING:`` (a circle of
    types is a circle of layers: a module below names one above it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import x``, ``mod``
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names}
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_circle_finder_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import x\n")
    modules = _module_names(pkg)
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_circle_finder_finds_a_circle_through_a_type_only_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from pkg.low import wire\n")
    (pkg / "low" / "wire.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:  # pragma: no cover\n"
        "    from pkg.high import Context\nelse:\n    import json\n")
    (pkg / "other.py").write_text("import typing\nif typing.TYPE_CHECKING:\n"
                                  "    from .low import wire\n")
    modules = _module_names(pkg)
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["pkg.low.wire"] == {"pkg.high"} and graph["pkg.other"] == {"pkg.low.wire"}
    assert _circles(graph) == [["pkg.high", "pkg.low.wire"]]


def test_no_import_circle_in_the_package() -> None:
    modules = _module_names(ROOT / "raycoll")
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    circles = _circles(graph)
    assert not circles, "import circles (each a set of modules that import each other):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)
