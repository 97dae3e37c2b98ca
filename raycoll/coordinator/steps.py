"""Step matching: every collective's arrivals at the coordinator, matched and answered.

A step is one exchange of one collective through the coordinator on one group, keyed
``(group, seq, step)`` (a collective takes one step or a few; the rounds of a round
transport, :mod:`raycoll.transport`, never come here). Each rank arrives with its
fingerprint (op, shapes, dtypes, reduce op, root: compared across ranks), the metadata of
what it sends and expects, and its payload; the last to arrive completes the step (a
mismatch fails it on every rank), routes or reduces the payloads, and wakes the others. A
rank that rejects its own arguments, an abort or a timeout fails the step for all.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional, Sequence, Tuple

from raycoll.coordinator.logic import (Result, err, fingerprint_mismatch, meta_mismatch, ok,
                                       route, subgroup_keys, timeout_error)
from raycoll.coordinator.state import Arrival, CoordinatorState, Step
from raycoll.reduce_op import ReduceOp, reduce_arrays


class StepsMixin(CoordinatorState):
    """The collectives' RPCs: ``exchange``, ``reject``, ``abort``, ``pending``."""

    async def exchange(
        self,
        key: str,
        ranks: Tuple[int, ...],
        seq: int,
        step: int,
        rank: int,
        fp: Dict[str, Any],
        send_meta: Optional[List[Any]],
        recv_meta: Optional[List[Any]],
        payload: Any,
        mode: str,
        root: Optional[int],
        timeout_s: float,
    ) -> Result:
        """Arrive at step ``step`` of collective ``seq`` on group ``key``; wait for the others.

        ``mode="route"``: ``payload`` is a per-destination list; each rank gets the list of what
        every source sent it. ``mode="reduce"``: ``payload`` is an array; the coordinator reduces
        all of them with ``fp["reduce_op"]`` and returns the result to every rank (or only to
        ``root``, a group rank). ``mode="gather"``: ``payload`` is one value; every rank gets
        the same list of them, by group rank (the coordinator's own Join rounds).
        """
        failed = self._unusable(key)
        if failed is not None:
            return failed
        self._groups[key] = tuple(ranks)
        size = len(ranks)
        st = self._step(key, seq, step, fp.get("op", "?"), size)
        if rank in st.arrivals:
            return err("protocol", f"group rank {rank} arrived twice at {st.op} #{seq}")
        self._current[key][rank] = (st.op, seq)
        if not st.done.is_set():
            st.arrivals[rank] = Arrival(fp, send_meta, recv_meta, payload)
            if len(st.arrivals) == size:
                self._complete(key, st, mode, root)
        if not st.done.is_set():
            try:
                with self._watching(ranks):
                    await asyncio.wait_for(st.done.wait(), timeout_s)
            except asyncio.TimeoutError:
                if not st.done.is_set():
                    self._time_out(key, st, timeout_s)
        return self._collect(key, step, st, rank)

    async def exchange_packed(self, request: Tuple[Any, ...]) -> Result:
        """:meth:`exchange` with its arguments in one tuple: the collectives' hot path.

        Ray serializes each argument of an actor call on its own; one tuple instead of twelve
        arguments saves a few hundred microseconds per call on both sides (object references
        nested in the tuple are tracked as with separate arguments).
        """
        return await self.exchange(*request)

    def reject(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int, op: str, message: str,
               kind: str = "peer_arg") -> Result:
        """``rank`` rejected its own arguments for collective ``seq`` (``kind="peer_arg"``), or
        found that the ranks' calls do not match (``"mismatch"``: ``message`` says how): fail
        it on every rank (the group goes on)."""
        self._groups[key] = tuple(ranks)
        st = self._step(key, seq, 0, op, len(ranks))
        if not st.done.is_set():
            st.error = (err("mismatch", message, source=ranks[rank]) if kind == "mismatch"
                        else err("peer_arg", f"{op} #{seq} on group {key!r} cannot run: rank "
                                 f"{ranks[rank]} rejected its arguments: {message}",
                                 source=ranks[rank]))
            self._finish(st)
        st.collected.add(rank)
        self._maybe_drop(key, 0, st)
        return ok()

    def abort(self, key: str, kind: str, message: str, extra: Optional[Dict[str, Any]] = None,
              generation: Optional[int] = None) -> Result:
        """Break group ``key`` (and the groups under it): every waiting and later call fails.
        ``generation``: the membership the breaking rank was in; an abort of an earlier one
        (a rank's failing call that reported after the group shrank or grew under the same
        name, :mod:`raycoll.elastic`) breaks nothing."""
        if generation is not None and generation != self._generation:
            return ok()
        error = err(kind, message, **(extra or {}))
        keys = subgroup_keys(key, self._groups)
        for k in keys:
            self._broken.setdefault(k, error)
        for (k, _seq, _step), st in list(self._steps.items()):
            if k in keys and not st.done.is_set():
                st.error = self._broken[k]
                self._finish(st)
        for (k, _dst), items in list(self._mail.items()):
            if k in keys:
                for msg in items:
                    if not msg.future.done():
                        msg.future.set_result(self._broken[k])
                items.clear()
        for (k, _dst), receivers in list(self._waiting.items()):
            if k in keys:
                for rcv in receivers:
                    if not rcv.future.done():
                        rcv.future.set_result(self._broken[k])
                receivers.clear()
        return ok()

    def pending(self, key: str, seq: int) -> Result:
        """Which global ranks have not yet arrived at collective ``seq`` of group ``key``."""
        ranks = self._groups.get(key, ())
        arrived = set()
        for (k, s, _step), st in self._steps.items():
            if k == key and s == seq:
                arrived |= set(st.arrivals)
        missing = [ranks[r] for r in range(len(ranks)) if r not in arrived]
        return ok({"missing": missing, "last": self._last_of(key, missing)})

    # ------------------------------------------------------------------ internals
    def _step(self, key: str, seq: int, step: int, op: str, size: int) -> Step:
        sk = (key, seq, step)
        st = self._steps.get(sk)
        if st is None:
            st = self._steps[sk] = Step(op, seq, size)
        return st

    def _complete(self, key: str, st: Step, mode: str, root: Optional[int]) -> None:
        ranks = self._groups[key]
        arrivals = st.arrivals
        mismatch = (fingerprint_mismatch({r: a.fp for r, a in arrivals.items()}, ranks)
                    or meta_mismatch({r: a.send_meta for r, a in arrivals.items()},
                                     {r: a.recv_meta for r, a in arrivals.items()}, ranks))
        if mismatch:
            st.error = err("mismatch", f"{st.op} #{st.seq} on group {key!r}: {mismatch}")
        elif mode == "reduce":
            arrays = [arrivals[r].payload for r in range(st.size)]
            try:
                out = reduce_arrays(ReduceOp(*arrivals[0].fp["reduce_op"]), arrays)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                st.error = err("value", f"{st.op} #{st.seq} on group {key!r}: {exc}")
            else:
                st.results = {r: out if root is None or r == root else None for r in range(st.size)}
        elif mode == "gather":
            st.results = dict.fromkeys(range(st.size),
                                       [arrivals[s].payload for s in range(st.size)])
        else:
            st.results = route([arrivals[s].payload for s in range(st.size)])
        for arrival in arrivals.values():
            arrival.payload = None
        if st.error is None:
            for r in range(st.size):
                self._last[key][r] = (st.op, st.seq)
        self._finish(st)

    def _finish(self, st: Step) -> None:
        for arrival in st.arrivals.values():  # release payload refs now, even on failure
            arrival.payload = None
        st.done.set()

    def _time_out(self, key: str, st: Step, timeout_s: float) -> None:
        missing_local = [r for r in range(st.size) if r not in st.arrivals]
        st.error = self._timeout_error(key, st.op, st.seq, missing_local, timeout_s)
        if st.op != "monitored_barrier":  # a diagnostic: it reports, the group stays usable
            self._broken[key] = st.error
        self._finish(st)

    def _timeout_error(self, key: str, op: str, seq: int, missing_local: Sequence[int],
                       timeout_s: float) -> Result:
        """The error of collective ``seq`` timing out with group ranks ``missing_local``
        absent: names them and the last collective each completed."""
        ranks = self._groups[key]
        missing = [ranks[r] for r in missing_local]
        return timeout_error(key, op, seq, missing, self._last_of(key, missing), timeout_s)

    def _last_of(self, key: str, global_ranks: Sequence[int]) -> Dict[int, Optional[Tuple[str, int]]]:
        ranks = self._groups.get(key, ())
        return {g: self._completed(key, ranks.index(g)) if g in ranks else None
                for g in global_ranks}

    def _completed(self, key: str, r: int) -> Optional[Tuple[str, int]]:
        """The last collective group rank ``r`` of group ``key`` completed, as far as the
        coordinator knows (its own steps, and the round transports' reports)."""
        last, floor = self._last[key].get(r), self._floor.get(key)
        if last is None or (floor is not None and floor[1] > last[1]):
            return floor
        return last

    def _collect(self, key: str, step: int, st: Step, rank: int) -> Result:
        st.collected.add(rank)
        if st.error is not None:
            result = st.error
        else:
            result = ok((st.results or {}).pop(rank, None))
        self._maybe_drop(key, step, st)
        return result

    def _maybe_drop(self, key: str, step: int, st: Step) -> None:
        if st.done.is_set() and len(st.collected) >= st.size:
            self._steps.pop((key, st.seq, step), None)
