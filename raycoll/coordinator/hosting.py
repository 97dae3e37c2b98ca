"""Several root groups' coordinators in one process: the groups of one ``create_groups`` call.

A coordinator is a Ray actor, so a process of its own; every root group formed from a driver
had one. :func:`raycoll.create_groups` forms several groups over the same actors at once (a
"dp" and a "tp" group, a group per pipeline stage), and on a small machine its cost was the
coordinators: eight processes each taking a roster, eight leases per rank, eight hand-overs
of the leases (benchmarks/BENCHMARKS.md, "Groups formed by their driver"). So the groups of
one call share one coordinator process, its *host*: each group still has a coordinator of its
own, a :class:`~raycoll.coordinator.actor.Coordinator` object that the host keeps by index,
with its own tables (steps, stores, Join, liveness, errors); only the process is shared.

- The driver forms them in one call (:meth:`HostingMixin.form_hosted`); a rank takes one lease
  for all of them (:meth:`HostingMixin.lease_hosted`: it ends when the rank has left every
  hosted group, or they ended) and hands it to every hosted coordinator in one call
  (:meth:`HostingMixin.watch_hosted`).
- A rank reaches its group's coordinator through a :class:`Hosted` handle (what the group's
  spec carries): ``handle.method.remote(...)`` becomes the host's
  ``hosted(index, "method", args, kwargs)``, so the client code is the same for both.
- A group's failure stays its own: a broken group breaks no other hosted group; a dead rank
  fails every group it is a member of (as it would with separate coordinators: the groups of
  one call share their actors). Destroying a group ends its coordinator object
  (:meth:`HostingMixin.end_hosted`); the host process goes back to the driver's pool when the
  last group ends and every one ended cleanly, else it is stopped. The host's own process
  dying (it is killed, its node is lost) fails all the call's groups at once, as the driver's
  death would.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Dict, List, Sequence, Tuple

import ray

from raycoll.coordinator.logic import Result, err, ok
from raycoll.coordinator.state import CoordinatorState

__all__ = ["Hosted", "HostingMixin", "process_of"]

#: How long a rank's lease (or watch) waits for the driver's ``form_hosted`` it overtook.
_FORM_WAIT_S = 60.0


class Hosted:
    """The handle of a coordinator hosted in another's process (index ``index`` of the host
    actor ``host``): ``hosted.method.remote(*args)`` is a call to that coordinator, as
    ``handle.method.remote(*args)`` is to one of its own. Pickles with the host's handle."""

    def __init__(self, host: "ray.actor.ActorHandle", index: int) -> None:
        self.host = host
        self.index = index

    def __getattr__(self, method: str) -> "_HostedMethod":
        if method.startswith("_"):  # pickle's and copy's probes, a handle's own attributes:
            raise AttributeError(method)  # no coordinator method starts with "_"
        return _HostedMethod(self.host, self.index, method)

    def __repr__(self) -> str:
        return f"Hosted({self.host!r}, {self.index})"


def process_of(handle: Any) -> Any:
    """The actor handle of the process a coordinator's handle reaches: a hosted one's host,
    else the handle itself (``None`` stays ``None``)."""
    return handle.host if isinstance(handle, Hosted) else handle


class _HostedMethod:
    """``Hosted(...).method``: what ``.remote`` sends to the host."""

    def __init__(self, host: "ray.actor.ActorHandle", index: int, method: str) -> None:
        self._host, self._index, self._method = host, index, method

    def remote(self, *args: Any, **kwargs: Any) -> "ray.ObjectRef":
        ref: "ray.ObjectRef" = self._host.hosted.remote(self._index, self._method, args, kwargs)
        return ref


