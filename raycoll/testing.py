"""Helpers for testing code that uses raycoll, on a small real Ray (no mocks).

``RankPool`` keeps a few idle actors and reuses them across tests: ``pool.run(fn, world_size,
*args)`` forms a fresh group among the first ``world_size`` of them, runs ``fn(rank, *args)``
on each rank, destroys the group and returns the results in rank order (a rank's exception is
re-raised as :class:`raycoll.SpawnError`, after the others were released);
``pool.run(fn, world_size, options={"transport": "store"})`` forms the group with those group
options, as ``create_group`` takes them. Actors that died are replaced before the next run,
and all of them after a Ray restart (``ray.shutdown()`` and ``ray.init()``: the pool's
actors belong to the session they were started in). ``local_ray`` starts a small local Ray
if none is running. :class:`NetnsCluster` (from :mod:`raycoll.testing_netns`) is a Ray
cluster whose worker nodes live in network namespaces behind shaped links, for tests and
benchmarks that need a real network on one machine (root only).

With pytest, the ``raycoll`` plugin (:mod:`raycoll.pytest_plugin`, installed with raycoll and
loaded automatically) gives these as fixtures::

    def test_sum(raycoll_ranks):
        def fn(rank):
            t = np.ones(3)
            raycoll.all_reduce(t)
            return t.tolist()
        assert raycoll_ranks.run(fn, 2) == [[2.0] * 3] * 2

or, by hand::

    @pytest.fixture(scope="session")
    def ranks():
        raycoll.testing.local_ray(num_cpus=4)
        with raycoll.testing.RankPool(max_world_size=4) as pool:
            yield pool
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, List, Optional

import ray

from raycoll import session
from raycoll.launch import RankWorker, run_on, start_ray
from raycoll.options import GroupOptions, OptionsLike
from raycoll.testing_netns import NetnsCluster

__all__ = ["RankPool", "local_ray", "NetnsCluster"]

_Worker = ray.remote(RankWorker)


def local_ray(num_cpus: int = 4, **kwargs: Any) -> bool:
    """Start a small local Ray for tests, unless Ray is already initialized.

    The new instance is always a fresh local one (``address="local"``), even when a Ray
    started by ``ray start`` runs on this machine or ``RAY_ADDRESS`` is set; pass ``address``
    to connect elsewhere. ``kwargs`` go to ``ray.init``. Returns True if it started Ray (the
    caller then owns it and may ``ray.shutdown()`` it), False if Ray was already running.
    """
    if ray.is_initialized():
        return False
    kwargs.setdefault("address", "local")
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", True)
    if kwargs["address"] == "local":
        kwargs["num_cpus"] = num_cpus
    start_ray(**kwargs)
    return True


class RankPool:
    """Reusable rank actors for fast tests (zero-CPU actors by default).

    ``RankPool(max_world_size=4, actor_options=None)`` starts ``max_world_size`` actors at
    once (``actor_options`` go to ``.options()``, default ``{"num_cpus": 0}``); use it as a
    context manager or call :meth:`close`. Functions passed to :meth:`run` travel to the
    actors by pickle (cloudpickle), so define them at module level or inline.
    """

    def __init__(self, max_world_size: int = 4,
                 actor_options: Optional[Dict[str, Any]] = None) -> None:
        self._options = dict(actor_options or {"num_cpus": 0})
        self._actors: List[Any] = [self._new() for _ in range(max_world_size)]
        self._session = session.current()  # Ray is initialized now, if it was not

    def _new(self) -> Any:
        return _Worker.options(**self._options).remote()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    @property
    def max_world_size(self) -> int:
        """The number of actors in the pool: the largest ``world_size`` :meth:`run` takes."""
        return len(self._actors)

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, backend: Optional[str] = None,
            timeout: float = 60.0, options: OptionsLike = None, **kwargs: Any) -> List[Any]:
        """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` pooled actors as one group.

        The group is fresh (a unique name, the default group inside the actors while ``fn``
        runs) and destroyed afterwards, so runs do not see each other's groups (nor a torch
        default group a run initialized and left: it is destroyed after the run). Returns the
        results in rank order; a rank's exception is raised as :class:`raycoll.SpawnError`
        naming the rank, with the original as its cause. ``timeout`` (seconds) bounds the
        group's collectives and the wait for the results.

        ``options`` are the group's options, exactly as :func:`raycoll.create_group` takes
        them: a dict such as ``{"transport": "store"}`` or a :class:`raycoll.GroupOptions`.
        They are validated before any actor is touched (an unknown name or a bad value raises
        ``ValueError`` naming the option). ``backend``, ``timeout`` and ``options`` are the
        pool's own keywords; every other keyword goes to ``fn``.
        """
        if not 1 <= world_size <= len(self._actors):
            raise ValueError(f"world_size must be in 1..{len(self._actors)}, got {world_size}")
        group_options = GroupOptions.of(options)  # refused here, before the actors are asked
        self._replace_dead()
        name = f"test-{uuid.uuid4().hex[:8]}"
        return run_on(self._actors[:world_size], fn, args, kwargs, group_name=name,
                      backend=backend, timeout=timeout, options=group_options)

    def _replace_dead(self) -> None:
        now = session.require("RankPool.run")
        if now != self._session:  # Ray restarted: the old actors went with their session
            self._session = now
            self._actors = [self._new() for _ in self._actors]
            return
        refs = [a.__ray_ready__.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0 if ref in ready else 5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(self._actors[i], no_restart=True)
                self._actors[i] = self._new()

    def close(self) -> None:
        """Kill the pool's actors (the pool cannot run anything afterwards); actors of a Ray
        session that has ended are gone already."""
        if session.current() == self._session:
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
        self._actors = []
