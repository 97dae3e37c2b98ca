"""Test fixtures: one real local Ray per session, a pool of reusable rank actors.

Tests marked ``cluster`` start their own multi-node Ray (``ray.cluster_utils.Cluster``); they
are moved to the end of the run, where the session's local Ray is shut down for them; tests
marked ``netns`` (a cluster in network namespaces, raycoll.testing_netns) come after them.

At the end of the session, Ray is shut down and the semaphores of Ray's shared-memory
channels that the session's Rays left in /dev/shm are removed (see ``pytest_sessionfinish``).
"""

from __future__ import annotations

import os
import re
import time

import pytest
import ray

import raycoll.testing

import helpers  # noqa: E402 - tests/ is on sys.path under pytest

#: When the session began: Ray semaphores made since then are the session's (its Rays', and
#: those of the Rays its tests start in processes of their own).
SESSION_START = time.time()
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# A Ray node registers with its GCS within 30 s by default: on a loaded machine (the suite
# beside other jobs) a start timed out ("The current node timed out during startup").
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
# Direct connections between ranks (raycoll.transport.links) stay on loopback in tests; set
# before any Ray starts, so that every worker and every local node inherits it.
os.environ["RAYCOLL_SOCKET_IFNAME"] = "lo"


#: The sanitizer run (.ci/run) says which build it means to test: the module loaded here, and
#: in the rank actors (``ray_local``), must be that one.
EXPECT_SANITIZE = os.environ.get("RAYCOLL_EXPECT_SANITIZE")
#: ... with the sanitizers' runtime preloaded (LD_PRELOAD): Ray's own processes (GCS,
#: raylet) start without it, the rank actors' workers with it (the job's runtime_env), so
#: that only raycoll's processes run the sanitized build.
SANITIZER_ENV = ({name: os.environ[name] for name in ("LD_PRELOAD", "ASAN_OPTIONS",
                                                      "UBSAN_OPTIONS") if name in os.environ}
                 if EXPECT_SANITIZE is not None and "LD_PRELOAD" in os.environ else {})


def pytest_sessionstart(session):  # noqa: D103 - pytest hook
    if EXPECT_SANITIZE is not None and helpers.sanitize() != EXPECT_SANITIZE:
        pytest.exit(f"RAYCOLL_EXPECT_SANITIZE={EXPECT_SANITIZE}, but the native core loaded "
                    f"here was built with {helpers.sanitize()!r}", returncode=3)


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
    if SANITIZER_ENV:
        preload = os.environ.pop("LD_PRELOAD")
        try:
            raycoll.testing.local_ray(num_cpus=4, runtime_env={"env_vars": SANITIZER_ENV})
        finally:
            os.environ["LD_PRELOAD"] = preload
    else:
        raycoll.testing.local_ray(num_cpus=4)
    if EXPECT_SANITIZE is not None:
        in_actor = ray.get(ray.remote(num_cpus=0)(helpers.sanitize).remote(), timeout=120)
        assert in_actor == EXPECT_SANITIZE, f"a Ray worker loaded a build with {in_actor!r}"
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


_RAY_SEMAPHORE = re.compile(r"^sem\.(?:hdr|obj)(\d+)-")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def sweep_ray_semaphores(since: float, wait_s: float = 10.0) -> list:
    """Remove ``/dev/shm/sem.hdr<pid>-*`` and ``sem.obj<pid>-*`` made at ``since`` or later
    whose creator ``<pid>`` is gone (waiting up to ``wait_s`` for it to exit). Ray's raylet
    makes a pair for every shared-memory channel (raycoll's lane, compiled graphs) and never
    unlinks them: not at ``channel.close()``, not when the channel's actors exit, not at
    ``ray.shutdown()``. A creator that lives is a Ray still running (another job's): kept."""
    ours = {}
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
        m = _RAY_SEMAPHORE.match(name)
        if m is None:
            continue
        try:
            if os.stat(os.path.join("/dev/shm", name)).st_mtime >= since - 1:
                ours[name] = int(m.group(1))
        except OSError:
            continue
    deadline = time.monotonic() + wait_s
    while any(not _gone(p) for p in ours.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    removed = []
    for name, pid in sorted(ours.items()):
        if _gone(pid):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except OSError:
                pass
    return removed


def pytest_sessionfinish(session, exitstatus):  # noqa: D103 - pytest hook
    if ray.is_initialized():
        ray.shutdown()
    sweep_ray_semaphores(SESSION_START)
