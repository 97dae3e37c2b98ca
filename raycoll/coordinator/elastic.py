"""Elastic membership: a root group's ranks renumbered in place, on the same coordinator.

One RPC, :meth:`ElasticMixin.reconfigure`, serves both directions:

- **shrink** (:func:`raycoll.shrink_group`): the survivors of generation ``g`` arrive, each
  with its old rank and its new one (its place among the survivors); the excluded ranks
  (dead, or alive and left out) do not take part;
- **grow** (:func:`raycoll.grow_group` from the driver, :func:`raycoll.admit_new_ranks` in
  each existing rank): every existing rank arrives with its rank kept, each new actor with
  its place among the newcomers and their number (``joining``): it takes the next free rank
  (the coordinator knows the world size: the driver asks nothing first).

Once every rank of the new membership has arrived, the coordinator moves the group to
generation ``g + 1`` at once: the calls of generation ``g`` still waiting here fail (an
abort), every table of the group's calls (steps, breaks, progress, Join, mailbox, the key-value
store and the groups' stores) starts empty, the dead ranks and the old leases are forgotten,
a new secret for direct connections is drawn, and every participant gets the new roster. Its
members' records (node, address, actor) are the old ones for the ranks that stay: nothing is
asked of Ray. The coordinator actor itself is kept (no new process, no new name).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from raycoll.coordinator.logic import Result, err, fmt_ranks, ok
from raycoll.coordinator.state import CoordinatorState

__all__ = ["ElasticMixin", "DEATH_CHECK_S"]

#: How often a rank waiting for a membership change checks that no member taking part died.
DEATH_CHECK_S = 0.1


@dataclass
class _Reconfiguration:
    """A membership change in progress: who arrived, as which rank, with what."""

    kind: str  # "shrink" or "grow"
    generation: int
    plan: Any  # shrink: the excluded ranks; grow: None
    size: Optional[int]  # the new world size, once someone said it
    # new rank -> (old rank, rank info of a newcomer, its config, what it hands over)
    arrivals: Dict[int, Tuple[Optional[int], Optional[Dict[str, Any]], Any, Any]] = field(
        default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    answer: Optional[Result] = None


class ElasticMixin(CoordinatorState):
    """The membership change RPCs: ``reconfigure``, ``membership``."""

    _reconf: Optional[_Reconfiguration] = None

    async def reconfigure(self, kind: str, generation: Optional[int], old_rank: Optional[int],
                          new_rank: int, new_size: Optional[int], plan: Any,
                          info: Optional[Dict[str, Any]], config: Any,
                          timeout_s: float, hand: Optional[Dict[str, Any]] = None,
                          joining: Optional[Tuple[int, int]] = None) -> Result:
        """Arrive at the change of the group into its next generation (see the module).

        ``kind``: ``"shrink"`` or ``"grow"``; ``generation``: the generation the caller is a
        member of (``None`` for a newcomer); ``old_rank``: its rank there (``None``: a
        newcomer, whose ``info`` is its :func:`~raycoll.coordinator.client.rank_info`);
        ``new_rank``: its rank in the next generation; ``new_size``: the next world size
        (an existing rank growing the group passes ``None``: the newcomers say it);
        ``plan``: what every participant must agree on (the excluded ranks of a shrink);
        ``config``: what the group's ranks use (backend, timeout, options), handed to the
        newcomers; ``hand``: what a member offers to keep of the old generation
        (:mod:`raycoll.elastic_links`: its last sequence number and its whole connections),
        handed to every participant. Waits up to ``timeout_s`` for every rank of the next
        generation; returns ``{"members", "generation", "secret", "config", "hands"}``
        (``hands``: each new rank's ``hand``, by new rank). ``joining``: a newcomer's
        ``(index, count)`` among the actors joining together, in place of ``new_rank`` and
        ``new_size`` (it takes rank ``world size + index``); refused while a member is dead
        (the survivors must shrink first) or if the newcomer is a member already."""
        if kind not in ("shrink", "grow"):
            return err("value", f"reconfigure: kind must be 'shrink' or 'grow', got {kind!r}")
        if generation is not None and generation != self._generation:
            return err("value", f"{kind} of group {self._group_name!r}: this rank is of generation "
                       f"{generation}, the group is at generation {self._generation} (it was "
                       "reconfigured without this rank)")
        if old_rank is not None and old_rank not in self._members:
            return err("value", f"{kind} of group {self._group_name!r}: rank {old_rank} is not a "
                       f"member (members: {fmt_ranks(sorted(self._members))})")
        if joining is not None:
            refused = self._refuse_newcomer(info)
            if refused is not None:
                return refused
            new_rank, new_size = self._world_size + joining[0], self._world_size + joining[1]
        rc = self._reconf
        if rc is not None and not rc.done.is_set() and rc.kind == "grow" and kind == "shrink":
            # a rank died while newcomers were coming: the survivors' shrink goes first
            rc.answer = err("aborted", f"grow of group {self._group_name!r} was superseded by a "
                            f"shrink (excluding ranks {fmt_ranks(list(plan or ()))}): grow the "
                            "shrunk group again")
            rc.done.set()
        if rc is None or rc.done.is_set():
            rc = self._reconf = _Reconfiguration(kind, self._generation, plan, None)
        if (rc.kind, rc.plan) != (kind, plan):
            return err("mismatch", f"group {self._group_name!r}: ranks disagree on the change "
                       f"in progress: {rc.kind} {rc.plan!r} against {kind} {plan!r} (from the "
                       f"rank arriving as {new_rank})")
        if new_size is not None:
            if rc.size is not None and rc.size != new_size:
                return err("mismatch", f"{kind} of group {self._group_name!r}: new world size "
                           f"{new_size} against {rc.size} said before")
            rc.size = new_size
        if kind == "shrink" and (old_rank is None or old_rank in (plan or ())):
            return err("value", f"shrink of group {self._group_name!r}: only the ranks kept "
                       f"take part (rank {old_rank} arrived; excluded: {plan!r})")
        if kind == "grow" and (new_rank < self._world_size) != (old_rank is not None):
            return err("value", f"grow of group {self._group_name!r}: a member keeps its rank "
                       f"and a newcomer takes one from {self._world_size} on (got old rank "
                       f"{old_rank}, new rank {new_rank})")
        if kind == "grow" and old_rank is not None and new_rank != old_rank:
            return err("value", f"grow of group {self._group_name!r}: rank {old_rank} must keep "
                       f"its rank (asked for {new_rank})")
        if new_rank in rc.arrivals or new_rank < 0 or (rc.size is not None and new_rank >= rc.size):
            return err("value", f"{kind} of group {self._group_name!r}: new rank {new_rank} is "
                       f"taken or out of range (new world size {rc.size})")
        rc.arrivals[new_rank] = (old_rank, info, config, hand)
        self._maybe_reconfigure(rc)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not rc.done.is_set():
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(rc.done.wait(), max(0.0, min(left, DEATH_CHECK_S)))
            except asyncio.TimeoutError:
                if rc.done.is_set():
                    break
                died = sorted(set(self._dead) - set(rc.plan or ()))
                if died:  # a member that takes part is gone: this change cannot complete
                    rc.answer = err("rank_failed", f"{rc.kind} of group {self._group_name!r} "
                                    f"cannot complete: ranks {fmt_ranks(died)} died meanwhile",
                                    failed_ranks=died)
                    rc.done.set()
                elif left <= DEATH_CHECK_S:
                    self._reconf_timed_out(rc, timeout_s)
        assert rc.answer is not None
        return rc.answer

    def membership(self) -> Result:
        """The group as it is now: ``{"generation", "world_size", "actor_ids", "dead"}``
        (actor ids by rank, ``None`` for a rank that is no actor; the ranks found dead)."""
        return ok({"generation": self._generation, "world_size": self._world_size,
                   "actor_ids": [(self._members.get(r) or {}).get("actor_id")
                                 for r in range(self._world_size)],
                   "dead": sorted(self._dead)})

    # ------------------------------------------------------------------ internals
    def _refuse_newcomer(self, info: Optional[Dict[str, Any]]) -> Optional[Result]:
        """Why a newcomer (rank info ``info``) cannot join now, or ``None``."""
        if self._dead:
            return err("aborted", f"grow of group {self._group_name!r}: ranks "
                       f"{fmt_ranks(sorted(self._dead))} of the group died; its survivors must "
                       "shrink_group first, then grow it")
        actor_id = (info or {}).get("actor_id")
        members = [r for r, m in self._members.items() if actor_id and m.get("actor_id") == actor_id]
        if members:
            return err("value", f"grow of group {self._group_name!r}: a new actor is already "
                       f"rank {members[0]} of the group (new_actors must not be members)")
        return None

    def _maybe_reconfigure(self, rc: _Reconfiguration) -> None:
        if rc.size is None or len(rc.arrivals) < rc.size:
            return
        if rc.kind == "grow":
            kept = {old for old, _info, _config, _hand in rc.arrivals.values() if old is not None}
            if kept != set(range(self._world_size)):
                return  # an existing rank still to come: its rank is among the arrivals
        self._apply(rc)

    def _apply(self, rc: _Reconfiguration) -> None:
        """Move the group to its next generation (every rank of it has arrived)."""
        assert rc.size is not None
        old_generation, name = self._generation, self._group_name
        self.abort(name, "aborted", f"group {name!r} moved to generation {old_generation + 1} "
                   f"({rc.kind}): calls of generation {old_generation} cannot complete", {})
        members: Dict[int, Dict[str, Any]] = {}
        config: Any = None
        for new_rank, (old_rank, info, given, _hand) in sorted(rc.arrivals.items()):
            record = info if old_rank is None else self._members[old_rank]
            members[new_rank] = dict(record or {})
            if config is None and old_rank is not None:
                config = given
        self._liveness_reset(old_generation)  # old leases released, the dead forgotten
        for task in list(self._probes.values()):
            task.cancel()
        self._probes.clear()
        self._reset_calls()
        self._members = members
        self._world_size = rc.size
        self._generation = old_generation + 1
        self._secret = secrets.token_bytes(16)
        self._roster = [dict(members[r], rank=r) for r in range(rc.size)]
        self._left = set()
        hands = {r: hand for r, (_old, _info, _given, hand) in rc.arrivals.items() if hand}
        rc.answer = ok({"members": self._roster, "generation": self._generation,
                        "secret": self._secret, "config": config, "hands": hands})
        rc.done.set()

    def _reset_calls(self) -> None:
        """Every table of the group's calls, emptied as a new group's."""
        for table in (self._steps, self._check_fps, self._groups, self._broken, self._last,
                      self._floor, self._current, self._mail, self._waiting, self._joins,
                      self._join_done, self._join_answers, self._kv, self._transports,
                      self._report_period, self._details):
            table.clear()
        self._kv_events.clear()
        self._store_reset()

    def _reconf_timed_out(self, rc: _Reconfiguration, timeout_s: float) -> None:
        known = set(rc.arrivals)
        expected = set(range(rc.size)) if rc.size is not None else set(range(self._world_size))
        missing = sorted(expected - known)
        rc.answer = err("timeout", f"{rc.kind} of group {self._group_name!r} (generation "
                        f"{rc.generation}) timed out after {timeout_s:g}s: new ranks "
                        f"{fmt_ranks(missing)} never arrived"
                        + ("" if rc.size is not None else " (no newcomer said the new size)"),
                        missing=missing)
        rc.done.set()
