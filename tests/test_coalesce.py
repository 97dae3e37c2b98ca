"""``create_group`` calls that overlap over the same actors form together
(:mod:`raycoll.coalesce`): the first at once, alone; those that came while it formed, as one
batch on one coordinator process; a batch that fails leaves each call its own result."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any, Dict, List

import pytest
import ray

import raycoll
from raycoll import coalesce, errors, session
from raycoll.coordinator.hosting import Hosted
from raycoll.launch import DRIVER_GROUPS

from helpers import group_sums, join_by_name, leave_by_name, rank_actors, wait_for


def _hold(rank: int, path: str) -> None:
    """Keep this (sync) actor busy until ``path`` exists (at most 60 s)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture()
def team(ray_local):
    with rank_actors(2) as actors:
        yield actors


def _overlapping(team: List[Any], names: List[str], tmp_path: Any) -> Dict[str, Any]:
    """``create_group`` of ``names[0]`` while ``team[0]`` is busy (its formation in flight),
    then of the others from threads of their own, queued behind it; the actor is let go once
    they wait. Returns each name's result: None, or the exception its call raised."""
    release = str(tmp_path / f"release-{uuid.uuid4().hex[:6]}")
    busy = team[0].run.remote(_hold, 0, (release,), {})
    out: Dict[str, Any] = {}

    def form(name: str) -> None:
        try:
            raycoll.create_group(team, group_name=name, timeout=60)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the call's own error, checked by the test
            out[name] = exc

    threads = [threading.Thread(target=form, args=(n,)) for n in names]
    threads[0].start()
    wait_for(lambda: len(coalesce._QUEUES) == 1, what="the first formation in flight")
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: sum(len(q) for q in coalesce._QUEUES.values()) == len(names) - 1,
             what="the other calls queued behind it")
    open(release, "w").close()
    for thread in threads:
        thread.join(timeout=90)
    ray.get(busy, timeout=30)
    assert not coalesce._QUEUES, "every key freed once its calls returned"
    return out


