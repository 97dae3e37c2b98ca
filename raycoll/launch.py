"""Driver side: form groups among existing actors, run SPMD functions, tear groups down.

``create_group(actors, ...)`` starts the group's coordinator (owned by the driver, named and
namespaced by the job so two jobs never meet) and has every actor join it, in list order, via
Ray's ``__ray_call__`` (so any actor class works unchanged). ``spawn(fn, world_size, ...)``
is ``torch.multiprocessing.spawn`` for Ray: it starts the actors, forms the group, runs
``fn(rank, *args)`` everywhere, returns the results in rank order and cleans up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.actor import ActorHandle

from raycoll import errors
from raycoll._shipping import ship
from raycoll.backends import backend_config
from raycoll.transport.base import report_period_s
from raycoll.coordinator import CoordinatorClient, coordinator_name, start_coordinator
from raycoll.process_group import DEFAULT_TIMEOUT_S, GroupSpec
from raycoll.world import join_root_group, world
from raycoll.options import GroupOptions, OptionsLike
from raycoll.work import to_seconds

logger = logging.getLogger("raycoll")

__all__ = ["create_group", "destroy_group", "spawn", "run_on", "group_status"]

#: How long driver-side teardown waits for busy or dead actors.
_TEARDOWN_S = 10.0
#: The longest group_status waits for late progress reports of a round transport.
_STATUS_WAIT_MAX_S = 5.0


@dataclass
class _DriverGroup:
    spec: GroupSpec
    actors: List[ActorHandle]


_lock = threading.Lock()
_groups: Dict[str, _DriverGroup] = {}


def _join(actor_self: Any, spec: GroupSpec, rank: int) -> None:
    """Runs inside each actor (through ``__ray_call__``): join the group as ``rank``."""
    join_root_group(spec, rank)


def _leave(actor_self: Any, group_name: str) -> None:
    """Runs inside each actor: forget the group (later calls get GroupDestroyedError)."""
    world().remove(group_name, "destroy_group() was called from the driver")


def create_group(actors: Sequence[ActorHandle], backend: Optional[str] = None,
                 group_name: str = "default", timeout: Any = None,
                 options: OptionsLike = None) -> None:
    """Form group ``group_name`` among ``actors`` (rank = position in the list).

    Call it from the driver (or any process that owns the actors). Returns once every actor
    has joined; raises ``DistTimeoutError`` naming the actors that did not join within
    ``timeout`` (a sync actor busy in another method cannot join until it returns). Inside
    the actors the group is then the default group if they had none, and is always reachable
    as ``group=group_name``.

    ``options`` tune the group's transports and algorithms: a dict such as
    ``{"transport": "tcp"}`` or a :class:`~raycoll.GroupOptions` (the names, their types and
    defaults are listed there). An unknown name or a bad value raises ``ValueError`` naming
    the option before anything starts.
    """
    if not isinstance(actors, (list, tuple)) or not actors:
        raise ValueError("actors must be a non-empty list of Ray actor handles")
    for i, actor in enumerate(actors):
        if not isinstance(actor, ActorHandle):
            raise TypeError(f"actors[{i}] must be a Ray actor handle, got {type(actor).__name__}")
    ids = [a._actor_id for a in actors]
    if len(set(ids)) != len(ids):
        raise ValueError("actors must be distinct: the same actor appears twice")
    if not isinstance(group_name, str) or not group_name or "/" in group_name:
        raise ValueError(f"group_name must be a non-empty str without '/', got {group_name!r}")
    backend_config(backend)  # reject a bad backend string before starting anything
    group_options = GroupOptions.of(options)
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    with _lock:
        if group_name in _groups:
            raise ValueError(f"group {group_name!r} already exists; destroy_group({group_name!r}) "
                             "first or pick another group_name")
        _groups[group_name] = _DriverGroup(GroupSpec(group_name, 0, backend, seconds, None), [])
    try:
        job = ray.get_runtime_context().get_job_id()
        try:
            handle = start_coordinator(group_name, len(actors), coordinator_name(job, group_name))
        except ValueError as exc:  # the name is taken: another process of this job made it
            raise ValueError(f"group {group_name!r} already exists in this job") from exc
        spec = GroupSpec(group_name, len(actors), backend, seconds, handle, group_options)
        refs = [a.__ray_call__.remote(_join, spec, rank) for rank, a in enumerate(actors)]
        _wait_joined(refs, seconds, group_name)
    except BaseException:
        with _lock:
            entry = _groups.pop(group_name, None)
        if entry is not None and entry.spec.coordinator is not None:
            ray.kill(entry.spec.coordinator)
        if "handle" in locals():
            ray.kill(handle)
        raise
    with _lock:
        _groups[group_name] = _DriverGroup(spec, list(actors))


def _wait_joined(refs: List[Any], timeout_s: float, group_name: str) -> None:
    """Wait for every join; raise at the first one that failed (a dead actor, an error)
    instead of letting the others wait out the timeout in rendezvous."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
        if not ready:
            break
        rank = refs.index(ready[0])
        try:
            ray.get(ready[0], timeout=_TEARDOWN_S)
        except ray.exceptions.RayActorError as exc:
            raise errors.RankFailedError(
                f"create_group({group_name!r}): the actor of rank {rank} is dead",
                failed_ranks=[rank], group=group_name) from exc
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
    if pending:
        missing = [rank for rank, ref in enumerate(refs) if ref in pending]
        raise errors.DistTimeoutError(
            f"create_group({group_name!r}): ranks {missing} did not join within {timeout_s:g}s "
            "(a sync actor busy in another method cannot join until it returns; an actor "
            "whose resources cannot be scheduled never starts)",
            missing=missing, group=group_name, op="create_group")


