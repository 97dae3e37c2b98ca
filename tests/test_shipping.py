"""``spawn`` with code the rank workers cannot import: a script in a temporary directory,
run from another directory, whose functions come from a module on its own ``sys.path`` only
(Ray gives its workers the script's directory, not that one). raycoll ships such modules by
value; compiled code it cannot ship is refused before anything runs, naming the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

_HELPER = textwrap.dedent('''
    import numpy as np
    import raycoll

    class Scale:
        def __init__(self, factor):
            self.factor = factor

    def contribution(rank, scale):
        return np.full(3, (rank + 1.0) * scale.factor)

    def total(rank, scale):
        x = contribution(rank, scale)
        raycoll.all_reduce(x)
        return x.tolist()
''')

_SCRIPT = textwrap.dedent('''
    import json, os, sys, types
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
    import ray
    import raycoll
    import helper  # importable here only: the workers get this script's directory, not lib/

    def from_main(rank, scale):  # pickled by value, but it names helper's functions
        x = helper.contribution(rank, scale)
        raycoll.all_reduce(x, op=raycoll.ReduceOp.MAX)
        return x.tolist()

    ray.init(address=sys.argv[1], log_to_driver=False)
    out = {"module": raycoll.spawn(helper.total, 2, args=(helper.Scale(2.0),),
                                   actor_options={"num_cpus": 0}, timeout=60),
           "main": raycoll.spawn(from_main, 2, args=(helper.Scale(1.0),),
                                 actor_options={"num_cpus": 0}, timeout=60)}
    ext = types.ModuleType("fastext")  # stands for a compiled module on sys.path only
    ext.__file__ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib",
                                "fastext.cpython-311-x86_64-linux-gnu.so")
    sys.modules["fastext"] = ext
    def kernel(rank):
        return rank
    kernel.__module__ = ext.__name__
    kernel.__qualname__ = "kernel"
    ext.kernel = kernel
    try:
        raycoll.spawn(ext.kernel, 2, actor_options={"num_cpus": 0}, timeout=60)
        out["compiled"] = None
    except raycoll.CodeNotShippableError as exc:
        out["compiled"] = str(exc)
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.timeout(240)
def test_spawn_ships_modules_the_workers_cannot_import(ray_local, tmp_path: Path) -> None:
    (tmp_path / "app" / "lib").mkdir(parents=True)
    (tmp_path / "app" / "lib" / "helper.py").write_text(_HELPER)
    script = tmp_path / "app" / "train.py"
    script.write_text(_SCRIPT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, RAYCOLL_SOCKET_IFNAME="lo")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, str(script), address], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["module"] == [[6.0] * 3] * 2  # (1 + 2) * 2 on both ranks
    assert out["main"] == [[2.0] * 3] * 2
    message = out["compiled"]
    assert message is not None and "cannot import module 'fastext'" in message, message
    assert "compiled code cannot be shipped" in message and "PYTHONPATH" in message, message