@pytest.mark.timeout(120)
def test_calls_that_come_while_one_forms_form_as_one_batch(team, tmp_path):
    names = [f"co{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    got = _overlapping(team, names, tmp_path)
    try:
        assert got == {n: None for n in names}, got
        coordinators = [DRIVER_GROUPS.get(n, session.current()).spec.coordinator for n in names]
        assert not isinstance(coordinators[0], Hosted), "the first formed at once, alone"
        assert all(isinstance(c, Hosted) for c in coordinators[1:]), coordinators
        assert len({c.host._actor_id for c in coordinators[1:]}) == 1, "one batch, one process"
        assert sorted(c.index for c in coordinators[1:]) == [1, 2, 3]
        for name in names:  # each a group of its own
            assert group_sums(team, name) == [3.0, 3.0], name
        raycoll.destroy_group(names[1])  # one of the batch destroyed: the others go on
        assert group_sums(team, names[2]) == [3.0, 3.0]
    finally:
        for name in names:
            try:
                raycoll.destroy_group(name)
            except errors.GroupNotFoundError:
                pass


@pytest.mark.timeout(150)
def test_a_batch_that_fails_leaves_each_call_its_own_result(team, tmp_path, ray_local):
    """A name of the batch was taken in the job (formed by name in other actors): the batch
    fails, its calls form alone, and only that name's call raises."""
    names = [f"cf{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    taken = names[2]
    with rank_actors(2) as others:
        ray.get([a.run.remote(join_by_name, r, (taken,), {}) for r, a in enumerate(others)],
                timeout=60)
        got = _overlapping(team, names, tmp_path)
        assert isinstance(got[taken], ValueError) and taken in str(got[taken]), got
        assert DRIVER_GROUPS.get(taken, session.current()) is None
        for name in names[:2] + names[3:]:
            assert got[name] is None, (name, got)
            assert group_sums(team, name) == [3.0, 3.0]
            raycoll.destroy_group(name)
        ray.get([a.run.remote(leave_by_name, r, (taken,), {}) for r, a in enumerate(others)],
                timeout=60)


class _Former:
    """Plain-Python formations for :func:`coalesce.form` (no Ray: the queue's own logic):
    each formation takes a ticket (``let_one``; at most 30 s), then records what it formed."""

    def __init__(self) -> None:
        self.tickets = threading.Semaphore(0)
        self.entered = 0  # formations started
        self.formed: List[List[str]] = []
        self.discarded: List[str] = []

    def let_one(self) -> None:
        self.tickets.release()

    def batch(self, names: Any) -> List[str]:
        self.entered += 1
        assert self.tickets.acquire(timeout=30)
        self.formed.append(list(names))
        return [f"group {n}" for n in names]

    def alone(self, name: str) -> str:
        return self.batch([name])[0]

    def form(self, key: Any, name: str, out: Dict[str, Any]) -> None:
        try:
            out[name] = coalesce.form(key, name, self.batch, self.alone, self.discarded.append)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out[name] = exc


def _interrupt_main_thread() -> None:
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _queued(key: Any) -> int:
    return len(coalesce._QUEUES.get(key) or [])


def _in_thread(fn: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_an_interrupt_while_queued_withdraws_the_call():
    former, key, out = _Former(), ("test", uuid.uuid4().hex), {}
    lead = _in_thread(lambda: former.form(key, "a", out))
    wait_for(lambda: former.entered == 1, what="a forming")

    def interrupt() -> None:
        wait_for(lambda: _queued(key) == 1, what="b queued")
        time.sleep(0.1)  # the main thread is in its wait by now
        _interrupt_main_thread()

    helper = _in_thread(interrupt)
    with pytest.raises(KeyboardInterrupt):
        coalesce.form(key, "b", former.batch, former.alone, former.discarded.append)
    helper.join(30)
    assert _queued(key) == 0, "withdrawn"
    former.let_one()
    lead.join(30)
    assert out == {"a": "group a"} and former.formed == [["a"]] and former.discarded == []
    assert key not in coalesce._QUEUES


@pytest.mark.timeout(60)
def test_an_interrupt_after_a_batch_took_the_call_sees_it_through_then_undoes_it():
    former, key, out = _Former(), ("test", uuid.uuid4().hex), {}
    lead = _in_thread(lambda: former.form(key, "a", out))
    wait_for(lambda: former.entered == 1, what="a forming")
    second = _in_thread(lambda: former.form(key, "b", out))
    wait_for(lambda: _queued(key) == 1, what="b queued")

    def interrupt_while_the_batch_forms() -> None:
        wait_for(lambda: _queued(key) == 2, what="c queued")
        former.let_one()  # a forms; b leads the batch [b, c]
        wait_for(lambda: former.entered == 2, what="the batch [b, c] forming")
        _interrupt_main_thread()
        time.sleep(0.2)
        former.let_one()

    helper = _in_thread(interrupt_while_the_batch_forms)
    with pytest.raises(KeyboardInterrupt):
        coalesce.form(key, "c", former.batch, former.alone, former.discarded.append)
    for thread in (helper, lead, second):
        thread.join(30)
    assert out == {"a": "group a", "b": "group b"}, out
    assert former.formed == [["a"], ["b", "c"]], former.formed
    assert former.discarded == ["group c"], "what the interrupted call formed is undone"
    assert key not in coalesce._QUEUES


@pytest.mark.timeout(60)
def test_an_interrupted_leader_forms_nothing_and_its_batch_forms_next():
    former, key, out = _Former(), ("test", uuid.uuid4().hex), {}
    queued: List[threading.Thread] = []

    def queue_two_then_interrupt() -> None:
        wait_for(lambda: former.entered == 1, what="a forming")
        queued.extend(_in_thread(lambda n=n: former.form(key, n, out)) for n in "bc")
        wait_for(lambda: _queued(key) == 2, what="b and c queued")
        _interrupt_main_thread()  # a's leader is the main thread, in its formation
        wait_for(lambda: former.entered == 2, what="the batch [b, c] forming")
        former.let_one()

    helper = _in_thread(queue_two_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        coalesce.form(key, "a", former.batch, former.alone, former.discarded.append)
    for thread in [helper] + queued:
        thread.join(30)
    assert out == {"b": "group b", "c": "group c"}, out
    assert former.formed == [["b", "c"]] and former.discarded == [], former.formed
    assert key not in coalesce._QUEUES
