"""The README's demo, `python examples/quickstart.py`, as a newcomer runs it: here while
another Ray (the test session's) runs on the same machine and is the one Ray would find
(``RAY_ADDRESS``, as ``ray start`` leaves it for ``ray.init()``). The demo promises a Ray of
its own; joining that one would fail (``num_cpus`` cannot be given to an existing cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_the_demo_passes_beside_another_ray(ray_local: None) -> None:
    env = dict(os.environ, RAYCOLL_SOCKET_IFNAME="lo",
               RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    proc = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "raycoll quickstart OK" in proc.stdout