class HostingMixin(CoordinatorState):
    """The host's side: ``form_hosted``, ``hosted``, ``lease_hosted``, ``watch_hosted``,
    ``end_hosted``. The host serves no group of its own meanwhile."""

    def form_hosted(self, names: Sequence[str], roster: List[Dict[str, Any]], secret: bytes,
                    generation: int) -> Result:
        """Form one hosted coordinator per name (indexes 1, 2, ... in order), each as
        :meth:`Coordinator.form <raycoll.coordinator.actor.Coordinator.form>` forms its group.
        Refused unless this coordinator serves nothing (started ahead or recycled) at
        ``generation``, the one its driver was told."""
        if (self._group_name or self._members or self._owned_by_ranks or self._dead
                or self._hosted or generation != self._generation):
            return err("value", f"coordinator of generation {self._generation} (serving "
                       f"{self._group_name!r}, hosting {len(self._hosted)}) cannot host groups "
                       f"{list(names)!r} (generation {generation} expected, nothing served)")
        for index, name in enumerate(names, 1):
            hosted: Any = type(self)("", 0)  # the actor's own class, as a plain object
            hosted._generation = generation
            formed = hosted.form(name, roster, secret, generation)
            if formed[0] != "ok":  # pragma: no cover - a fresh object serves nothing
                self._hosted.clear()
                return formed
            self._hosted[index] = hosted
        self._hosting.set()
        return ok({"generation": generation, "hosted": len(names)})

    async def hosted(self, index: int, method: str, args: Tuple[Any, ...],
                     kwargs: Dict[str, Any]) -> Any:
        """Call ``method`` of hosted coordinator ``index`` (what a :class:`Hosted` handle
        sends); its answer, or a ``gone`` error once its group was destroyed."""
        target = self._hosted.get(index)
        if target is None or method.startswith("_"):
            return err("gone", f"the coordinator of this group (#{index} of its host) ended: "
                       "the group was destroyed")
        answer = getattr(target, method)(*args, **kwargs)
        if inspect.isawaitable(answer):
            answer = await answer
        return answer

    async def lease_hosted(self, rank: int, generation: int) -> Result:
        """One lease for every hosted group that ``rank`` is in: pending until the rank has
        left them all (or they ended). The rank owns its reference and hands it over
        (:meth:`watch_hosted`), so that its process's death reaches every hosted group."""
        if not await self._hosting_formed(generation):
            return ok()
        futures = [hosted._lease_future(rank, generation) for hosted in self._hosted.values()]
        if futures:
            await asyncio.gather(*futures)
        return ok()

    async def watch_hosted(self, rank: int, generation: int,
                           lease: List["ray.ObjectRef"]) -> Result:
        """``watch`` on every hosted coordinator with ``rank``'s one lease (in a list, so that
        it arrives unresolved)."""
        if await self._hosting_formed(generation):
            for hosted in self._hosted.values():
                hosted.watch(rank, generation, lease)
        return ok()

    async def _hosting_formed(self, generation: int) -> bool:
        """Wait for :meth:`form_hosted` of ``generation`` (a rank's lease or watch can overtake
        the driver's call: their callers differ, so Ray does not order them); False if this
        host moved on, or the formation never came (it failed: the driver ends this host)."""
        while generation == self._generation and not self._hosting.is_set():
            try:
                await asyncio.wait_for(self._hosting.wait(), _FORM_WAIT_S)
            except asyncio.TimeoutError:
                return False
        return generation == self._generation

    def end_hosted(self, index: int) -> Result:
        """End hosted coordinator ``index`` (its group was destroyed): its leases released, its
        tasks cancelled, anything still waiting failed. ``{"clean": whether it could have
        served another group (nothing pending, no failure seen), "hosted": how many are
        left}``."""
        hosted = self._hosted.pop(index, None)
        if hosted is None:
            return ok({"clean": False, "hosted": len(self._hosted)})
        clean = not hosted._busy()
        if not clean:
            name = hosted._group_name
            hosted.abort(name, "aborted", f"group {name!r} was destroyed")
        hosted._release(hosted._generation + 1)
        return ok({"clean": clean, "hosted": len(self._hosted)})
