"""The repository itself: nothing in it names one machine's absolute paths (a fresh clone
anywhere must work as it is), and no module of the package grows past a few hundred lines."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The most lines a module of the package may have (split it by concern beyond that).
MAX_MODULE_LINES = 700
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
