"""The coordinator actor: one async Ray actor per root group, and how it is started.

:class:`Coordinator` combines the concerns, each in its own module: membership
(rendezvous, leave), the key-value store and ``status`` here; step matching
(:mod:`.steps`), round-transport bookkeeping (:mod:`.transports`), Join state
(:mod:`.join_state`), the point-to-point mailbox (:mod:`.mailbox`), the groups' stores
(:mod:`.store`), liveness
(:mod:`.liveness`) and membership changes (:mod:`.elastic`). Every RPC answers
with a result tuple (:mod:`.logic`); ranks call it through
:class:`raycoll.coordinator.client.CoordinatorClient`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Dict, List, Optional, Tuple

import ray

from raycoll import errors
from raycoll.coordinator.elastic import ElasticMixin
from raycoll.coordinator.hosting import HostingMixin
from raycoll.coordinator.join_state import JoinMixin
from raycoll.coordinator.client import unpack_handle
from raycoll.coordinator.liveness import REPROBE_S, LivenessMixin
from raycoll.coordinator.logic import Result, err, fmt_ranks, ok
from raycoll.coordinator.mailbox import MailboxMixin
from raycoll.coordinator.state import CoordinatorState
from raycoll.coordinator.steps import StepsMixin
from raycoll.coordinator.store import StoreMixin, table_sizes
from raycoll.coordinator.transports import TransportMixin


class Coordinator(StepsMixin, TransportMixin, JoinMixin, MailboxMixin, StoreMixin, LivenessMixin,
                  ElasticMixin, HostingMixin):
    """The coordinator actor's class. Create it with :func:`start_coordinator`."""

    # ------------------------------------------------------------------ rendezvous
    async def rendezvous(self, rank: int, world_size: int, info: Dict[str, Any], timeout_s: float,
                         group_name: str = "", lease: Optional[List[Any]] = None,
                         token: str = "") -> Result:
        """Register ``rank``; return every rank's info once all ``world_size`` have arrived.

        A coordinator started ahead (:mod:`.spare`) serves no group yet: the first rank to
        arrive makes it group ``group_name``'s, of ``world_size`` ranks, for good. ``lease``
        (a list holding the reference of the rank's ``lease(rank, -1, token)`` call, taken
        just before): the rank's lease once the group forms, with no ``watch`` call after."""
        result = await self._rendezvous(rank, world_size, info, timeout_s, group_name,
                                        (token, lease[0]) if lease and token else None)
        if result[0] != "ok":
            self._end_token_lease(token)
        return result

    async def _rendezvous(self, rank: int, world_size: int, info: Dict[str, Any],
                          timeout_s: float, group_name: str,
                          lease: Optional[Tuple[str, Any]]) -> Result:
        if not self._group_name:
            self._group_name = group_name
        if not self._world_size:  # a spare's first rank, or a lingering one's (by name)
            self._world_size = world_size
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        by_name = self._owned_by_ranks  # a name ranks formed: Ray's semantics, taken over
        if world_size != self._world_size and not (by_name and self._formed.is_set()):
            return self._size_refused(rank, world_size)
        if not 0 <= rank < world_size:
            return err("value", f"rank={rank} is out of range for world_size={world_size}")
        while True:
            if rank in self._members and not (self._formed.is_set() and rank in self._left):
                refused = await self._make_way(rank, info)
                if refused is not None:
                    return refused
            if self._formed.is_set() and (rank in self._left or by_name and (
                    rank in self._members or world_size != self._world_size)):
                # This rank left (or another process holds it, or the group is formed again
                # at another size): wait until every rank of the formed generation has left
                # or died, then form the group again.
                waited = await self._await_reset(rank, timeout_s)
                if waited is not None:
                    return waited
                continue
            if rank not in self._members:
                break
        if not self._world_size:  # every rank of the generation it waited for left
            self._world_size = world_size
        if world_size != self._world_size:
            return self._size_refused(rank, world_size)
        self._members[rank] = info
        if lease is not None:
            self._pending_leases[rank] = lease
        if len(self._members) == self._world_size:
            # every rank's answer: built once, not once per rank (O(W), not O(W^2))
            self._roster = [dict(self._members[r], rank=r) for r in range(self._world_size)]
            self._secret = secrets.token_bytes(16)  # for direct connections (transport.links)
            self._formed.set()
            self._reset = asyncio.Event()
            self._left = set()
            for r, (token, ref) in self._pending_leases.items():
                self._adopt_lease(r, self._generation, token, ref)
            self._pending_leases.clear()
        try:
            await asyncio.wait_for(self._formed.wait(), timeout_s)
        except asyncio.TimeoutError:
            missing = sorted(set(range(self._world_size)) - set(self._members))
            self._members.pop(rank, None)
            self._pending_leases.pop(rank, None)
            if self._owned_by_ranks and not self._members and not self._formed.is_set():
                self._world_size = 0
                self._linger()  # nobody came: wait for the name again, then stop
            return err("timeout", f"rendezvous of group {self._group_name!r} timed out after "
                        f"{timeout_s:g}s: ranks {fmt_ranks(missing)} never joined", missing=missing)
        return ok({
            "members": self._roster,
            "generation": self._generation,
            "secret": self._secret,
        })

    def _size_refused(self, rank: int, world_size: int) -> Result:
        return err("value", f"group {self._group_name!r} has world_size={self._world_size}, "
                   f"but rank {rank} called with world_size={world_size}")

    async def _make_way(self, rank: int, info: Dict[str, Any]) -> Optional[Result]:
        """``rank`` is held by a member and is asked for again, in a group formed by name:
        by the same process re-initialising its rank (its old membership ends here), or by
        another process (Ray's semantics: a group formed again under a name takes over the
        names of the ranks that departed). A group formed from a driver refuses: its ranks
        are the ones the driver named. The holder of a formed group leaves when its process is gone
        (:meth:`_await_reset` probes it); the holder of a group still forming is replaced
        only if it is dead already. None: go on; else the refusal."""
        holder = self._members[rank]
        who = holder.get("actor_id") or "a non-actor process"
        if not self._owned_by_ranks:  # formed from a driver: its ranks are the driver's
            state = "formed" if self._formed.is_set() else "forming"
            return err("value", f"rank {rank} joined group {self._group_name!r} ({state}) twice: "
                       f"it is held by another process (actor {who}); two processes called "
                       "with the same rank, or this process was not made part of the group")
        same = bool(info.get("actor_id")) and holder.get("actor_id") == info.get("actor_id")
        if self._formed.is_set():
            if same:
                self.leave(rank)  # its earlier membership ends: it re-joins
            return None
        if not same and await self._dead_now(rank):
            self._members.pop(rank, None)
            self._end_token_lease(self._pending_leases.pop(rank, ("", None))[0])
            return None
        return err("value", f"rank {rank} joined group {self._group_name!r} (forming) twice: "
                   f"it is held by another live process (actor {who}); two processes called "
                   "with the same rank, or this process was not made part of the group")

    async def _await_reset(self, rank: int, timeout_s: float) -> Optional[Result]:
        """Wait (up to ``timeout_s``) until every rank of the formed generation has left, the
        ranks still holding it probed meanwhile so that a departed process counts as left
        at once (Ray reports an actor that went out of scope, or was killed, as dead)."""
        reset, deadline = self._reset, asyncio.get_running_loop().time() + timeout_s
        self._joiners += 1
        try:
            while not reset.is_set():
                holders = [g for g in self._members if g not in self._left]
                now = asyncio.get_running_loop().time()
                for g in holders:
                    self._probe_if_due(g, time.monotonic())
                if now >= deadline:
                    return err("timeout", f"rank {rank} re-joined group {self._group_name!r} but "
                               f"ranks {fmt_ranks(sorted(holders))} of its previous generation, "
                               f"alive, never left within {timeout_s:g}s (destroy the group in "
                               "them, or end their processes)", missing=sorted(holders))
                try:
                    await asyncio.wait_for(reset.wait(), min(REPROBE_S, deadline - now))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._joiners -= 1
        return None

    async def _dead_now(self, rank: int) -> bool:
        """Whether the process holding ``rank`` is gone, as Ray knows now (an actor's probe
        fails at once when Ray has it dead; a live one, maybe busy, is given a second)."""
        member = self._members.get(rank) or {}
        actor = member.get("actor")
        if actor is None:
            return False
        try:
            if isinstance(actor, bytes):
                actor = member["actor"] = await asyncio.get_running_loop().run_in_executor(
                    None, unpack_handle, actor)
            await asyncio.wait_for(actor.__ray_ready__.remote(), _DEAD_NOW_S)
        except ray.exceptions.RayActorError as exc:
            return not isinstance(exc, ray.exceptions.ActorUnavailableError)
        except Exception:  # noqa: BLE001 - busy or unreachable: not known dead
            return False
        return False

    def leave(self, rank: int) -> Result:
        """``rank`` destroyed its handle on the group; once all have, the group may re-form.

        Returns ``{"all_left": bool}`` (False while a rank of the next generation waits
        here to join, :meth:`_await_reset`). A by-name coordinator whose ranks all left
        lingers for the name's next formation (:meth:`_linger`), then stops itself.
        """
        self._left.add(rank)
        self._liveness_left(rank)
        all_left = (len(self._left) >= self._world_size  # O(1) until the last one leaves
                    and self._left >= set(range(self._world_size)))
        if all_left:
            self._liveness_reset(self._generation)
            self._members.clear()
            self._roster = []
            self._formed = asyncio.Event()
            self._generation += 1
            self._steps.clear()
            self._check_fps.clear()
            self._broken.clear()
            self._last.clear()
            self._floor.clear()
            self._current.clear()
            self._joins.clear()
            self._join_done.clear()
            self._join_answers.clear()
            self._kv.clear()  # per generation: e.g. an NCCL unique id must not be reused
            self._kv_events.clear()
            self._store_reset()  # a store outlives no group
            self._reset.set()
            if self._owned_by_ranks:  # next generation: any world size, its first rank's
                self._world_size = 0
                self._linger()
        return ok({"all_left": all_left and not self._joiners})

    def recycle(self) -> Result:
        """Serve no group any more, to be handed to the next group formed from the driver
        (:func:`raycoll.coordinator.spare.recycle`): every table emptied as a new
        coordinator's, the generation moved on (a stale lease or watch of the old group is
        ignored). Refused (``{"recycled": False}``, the driver then ends it) while anything
        of the group is pending or after the group failed: a coordinator that saw a failure
        never serves another group."""
        if self._busy():
            return ok({"recycled": False})
        generation = self._generation + 1
        self._release(generation)
        CoordinatorState.__init__(self, "", 0)
        self._generation = generation
        return ok({"recycled": True, "generation": generation})

    def _busy(self) -> bool:
        """Whether anything of the group is pending or it saw a failure (then it serves no
        other group)."""
        return bool(self._steps or self._dead or self._broken or self._store_waiters
                    or any(self._waiting.values())
                    or any(not t.done() for t in self._probes.values())
                    or self._owned_by_ranks or self._joiners or self._hosted)

    def _release(self, generation: int) -> None:
        """Let go of everything running for the group: every lease up to ``generation``
        released (its watcher cancelled), the probes, the wait monitor and a pending death
        report cancelled, the leases taken with a rendezvous ended."""
        self._liveness_reset(generation)
        for task in list(self._probes.values()) + [self._monitor]:
            if task is not None and not task.done():
                task.cancel()
        if self._death_report is not None:
            self._death_report.cancel()
        for future in self._token_leases.values():  # none should be left: end them all
            if not future.done():
                future.set_result(None)

    def form(self, group_name: str, roster: List[Dict[str, Any]], secret: bytes,
             generation: int) -> Result:
        """The group formed by its driver (:mod:`raycoll.formation`): ``roster`` is every
        rank's info (``rank`` included), in rank order, as a rendezvous would have gathered
        it, and ``secret`` the direct connections' secret; the ranks install it themselves,
        each taking its lease (``lease``, ``watch``) with no call that waits. Refused unless
        this coordinator serves no group yet (started ahead or recycled) at ``generation``
        (the one its driver was told): it never takes over a group another formed."""
        if (self._group_name or self._members or self._owned_by_ranks or self._dead
                or self._hosted or generation != self._generation):
            return err("value", f"coordinator of generation {self._generation} serving "
                       f"{self._group_name!r} cannot form group {group_name!r} (generation "
                       f"{generation} expected, no group yet)")
        self._group_name = group_name
        self._world_size = len(roster)
        self._members = {r: member for r, member in enumerate(roster)}
        self._roster = list(roster)
        self._secret = secret
        self._formed.set()
        self._reset = asyncio.Event()
        self._left = set()
        return ok({"generation": generation})

    def _linger(self) -> None:
        """A by-name coordinator whose ranks all left waits ``LINGER_S``, idle, for the same
        name to be formed again (a test suite's or notebook's next group, Ray's module's
        next ``init_collective_group``): that formation then starts no process. Stopped
        after that, unless a rank arrived (detached, it would outlive the job otherwise)."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        generation = self._generation
        self._linger_timer = asyncio.get_running_loop().call_later(
            LINGER_S, self._stop_if_idle, generation)

    def _stop_if_idle(self, generation: int) -> None:
        self._linger_timer = None
        if generation == self._generation and not self._members and not self._joiners:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _self_destruct_if_orphaned(self) -> None:
        """A by-name coordinator whose ranks all died stops itself (nobody else will)."""
        if self._owned_by_ranks and not self._members and not self._joiners:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ------------------------------------------------------------------ key-value store
    def kv_set(self, key: str, value: Any) -> Result:
        """Set ``key`` (for this generation of the group), waking its waiting readers."""
        self._kv[key] = value
        self._kv_events[key].set()
        return ok()

    async def kv_get(self, key: str, timeout_s: float) -> Result:
        """The value of ``key``, waiting up to ``timeout_s`` for it to be set."""
        if key not in self._kv:
            try:
                await asyncio.wait_for(self._kv_events[key].wait(), timeout_s)
            except asyncio.TimeoutError:
                return err("timeout", f"key {key!r} was not set within {timeout_s:g}s")
        return ok(self._kv[key])

    # ------------------------------------------------------------------ status
    def status(self) -> Result:
        """Each group's ranks: last completed and current collective (name, seq)."""
        out: Dict[str, Any] = {}
        for key, ranks in self._groups.items():
            out[key] = {
                ranks[r]: {
                    "last_completed": self._completed(key, r),
                    "current": self._current[key].get(r),
                }
                for r in range(len(ranks))
            }
            if key in self._broken:
                out[key]["broken"] = self._broken[key][2]
            if key in self._transports:
                out[key]["transport"] = self._transports[key]
                out[key]["lane"] = self._transports[key] == "lane"
                out[key]["report_period_s"] = self._report_period.get(key, 0.0)
            for g, detail in self._details.get(key, {}).items():
                if g in out[key]:
                    out[key][g]["algorithms"] = detail.get("algorithms", {})
                    out[key][g]["counters"] = detail.get("counters")
            self._join_status(key, out[key])
        return ok({"world_size": self._world_size, "members": sorted(self._members),
                    "generation": self._generation, "groups": out})

    def state_sizes(self) -> Result:
        """How many entries the coordinator holds per table (a leak check for soak runs)."""
        return ok({
            "steps": len(self._steps), "groups": len(self._groups), "broken": len(self._broken),
            "mail": sum(len(q) for q in self._mail.values()),
            "receivers": sum(len(q) for q in self._waiting.values()),
            "kv": len(self._kv), "store": table_sizes(self._store), "leases": len(self._leases),
            "lease_watchers": len(self._lease_watchers), "waits": len(self._waits),
            "token_leases": len(self._token_leases),
            "probes": sum(1 for t in self._probes.values() if not t.done()),
            "probes_sent": self._probes_sent,
        })


