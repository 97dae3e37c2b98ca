"""Fault injection on real actors: dead ranks, stalled ranks, a dead coordinator, recovery.

Each test asserts the error type, that it names the right rank, and how long it took: a
dead rank must fail its peers within seconds, far below the collective timeout.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
import ray

import raycoll
from raycoll.native import core
from raycoll.coordinator.spare import find as find_coordinator
from raycoll.launch import RankWorker

from helpers import store_used

#: How fast a dead rank must fail its peers (the collective timeout is far above it).
DETECT_S = 5.0
#: The collective timeout of groups whose ranks are expected to fail for another reason.
LONG_TIMEOUT_S = 120.0

Worker = ray.remote(num_cpus=0)(RankWorker)
ThreadedWorker = ray.remote(num_cpus=0, max_concurrency=4)(RankWorker)


# ---------------------------------------------------------------------- rank-side functions
def _outcome(exc: BaseException, start: float) -> Dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "msg": str(exc),
            "failed_ranks": list(getattr(exc, "failed_ranks", ())),
            "missing": list(getattr(exc, "missing", ())), "t": time.time(),
            "elapsed": time.time() - start, "is": [c.__name__ for c in type(exc).__mro__]}


def _all_reduce(rank: int, group: str, n: int) -> Dict[str, Any]:
    x = np.full(n, rank + 1.0)
    start = time.time()
    try:
        raycoll.all_reduce(x, group=group)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _outcome(exc, start)
    return {"ok": True, "value": float(x[0]), "all_equal": bool((x == x[0]).all()), "t": time.time()}


def _all_reduce_twice(rank: int, group: str, n: int) -> List[Dict[str, Any]]:
    return [_all_reduce(rank, group, n), _all_reduce(rank, group, n)]


def _recv_from(rank: int, group: str, src: int) -> Dict[str, Any]:
    x = np.zeros(4)
    start = time.time()
    try:
        raycoll.recv(x, src=src, group=group)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _outcome(exc, start)
    return {"ok": True, "t": time.time()}


def _sleep(rank: int, seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def _async_all_reduce_wait(rank: int, group: str, timeout: float) -> Dict[str, Any]:
    x = np.ones(8)
    work = raycoll.all_reduce(x, group=group, async_op=True)
    start = time.time()
    try:
        work.wait(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = _outcome(exc, start)
    else:
        return {"ok": True}
    try:  # the group is broken now: the next call fails at once
        raycoll.barrier(group=group)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["after"] = type(exc).__name__
    return out


def _monitored(rank: int, group: str, timeout: float, wait_all: bool, delay: float) -> Dict[str, Any]:
    time.sleep(delay)
    start = time.time()
    out: Dict[str, Any] = {"ok": True}
    try:
        raycoll.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = _outcome(exc, start)
    x = np.full(3, float(rank))  # the group must still work, on every rank
    raycoll.all_reduce(x, group=group)
    out["after"] = float(x[0])
    return out


# ---------------------------------------------------------------------- driver-side helpers
class _Actors:
    """Survivors reused across tests, and pre-started spares for ranks that get killed."""

    def __init__(self) -> None:
        self.pool = [Worker.remote() for _ in range(4)]
        self._spares = [Worker.remote() for _ in range(6)]
        self._threaded = [ThreadedWorker.remote()]
        ray.get([a.__ray_ready__.remote() for a in self.pool + self._spares + self._threaded],
                timeout=120)

    def spare(self, threaded: bool = False) -> Any:
        """A started actor that the test may kill (a new one if the spares ran out)."""
        stock = self._threaded if threaded else self._spares
        actor = stock.pop() if stock else (ThreadedWorker if threaded else Worker).remote()
        ray.get(actor.__ray_ready__.remote(), timeout=60)
        return actor

    def close(self) -> None:
        for actor in self.pool + self._spares + self._threaded:
            ray.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def actors(ray_local) -> Iterator[_Actors]:
    pool = _Actors()
    yield pool
    pool.close()


@pytest.fixture
def form(actors: _Actors) -> Iterator[Callable[..., Tuple[List[Any], str]]]:
    """``form(team, timeout=...)``: a fresh group among ``team`` (actor handles), destroyed
    after the test; actors not in the module's pool are killed then too."""
    made: List[Tuple[List[Any], str]] = []

    def make(team: List[Any], timeout: float = LONG_TIMEOUT_S,
             options: Optional[Dict[str, Any]] = None) -> Tuple[List[Any], str]:
        name = f"faults-{uuid.uuid4().hex[:6]}"
        raycoll.create_group(team, group_name=name, timeout=timeout, options=options)
        made.append((team, name))
        return team, name

    yield make
    for team, name in made:
        try:
            raycoll.destroy_group(name)
        except ValueError:
            pass  # destroyed by the test
        for actor in team:
            if actor not in actors.pool:
                ray.kill(actor, no_restart=True)