def destroy_group(group_name: str = "default") -> None:
    """Destroy a group formed with :func:`create_group`: actors forget it, the coordinator
    stops. Actors that are busy or dead are not waited for beyond a few seconds. The same
    name can be formed again afterwards."""
    with _lock:
        entry = _groups.pop(group_name, None)
    if entry is None:
        raise ValueError(f"no group {group_name!r} was created from this process; "
                         f"groups: {sorted(_groups)}")
    refs = []
    for actor in entry.actors:
        try:
            refs.append(actor.__ray_call__.remote(_leave, group_name))
        except Exception:  # noqa: BLE001 - a dead actor's handle may refuse calls
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=_TEARDOWN_S)
    coordinator = entry.spec.coordinator
    if coordinator is not None:
        ray.kill(coordinator, no_restart=True)
        try:  # wait for the name to be released, so the group can be formed again at once
            ray.get(coordinator.__ray_ready__.remote(), timeout=_TEARDOWN_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass


def group_status(group_name: str = "default") -> Dict[str, Any]:
    """Where every rank of a group is, from its coordinator: for a notebook or a hung job.

    Works for groups made with :func:`create_group` or :func:`spawn` from this process, for
    groups this process is a rank of, and, by name, for groups the ranks formed themselves
    with ``init_process_group`` in this Ray job. A subgroup's name (``"dp/0-1#0"``) gives
    that subgroup's view. Returns::

        {
          "group": "dp", "world_size": 4, "generation": 0,
          "broken": None,            # or the error that broke the group
          "transport": "tcp",        # its round transport ("lane", "tcp"), None before one
          "algorithms": {"all_reduce": "hierarchical", ...},  # the last one each collective
                                     # ran with on direct connections (the cost model's pick)
          "ranks": {                 # by global rank
            0: {"last_collective": ("all_reduce", 12), "waiting": True, "joined": False,
                "counters": {...}},  # on direct connections: ProcessGroup.counters()
            3: {"last_collective": ("join", 12), "waiting": True, "joined": True},
            ...                      # last_collective is None before the first collective
          },
          "joined": [3],             # ranks that joined the Join in progress, in join order
          "last_join": None,         # or {"join_order", "last_joiners", "final_seq",
                                     #      "terminated_early"} of the last finished Join
          "subgroups": {name: {"ranks", "joined", "last_join", "broken"}},
          "summary": "rank 0: waiting in all_reduce #12\n...",
        }

    ``waiting`` means the rank has arrived at ``last_collective`` and it has not completed
    (others are missing); a joined rank shadows the others' collectives until all have
    joined.
    """
    root = group_name.split("/", 1)[0]
    with world().lock:
        mine = [pg for name, pg in world().groups.items()
                if name == root or name.startswith(root + "/")]
    for pg in mine:  # this process is a rank: what its lane knows goes first
        pg.report_progress()
    client = _status_client(root)
    raw = client.status(_TEARDOWN_S, where={"op": "group_status", "group": root})
    periods = [g.get("report_period_s") or report_period_s() for g in raw.get("groups",
                                                                              {}).values()
               if isinstance(g, dict) and g.get("transport")]
    if periods:
        # ranks report their round transport's collectives at most a period late (a node's
        # ranks share one period's worth of reports): ask again after the longest
        time.sleep(min(max(periods), _STATUS_WAIT_MAX_S) + 0.05)
        raw = client.status(_TEARDOWN_S, where={"op": "group_status", "group": root})
    groups = raw.get("groups", {})
    view = _group_view(group_name, groups.get(group_name, {}),
                       range(raw["world_size"]) if group_name == root else ())
    out: Dict[str, Any] = {"group": group_name, "world_size": len(view["ranks"]),
                           "generation": raw.get("generation"), **view}
    if group_name == root:
        out["subgroups"] = {k: _group_view(k, v, ()) for k, v in groups.items()
                            if k.startswith(root + "/")}
    out["summary"] = _summary(out)
    return out


def _status_client(root: str) -> CoordinatorClient:
    """The coordinator of root group ``root``: created here, joined here, or found by name."""
    with _lock:
        entry = _groups.get(root)
    if entry is not None and entry.spec.coordinator is not None:
        return CoordinatorClient(entry.spec.coordinator, root)
    with world().lock:
        pg = world().groups.get(root)
    if pg is not None:
        return pg.client
    if ray.is_initialized():
        job = ray.get_runtime_context().get_job_id()
        try:
            return CoordinatorClient(ray.get_actor(coordinator_name(job, root)), root)
        except ValueError:
            pass
    with _lock:
        known = sorted(_groups)
    raise ValueError(f"group_name={root!r}: no such group in this Ray job (none was created "
                     f"from this process under that name, this process is not one of its "
                     f"ranks, and no coordinator of that name is running); groups created "
                     f"here: {known}")


def _group_view(name: str, raw: Dict[Any, Any], all_ranks: Any) -> Dict[str, Any]:
    """The friendly per-rank view of one group's entry of ``Coordinator.status``."""
    ranks: Dict[int, Dict[str, Any]] = {}
    for g in sorted(set(all_ranks) | {k for k in raw if isinstance(k, int)}):
        info = raw.get(g, {})
        current, done = info.get("current"), info.get("last_completed")
        # the newer of the two (a rank's lane collectives update only last_completed)
        waiting = current is not None and (done is None or tuple(current) != tuple(done)
                                           and current[1] >= done[1])
        last = current if waiting else done
        ranks[g] = {"last_collective": tuple(last) if last else None,
                    "waiting": waiting,
                    "joined": bool(info.get("joined", False))}
        if "counters" in info:  # reported with its progress on direct connections
            ranks[g]["counters"] = info["counters"]
    join = raw.get("join") or {}
    # every rank chooses alike: the lowest reporting rank speaks for the group
    algorithms = next((dict(raw[g]["algorithms"]) for g in sorted(ranks)
                       if isinstance(raw.get(g), dict) and raw[g].get("algorithms")), {})
    return {"ranks": ranks, "joined": list(join.get("joined", [])),
            "last_join": join.get("last"), "broken": raw.get("broken"),
            "transport": raw.get("transport"), "algorithms": algorithms}


def _summary(status: Dict[str, Any]) -> str:
    lines = [f"group {status['group']!r}: {status['world_size']} ranks"
             + (f" on {status['transport']}" if status.get("transport") else "")
             + (f", BROKEN: {status['broken']}" if status.get("broken") else "")]
    if status.get("algorithms"):
        lines.append("algorithms: " + ", ".join(f"{c} {a}" for c, a in
                                                sorted(status["algorithms"].items())))
    for g, info in status["ranks"].items():
        last = info["last_collective"]
        if last is None:
            where = "no collective yet"
        else:
            where = f"{'waiting in' if info['waiting'] else 'done with'} {last[0]} #{last[1]}"
        lines.append(f"rank {g}: {where}" + (" (joined: shadowing the others)"
                                             if info["joined"] else ""))
    return "\n".join(lines)


class RankWorker:
    """The actor class :func:`spawn` starts for each rank (and :mod:`raycoll.testing` reuses)."""

    def run(self, fn: Callable[..., Any], rank: int, args: tuple, kwargs: dict) -> Any:
        return fn(rank, *args, **kwargs)


_SpawnWorker: Any = ray.remote(RankWorker)


#: Ray frees out-of-scope objects in batches, once a second by default; until then every new
#: ``ray.put`` lands in cold store memory (page faults), which makes large collectives 2-3x
#: slower (benchmarks/BENCHMARKS.md). A Ray that raycoll starts frees every 10 ms.
FREE_PERIOD_ENV = "RAY_free_objects_period_milliseconds"


def start_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)`` with the object-free period raycoll's collectives want, unless
    the environment already sets one. Used when raycoll itself starts Ray."""
    os.environ.setdefault(FREE_PERIOD_ENV, "10")
    ray.init(**kwargs)


def _check_feasible(world_size: int, options: Dict[str, Any]) -> None:
    """Refuse a group the cluster can never schedule, instead of waiting forever."""
    total = ray.cluster_resources()
    demand = {"CPU": float(options.get("num_cpus", 1)) * world_size,
              "GPU": float(options.get("num_gpus", 0) or 0) * world_size}
    for name, amount in dict(options.get("resources") or {}).items():
        demand[name] = float(amount) * world_size
    short = {k: (v, total.get(k, 0.0)) for k, v in demand.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        detail = ", ".join(f"{k}: needs {need:g}, cluster has {have:g}" for k, (need, have) in short.items())
        raise ValueError(
            f"spawn(world_size={world_size}) can never be scheduled on this cluster ({detail}); "
            "pass e.g. actor_options={'num_cpus': 0} or fractional resources, or start Ray "
            "with more (ray.init(num_cpus=...))")


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: Optional[dict] = None,
          backend: Optional[str] = None, actor_options: Optional[Dict[str, Any]] = None,
          group_name: Optional[str] = None, timeout: Any = None) -> List[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` new actors forming one group.

    Returns the per-rank results in rank order. If a rank raises, the group is aborted (so
    the others fail fast instead of waiting in a collective), the actors are cleaned up, and
    :class:`~raycoll.errors.SpawnError` is raised with the rank in its message and the rank's
    exception as its cause. Actors reserve 1 CPU each unless ``actor_options`` says otherwise;
    a request the cluster can never satisfy is refused at once.

    ``fn`` may be defined anywhere: in ``__main__``, a notebook, a test file, or a module on
    this process's ``sys.path`` only. Modules the actors cannot import are shipped to them by
    value (``cloudpickle.register_pickle_by_value``); compiled code, which cannot travel
    that way, is refused before ``fn`` runs (:class:`~raycoll.errors.CodeNotShippableError`
    naming the module and the fix).

    Before ``fn`` runs, each rank's environment holds torchrun's variables, so that torch code
    reading them ports unchanged: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (among the ranks on the same Ray node, in rank order), and
    ``MASTER_ADDR``/``MASTER_PORT``: rank 0's address for direct connections
    (``RAYCOLL_SOCKET_IFNAME``'s address, else its node's IP when the cluster has several
    nodes, else 127.0.0.1) and a port free there when ``spawn`` looked (not reserved), where
    torch's ``env://`` rendezvous (``init_process_group("gloo")``) can put its store.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if not ray.is_initialized():
        start_ray()
    options = dict(actor_options or {})
    _check_feasible(world_size, options)
    name = group_name or f"spawn-{uuid.uuid4().hex[:8]}"
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    actors = [_SpawnWorker.options(**options).remote() for _ in range(world_size)]
    try:
        return run_on(actors, fn, args, kwargs, group_name=name, backend=backend, timeout=seconds,
                      torchrun_env=True)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def run_on(actors: Sequence[ActorHandle], fn: Callable[..., Any], args: tuple = (),
           kwargs: Optional[dict] = None, *, group_name: str, backend: Optional[str] = None,
           timeout: Any = None, torchrun_env: bool = False,
           options: OptionsLike = None) -> List[Any]:
    """Form ``group_name`` among ``actors`` (which must have a ``run(fn, rank, args, kwargs)``
    method, like spawn's workers), run ``fn`` on each, destroy the group, return the results.
    ``torchrun_env``: set torchrun's environment in each actor first (see :func:`spawn`);
    ``options``: the group's options, as :func:`create_group` takes them.

    ``fn`` and its arguments may come from modules the actors cannot import (a test file, a
    module beside a notebook or on a script's own ``sys.path``): those are shipped by value
    (see :mod:`raycoll._shipping`)."""
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    create_group(actors, backend=backend, group_name=group_name, timeout=seconds,
                 options=options)
    try:
        shipped = ship(actors, (fn, args, kwargs or {}), min(seconds, 30.0))
        if shipped:
            logger.debug("raycoll: shipping modules %s to the ranks by value", shipped)
        if torchrun_env:
            _set_torchrun_env(actors, group_name, min(seconds, 30.0))
        refs = [a.run.remote(fn, rank, args, kwargs or {}) for rank, a in enumerate(actors)]
        return _collect(refs, group_name, seconds)
    finally:
        try:
            destroy_group(group_name)
        except Exception:  # noqa: BLE001 - teardown must not hide the real error
            logger.exception("destroying group %r failed", group_name)


#: What :func:`spawn` sets in each rank before ``fn`` runs, as torchrun does.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")


def _master_endpoint(actor_self: Any) -> Tuple[str, int]:
    """Runs in rank 0: its address for direct connections (raycoll.transport.tcp's choice:
    ``RAYCOLL_SOCKET_IFNAME``'s address, else the node's IP on a multi-node cluster, else
    127.0.0.1) and a port that is free there now (not reserved, as torchrun's)."""
    import socket

    from raycoll.transport.tcp import listen_address

    host = listen_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])


def _export_env(actor_self: Any, group_name: str, rank: int, master: Tuple[str, int]) -> None:
    """Runs in each rank: torchrun's variables, LOCAL_* from the ranks that share its node."""
    nodes = world().groups[group_name].node_ids
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(len(nodes)),
        "LOCAL_RANK": str(nodes[:rank].count(nodes[rank])),
        "LOCAL_WORLD_SIZE": str(nodes.count(nodes[rank])),
        "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
    })


