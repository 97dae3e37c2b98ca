"""Every ```python block of README.md runs as written, and every relative link resolves.

Each block runs alone in a fresh interpreter (so a fresh Ray: the blocks start their own with
``ray.init(address="local", ...)``), from the repository root, with a timeout. An HTML comment
on the line just before a block marks it:

- ``<!-- excerpt -->``: a fragment that cannot run alone; not run.
- ``<!-- requires: torch -->`` / ``<!-- requires: train -->``: runs only where the extra's
  modules import; otherwise the test skips, naming the missing module.

A block that exits non-zero, or outlives its timeout, fails its test.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Seconds one block may run (Ray's start included).
BLOCK_TIMEOUT_S = 90

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


def test_the_readme_has_runnable_blocks() -> None:
    runnable = [b for b in BLOCKS if not b.excerpt]
    assert len(runnable) >= 3, f"README.md: expected the three ways to form a group, got {BLOCKS}"


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
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