def _run(actor: Any, fn: Callable[..., Any], rank: int, *args: Any) -> Any:
    return actor.run.remote(fn, rank, args, {})


def _wait_arrived(name: str, ranks: List[int], op: str, seq: int, timeout: float = 30.0) -> None:
    """Wait until the coordinator saw ``ranks`` arrive at collective ``seq`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = raycoll.group_status(name)["ranks"]
        if all(status[r]["waiting"] and status[r]["last_collective"] == (op, seq) for r in ranks):
            return
        time.sleep(0.05)
    raise AssertionError(f"ranks {ranks} did not reach {op} #{seq} within {timeout}s: "
                         f"{raycoll.group_status(name)}")


def _coordinator(name: str) -> Any:
    return find_coordinator(ray.get_runtime_context().get_job_id(), name)


def _wait_probed(name: str, at_least: int = 1, timeout: float = 30.0) -> None:
    """Wait until the group's coordinator has sent ``at_least`` liveness probes (a rank's
    wait lasted past ``PROBE_AFTER_S``: the waits are well under way), bounded."""
    coordinator = _coordinator(name)
    deadline = time.monotonic() + timeout
    sent = 0
    while time.monotonic() < deadline:
        sent = ray.get(coordinator.state_sizes.remote(), timeout=30)[1]["probes_sent"]
        if sent >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"the coordinator of {name!r} sent {sent} probes within {timeout}s, "
                         f"expected {at_least}")


def _wait_dead(name: str, rank: int, timeout: float = 30.0) -> None:
    """Wait until the group's coordinator has found global rank ``rank`` dead, bounded."""
    coordinator = _coordinator(name)
    deadline = time.monotonic() + timeout
    dead: Dict[int, Any] = {}
    while time.monotonic() < deadline:
        dead = ray.get(coordinator.dead_ranks.remote(), timeout=30)[1]
        if rank in dead:
            return
        time.sleep(0.05)
    raise AssertionError(f"the coordinator of {name!r} did not find rank {rank} dead within "
                         f"{timeout}s: {dead}")


