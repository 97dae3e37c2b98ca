"""Every ```python block of README.md runs as written, and every relative link resolves.

Each block runs alone in a fresh interpreter (so a fresh Ray: the blocks start their own with
``ray.init(address="local", ...)``), from the repository root, with a timeout. An HTML comment
on the line just before a block marks it:

- ``<!-- excerpt -->``: a fragment that cannot run alone; not run.
- ``<!-- requires: torch -->`` / ``<!-- requires: train -->``: runs only where the extra's
  modules import; otherwise the test skips, naming the missing module.

A block that exits non-zero, or outlives its timeout, fails its test. Every ``print`` of a
runnable block says in a comment on its line what it prints (``# [3. 3. 3. 3.] on each``):
:data:`PROMISES` holds, for each such comment, the check of the block's output that makes it
true; a print without a comment, or a comment with no check here, fails the test.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Seconds one block may run (Ray's start included).
BLOCK_TIMEOUT_S = 180

#: The modules an extra named by ``<!-- requires: NAME -->`` must make importable.
EXTRAS = {
    "torch": ["torch"],
    "train": ["torch", "ray.train.torch"],
}

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*(excerpt|requires:\s*([\w, -]+?))\s*-->\s*$")


class Block(NamedTuple):
    line: int               # the README line of the opening fence
    code: str
    excerpt: bool
    requires: List[str]     # extra names


def readme_blocks(text: str) -> List[Block]:
    """The python blocks of ``text`` with the marker on the line before each, if any."""
    blocks = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        excerpt = bool(mark and mark.group(1) == "excerpt")
        requires = ([r.strip() for r in mark.group(2).split(",")]
                    if mark and mark.group(2) else [])
        blocks.append(Block(line, m.group(1), excerpt, requires))
    return blocks


def _missing(extra: str) -> Optional[str]:
    """The first module of ``extra`` that does not import here, or None."""
    if extra not in EXTRAS:
        raise ValueError(f"README marks a block as requiring unknown extra {extra!r}; "
                         f"expected one of {sorted(EXTRAS)}")
    for module in EXTRAS[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ImportError:          # a missing parent package (ray.train without ray)
            return module
    return None


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))

_PRINT = re.compile(r"\bprint\(.*?#\s*(.+?)\s*$")


def printed_values(out: str) -> List[Any]:
    """Every line of ``out`` that is a Python literal, or a list of numpy arrays as numpy
    prints one (``[array([3., 3.]), ...]``), as that value; other lines (Ray's logs) skipped."""
    values = []
    for line in out.splitlines():
        line = line.strip()
        try:
            values.append(ast.literal_eval(line))
            continue
        except (ValueError, SyntaxError):
            pass
        if line.startswith("[array("):
            values.append(eval(line, {"__builtins__": {}}, {"array": np.array}))  # noqa: S307
    return values


def _arrays_of(value: float, count: int, size: int) -> Callable[[str], None]:
    """Checks that a line holds ``count`` arrays of ``size`` elements, each all ``value``."""
    def check(out: str) -> None:
        for v in printed_values(out):
            if (isinstance(v, list) and len(v) == count
                    and all(isinstance(a, np.ndarray) and a.shape == (size,)
                            and (a == value).all() for a in v)):
                return
        raise AssertionError(f"no line of {count} arrays of {size} x {value} in {out!r}")
    return check


def _lines(*patterns: str) -> Callable[[str], None]:
    """Checks that every regex of ``patterns`` matches a line of the output."""
    def check(out: str) -> None:
        absent = [p for p in patterns if not re.search(p, out, re.M)]
        assert not absent, f"no line matches {absent} in {out!r}"
    return check


def _value(predicate: Callable[[Any], bool], what: str) -> Callable[[str], None]:
    """Checks that some printed literal satisfies ``predicate`` (``what`` it should be)."""
    def holds(v: Any) -> bool:
        try:
            return bool(predicate(v))
        except (ValueError, TypeError):  # numpy arrays compared with lists
            return False

    def check(out: str) -> None:
        assert any(holds(v) for v in printed_values(out)), f"no {what} in {out!r}"
    return check


#: What each README comment on a print promises, as a check of the block's stdout.
PROMISES: Dict[str, Callable[[str], None]] = {
    "[3. 3. 3. 3.] on each": _arrays_of(3.0, 2, 4),
    "each rank's last collective": _lines(r"^rank 0: done with all_reduce #1$",
                                          r"^rank 1: done with all_reduce #1$"),
    "two arrays of 0.5": _arrays_of(0.5, 2, 3),
    "[2. 2. 2. 2.] on each": _arrays_of(2.0, 2, 4),
    "the same gradient on both ranks: [[2.0, 2.0, 2.0, 2.0]]":
        _value(lambda v: v == [[[2.0] * 4]] * 2, "two gradients [[2.0, 2.0, 2.0, 2.0]]"),
    "on each worker: rank 0 of 2, rank 1 of 2": _lines(r"\brank 0 of 2$", r"\brank 1 of 2$"),
    "[3.0, 3.0, 3.0, 3.0] from each":
        _value(lambda v: v == [[3.0] * 4] * 2, "two lists [3.0, 3.0, 3.0, 3.0]"),
    "the shape mismatch, named on both ranks":
        _value(lambda v: isinstance(v, list) and len(v) == 2 and all(
            isinstance(m, str) and "all_reduce #1" in m and "disagree on shape" in m
            and "(2,)" in m and "(3,)" in m for m in v), "two mismatch messages"),
    "rank 0's timeout, naming rank 1 as missing":
        _lines(r"barrier #1 .*timed out after 2s: ranks \[1\] never arrived"),
}


def promises(code: str) -> List[str]:
    """The comments on the print lines of ``code``; a print without one raises."""
    found = []
    for line in code.splitlines():
        if "print(" not in line:
            continue
        m = _PRINT.search(line)
        if m is None:
            raise AssertionError(f"a README print says nothing of what it prints: {line!r} "
                                 f"(end its line with a comment that tests/test_readme.py "
                                 f"checks)")
        found.append(m.group(1))
    return found


def test_the_readme_has_runnable_blocks() -> None:
    runnable = [b for b in BLOCKS if not b.excerpt]
    assert len(runnable) >= 3, f"README.md: expected the three ways to form a group, got {BLOCKS}"


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", [  # a block an extra's marker names is marked as its tests
    pytest.param(b, marks=[getattr(pytest.mark, r) for r in b.requires if r in EXTRAS])
    for b in BLOCKS], ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_block_runs(block: Block) -> None:
    if block.excerpt:
        pytest.skip(f"README.md line {block.line}: marked <!-- excerpt -->")
    for extra in block.requires:
        module = _missing(extra)
        if module is not None:
            pytest.skip(f"README.md line {block.line} needs the {extra!r} extra "
                        f"({module} is not importable)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("RAYCOLL_SOCKET_IFNAME", "lo")
    env.pop("RAY_ADDRESS", None)     # the block's own local Ray, not the test session's
    proc = subprocess.run([sys.executable, "-c", block.code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (f"README.md line {block.line} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    # workers' prints reach the driver's stdout or stderr (Ray's log streaming)
    out = proc.stdout + "\n" + proc.stderr
    for promise in promises(block.code):
        PROMISES[promise](out)


def test_every_print_of_the_readme_has_a_check() -> None:
    """Each runnable block's prints carry a comment, and each comment a check here; and the
    checks are not vacuous: each fails on output that lacks what it promises."""
    used = set()
    for block in BLOCKS:
        if not block.excerpt:
            for promise in promises(block.code):
                assert promise in PROMISES, (f"README.md line {block.line}: no check of "
                                             f"'# {promise}' in tests/test_readme.py PROMISES")
                used.add(promise)
    assert used == set(PROMISES), f"checks of comments the README lost: {set(PROMISES) - used}"
    assert len(used) >= 6, used
    for promise, check in PROMISES.items():
        for wrong in ("", "[None, None]\nNone", "[array([1., 1., 1., 1.]), array([1., 1., 1., 1.])]"):
            with pytest.raises(AssertionError):
                check(wrong)
    with pytest.raises(AssertionError, match="says nothing"):
        promises("print(x)\n")


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_relative_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                 # a URL (https:, mailto:) or an anchor of this page
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_markers_are_read() -> None:
    text = ("<!-- excerpt -->\n```python\nx\n```\n\n<!-- requires: torch, train -->\n"
            "```python\ny\n```\n```python\nz\n```\n")
    assert readme_blocks(text) == [Block(2, "x\n", True, []),
                                   Block(7, "y\n", False, ["torch", "train"]),
                                   Block(10, "z\n", False, [])]
    with pytest.raises(ValueError, match="unknown extra 'cuda'"):
        _missing("cuda")


def test_docs_links_out_of_the_site_resolve() -> None:
    """Links from docs/ to repository files (../examples/..., ../benchmarks/...), which
    `mkdocs build --strict` does not check (mkdocs.yml: they are not documentation files)."""
    broken = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in _LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, f"docs link to files that do not exist: {broken}"


def test_api_reference_covers_every_public_name() -> None:
    """docs/api.md renders every name of raycoll.__all__ and raycoll.testing.__all__, and each
    has a docstring of its own (mkdocstrings would render an empty entry silently)."""
    import raycoll
    import raycoll.testing

    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    names = [f"raycoll.{n}" for n in raycoll.__all__ if n != "group"]  # an object: prose
    names += [f"raycoll.testing.{n}" for n in raycoll.testing.__all__]
    absent = [n for n in names if f"::: {n}\n" not in api]
    assert not absent, f"docs/api.md lacks: {absent}"
    undocumented = [n for n in names
                    if not (getattr(importlib.import_module(n.rsplit(".", 1)[0]),
                                    n.rsplit(".", 1)[1]).__doc__ or "").strip()]
    assert not undocumented, f"public names without a docstring: {undocumented}"
