"""Driver side: form groups among existing actors, run SPMD functions, tear groups down.

``create_group(actors, ...)`` gives the group a coordinator (owned by the driver, its name
namespaced by the job so two jobs never meet; the one started ahead when there is one, see
:mod:`raycoll.coordinator.spare`) and has every actor join it, in list order, via Ray's
``__ray_call__`` (so any actor class works unchanged). ``spawn(fn, world_size, ...)``
is ``torch.multiprocessing.spawn`` for Ray: it starts the actors, forms the group, runs
``fn(rank, *args)`` everywhere, returns the results in rank order and cleans up.

What the driver records (each group by name, with its coordinator's handle and its actors)
belongs to the Ray session it was made in (:class:`raycoll.session.SessionRecords`): after
``ray.shutdown()`` or a new ``ray.init()`` it is forgotten, so the same names form again at
once and destroying a name of the ended session does nothing. Ray's exceptions are translated
here into raycoll's, the original chained as the cause.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import ray
from ray.actor import ActorHandle

from raycoll import coalesce, errors, formation, session
from raycoll._shipping import ship
from raycoll.backends import backend_config
from raycoll.coordinator import CoordinatorClient, spare
from raycoll.coordinator.hosting import Hosted, process_of
from raycoll.process_group import DEFAULT_TIMEOUT_S, GroupSpec
from raycoll.world import world
from raycoll.options import GroupOptions, OptionsLike
from raycoll.work import to_seconds

logger = logging.getLogger("raycoll")

__all__ = ["create_group", "destroy_group", "spawn", "run_on", "DRIVER_GROUPS"]

#: How long driver-side teardown waits for busy or dead actors.
_TEARDOWN_S = 10.0


@dataclass
class _Host:
    """The coordinator process hosting the groups of one ``create_groups`` call
    (:mod:`raycoll.coordinator.hosting`): back in the pool when its last group is destroyed
    and every one ended cleanly (all ranks left, nothing pending, no failure), else ended."""

    coordinator: spare.Spare
    remaining: Set[int]
    clean: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)

    def end(self, index: int, left: bool, now: Optional[session.SessionKey]) -> None:
        """Group ``index``'s coordinator ends (its group was destroyed; ``left``: every rank
        left it); the process with the last one."""
        clean = False
        handle = self.coordinator.handle
        try:
            clean = bool(CoordinatorClient(handle, "").end_hosted(index, _TEARDOWN_S)["clean"])
        except Exception as exc:  # noqa: BLE001 - dead or gone: the process is ended below
            logger.debug("raycoll: ending hosted coordinator %d failed: %s", index, exc)
        with self.lock:
            self.remaining.discard(index)
            self.clean = self.clean and clean and left
            last, clean = not self.remaining, self.clean
        if last and clean:
            spare.recycle(handle, self.coordinator.name, now)
        elif last:
            _kill(handle)


@dataclass
class _DriverGroup:
    spec: GroupSpec
    actors: List[ActorHandle]
    coordinator: Optional[spare.Spare] = None  # recycled when the group is destroyed
    host: Optional[_Host] = None  # the process its coordinator is hosted in, if shared


#: The groups this process formed, by name, each of the Ray session it was formed in (read by
#: :mod:`raycoll.status`).
DRIVER_GROUPS: session.SessionRecords[_DriverGroup] = session.SessionRecords("group")


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

    Calls that overlap (from threads of this process) over the same actors, with the same
    backend, timeout and options, form together (:mod:`raycoll.coalesce`): the first at once,
    the ones that come while it forms in one batch after it, as :func:`raycoll.create_groups`
    forms them (their coordinators in one process); each call returns or raises its own result.

    A name is taken only within the Ray session it was formed in: after ``ray.shutdown()``
    and ``ray.init()`` it can be formed again at once. Actors of an ended session (or with
    Ray not initialized) raise :class:`~raycoll.errors.RaySessionError`; a dead actor
    :class:`~raycoll.errors.RankFailedError`.
    """
    _check_actors(actors)
    _check_name(group_name)
    backend_config(backend)  # reject a bad backend string before starting anything
    group_options = GroupOptions.of(options)
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    now = session.require(f"create_group(group_name={group_name!r})")
    placeholder = _DriverGroup(GroupSpec(group_name, 0, backend, seconds, None), [])
    if not DRIVER_GROUPS.add(group_name, placeholder, now):
        raise ValueError(f"group {group_name!r} already exists; destroy_group({group_name!r}) "
                         "first or pick another group_name")

    def together(names: Sequence[str]) -> List[_DriverGroup]:
        return form_groups(actors, names, backend, seconds, group_options, now,
                           f"create_group() of {list(names)!r}, calls formed together")

    def alone(name: str) -> _DriverGroup:
        return form_groups(actors, [name], backend, seconds, group_options, now,
                           f"create_group({name!r})")[0]

    # overlapping calls of the same key form together (raycoll/coalesce.py)
    key: Any = (now, tuple(a._actor_id for a in actors), backend, seconds, group_options)
    try:
        hash(key)
    except TypeError:  # options that cannot be compared: this call forms on its own
        key = object()
    try:
        formed = coalesce.form(key, group_name, together, alone,
                               discard=lambda entry: _tear_down(group_name, entry, now))
    except BaseException:
        DRIVER_GROUPS.pop(group_name, now)
        raise
    DRIVER_GROUPS.replace(group_name, formed, now)
    spare.refill(now)  # the next group's coordinator, started while this one is used