def _store_settled(limit: float, timeout: float = 20.0) -> Tuple[int, int]:
    """Object-store use once it is at most ``limit`` bytes (Ray frees objects a moment after
    their last reference goes), or as it is after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    used = store_used()
    while used[0] > limit and time.monotonic() < deadline:
        time.sleep(0.1)
        used = store_used()
    return used


def _assert_failed(result: Dict[str, Any], cls: str, dead: List[int], since: float,
                   within: float = DETECT_S) -> float:
    assert not result["ok"], f"expected {cls}, the collective succeeded: {result}"
    assert cls in result["is"], f"expected {cls}, got {result['type']}: {result['msg']}"
    assert result["failed_ranks"] == dead, result
    for g in dead:
        assert f"rank {g}" in result["msg"], result["msg"]
    took = result["t"] - since
    assert took < within, f"took {took:.2f}s to fail (limit {within}s): {result['msg']}"
    return took


# ---------------------------------------------------------------------- dead ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["busy", "arrived", "idle_threaded"])
def test_killed_rank_fails_survivors_fast(actors, form, where):
    """ray.kill a rank while the others wait in all_reduce: RankFailedError naming it, fast.

    busy: the victim is a sync actor inside another method (never arrived); arrived: it is in
    the collective, waiting for a rank that is busy; idle_threaded: a threaded actor that is
    idle (probes answer at once: its re-probes and its lease tell that it died).
    """
    victim = 3
    helper = actors.spare() if where == "arrived" else actors.pool[2]  # "arrived" kills it too
    team, name = form(actors.pool[:2] + [helper, actors.spare(where == "idle_threaded")])
    if where == "busy":
        busy = [_run(team[victim], _sleep, victim, 300.0)]
        waiting = [0, 1, 2]
    elif where == "arrived":
        busy = [_run(team[2], _sleep, 2, 300.0)]  # rank 2 keeps the collective open
        waiting = [0, 1, 3]
    else:
        busy, waiting = [], [0, 1, 2]
    refs = {r: _run(team[r], _all_reduce, r, name, 16) for r in waiting}
    _wait_arrived(name, waiting, "all_reduce", 1)
    _wait_probed(name)  # well inside the wait: probes have started
    killed_at = time.time()
    ray.kill(team[victim], no_restart=True)
    survivors = [r for r in waiting if r != victim]
    results = ray.get([refs[r] for r in survivors], timeout=60)
    took = [_assert_failed(res, "RankFailedError", [victim], killed_at) for res in results]
    print(f"\n[{where}] survivors failed {max(took):.3f}s after ray.kill: {results[0]['msg']}")
    if where == "arrived":
        ray.kill(team[2], no_restart=True)  # busy: it could not leave the group in time
    del busy


@pytest.mark.timeout(120)
def test_rank_that_died_while_idle_fails_next_collective_at_once(actors, form):
    """A rank dies between collectives (its lease tells the coordinator): the next
    collective fails at once, naming it, instead of waiting for the timeout."""
    team, name = form(actors.pool[:2] + [actors.spare()])
    assert ray.get([_run(a, _all_reduce, r, name, 4) for r, a in enumerate(team)],
                   timeout=60)[0]["value"] == 6.0
    ray.kill(team[2], no_restart=True)
    _wait_dead(name, 2)  # the coordinator learns of the death with nobody waiting
    start = time.time()
    results = ray.get([_run(team[r], _all_reduce, r, name, 4) for r in (0, 1)], timeout=60)
    for res in results:  # at once: far from the group's timeout (LONG_TIMEOUT_S)
        _assert_failed(res, "RankFailedError", [2], start)


@pytest.mark.timeout(120)
def test_killed_rank_fails_point_to_point_peer_fast(actors, form):
    team, name = form(actors.pool[:1] + [actors.spare()])
    busy = _run(team[1], _sleep, 1, 300.0)
    ref = _run(team[0], _recv_from, 0, name, 1)
    _wait_probed(name)  # p2p waits do not show in group_status: the recv is posted, probed
    killed_at = time.time()
    ray.kill(team[1], no_restart=True)
    result = ray.get(ref, timeout=60)
    took = _assert_failed(result, "RankFailedError", [1], killed_at)
    print(f"\nrecv failed {took:.3f}s after its sender was killed: {result['msg']}")
    del busy


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["store", "auto"], ids=["object-store", "native"])
def test_large_collective_with_dead_rank_releases_objects_and_group_recovers(actors, form,
                                                                             transport):
    """Kill a rank mid large all_reduce (payloads in the object store, or on the native
    plane: the node segment), then destroy the group from the driver and form it again with
    the survivors plus a replacement: collectives work again, and object-store memory is
    back to where it was."""
    n = 1_000_000  # 8 MB per rank: object references, not inline
    native = transport != "store" and core is not None
    options = {"transport": transport}
    team, name = form(actors.pool[:2] + [actors.spare()], options=options)
    warm = ray.get([_run(a, _all_reduce, r, name, n) for r, a in enumerate(team)], timeout=60)
    assert all(w["ok"] and w["value"] == 6.0 for w in warm), warm
    base_bytes, base_objects = _store_settled(1e6)

    busy = _run(team[2], _sleep, 2, 300.0)
    refs = [_run(team[r], _all_reduce, r, name, n) for r in (0, 1)]
    _wait_arrived(name, [0, 1], "all_reduce", 2)
    during_bytes, _ = store_used()
    killed_at = time.time()
    ray.kill(team[2], no_restart=True)
    for res in ray.get(refs, timeout=60):
        _assert_failed(res, "RankFailedError", [2], killed_at)
    del busy

    raycoll.destroy_group(name)
    team = team[:2] + [actors.spare()]
    raycoll.create_group(team, group_name=name, timeout=LONG_TIMEOUT_S, options=options)
    form_cleanup = team, name
    try:
        again = ray.get([_run(a, _all_reduce_twice, r, name, n) for r, a in enumerate(team)],
                        timeout=60)
    finally:
        raycoll.destroy_group(name)
        ray.kill(form_cleanup[0][2], no_restart=True)
    for rank_results in again:
        for res in rank_results:
            assert res["ok"] and res["value"] == 6.0 and res["all_equal"], res
    after_bytes, after_objects = _store_settled(base_bytes + 1e6)
    print(f"\nobject store: baseline {base_bytes / 1e6:.1f} MB ({base_objects} objects), during "
          f"the failed collective {during_bytes / 1e6:.1f} MB, after recovery "
          f"{after_bytes / 1e6:.1f} MB ({after_objects} objects)")
    if native:
        assert during_bytes <= base_bytes + 1e6, "a collective on the native plane put objects"
    else:
        assert during_bytes >= base_bytes + 4e6, \
            "the failed collective's payloads were not in the store"
    assert after_bytes <= base_bytes + 1e6, (base_bytes, after_bytes)


@pytest.mark.timeout(120)
def test_create_group_with_a_dead_actor_fails_fast_and_frees_the_others(actors):
    dead = actors.spare()
    ray.kill(dead, no_restart=True)
    # ray.kill is asynchronous: a call sent right after it may still be answered
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(60):
            ray.get(dead.__ray_ready__.remote(), timeout=30)
            time.sleep(0.5)
    name = f"faults-{uuid.uuid4().hex[:6]}"
    start = time.time()
    with pytest.raises(raycoll.RankFailedError, match="rank 1 is dead") as info:
        raycoll.create_group([actors.pool[0], dead], group_name=name, timeout=LONG_TIMEOUT_S)
    assert info.value.failed_ranks == (1,)
    assert time.time() - start < DETECT_S
    team, name = actors.pool[:2], name + "-2"  # rank 0 was not left half-joined
    raycoll.create_group(team, group_name=name, timeout=LONG_TIMEOUT_S)
    try:
        assert [r["value"] for r in ray.get([_run(a, _all_reduce, r, name, 4)
                                             for r, a in enumerate(team)], timeout=60)] == [3.0, 3.0]
    finally:
        raycoll.destroy_group(name)


def _barrier_failing_on(rank: int, group: str, bad_rank: int) -> Dict[str, Any]:
    """barrier, where ``bad_rank``'s backend raises an unexpected error inside it."""
    from raycoll.backends.cpu import ObjstoreBackend

    original = ObjstoreBackend.barrier

    def broken(self: Any, call: Any) -> None:
        raise RuntimeError("injected failure inside the backend")

    if rank == bad_rank:
        ObjstoreBackend.barrier = broken  # type: ignore[method-assign]
    start = time.time()
    try:
        raycoll.barrier(group=group)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _outcome(exc, start)
    finally:
        ObjstoreBackend.barrier = original  # type: ignore[method-assign]
    return {"ok": True}


