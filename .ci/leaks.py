"""What CI's stages must not leave on the machine, checked last by ``.ci/run``.

``python .ci/leaks.py snapshot FILE`` (first thing) records /dev/shm; ``python .ci/leaks.py
check FILE`` (after every stage) fails, listing them, on:

- raycoll's node segments (``/dev/shm/rc*``) that were not there at the snapshot;
- Ray's shared-memory channel semaphores (``/dev/shm/sem.hdr<pid>-*``, ``sem.obj<pid>-*``;
  Ray's raylet never unlinks them, even after ``channel.close()`` and ``ray.shutdown()``)
  that were not there at the snapshot and whose creator ``<pid>`` is gone (a live one
  belongs to a Ray still running, another job's);
- network namespaces and links named ``rcn-*`` (raycoll.testing_netns);
- processes that carry CI's marker in their environment (``RAYCOLL_CI_RUN``, exported by
  ``.ci/run`` before anything starts, so every Ray process its stages start inherits it):
  raylets, GCS servers, Ray workers left after the stages shut Ray down. They get
  ``--wait`` seconds (default 30) to exit first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Set

SHM = "/dev/shm"
MARKER = "RAYCOLL_CI_RUN"
_SEM = re.compile(r"^sem\.(hdr|obj)(\d+)-")


def _shm() -> Set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _marked(token: str) -> Dict[int, str]:
    """Processes (not this one, nor its ancestors) whose environment holds the marker."""
    mine = set()
    pid = os.getpid()
    while pid > 1:  # this checker and the shells that run it
        mine.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    needle = f"{MARKER}={token}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
    return found


def _netns() -> List[str]:
    left = []
    for args in (["ip", "netns", "list"], ["ip", "-o", "link", "show"]):
        try:
            out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        left += re.findall(r"(?:^|: )(rcn-[^\s:@]+)", out, re.M)
    return sorted(set(left))


def check(before: Set[str], wait_s: float) -> List[str]:
    """Every leftover, one line each (empty: the machine is as CI found it)."""
    problems = []
    token = os.environ.get(MARKER)
    if token:
        deadline = time.monotonic() + wait_s
        procs = _marked(token)
        while procs and time.monotonic() < deadline:
            time.sleep(0.5)
            procs = _marked(token)
        problems += [f"process {pid} still running: {cmd}" for pid, cmd in sorted(procs.items())]
    new = sorted(_shm() - before)
    problems += [f"raycoll segment left in {SHM}: {name}" for name in new if name.startswith("rc")]
    for name in new:
        m = _SEM.match(name)
        if m and not _alive(int(m.group(2))):
            problems.append(f"Ray channel semaphore left in {SHM} (its creator {m.group(2)} "
                            f"is gone): {name}")
    problems += [f"network namespace or link left: {name}" for name in _netns()]
    return problems


def main(argv: List[str]) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=".ci/leaks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["snapshot", "check"])
    parser.add_argument("file", help="where the snapshot is kept")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds marked processes get to exit before they count")
    args = parser.parse_args(argv)
    if args.action == "snapshot":
        with open(args.file, "w") as f:
            json.dump(sorted(_shm()), f)
        return 0
    with open(args.file) as f:
        before = set(json.load(f))
    problems = check(before, args.wait)
    for line in problems:
        print(f"ci: leak: {line}", file=sys.stderr)
    if problems:
        print(f"ci: {len(problems)} leftovers (above)", file=sys.stderr)
        return 1
    print("ci: no leftovers: /dev/shm, network namespaces and processes as before")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
