"""``backend="raycoll"`` in Ray's own ``ray.util.collective`` (Ray 2.60's backend registry),
and what Ray's module does that the drop-in does too, as a user's code meets it: the script
written for Ray's module through ``backend="raycoll"`` with only ``import raycoll`` in the
actors (registered on import), Ray's declarative ``create_collective_group`` (formed at the
first collective), destroy then the same name again; numpy arguments Ray hands an actor
method (read-only) written into through both routes with one warning, the object changed for
the driver as Ray's gloo changes it, raycoll's own API still refusing; a backend class
registered through the drop-in's ``register_collective_backend`` (Ray's gloo group under
another name) serving the drop-in's calls; Ray's ``worker_process_setup_hook`` registering it
in actors that import nothing of raycoll."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import uuid
import warnings
from typing import Any, Dict, Iterator, List, Sequence

import numpy as np
import pytest
import ray

import raycoll
import raycoll.util.collective as dropin

import test_util_collective
from test_util_collective import RAY, expected, script

# the shared script travels by value (conftest registers only the modules it collects)
ray.cloudpickle.register_pickle_by_value(test_util_collective)


@ray.remote(num_cpus=0)
class Holder:
    """A user's actor in Ray's tests' style: it keeps what it is given and calls a library."""

    def __init__(self) -> None:
        self.buffer: Any = None

    def set_buffer(self, data: Any) -> bool:
        self.buffer = data  # as Ray hands it: a read-only numpy array
        return bool(data.flags.writeable)

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(self, *args)


@pytest.fixture
def holders(ray_local: None) -> Iterator[List[Any]]:
    """Fresh actors: the read-only warning is once per process."""
    pool = [Holder.remote() for _ in range(2)]
    yield pool
    for actor in pool:
        ray.kill(actor, no_restart=True)


def _name() -> str:
    return f"rb-{uuid.uuid4().hex[:8]}"


def _on(actors: Sequence[Any], fn: Any, *args: Any, timeout: float = 90) -> List[Any]:
    return ray.get([a.run.remote(fn, r, *args) for r, a in enumerate(actors)], timeout=timeout)


def _ray_script(actor: Any, rank: int, *args: Any) -> Dict[str, Any]:
    """The script written for Ray's module, in an actor that only imported raycoll."""
    import raycoll  # noqa: F401 - all it takes: "raycoll" is registered once Ray's is imported

    return script(rank, RAY, *args, backend="raycoll")


@pytest.mark.torch  # Ray's module imports torch
@pytest.mark.timeout(120)
def test_ray_s_own_module_runs_on_backend_raycoll(holders):
    got = _on(holders, _ray_script, 2, _name(), ("numpy",))
    assert got == [expected(r, 2, ("numpy",)) for r in range(2)]


def _declared(actor: Any, rank: int, group: str) -> Dict[str, Any]:
    import raycoll  # noqa: F401
    import ray.util.collective as col

    before = col.is_group_initialized(group)  # Ray forms it at the first collective
    x = np.full(3, rank + 1.0)
    col.allreduce(x, group)
    out = {"before": before, "sum": x.tolist(), "rank": col.get_rank(group),
           "is_raycoll": type(col.get_group_handle(group)).__name__}
    col.destroy_collective_group(group)
    try:
        col.allreduce(np.ones(1), group)
        out["after_destroy"] = "ok"
    except RuntimeError:  # Ray's "not initialized" (no record left either)
        out["after_destroy"] = "refused"
    except ray.exceptions.RayActorError:  # Ray's own race: the other rank's destroy killed the
        out["after_destroy"] = "refused"  # group's info actor while this rank read it
    col.init_collective_group(2, rank, backend="raycoll", group_name=group)
    y = np.ones(2)
    col.allreduce(y, group)
    out["again"] = y.tolist()
    col.destroy_collective_group(group)
    return out


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_create_collective_group_of_ray_s_module_forms_at_the_first_collective(holders):
    import ray.util.collective as col

    import raycoll.util.collective.ray_group  # noqa: F401 - the driver registers too (Ray's rule)

    group = _name()
    col.create_collective_group(holders, 2, [1, 0], backend="raycoll", group_name=group)
    got = _on(holders, _declared, group)
    assert [g["rank"] for g in got] == [1, 0]
    for g in got:
        assert g == {"before": False, "sum": [3.0, 3.0, 3.0], "rank": g["rank"],
                     "is_raycoll": "RaycollGroup", "after_destroy": "refused",
                     "again": [2.0, 2.0]}


