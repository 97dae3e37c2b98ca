"""The README's demo, `python examples/quickstart.py`, as a newcomer runs it: here while
another Ray (the test session's) runs on the same machine and is the one Ray would find
(``RAY_ADDRESS``, as ``ray start`` leaves it for ``ray.init()``). The demo promises a Ray of
its own; joining that one would fail (``num_cpus`` cannot be given to an existing cluster).
The values it prints are the ones its comments promise."""

from __future__ import annotations

import ast
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
    check_printed(proc.stdout)


def check_printed(out: str) -> None:
    """The demo's printed values are the ones its comments promise: per rank of ``spawn``,
    the average of 1 and 2, both ranks' gathered pairs and one node id twice; the driver's
    group, 1 + 2 + 3 on each of its three workers."""
    spawned = [ast.literal_eval(line[len("spawn: "):]) for line in out.splitlines()
               if line.startswith("spawn: ")]
    assert [r["rank"] for r in spawned] == [0, 1], out
    for r in spawned:
        assert r["avg_grad"] == [1.5] * 4, r
        assert r["gathered"] == [[0, 0], [1, 1]], r
        assert len(r["nodes"]) == 2 and r["nodes"][0] == r["nodes"][1], r
        assert isinstance(r["nodes"][0], str) and len(r["nodes"][0]) == 8, r
    prefix = "driver-formed group 'dp': "
    dp = [ast.literal_eval(line[len(prefix):]) for line in out.splitlines()
          if line.startswith(prefix)]
    assert dp == [[[6.0, 6.0, 6.0]] * 3], out


def test_the_check_fails_on_wrong_values() -> None:
    """The value check is not vacuous: wrong or missing values fail it."""
    good = ("spawn: {'rank': 0, 'avg_grad': [1.5, 1.5, 1.5, 1.5], 'gathered': [[0, 0], [1, 1]], "
            "'nodes': ['abcdef01', 'abcdef01']}\n"
            "spawn: {'rank': 1, 'avg_grad': [1.5, 1.5, 1.5, 1.5], 'gathered': [[0, 0], [1, 1]], "
            "'nodes': ['abcdef01', 'abcdef01']}\n"
            "driver-formed group 'dp': [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]\n")
    check_printed(good)
    for wrong in (good.replace("1.5, 1.5]", "1.5, 2.0]", 1), good.replace("[1, 1]", "[1, 0]"),
                  good.replace("[6.0, 6.0, 6.0]]", "[6.0, 6.0, 3.0]]"),
                  good.split("driver")[0], good.replace("'nodes': ['abcdef01', 'abcdef01']",
                                                        "'nodes': ['abcdef01', 'abcdef02']", 1)):
        with pytest.raises(AssertionError):
            check_printed(wrong)