def form_groups(actors: Sequence[ActorHandle], names: Sequence[str], backend: Optional[str],
                seconds: float, group_options: GroupOptions, now: session.SessionKey,
                label: str) -> List[_DriverGroup]:
    """Form root groups ``names`` over ``actors``, by their driver (:mod:`raycoll.formation`):
    one group's coordinator taken idle (or started); several groups' coordinators hosted in
    one such process (:mod:`raycoll.coordinator.hosting`). All or none: on any failure every
    group is undone (ranks told to leave, names freed, coordinators ended) and the failure
    raised. Forms again once if a rank's kept info was stale."""
    for attempt in (0, 1):
        host = spare.take(now) if len(names) > 1 else None
        taken: List[spare.Spare] = [host] if host is not None else []
        specs: List[GroupSpec] = []
        claims: List[Tuple[str, spare.Spare, int]] = []  # (name, coordinator, hosted index)
        claimed: List[str] = []  # the names recorded (spare.claim) while the ranks install
        try:
            for index, name in enumerate(names, 1):
                coordinator = host or spare.take(now)  # idle (started ahead, recycled), or started
                if host is None:
                    taken.append(coordinator)
                claims.append((name, coordinator, index if host else 0))
                specs.append(GroupSpec(name, len(actors), backend, seconds,
                                       Hosted(coordinator.handle, index) if host
                                       else coordinator.handle, group_options))
            generations = [c.generation for c in taken] * (len(specs) // len(taken))
            formation.form(actors, specs, generations, label,
                           claim=lambda: _claim(now, claims, claimed))
        except BaseException as exc:
            ours = [c.handle._actor_id.binary() for c in taken]
            for actor in actors if specs else []:
                try:  # a rank that installed a group forgets it (after its install call)
                    actor.__ray_call__.remote(_undo, [s.name for s in specs], ours)
                except Exception:  # noqa: BLE001 - a dead actor's handle may refuse calls
                    pass
            for name in claimed:
                spare.unclaim(now[1], name)
            for coordinator in taken:
                _kill(coordinator.handle)
            if not isinstance(exc, formation.Stale) or attempt:
                raise
            logger.debug("raycoll: %s: %s; forming again", label, exc)
            continue
        if host is None:
            return [_DriverGroup(spec, list(actors), c) for spec, c in zip(specs, taken)]
        shared = _Host(host, set(range(1, len(names) + 1)))
        return [_DriverGroup(spec, list(actors), None, shared) for spec in specs]
    raise AssertionError("unreachable")  # pragma: no cover


def _claim(now: session.SessionKey, claims: Sequence[Tuple[str, spare.Spare, int]],
           claimed: List[str]) -> None:
    """Record each group's name for its coordinator (:func:`spare.claim`: ``(name,
    coordinator, index)``, the index of a hosted one), in ``claimed``; ``ValueError`` at the
    first name taken in this job (by another process's group, or a group its ranks formed by
    name). :func:`formation.form` calls it while the ranks install, so that its GCS calls
    (1-2 ms) run under their calls instead of before them; a name taken then undoes the
    formation as any failure does (its coordinators are ended, not handed to the next
    group: the ranks took leases on them)."""
    for name, coordinator, index in claims:
        if not spare.claim(now[1], name, coordinator, index):
            raise ValueError(f"group {name!r} already exists in this job")
        claimed.append(name)


def _undo(actor_self: Any, names: List[str],
          coordinators: Optional[List[bytes]] = None) -> None:
    """Runs inside each actor: forget the groups of a formation that failed, if installed
    (with ``coordinators``, the formation's coordinators' actor ids: only a group installed
    with one of them, not a group of the same name the actor had before, e.g. formed by
    name)."""
    for name in names:
        pg = world().groups.get(name)
        if pg is None:
            continue
        if coordinators is not None:
            handle = process_of(pg.client.handle)
            if handle is None or handle._actor_id.binary() not in coordinators:
                continue
        world().remove(name, "the group's formation failed")


def _check_actors(actors: Sequence[ActorHandle]) -> None:
    """Refuse anything but a non-empty list of distinct actor handles."""
    if not isinstance(actors, (list, tuple)) or not actors:
        raise ValueError("actors must be a non-empty list of Ray actor handles")
    for i, actor in enumerate(actors):
        if not isinstance(actor, ActorHandle):
            raise TypeError(f"actors[{i}] must be a Ray actor handle, got {type(actor).__name__}")
    ids = [a._actor_id for a in actors]
    if len(set(ids)) != len(ids):
        raise ValueError("actors must be distinct: the same actor appears twice")


def _check_name(group_name: Any) -> None:
    if not isinstance(group_name, str) or not group_name or "/" in group_name:
        raise ValueError(f"group_name must be a non-empty str without '/', got {group_name!r}")


def _kill(actor: ActorHandle) -> None:
    """``ray.kill``, quietly: teardown of an actor that may be gone already."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - a handle Ray does not know any more
        logger.debug("raycoll: ray.kill failed (%s: %s)", type(exc).__name__, _first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def destroy_group(group_name: str = "default") -> None:
    """Destroy a group formed with :func:`create_group`: actors forget it, the coordinator
    stops. Actors that are busy or dead are not waited for beyond a few seconds. The same
    name can be formed again afterwards.

    A group of a Ray session that has ended (``ray.shutdown()`` or a new ``ray.init()`` since
    it was formed) is gone with it: destroying it does nothing. A name never formed here
    raises :class:`~raycoll.errors.GroupNotFoundError`."""
    now = session.current()
    entry = DRIVER_GROUPS.pop(group_name, now)
    if entry is None:
        if DRIVER_GROUPS.ended(group_name, now):
            logger.debug("raycoll: destroy_group(%r): the group's Ray session ended; nothing "
                         "to do", group_name)
            return
        raise errors.GroupNotFoundError(
            f"destroy_group: no group {group_name!r} was created from this process in this Ray "
            f"session; groups: {DRIVER_GROUPS.names(now)}")
    _tear_down(group_name, entry, now)


def _tear_down(group_name: str, entry: _DriverGroup, now: Optional[session.SessionKey]) -> None:
    """Destroy a formed group that is no longer in :data:`DRIVER_GROUPS`: its ranks leave
    it, its name is freed, its coordinator recycled (or ended, or its host told)."""
    refs = []
    for actor in entry.actors:
        try:
            refs.append(actor.__ray_call__.remote(_leave, group_name))
        except Exception:  # noqa: BLE001 - a dead actor's handle may refuse calls
            pass
    left = False
    if refs:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=_TEARDOWN_S)
        left = len(done) == len(entry.actors) and _all_ok(done)
    if now is not None:  # the group's name is free again at once (its coordinator's
        spare.unclaim(now[1], group_name)  # own name is unique)
    if entry.host is not None:  # hosted with the groups it was formed with
        entry.host.end(entry.spec.coordinator.index, left, now)
    elif entry.coordinator is not None and left:  # every rank left: the next group's
        spare.recycle(entry.coordinator.handle, entry.coordinator.name, now)
    elif entry.spec.coordinator is not None:
        _kill(entry.spec.coordinator)


def _all_ok(refs: List[Any]) -> bool:
    """Whether every one of these finished calls returned (none raised)."""
    try:
        ray.get(refs, timeout=_TEARDOWN_S)
        return True
    except Exception:  # noqa: BLE001 - an actor died or raised while leaving
        return False


class RankWorker:
    """The actor class :func:`spawn` starts for each rank (and :mod:`raycoll.testing` reuses)."""

    def run(self, fn: Callable[..., Any], rank: int, args: tuple, kwargs: dict) -> Any:
        """``fn(rank, *args, **kwargs)``. A ``torch.distributed`` default group that ``fn``
        initialized and did not destroy (it raised first, or left it) is destroyed after it,
        as a process of ``torch.multiprocessing.spawn`` would take it with it: the run's
        raycoll group under it is destroyed after the run too, and the actor's next run can
        initialize torch again."""
        torch_before = _torch_initialized()
        try:
            return fn(rank, *args, **kwargs)
        finally:
            if not torch_before and _torch_initialized():
                _destroy_torch_default()


def _torch_initialized() -> bool:
    """Whether ``torch.distributed`` (if this process imported it) has a default group."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _destroy_torch_default() -> None:
    try:
        sys.modules["torch.distributed"].destroy_process_group()
    except Exception:  # noqa: BLE001 - its raycoll group may be broken or gone already
        logger.debug("raycoll: destroying the torch default group a run left failed",
                     exc_info=True)


_SpawnWorker: Any = ray.remote(RankWorker)


#: Ray frees out-of-scope objects in batches, once a second by default; until then every new
#: ``ray.put`` lands in cold store memory (page faults), which makes large collectives 2-3x
#: slower (benchmarks/HISTORY.md). A Ray that raycoll starts frees every 10 ms.
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
          group_name: Optional[str] = None, timeout: Any = None,
          options: OptionsLike = None) -> List[Any]:
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

    ``backend``, ``group_name``, ``timeout`` and ``options`` (the group's options: a dict
    such as ``{"transport": "tcp"}`` or a :class:`~raycoll.GroupOptions`) are
    :func:`create_group`'s, checked alike before any actor starts. With Ray not initialized,
    ``spawn`` starts a local Ray.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if group_name is not None and (not isinstance(group_name, str) or not group_name
                                   or "/" in group_name):
        raise ValueError(f"group_name must be a non-empty str without '/', got {group_name!r}")
    backend_config(backend)  # as create_group: refused before any actor starts
    group_options = GroupOptions.of(options)
    if not ray.is_initialized():
        start_ray()
    options = dict(actor_options or {})
    _check_feasible(world_size, options)
    name = group_name or f"spawn-{uuid.uuid4().hex[:8]}"
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    actors = [_SpawnWorker.options(**options).remote() for _ in range(world_size)]
    try:
        return run_on(actors, fn, args, kwargs, group_name=name, backend=backend, timeout=seconds,
                      torchrun_env=True, options=group_options)
    finally:
        for actor in actors:
            _kill(actor)


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
    """Runs in rank 0: its address for direct connections (raycoll.transport.links' choice:
    ``RAYCOLL_SOCKET_IFNAME``'s address, else the node's IP on a multi-node cluster, else
    127.0.0.1) and a port that is free there now (not reserved, as torchrun's)."""
    import socket

    from raycoll.transport.links import listen_address

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
    master = _collect([formation.submit(actors[0], 0, group_name, _master_endpoint)], group_name,
                      timeout_s)[0]
    refs = [formation.submit(a, rank, group_name, _export_env, group_name, rank, master)
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
            raise _rank_error(exc, rank) from (
                exc.as_instanceof_cause() if isinstance(exc, ray.exceptions.RayTaskError) else exc)
    try:
        return ray.get(refs, timeout=_TEARDOWN_S)
    except Exception as exc:  # all were ready a moment ago: Ray lost a result
        raise errors.SpawnError(f"spawn: the ranks' results could not be read ({exc})",
                                rank=-1) from exc


def _rank_error(exc: BaseException, rank: int) -> errors.SpawnError:
    """The SpawnError for rank ``rank``'s failure ``exc`` (raised from its cause)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.as_instanceof_cause()
        message = f"spawn: rank {rank} failed: {type(cause).__name__}: {cause}"
        tb = getattr(exc, "traceback_str", "")
        return errors.SpawnError(message + (f"\n{tb}" if tb else ""), rank=rank)
    if isinstance(exc, ray.exceptions.RayActorError):
        return errors.SpawnError(
            f"spawn: the actor of rank {rank} died ({_first_line(exc)}): its process exited or "
            "was killed, or its node was lost; the others were aborted. Check the rank's "
            "memory and actor_options, and run spawn again", rank=rank)
    return errors.SpawnError(f"spawn: rank {rank} failed: {type(exc).__name__}: {exc}",
                             rank=rank)


def _abort(group_name: str, reason: str) -> None:
    entry = DRIVER_GROUPS.get(group_name, session.current())
    if entry is not None and entry.spec.coordinator is not None:
        CoordinatorClient(entry.spec.coordinator, group_name).submit_abort(
            group_name, "aborted", reason, {})