def _set_torchrun_env(actors: Sequence[ActorHandle], group_name: str, timeout_s: float) -> None:
    master = ray.get(actors[0].__ray_call__.remote(_master_endpoint), timeout=timeout_s)
    refs = [a.__ray_call__.remote(_export_env, group_name, rank, master)
            for rank, a in enumerate(actors)]
    _collect(refs, group_name, timeout_s)


def _collect(refs: List[Any], group_name: str, timeout_s: float) -> List[Any]:
    """Wait for every rank; on the first failure abort the group, then raise it."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s + 60.0)
        if not done:
            raise errors.DistTimeoutError(f"spawn: ranks did not finish within {timeout_s:g}s",
                                          group=group_name)
        ref = done[0]
        rank = refs.index(ref)
        try:
            ray.get(ref, timeout=_TEARDOWN_S)
        except Exception as exc:  # noqa: BLE001 - re-raised below with the rank
            _abort(group_name, f"rank {rank} raised {type(exc).__name__} in spawn")
            cause = exc.as_instanceof_cause() if isinstance(exc, ray.exceptions.RayTaskError) else exc
            message = f"spawn: rank {rank} failed: {type(cause).__name__}: {cause}"
            if isinstance(exc, ray.exceptions.RayTaskError):
                message += f"\n{exc.traceback_str}" if getattr(exc, "traceback_str", "") else ""
            raise errors.SpawnError(message, rank=rank) from cause
    return ray.get(refs, timeout=_TEARDOWN_S)


def _abort(group_name: str, reason: str) -> None:
    with _lock:
        entry = _groups.get(group_name)
    if entry is not None and entry.spec.coordinator is not None:
        CoordinatorClient(entry.spec.coordinator, group_name).submit_abort(
            group_name, "aborted", reason, {})