_RemoteCoordinator: Any = ray.remote(  # type: ignore[call-overload]
    num_cpus=0, max_concurrency=100_000, max_restarts=0)(Coordinator)


def start_coordinator(group_name: str, world_size: int, actor_name: str,
                      get_if_exists: bool = False) -> "ray.actor.ActorHandle":
    """Start (or, with ``get_if_exists``, find) the named coordinator of a root group.

    Ranks that rendezvous by name race to create it: the loser of the race may be handed a
    handle whose creation failed, so each candidate is checked alive, and looked up again
    by name if it is not.
    """
    if not get_if_exists:
        return _RemoteCoordinator.options(name=actor_name, scheduling_strategy=_here()).remote(
            group_name, world_size)
    last: Optional[BaseException] = None
    for _ in range(_START_ATTEMPTS):
        try:
            handle = ray.get_actor(actor_name)
        except ValueError:
            try:
                handle = _RemoteCoordinator.options(
                    name=actor_name, lifetime="detached", scheduling_strategy=_here(),
                ).remote(group_name, world_size, True)
            except ValueError as exc:  # another rank created it between our two calls
                last = exc
                continue
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=_START_TIMEOUT_S)
            return handle
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            last = exc
    raise errors.CoordinatorDiedError(
        f"could not start or find the coordinator {actor_name!r} of group {group_name!r} "
        f"after {_START_ATTEMPTS} attempts: {last}", group=group_name)


_START_ATTEMPTS = 5
#: How long a by-name coordinator whose ranks all left waits for its name to form again.
LINGER_S = 15.0
#: How long a rendezvous waits on a probe of a forming group's holder of its rank.
_DEAD_NOW_S = 1.0
_START_TIMEOUT_S = 60.0


def _here() -> Any:
    """Place the coordinator on the node of the process that starts it (the driver, for
    create_group), not on any node: a zero-CPU actor could otherwise land on a worker node,
    and losing that node would take the whole group's control plane with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # hard affinity: soft=True lets Ray 2.60 place it elsewhere even when this node is free;
    # this node is alive (we run on it) and the actor needs no CPU.
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(),
                                          soft=False)


