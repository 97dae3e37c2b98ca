"""A pytest plugin for testing code that uses raycoll: a small real Ray and reusable ranks.

Installed with raycoll and loaded by pytest automatically (entry point ``pytest11``, plugin
name ``raycoll``; ``-p no:raycoll`` turns it off; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set,
load it with ``-p raycoll.pytest_plugin``). It only declares fixtures and two ini options:
nothing imports Ray or starts it until a test asks for a fixture.

Fixtures:

``raycoll_ray`` (session)
    A small local Ray: a fresh local instance with ``raycoll_num_cpus`` logical CPUs (ini
    option, default 4), started on first use and shut down at the end of the session. If Ray
    is already initialized (your own fixture or conftest started it), that one is used and
    left running.

``raycoll_ranks`` (function; the actors live for the session)
    A :class:`raycoll.testing.RankPool` of ``raycoll_max_world_size`` zero-CPU actors (ini
    option, default 4) on ``raycoll_ray``. ``raycoll_ranks.run(fn, world_size, *args)`` forms
    a fresh group, runs ``fn(rank, *args)`` on every rank and returns the results in rank
    order. The requesting test module is registered with cloudpickle to travel by value, so
    functions defined in test files run in the actors even though test files are not
    importable there (register helper modules yourself with
    ``ray.cloudpickle.register_pickle_by_value(module)``).

``raycoll_netns`` (module)
    A :class:`raycoll.testing_netns.NetnsCluster`: a Ray head and worker nodes on this machine,
    each worker in a network namespace of its own behind a shaped link, with the driver
    connected to it (a Ray already initialized in the process is shut down first). The
    module's ``netns`` marker sets its arguments, e.g.
    ``pytestmark = pytest.mark.netns(nodes=2, rate="1gbit", cpus=2)``. Skipped, with the
    reason, where namespaces cannot be made (not root, no ``ip``/``tc``). Everything it made
    is removed at the end of the module (and at exit, or by the next start, after a crash).

Example (``tests/test_mine.py``)::

    import numpy as np
    import raycoll

    def average(rank):
        t = np.full(3, float(rank))
        raycoll.all_reduce(t, op=raycoll.ReduceOp.AVG)
        return t.tolist()

    def test_average(raycoll_ranks):
        assert raycoll_ranks.run(average, 2) == [[0.5] * 3] * 2

and, optionally, in ``pytest.ini`` / ``pyproject.toml``'s ``[tool.pytest.ini_options]``::

    raycoll_num_cpus = 2
    raycoll_max_world_size = 8
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:  # imported lazily at run time: loading the plugin must not import Ray
    from raycoll.testing import RankPool

__all__ = ["raycoll_ray", "raycoll_ranks", "raycoll_netns", "pytest_addoption",
           "pytest_configure"]

_NUM_CPUS = "raycoll_num_cpus"
_MAX_WORLD_SIZE = "raycoll_max_world_size"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Declare the plugin's ini options."""
    parser.addini(_NUM_CPUS, "logical CPUs of the local Ray that raycoll_ray starts",
                  default="4")
    parser.addini(_MAX_WORLD_SIZE, "actors in the raycoll_ranks pool (the largest world_size)",
                  default="4")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``netns`` marker that ``raycoll_netns`` reads."""
    config.addinivalue_line(
        "markers", "netns(**kwargs): a Ray cluster in network namespaces (raycoll_netns; "
        "kwargs go to raycoll.testing_netns.NetnsCluster)")


def _positive_int(config: pytest.Config, name: str) -> int:
    raw = config.getini(name)
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise pytest.UsageError(f"ini option {name} must be a positive integer, got {raw!r}")
    return value


@pytest.fixture(scope="session")
def raycoll_ray(pytestconfig: pytest.Config) -> Iterator[None]:
    """A small local Ray for the session (reuses one that is already initialized)."""
    import ray

    from raycoll.testing import local_ray

    started = local_ray(num_cpus=_positive_int(pytestconfig, _NUM_CPUS))
    yield
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def _raycoll_pool(raycoll_ray: None, pytestconfig: pytest.Config) -> Iterator["RankPool"]:
    import ray

    from raycoll.testing import RankPool

    pool = RankPool(max_world_size=_positive_int(pytestconfig, _MAX_WORLD_SIZE))
    yield pool
    if ray.is_initialized():
        pool.close()


@pytest.fixture
def raycoll_ranks(_raycoll_pool: "RankPool", request: pytest.FixtureRequest) -> "RankPool":
    """Reusable rank actors: ``raycoll_ranks.run(fn, world_size, *args)`` -> per-rank results."""
    module: Any = getattr(request, "module", None)
    if isinstance(module, types.ModuleType) and module.__name__ != "__main__" \
            and sys.modules.get(module.__name__) is module:
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(module)
    return _raycoll_pool


@pytest.fixture(scope="module")
def raycoll_netns(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Ray cluster in network namespaces, the driver connected (see the module docstring)."""
    from raycoll.testing_netns import NetnsCluster, netns_unavailable

    reason = netns_unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    import ray

    marker = request.node.get_closest_marker("netns")
    kwargs = dict(marker.kwargs) if marker is not None else {}
    if ray.is_initialized():
        ray.shutdown()
    cluster = NetnsCluster(**kwargs).start()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
