"""Round-transport bookkeeping: what the coordinator hears from groups whose collectives
skip it.

The collectives of a group with a round transport (:mod:`raycoll.transport`: the
shared-memory lane on one node, direct connections across nodes) skip the coordinator: the
ranks exchange their messages among themselves. The coordinator only hears from such a rank
when its wait lasts (``transport_check``, a few times a second at most) or times out
(``transport_timeout``), and now and then from its progress reports
(``transport_progress``); each of those calls carries what the rank knows of its peers'
progress, so timeouts and group_status still name every rank's last completed collective.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from raycoll.coordinator.liveness import PROBE_AFTER_S
from raycoll.coordinator.logic import (EVERY_RANK, Result, err, fingerprint_mismatch,
                                      fmt_ranks, ok)
from raycoll.coordinator.state import CoordinatorState


#: The calls whose waiting ranks' fingerprints the coordinator keeps (the newest).
_WAITS_KEPT = 1024

#: How a mismatch names a round transport.
_TRANSPORT_NAMES = {"lane": "the shared-memory lane", "tcp": "direct connections"}


class TransportMixin(CoordinatorState):
    """The round transports' RPCs: ``transport_check``, ``transport_timeout``,
    ``transport_progress``."""

    def transport_check(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int,
                        fp: Dict[str, Any], progress: Dict[int, Tuple[str, int]],
                        waiting: Sequence[int] = (), waited_s: float = 0.0,
                        transport: str = "lane") -> Result:
        """A rank has waited ``waited_s`` in collective ``seq`` on its round transport for
        group ranks ``waiting``: is anything wrong? (Past ``PROBE_AFTER_S`` those ranks are
        probed, as for waits here; ``waited_s`` infinite: they are suspected dead, probed at
        once.)

        Returns the error that ends its wait, if any: the group is broken or a rank died, a
        rank rejected its arguments for ``seq``, or ranks came to ``seq`` through the
        coordinator (they called a different collective, one not for the transport): then
        that step fails with the mismatch, for them too. Otherwise ``("ok", None)``.
        """
        self._groups[key] = tuple(ranks)
        self._note_progress(key, rank, seq, fp.get("op", "?"), progress, transport)
        if waited_s >= PROBE_AFTER_S:
            now = time.monotonic()
            for r in waiting:
                self._probe_if_due(ranks[r], now, force=waited_s == math.inf)
        failed = self._unusable(key)
        if failed is not None:
            return failed
        crossed = self._waits_cross(key, ranks, seq, rank, fp)
        if crossed is not None:
            return crossed
        self._check_fps[(key, seq)].setdefault("waits", {})[rank] = tuple(waiting)
        st = self._steps.get((key, seq, 0))
        if st is None or st.error is None and (st.done.is_set() or not st.arrivals):
            return ok()  # nothing there, or the lane's own set-up step
        if not st.done.is_set():
            fps = {r: a.fp for r, a in st.arrivals.items()}
            fps[rank] = fp
            why = fingerprint_mismatch(fps, ranks) or (
                f"ranks {fmt_ranks(sorted(ranks[r] for r in st.arrivals))} came to it "
                f"through the coordinator, rank {ranks[rank]} through "
                f"{_TRANSPORT_NAMES.get(transport, transport)}")
            st.error = err("mismatch", f"{st.op} #{seq} on group {key!r}: {why}")
            self._finish(st)
        return self._collect(key, 0, st, rank)

    def _waits_cross(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int,
                     fp: Dict[str, Any]) -> Optional[Result]:
        """Ranks that wait in collective ``seq`` with different fingerprints (a different
        collective, shape, dtype, op or root) may each wait on a peer that never sends them
        anything (an all_reduce's ring beside a broadcast's tree): their checks meet here,
        and the call fails with the mismatch on every rank that waits in it."""
        waits = self._check_fps
        entry = waits.get((key, seq))
        if entry is None:
            if len(waits) >= _WAITS_KEPT:  # the oldest first: dicts keep insertion order
                del waits[next(iter(waits))]
            entry = waits[(key, seq)] = {"rank": rank, "fp": fp, "error": None}
        elif entry["error"] is None and fp != entry["fp"]:  # one comparison a check: O(1)
            why = fingerprint_mismatch({entry["rank"]: entry["fp"], rank: fp}, ranks)
            entry["error"] = err("mismatch", f"{fp.get('op', '?')} #{seq} on group {key!r}: "
                                             f"{why}")
        return entry["error"]

    def transport_timeout(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int, op: str,
                          missing: List[int], progress: Dict[int, Tuple[str, int]],
                          timeout_s: float, transport: str = "lane") -> Result:
        """Collective ``seq`` on a round transport timed out on ``rank`` waiting for group
        ranks ``missing``: the error naming them and their last completed collective; the
        group is broken (as for a timeout through the coordinator)."""
        self._groups[key] = tuple(ranks)
        self._note_progress(key, rank, seq, op, progress, transport)
        if key in self._broken:
            return self._broken[key]
        error = self._timeout_error(key, op, seq, self._behind(key, seq, rank, missing), timeout_s)
        self._broken[key] = error
        return error

    def _behind(self, key: str, seq: int, rank: int, missing: Sequence[int]) -> List[int]:
        """The group ranks behind rank ``rank``'s wait in collective ``seq`` for group ranks
        ``missing``: a missing rank that itself waits in ``seq`` (its last check said on
        whom) stands for the ranks it waits on, and so on, to the ranks that wait on none
        (they never came: a stalled rank) or only on ranks already passed (``rank`` among
        them: two ranks waiting on each other's bytes across a crawling link). So a rank of
        a node segment waiting at a segment step on a node-mate that waits in the sockets'
        step for another node names that node's ranks, not its node-mate."""
        entry = self._check_fps.get((key, seq))
        waits: Dict[int, Tuple[int, ...]] = entry.get("waits", {}) if entry else {}
        behind: List[int] = []
        seen = {rank}
        todo = list(missing)
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            onward = [w for w in waits.get(r, ()) if w not in seen]
            if onward:
                todo.extend(onward)
            else:
                behind.append(r)
        return sorted(behind) or list(missing)

    def transport_progress(self, key: str, ranks: Tuple[int, ...],
                           progress: Dict[int, Tuple[str, int]],
                           transport: str = "lane", period_s: float = 0.0,
                           detail: Optional[Dict[str, Any]] = None) -> Result:
        """What a rank knows of its collectives on round transport ``transport`` (``"lane"``
        or ``"tcp"``): ``progress[r]`` is the last collective group rank ``r`` completed (for
        group_status; sent every ``period_s`` at most, and before group_status is asked from
        inside a rank). The ranks of a node share one period's worth of reports, so the
        coordinator takes O(1) of these a second per group and node, however many ranks.
        ``detail``: the reporting rank's own view (``{"rank": group rank, "algorithms":
        {collective: algorithm}, "counters": ProcessGroup.counters()}``), kept for
        group_status, the last one a rank."""
        self._groups[key] = tuple(ranks)
        self._note_progress(key, None, 0, "", progress, transport)
        self._report_period[key] = max(self._report_period.get(key, 0.0), float(period_s))
        if detail is not None and 0 <= detail.get("rank", -1) < len(ranks):
            self._details.setdefault(key, {})[ranks[detail["rank"]]] = detail
        return ok()

    def _note_progress(self, key: str, rank: Optional[int], seq: int, op: str,
                       progress: Dict[int, Tuple[str, int]], transport: str) -> None:
        self._transports[key] = transport
        if rank is not None:
            self._current[key][rank] = (op, seq)
        floor = progress.get(EVERY_RANK)
        if floor is not None:  # every rank completed this: one entry, not W
            if key not in self._floor or self._floor[key][1] < floor[1]:
                self._floor[key] = (floor[0], floor[1])
            return
        last = self._last[key]
        for r, done in progress.items():
            if last.get(r) is None or last[r][1] < done[1]:
                last[r] = (done[0], done[1])
