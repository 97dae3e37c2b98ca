"""Liveness: how the coordinator learns that a rank's process is gone, and what it then does.

Two event-driven signals tell the coordinator that a rank's process is gone, so that every
surviving rank fails about ``DEATH_BATCH_S`` after Ray reports the death (at once for a kill
or a crash; for a node lost without warning, when Ray's health check declares it dead) with
RankFailedError naming it, instead of waiting out the collective timeout:

- a lease: after rendezvous each rank calls ``lease`` (a call that stays pending for as
  long as the rank is a member; the rank owns its result) and hands the reference back
  through ``watch``. When the rank's process dies, awaiting that reference fails with
  ``OwnerDiedError``. Nothing is ever sent to the rank. Covers ranks that are not actors.
- probes: while a collective or point-to-point wait has lasted ``PROBE_AFTER_S``, the
  coordinator keeps one ``actor.__ray_ready__`` call outstanding per rank of that wait.
  A rank busy in a method (a sync actor inside a collective, or computing) leaves the
  probe queued, a no-op that runs when the method returns; when the actor dies the
  pending probe fails within milliseconds (Ray's actor-death notification). An idle
  actor answers at once and is probed again at most every ``REPROBE_S`` while the wait
  lasts. No GCS polling; no probe at all while collectives complete quickly.

A death breaks the root group and every subgroup (as an NCCL abort does in torch): the
waiting calls fail now, later calls fail at once, until the group is destroyed and
formed again. Deaths detected within ``DEATH_BATCH_S`` of each other (a node going down)
are reported together. The dead rank counts as having left, so that the survivors can
re-form the group by name with a replacement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence

import ray

from raycoll.coordinator.client import unpack_handle
from raycoll.coordinator.logic import Result, death_cause, err, fmt_ranks, ok
from raycoll.coordinator.state import CoordinatorState

logger = logging.getLogger("raycoll")

#: A wait must last this long before the coordinator probes the ranks it waits on.
PROBE_AFTER_S = 0.5
#: While a wait lasts, an actor that answered a probe is probed again after this long.
REPROBE_S = 1.0
#: Deaths detected within this window of the first one are reported together.
DEATH_BATCH_S = 0.2


class LivenessMixin(CoordinatorState):
    """Leases, probes and rank death: ``lease``, ``watch``, ``dead_ranks``."""

    async def lease(self, rank: int, generation: int, token: str = "") -> Result:
        """Held pending by ``rank`` for as long as it is a member (see ``watch``). With a
        ``token``, the lease a rank takes as it calls ``rendezvous`` (which hands its
        reference over, so that no ``watch`` call follows): it becomes the rank's lease of
        the generation it joins (:meth:`_adopt_lease`), or ends if the rendezvous fails."""
        if not token:
            await self._lease_future(rank, generation)
            return ok()
        try:
            await self._token_lease(token)
        finally:
            self._token_leases.pop(token, None)
        return ok()

    def _token_lease(self, token: str) -> "asyncio.Future[None]":
        future = self._token_leases.get(token)
        if future is None:
            future = self._token_leases[token] = asyncio.get_running_loop().create_future()
        return future

    def _adopt_lease(self, rank: int, generation: int, token: str, ref: "ray.ObjectRef") -> None:
        """At formation: the lease ``rank`` took with its rendezvous (``token``, its reference
        ``ref``) is its lease of ``generation``, watched as ``watch`` would."""
        future = self._token_lease(token)
        held = self._leases.get((generation, rank))
        if held is not None and held is not future and not held.done():
            held.set_result(None)
        self._leases[(generation, rank)] = future
        self.watch(rank, generation, [ref])

    def _end_token_lease(self, token: str) -> None:
        """A rendezvous that did not form (refused, timed out, made way for): its lease call
        returns (at once if it comes later)."""
        if token:
            future = self._token_lease(token)
            if not future.done():
                future.set_result(None)

    def watch(self, rank: int, generation: int, lease: List["ray.ObjectRef"]) -> Result:
        """Watch ``rank``'s lease (its ``lease`` call's reference, in a list so that it arrives
        unresolved): when the rank's process dies, the reference fails and the rank is dead."""
        if generation != self._generation or rank in self._left:
            return ok()
        key = (generation, rank)
        if key not in self._lease_watchers:
            self._lease_watchers[key] = asyncio.get_running_loop().create_task(
                self._watch_lease(rank, generation, lease[0]))
        return ok()

    def dead_ranks(self) -> Result:
        """The global ranks found dead in this generation, with the reason."""
        return ok(dict(self._dead))

    def _lease_future(self, rank: int, generation: int) -> "asyncio.Future[None]":
        key = (generation, rank)
        future = self._leases.get(key)
        if future is None:
            future = self._leases[key] = asyncio.get_running_loop().create_future()
            if generation != self._generation or rank in self._left:
                future.set_result(None)
        return future

    def _release_lease(self, rank: int, generation: int) -> None:
        future = self._leases.pop((generation, rank), None)
        if future is not None and not future.done():
            future.set_result(None)
        task = self._lease_watchers.pop((generation, rank), None)
        if task is not None and not task.done():
            task.cancel()

    async def _watch_lease(self, rank: int, generation: int, ref: "ray.ObjectRef") -> None:
        try:
            await ref
        except asyncio.CancelledError:
            raise
        except ray.exceptions.RayActorError:
            pass  # the lease call itself failed: this coordinator is going away, not the rank
        except ray.exceptions.RayError as exc:  # OwnerDiedError: the rank's process is gone
            self._rank_died(rank, generation, f"its process exited ({type(exc).__name__} on "
                            "the lease it held on the coordinator)")

    def _liveness_left(self, rank: int) -> None:
        """``rank`` left the group on purpose: release its lease (it is not dead)."""
        self._release_lease(rank, self._generation)

    def _liveness_reset(self, old_generation: int) -> None:
        """Every rank has left: a new generation starts with no dead ranks."""
        for gen, rank in list(self._leases):
            if gen <= old_generation:
                self._release_lease(rank, gen)
        self._dead.clear()
        self._answered.clear()
        if self._death_report is not None:
            self._death_report.cancel()
            self._death_report = None

    def _unusable(self, key: str) -> Optional[Result]:
        """Why group ``key`` cannot run a call now (a dead rank, a broken group), or None."""
        failed = self._dead_error(key)
        return failed if failed is not None else self._broken.get(key)

    def _dead_error(self, key: str) -> Optional[Result]:
        """The error for a call on ``key`` once a rank of the root group is dead, else None."""
        if not self._dead or self._death_report is not None:  # none, or a report is pending
            return None
        error = self._broken.get(key)
        if error is None:
            error = self._broken[key] = err(
                "rank_failed", f"group {key!r} is broken: {self._dead_text()}; destroy the "
                "group and form it again", failed_ranks=sorted(self._dead))
        return error

    def _dead_text(self) -> str:
        root = self._group_name
        return "; ".join(f"rank {g} of group {root!r} died: {why}"
                         for g, why in sorted(self._dead.items()))

    @contextmanager
    def _watching(self, ranks: Optional[Sequence[int]]) -> Iterator[None]:
        """While the body waits, probe ``ranks`` (global; ``None``: every member) if it lasts."""
        token = next(self._wait_tokens)
        targets = tuple(ranks) if ranks is not None else tuple(sorted(self._members))
        self._waits[token] = (time.monotonic(), targets)
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_waits())
        elif len(self._waits) == 1:
            self._waits_started.set()
        try:
            yield
        finally:
            self._waits.pop(token, None)

    async def _monitor_waits(self) -> None:
        """Start probes for the ranks of every wait older than ``PROBE_AFTER_S``."""
        while True:
            if not self._waits:
                self._waits_started.clear()
                await self._waits_started.wait()
                continue
            now = time.monotonic()
            wake = now + REPROBE_S
            due: set = set()
            for start, ranks in self._waits.values():
                if now - start >= PROBE_AFTER_S:
                    due.update(ranks)
                else:
                    wake = min(wake, start + PROBE_AFTER_S)
            for g in sorted(due):
                wake = min(wake, self._probe_if_due(g, now))
            await asyncio.sleep(max(0.01, wake - time.monotonic()))

    def _probe_if_due(self, g: int, now: float, force: bool = False) -> float:
        """Start a probe of global rank ``g`` unless one is out or it answered less than
        ``REPROBE_S`` ago (``force``: however recently; a rank suspected dead, whose
        connections closed, is probed at once); returns when it is due again (``inf``: no
        need)."""
        probe = self._probes.get(g)
        if g in self._dead or (probe is not None and not probe.done()):
            return float("inf")
        if (self._members.get(g) or {}).get("actor") is None:
            return float("inf")  # not an actor: only its lease watches it
        answered = self._answered.get(g)
        if answered is not None and now - answered < REPROBE_S and not force:
            return answered + REPROBE_S
        self._probes[g] = asyncio.get_running_loop().create_task(self._probe(g))
        return float("inf")

    async def _probe(self, g: int) -> None:
        member = self._members.get(g) or {}
        actor, actor_id, generation = member.get("actor"), member.get("actor_id"), self._generation
        if actor is None:  # not an actor: only its lease watches it
            return
        self._probes_sent += 1
        try:
            if isinstance(actor, bytes):  # packed by the rank (client.pack_handle): reading it
                # may import the rank's class, so not on the event loop; once per rank
                actor = member["actor"] = await asyncio.get_running_loop().run_in_executor(
                    None, unpack_handle, actor)
            await actor.__ray_ready__.remote()
        except ray.exceptions.ActorUnavailableError:
            pass  # restarting or unreachable for now; its lease tells if its process died
        except ray.exceptions.RayActorError as exc:
            if (self._members.get(g) or {}).get("actor_id") == actor_id:
                self._rank_died(g, generation, death_cause(exc))
            return
        except Exception:  # noqa: BLE001 - a failed probe must never take the coordinator down
            logger.exception("probing rank %d of group %r failed", g, self._group_name)
        self._answered[g] = time.monotonic()

    def _rank_died(self, g: int, generation: int, cause: str) -> None:
        """Record that global rank ``g`` is dead; fail everything (after a short batch window)."""
        if generation != self._generation or g in self._dead or g in self._left:
            return
        self._dead[g] = cause
        logger.warning("raycoll: rank %d of group %r died: %s", g, self._group_name, cause)
        if self._death_report is None:
            self._death_report = asyncio.get_running_loop().call_later(
                DEATH_BATCH_S, self._fail_dead)

    def _fail_dead(self) -> None:
        """Fail every waiting call of the root group and its subgroups; break them all."""
        self._death_report = None
        if not self._dead:
            return
        failed = sorted(self._dead)
        text = self._dead_text()
        for (key, _seq, _step), st in list(self._steps.items()):
            if st.done.is_set():
                continue
            ranks = self._groups.get(key, ())
            waiting_for = [ranks[r] for r in range(st.size) if r not in st.arrivals]
            st.error = err(
                "rank_failed",
                f"{st.op} #{st.seq} on group {key!r} cannot complete: {text} (the collective "
                f"was waiting for ranks {fmt_ranks(waiting_for)})",
                failed_ranks=failed)
            self._broken[key] = st.error
            self._finish(st)
        self.abort(self._group_name, "rank_failed",
                   f"group {self._group_name!r} is broken: {text}; destroy the group and form it "
                   "again", {"failed_ranks": failed})
        for g in failed:  # counts as having left: the survivors can re-form the group by name
            if g not in self._left:
                self.leave(g)
        self._self_destruct_if_orphaned()

