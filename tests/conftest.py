"""Test fixtures: one real local Ray per session, a pool of reusable rank actors.

Tests marked ``cluster`` start their own multi-node Ray (``ray.cluster_utils.Cluster``); they
are moved to the end of the run, where the session's local Ray is shut down for them; tests
marked ``netns`` (a cluster in network namespaces, raycoll.testing_netns) come after them.
"""

from __future__ import annotations

import os

import pytest
import ray

import raycoll.testing

import helpers  # noqa: E402 - tests/ is on sys.path under pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Direct connections between ranks (raycoll.transport.tcp) stay on loopback in tests; set
# before any Ray starts, so that every worker and every local node inherits it.
os.environ["RAYCOLL_SOCKET_IFNAME"] = "lo"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # noqa: D103 - pytest hook
    if item.get_closest_marker("torch") is not None and not helpers.HAS_TORCH:
        pytest.skip(helpers.TORCH_MISSING)


def pytest_collection_modifyitems(config, items):  # noqa: D103 - pytest hook
    # cluster tests, then netns tests (each replaces the session's Ray with a cluster of its own)
    items.sort(key=lambda item: 2 if item.get_closest_marker("netns")
               else 1 if item.get_closest_marker("cluster") else 0)
    # Test modules are not importable inside Ray workers: ship their functions by value.
    modules = {item.module for item in items if getattr(item, "module", None) is not None}
    for module in modules | {helpers}:
        ray.cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray with 4 logical CPUs on this 2-core machine."""
    raycoll.testing.local_ray(num_cpus=4)
    yield
    # cluster tests (sorted last) shut it down themselves


@pytest.fixture(scope="session")
def ranks(ray_local):
    """Reusable rank actors: ``ranks.run(fn, world_size, *args)``."""
    pool = raycoll.testing.RankPool(max_world_size=4)
    yield pool
    if ray.is_initialized():
        pool.close()


@pytest.fixture(scope="module")
def rank_actors(ray_local):
    """Three zero-CPU ``RankWorker`` actors for tests that form groups with options
    (``raycoll.create_group(rank_actors, options=...)``)."""
    pool = [ray.remote(raycoll.launch.RankWorker).options(num_cpus=0).remote() for _ in range(3)]
    yield pool
    for actor in pool:
        ray.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), custom resources
    ``node0`` / ``node1`` to place actors on each. Replaces the session's local Ray."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node0": 8}, "object_store_memory": 400 * 1024 ** 2})
    cluster.add_node(num_cpus=2, resources={"node1": 8}, object_store_memory=400 * 1024 ** 2)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
