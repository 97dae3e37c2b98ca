"""The coordinator's work per operation, counted at 256 and 1,024 simulated ranks, without Ray."""

from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Awaitable, Callable, Dict, List, Optional

import numpy as np
import pytest

import raycoll
from raycoll.coordinator import logic
from raycoll.coordinator.actor import Coordinator
from raycoll.reduce_op import ReduceOp

pytestmark = pytest.mark.timeout(60)

SMALL, LARGE = 256, 1024
#: At most this much more work for four times the ranks (4 is linear; a loop over every rank
#: at each rank's arrival gives 16).
LINEAR = 4.5
_PACKAGE = str(Path(raycoll.__file__).resolve().parent)


class _Work:
    """Work counted, not timed: while an operation lasts (from the first rank's call to the
    last rank's answer), every function called, Python or C (``sys.setprofile``), and every
    line of raycoll run (``sys.settrace``: a loop over the ranks that calls nothing counts).
    Each rank is a coroutine calling the actor's class, as in test_coordinator_logic.py."""

    def __init__(self) -> None:
        self.count = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.count += 1

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        return self._line if frame.f_code.co_filename.startswith(_PACKAGE) else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            self.count += 1
        return self._line

    async def measure(self, operation: Awaitable[Any]) -> Any:
        before = sys.getprofile(), sys.gettrace()  # a coverage tracer, say: put back after
        sys.setprofile(self._profile)
        sys.settrace(self._trace)
        try:
            return await operation
        finally:
            sys.settrace(before[1])
            sys.setprofile(before[0])


async def _scenario(size: int) -> Dict[str, int]:
    """Every operation with ``size`` ranks, each checked; the work each took."""
    c = Coordinator("g", size)
    ranks = tuple(range(size))
    every = range(size)
    work: Dict[str, int] = {}

    async def counted(name: str, operation: Awaitable[Any]) -> Any:
        counter = _Work()
        result = await counter.measure(operation)
        work[name] = counter.count
        return result

    def gather(calls: Any) -> "asyncio.Future[List[Any]]":
        return asyncio.gather(*calls)

    def exchange(r: int, seq: int, fp: Dict[str, Any], payload: Any, mode: str) -> Any:
        return c.exchange("g", ranks, seq, 0, r, fp, None, None, payload, mode, None, 30.0)

    info = [{"node_id": f"node{r // 8}", "actor_id": None, "actor": None} for r in every]
    formed = await counted("rendezvous", gather(c.rendezvous(r, size, info[r], 30.0)
                                                for r in every))
    assert all(f[0] == "ok" and len(f[1]["members"]) == size for f in formed)
    assert formed[-1][1]["members"][size - 1] == dict(info[size - 1], rank=size - 1)

    barrier = await counted("barrier", gather(exchange(r, 1, {"op": "barrier"}, None, "route")
                                              for r in every))
    assert barrier == [("ok", [None] * size)] * size

    fp = {"op": "all_reduce", "reduce_op": ReduceOp.SUM.key, "shape": (2,), "dtype": "float64"}
    summed = await counted("all_reduce", gather(exchange(r, 2, fp, np.full(2, float(r)), "reduce")
                                                for r in every))
    assert all(s[0] == "ok" and list(s[1]) == [size * (size - 1) / 2] * 2 for s in summed)

    async def join() -> List[Any]:  # a quarter of the ranks join in round 3, the rest in 4
        early = [3 if r % 4 == 0 else None for r in every]
        await gather(c.join_round("g", ranks, 3, r, early[r], False, 30.0) for r in every)
        return await gather(c.join_round("g", ranks, 4, r, early[r] or 4, False, 30.0)
                            for r in every)

    last = await counted("join_round", join())
    assert all(a[1]["all_joined"] and a[1]["is_last_joiner"] == (r % 4 != 0)
               for r, a in enumerate(last))

    # what a rank on a round transport sends: every rank completed all_reduce #5 (one entry)
    progress = {logic.EVERY_RANK: ("all_reduce", 5)}

    async def reports() -> List[Any]:
        return [c.transport_progress("g", ranks, dict(progress), "lane", 0.8) for _r in every]

    async def checks() -> List[Any]:
        return [c.transport_check("g", ranks, 6, r, {"op": "all_reduce"}, dict(progress),
                                  (), 0.0, "lane") for r in every]

    assert await counted("transport_progress", reports()) == [("ok", None)] * size
    assert await counted("transport_check", checks()) == [("ok", None)] * size
    assert all(c._completed("g", r) == ("all_reduce", 5) for r in (0, size - 1))

    async def status() -> Any:
        return c.status()

    group = (await counted("status", status()))[1]["groups"]["g"]
    assert group[size - 1]["last_completed"] == ("all_reduce", 5) and group["transport"] == "lane"
    assert group["join"]["last"]["join_order"][:3] == [0, 4, 8]  # round 3's joiners first

    dead = size - 1  # the others wait for it in a barrier; it dies
    waiting = [asyncio.ensure_future(exchange(r, 7, {"op": "barrier"}, None, "route"))
               for r in range(dead)]
    await asyncio.sleep(0)

    async def failure() -> Any:
        c._rank_died(dead, 0, "killed")
        failed = await gather(waiting)
        later = await gather(exchange(r, 8, {"op": "barrier"}, None, "route") for r in range(dead))
        return failed, later, [c.leave(r) for r in range(dead)]

    failed, later, left = await counted("rank_failure", failure())
    assert all(f[:2] == ("err", "rank_failed") and f[3] == {"failed_ranks": [dead]}
               for f in failed + later)
    assert left[-1] == ("ok", {"all_left": True}) and not any(x[1]["all_left"] for x in left[:-1])
    return work


@functools.lru_cache(maxsize=None)
def _work(size: int) -> Dict[str, int]:
    return asyncio.run(asyncio.wait_for(_scenario(size), 30))


@pytest.mark.parametrize("operation", [
    "rendezvous", "barrier", "all_reduce", "join_round",
    "transport_progress", "transport_check", "status", "rank_failure"])
def test_the_work_of_an_operation_grows_linearly_with_the_ranks(operation: str) -> None:
    small, large = _work(SMALL)[operation], _work(LARGE)[operation]
    assert large <= LINEAR * small, (
        f"{operation}: {small} at {SMALL} ranks, {large} at {LARGE} ({large / small:.1f}x)")