@pytest.mark.timeout(120)
def test_unexpected_error_inside_a_collective_fails_the_peers_at_once(actors, form):
    """A rank whose backend fails mid-collective (after the call was issued) must not leave
    its peers waiting for the timeout: they get GroupBrokenError naming it and the error."""
    team, name = form(actors.pool[:3])
    results = ray.get([_run(a, _barrier_failing_on, r, name, 1) for r, a in enumerate(team)],
                      timeout=60)
    assert results[1]["type"] == "RuntimeError", results[1]
    for r in (0, 2):
        assert results[r]["type"] == "GroupBrokenError", results[r]
        assert "rank 1 failed inside it" in results[r]["msg"], results[r]["msg"]
        assert "injected failure" in results[r]["msg"], results[r]["msg"]
        assert results[r]["elapsed"] < DETECT_S, results[r]


# ---------------------------------------------------------------------- timeouts
@pytest.mark.timeout(120)
def test_stalled_rank_times_out_naming_it_and_its_last_collective(actors, form):
    timeout = 2.0
    team, name = form(actors.pool[:3], timeout=timeout)
    assert ray.get([_run(a, _all_reduce, r, name, 4) for r, a in enumerate(team)],
                   timeout=60)[0]["ok"]
    late = _run(team[2], _sleep, 2, timeout + 1.5)
    start = time.time()
    results = ray.get([_run(team[r], _all_reduce, r, name, 4) for r in (0, 1)], timeout=60)
    for res in results:
        assert "DistTimeoutError" in res["is"], res
        assert res["missing"] == [2], res
        assert "all_reduce #2" in res["msg"], res["msg"]
        assert "rank 2 last completed all_reduce #1" in res["msg"], res["msg"]
        took = res["t"] - start
        assert timeout - 0.5 < took < timeout + 5.0, f"timed out after {took:.2f}s"
    print(f"\ntimed out after {results[0]['t'] - start:.2f}s (timeout {timeout}s): "
          f"{results[0]['msg']}")
    # liveness probes while they waited: at most one per rank (sync actors busy in a method
    # keep it queued, a no-op run when the method returns), never a stream
    sent = ray.get(_coordinator(name).state_sizes.remote(), timeout=30)[1]["probes_sent"]
    assert 1 <= sent <= 3, sent
    ray.get(late, timeout=60)
    arrived_late = ray.get(_run(team[2], _all_reduce, 2, name, 4), timeout=60)
    assert "DistTimeoutError" in arrived_late["is"], arrived_late  # the group is broken
    assert arrived_late["elapsed"] < DETECT_S, arrived_late  # at once, not after a timeout