def _write_into_what_ray_handed(actor: Any, rank: int, lib: str, backend: str,
                                group: str) -> Dict[str, Any]:
    import raycoll  # noqa: F401

    col = importlib.import_module(lib)
    col.init_collective_group(2, rank, backend=backend, group_name=group)
    buffer = actor.buffer  # read-only: the argument of set_buffer, as Ray gave it
    out: Dict[str, Any] = {"writeable": bool(buffer.flags.writeable)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        col.allreduce(buffer, group)  # Ray's tests: self.buffer, then return it
        out["allreduce"] = buffer[:2].tolist()
        col.broadcast(buffer, 1, group)
        out["broadcast"] = buffer[:2].tolist()
        col.reduce(buffer, 0, group)  # rank 1 sends what it holds, its array left as it was
        out["reduce"] = buffer[:2].tolist()
        if rank == 0:
            col.send(np.full(buffer.shape, 7.0, buffer.dtype), 1, group)
        else:
            col.recv(buffer, 0, group)
        out["recv"] = buffer[:2].tolist()
    out["warnings"] = [(w.category.__name__, "copy()" in str(w.message)) for w in seen
                       if "read-only" in str(w.message)]
    try:
        raycoll.all_reduce(buffer, group=group)
        out["raycoll_api"] = "ok"
    except ValueError as exc:
        out["raycoll_api"] = "ValueError: read-only" if "read-only" in str(exc) else str(exc)
    col.destroy_collective_group(group)
    return out


@pytest.mark.torch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("lib,backend", [("raycoll.util.collective", "gloo"),
                                         (RAY, "raycoll")], ids=["drop-in", "ray-module"])
def test_read_only_arguments_are_written_into_as_ray_does(holders, lib, backend):
    refs = [ray.put(np.ones(1 << 16, np.float32)) for _ in holders]  # in the object store
    assert ray.get([h.set_buffer.remote(ref) for h, ref in zip(holders, refs)],
                   timeout=60) == [False, False]
    got = _on(holders, _write_into_what_ray_handed, lib, backend, _name())
    for rank, g in enumerate(got):
        assert g == {"writeable": False, "allreduce": [2.0, 2.0], "broadcast": [2.0, 2.0],
                     "reduce": [4.0, 4.0] if rank == 0 else [2.0, 2.0],
                     "recv": [4.0, 4.0] if rank == 0 else [7.0, 7.0],
                     # once, naming the fix: the first write of this process
                     "warnings": [("ReadOnlyWriteWarning", True)],
                     "raycoll_api": "ValueError: read-only"}
    # The hazard the warning names, Ray's behaviour too: the objects themselves changed, for
    # every reader (here the driver)
    assert [float(ray.get(ref)[0]) for ref in refs] == [4.0, 7.0]


def _foreign(actor: Any, rank: int, group: str) -> Dict[str, Any]:
    from ray.util.collective.collective_group.torch_gloo_collective_group import (
        TorchGLOOGroup,
    )

    dropin.register_collective_backend("mygloo", TorchGLOOGroup)  # in every rank (Ray's rule)
    dropin.init_collective_group(2, rank, backend="mygloo", group_name="default")
    x = np.full(2, rank + 1.0)
    dropin.allreduce(x, "default", op=dropin.types.ReduceOp.MAX)
    out = {"max": x.tolist(), "rank": dropin.get_rank("default"),
           "size": dropin.get_collective_group_size("default"),
           "handle": type(importlib.import_module(RAY).get_group_handle("default")).__name__}
    dropin.destroy_collective_group("default")
    out["after"] = dropin.is_group_initialized("default")
    return out


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_ray_backend_class_registered_through_the_drop_in_serves_its_groups(holders):
    got = _on(holders, _foreign, _name())
    assert got == [{"max": [2.0, 2.0], "rank": r, "size": 2, "handle": "TorchGLOOGroup",
                    "after": False} for r in range(2)]


def test_register_is_idempotent_and_refuses_a_taken_name():
    pytest.importorskip("torch")  # Ray's module imports it
    from ray.util.collective import backend_registry, types

    from raycoll.util.collective import ray_group

    dropin.register()
    dropin.register()
    assert ray_group.is_registered() and types.Backend.RAYCOLL == "RAYCOLL"
    assert backend_registry._global_registry.get("raycoll") is ray_group.RaycollGroup
    with pytest.raises(ValueError, match="own backends"):
        dropin.register_collective_backend("gloo", ray_group.RaycollGroup)


# A user's script whose actors import nothing of raycoll (a class of __main__, shipped by
# value): Ray's setup hook registers the backend in every worker. Its own Ray, so a process
# of its own (the session's Ray lives on).
_HOOKED = textwrap.dedent("""
    import numpy as np, ray
    import ray.util.collective as col
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "raycoll.util.collective.register"})

    @ray.remote(num_cpus=0)
    class W:
        def step(self, rank):
            import sys
            col.init_collective_group(2, rank, backend="raycoll", group_name="h")
            x = np.full(2, rank + 1.0)
            col.allreduce(x, group_name="h")
            return x.tolist(), "raycoll" in sys.modules

    ws = [W.remote() for _ in range(2)]
    print("RESULT", ray.get([w.step.remote(r) for r, w in enumerate(ws)], timeout=120))
""")


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_ray_s_setup_hook_registers_the_backend_in_actors_that_import_nothing_of_raycoll(
        tmp_path):
    script_path = tmp_path / "hooked.py"
    script_path.write_text(_HOOKED)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(script_path)], capture_output=True, text=True,
                          timeout=220, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    assert line == "RESULT [([3.0, 3.0], True), ([3.0, 3.0], True)]"
