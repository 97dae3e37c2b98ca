"""Join state: the coordinator's side of raycoll.Join (uneven inputs).

raycoll.Join runs one "join round" per iteration on its group: ranks still processing
inputs arrive from Join.notify_join_context with join_seq=None; ranks that have joined
arrive from Join.__exit__ with the sequence number of the round in which they joined.
A join round is an ordinary exchange step (op "join"), so fingerprints, timeouts that
name the missing ranks, aborts and group_status work as for any collective. Each rank's
answer is computed from what every rank sent in that very round; the state kept here
(who has joined, in what order) only feeds group_status and can never make ranks disagree.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from raycoll.coordinator.logic import (JOIN_OUT_OF_STEP, Result, err, join_outcome,
                                       join_summary, ok)
from raycoll.coordinator.state import CoordinatorState


class JoinMixin(CoordinatorState):
    """Join's RPCs: ``join_round`` (and packed), ``join_report``, ``join_end``."""

    async def join_round(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int,
                         join_seq: Optional[int], throw_on_early_termination: bool,
                         timeout_s: float) -> Result:
        """One iteration of a Join context on group ``key``, arriving as group rank ``rank``.

        Returns ``{"nonjoined": [...], "join_order": [...], "all_joined": bool,
        "is_last_joiner": bool}`` (global ranks; ``join_order`` sorted by the round each
        joined in, then by rank). When no rank is left with inputs, the joined ranks run their
        post-hooks; otherwise they run one shadow round (their main hooks), or, with
        ``throw_on_early_termination``, every rank raises.
        """
        joined = self._joins[key]
        if join_seq is None:
            joined.pop(rank, None)
        else:
            joined[rank] = join_seq
        fp = {"op": "join", "throw_on_early_termination": bool(throw_on_early_termination)}
        result = await self.exchange(key, ranks, seq, 0, rank, fp, None, None, join_seq,
                                     "gather", None, timeout_s)
        if result[0] != "ok":
            if result[1] == "mismatch":  # the ranks are out of step: nothing can go on
                message = f"{result[2]} {JOIN_OUT_OF_STEP}"
                self.abort(key, "mismatch", message)
                return self._broken.get(key, err("mismatch", message))
            return result
        seqs = result[1]  # one list, the same for every rank of this round: answer it once
        shared = self._join_answers.get(key)
        if shared is None or shared[0] is not seqs:
            outcome, order, ended = join_outcome(ranks, seqs, None, throw_on_early_termination)
            if ended:
                self._end_join(key, ranks, seq, order, terminated=not outcome["all_joined"])
            shared = self._join_answers[key] = (seqs, outcome, order[-1][0] if order else None)
        _seqs, outcome, last_seq = shared
        return ok(dict(outcome, is_last_joiner=outcome["all_joined"] and join_seq is not None
                       and join_seq == last_seq))

    def join_report(self, key: str, ranks: Tuple[int, ...], rank: int, join_seq: int) -> Result:
        """Group rank ``rank`` joined in round ``join_seq`` of a Join whose rounds run on the
        shared-memory lane (for group_status; the ranks compute each round's answer)."""
        self._groups[key] = tuple(ranks)
        self._joins[key][rank] = join_seq
        return ok()

    def join_end(self, key: str, ranks: Tuple[int, ...], seq: int,
                 order: List[Tuple[int, int]], terminated: bool) -> Result:
        """The lane Join whose final round is ``seq`` is over (see :meth:`join_report`)."""
        self._groups[key] = tuple(ranks)
        self._end_join(key, tuple(ranks), seq, [(o[0], o[1]) for o in order], terminated)
        return ok()

    async def join_round_packed(self, request: Tuple[Any, ...]) -> Result:
        """:meth:`join_round` with its arguments in one tuple (cheaper to serialize: this is
        called once per iteration by every rank inside a Join)."""
        return await self.join_round(*request)

    def _end_join(self, key: str, ranks: Tuple[int, ...], seq: int,
                  order: List[Tuple[int, int]], terminated: bool) -> None:
        """The Join context whose final round is ``seq`` is over: keep its summary."""
        self._join_done[key] = join_summary(ranks, seq, order, terminated)
        joined = self._joins[key]
        for r in [r for r, s in joined.items() if s <= seq]:  # never a later context's entry
            del joined[r]

    def _join_status(self, key: str, out: Dict[Any, Any]) -> None:
        """Add the Join state of group ``key`` to its entry of ``status``."""
        ranks = self._groups.get(key, ())
        joined = self._joins.get(key, {})
        for r, g in enumerate(ranks):
            if isinstance(out.get(g), dict):
                out[g]["joined"] = r in joined
        out["join"] = {
            "joined": [ranks[r] for _s, r in sorted((s, r) for r, s in joined.items())],
            "last": self._join_done.get(key),
        }