@pytest.mark.timeout(120)
def test_work_wait_timeout_names_the_missing_rank_and_breaks_the_group(actors, form):
    team, name = form(actors.pool[:2] + [actors.spare()])  # the group's own timeout is long
    busy = _run(team[2], _sleep, 2, 300.0)
    results = ray.get([_run(team[r], _async_all_reduce_wait, r, name, 1.5) for r in (0, 1)],
                      timeout=60)
    for res in results:
        assert "DistTimeoutError" in res["is"], res
        assert res["missing"] == [2], res
        assert 1.2 < res["elapsed"] < 1.5 + 5.0, res  # (the wait may count from the call)
        assert "within 1.5s" in res["msg"] and "[2]" in res["msg"], res["msg"]
        assert res["after"] in ("GroupBrokenError", "DistTimeoutError"), res
    print(f"\nWork.wait(timeout=1.5) raised after {results[0]['elapsed']:.2f}s: {results[0]['msg']}")
    ray.kill(team[2], no_restart=True)  # busy: it could not leave the group in time
    del busy


@pytest.mark.timeout(120)
def test_monitored_barrier_reports_missing_ranks_and_group_stays_usable(actors, form):
    team, name = form(actors.pool[:4])
    timeout = 1.0
    for wait_all_ranks in (False, True):
        delays = {0: 0.0, 1: 0.0, 2: timeout + 1.0, 3: timeout + 1.0}
        results = ray.get([_run(a, _monitored, r, name, timeout, wait_all_ranks, delays[r])
                           for r, a in enumerate(team)], timeout=60)
        for r in (0, 1):
            res = results[r]
            assert "DistTimeoutError" in res["is"], res
            assert res["missing"] == [2, 3], res
            assert timeout - 0.1 < res["elapsed"] < timeout + 5.0, res
            lead = "Ranks 2, 3" if wait_all_ranks else "Rank 2"  # torch's (gloo's) words
            assert res["msg"].startswith(f"{lead} failed to pass monitoredBarrier in 1000 ms"), \
                res["msg"]
            assert "Timed out" in res["msg"] and "[2, 3]" in res["msg"], res["msg"]
        for r in (2, 3):
            assert "DistTimeoutError" in results[r]["is"], results[r]
            assert "after it had timed out" in results[r]["msg"], results[r]["msg"]
        assert [res["after"] for res in results] == [6.0] * 4  # the group still works everywhere
        print(f"\nmonitored_barrier(wait_all_ranks={wait_all_ranks}): {results[0]['msg']}")


@pytest.mark.timeout(120)
def test_monitored_barrier_with_a_dead_rank_fails_fast(actors, form):
    team, name = form(actors.pool[:2] + [actors.spare()])
    busy = _run(team[2], _sleep, 2, 300.0)
    refs = [_run(team[r], _monitored_dead, r, name) for r in (0, 1)]
    _wait_arrived(name, [0, 1], "monitored_barrier", 1)
    killed_at = time.time()
    ray.kill(team[2], no_restart=True)
    for res in ray.get(refs, timeout=60):
        _assert_failed(res, "RankFailedError", [2], killed_at)
    del busy


def _monitored_dead(rank: int, group: str) -> Dict[str, Any]:
    start = time.time()
    try:
        raycoll.monitored_barrier(group=group, timeout=LONG_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return _outcome(exc, start)
    return {"ok": True}


# ---------------------------------------------------------------------- the coordinator dies
@pytest.mark.timeout(120)
def test_killed_coordinator_fails_every_waiting_rank_fast(actors, form):
    team, name = form(actors.pool[:2] + [actors.spare()])
    busy = _run(team[2], _sleep, 2, 300.0)
    refs = [_run(team[r], _all_reduce, r, name, 4) for r in (0, 1)]
    _wait_arrived(name, [0, 1], "all_reduce", 1)
    coordinator = find_coordinator(ray.get_runtime_context().get_job_id(), name)
    killed_at = time.time()
    ray.kill(coordinator, no_restart=True)
    for res in ray.get(refs, timeout=60):
        assert "CoordinatorDiedError" in res["is"], res
        assert name in res["msg"], res["msg"]
        took = res["t"] - killed_at
        assert took < DETECT_S, f"took {took:.2f}s"
    print(f"\nranks failed {took:.3f}s after the coordinator was killed: {res['msg']}")
    ray.kill(team[2], no_restart=True)  # busy: it could not leave the group in time
    del busy


# ---------------------------------------------------------------------- recovery by name
def _elastic(rank: int, name: str, world_size: int, kill_me: bool) -> Dict[str, Any]:
    """init_process_group by name; all_reduce; the victim then dies; survivors re-form."""
    import os

    raycoll.init_process_group("objstore", world_size=world_size, rank=rank, group_name=name,
                               timeout=LONG_TIMEOUT_S)
    x = np.ones(4)
    raycoll.all_reduce(x, group=name)
    if kill_me:
        os._exit(1)  # a crash, not a clean exit
    start = time.time()
    try:
        raycoll.all_reduce(x, group=name)
        return {"ok": True}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = _outcome(exc, start)
    raycoll.destroy_process_group(name)
    return out


def _rejoin(rank: int, name: str, world_size: int) -> float:
    raycoll.init_process_group("objstore", world_size=world_size, rank=rank, group_name=name,
                               timeout=LONG_TIMEOUT_S)
    x = np.full(4, rank + 1.0)
    raycoll.all_reduce(x, group=name)
    raycoll.destroy_process_group(name)
    return float(x[0])


@pytest.mark.timeout(120)
def test_crashed_rank_of_a_group_formed_by_name_fails_its_peers(actors):
    """Ranks that rendezvous by name (init_process_group): one crashes (os._exit), the
    survivors get RankFailedError naming it, destroy the broken group, and form it again by
    the same name with a replacement (the dead rank counts as having left)."""
    name = f"elastic-{uuid.uuid4().hex[:6]}"
    team = [actors.spare() for _ in range(3)]
    try:
        refs = [_run(a, _elastic, r, name, 3, r == 2) for r, a in enumerate(team)]
        for res in ray.get(refs[:2], timeout=60):  # they wait from about when rank 2 exits
            _assert_failed(res, "RankFailedError", [2], res["t"] - res["elapsed"])
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs[2], timeout=60)
        team[2] = actors.spare()
        values = ray.get([_run(a, _rejoin, r, name, 3) for r, a in enumerate(team)],
                         timeout=60)
        assert values == [6.0, 6.0, 6.0]
    finally:
        for actor in team:
            ray.kill(actor, no_restart=True)
