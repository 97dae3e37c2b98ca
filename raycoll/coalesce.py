"""Driver side: ``create_group`` calls that overlap, over the same actors, formed together.

A driver that forms several groups over the same actors from threads at once (a thread per
group, a thread pool of setup steps) would form each on a coordinator process of its own:
eight formations on the same cores, 5-8x one group's time (benchmarks/BENCHMARKS.md). Here
the first call starts at once, alone; the calls that come while it forms, with the same key
(the same actors in the same order, backend, timeout and options), wait for it and then form
as one batch, as one :func:`raycoll.create_groups` call would (their coordinators hosted in
one process, each group's tables and failures its own). A call that finds nothing in flight
for its key waits for nothing.

If a batch fails, its calls do not share the failure: each forms again alone (at once, each
in its own thread), and gets its own result, exactly as without coalescing. Only a timeout
(the actors did not join in time, which forming alone would meet again) is handed to every
call of the batch as it is.

The queue of each key, and the hand-over of the lead, are this module's only state; a batch
leader always hands over (``finally``), so no call waits on a batch that will not run. A
``KeyboardInterrupt`` in a queued call withdraws it; once a batch took the call, the call
sees the batch through (the others wait on it), undoes its own group, then raises; a batch
whose leader is interrupted forms nothing, and its other calls form in the next batch.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence

from raycoll import errors

__all__ = ["form"]


@dataclass(eq=False)
class _Call:
    """One call waiting in a key's queue (``name``), woken (``turn``) with its result, its
    error, or the lead of the next batch (``batch``: the calls it forms, itself first; empty
    for a call another leads)."""

    name: str
    turn: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Optional[BaseException] = None
    batch: List["_Call"] = field(default_factory=list)


_LOCK = threading.Lock()
#: Each key's calls that came while a batch of it formed, in arrival order; a key is present
#: while one of its batches forms.
_QUEUES: Dict[Hashable, List[_Call]] = {}


def form(key: Hashable, name: str, form_batch: Callable[[Sequence[str]], List[Any]],
         form_alone: Callable[[str], Any],
         discard: Optional[Callable[[Any], None]] = None) -> Any:
    """Form ``name``: alone at once if nothing of ``key`` is forming, else in the next batch
    of ``key``. ``form_batch(names)`` forms several names together and returns their results
    in order (all or none); ``form_alone(name)`` forms one. Returns this call's result or
    raises its error.

    An interrupt (``KeyboardInterrupt``) while the call waits in the queue withdraws it;
    once a batch took it, the call sees the batch through (the others wait on it), then
    ``discard(result)`` undoes what it formed and the interrupt is raised."""
    call = _Call(name)
    with _LOCK:
        queue = _QUEUES.get(key)
        if queue is None:
            _QUEUES[key] = []
            call.batch = [call]
        else:
            queue.append(call)
    interrupted = None if call.batch else _wait(key, call)
    if call.batch:  # this call leads its batch
        again: List[_Call] = []
        try:
            again = _run(call.batch, form_batch, form_alone)
        finally:
            _hand_over(key, again)
    if interrupted is not None:
        if call.error is None and discard is not None:
            discard(call.result)
        raise interrupted
    if call.error is not None:
        raise call.error
    return call.result


def _wait(key: Hashable, call: _Call) -> Optional[BaseException]:
    """Wait until a leader wakes ``call``: with its result, or the lead of the next batch (a
    leader always wakes the calls it took). Returns an interrupt that came after a batch
    took the call; one that came while it was queued withdraws it and is raised."""
    interrupted: Optional[BaseException] = None
    while True:
        try:
            call.turn.wait()
            return interrupted
        except BaseException as exc:
            with _LOCK:
                queue = _QUEUES.get(key)
                if queue is not None and any(c is call for c in queue):
                    queue.remove(call)
                    raise
            interrupted = exc


def _run(batch: List[_Call], form_batch: Callable[[Sequence[str]], List[Any]],
         form_alone: Callable[[str], Any]) -> List[_Call]:
    """Form ``batch``; every call of it but the first (the caller) is woken, done. Returns
    the calls to form in the next batch: the others of a batch whose leader's thread was
    interrupted (it formed nothing; they did nothing wrong)."""
    try:
        if len(batch) == 1:
            batch[0].result = form_alone(batch[0].name)
        else:
            for call, result in zip(batch, form_batch([c.name for c in batch])):
                call.result = result
    except errors.DistTimeoutError as exc:  # alone, each would wait as long again
        for call in batch:
            call.error = exc if call is batch[0] else copy.copy(exc)
    except Exception as exc:  # noqa: BLE001 - each call's own error, below
        if len(batch) == 1:
            batch[0].error = exc
        else:
            _each_alone(batch, form_alone)
    except BaseException as exc:  # an interrupt of the leader's thread: nothing formed
        batch[0].error = exc
        return batch[1:]
    for call in batch[1:]:
        call.turn.set()
    return []


def _each_alone(batch: List[_Call], form_alone: Callable[[str], Any]) -> None:
    """After a batch failed: every call forms alone, at once, in its own thread."""
    def one(call: _Call) -> None:
        try:
            call.result = form_alone(call.name)
        except BaseException as exc:  # noqa: BLE001 - the call's own error
            call.error = exc

    threads = [threading.Thread(target=one, args=(c,), daemon=True,
                                name=f"raycoll-form-{c.name}") for c in batch[1:]]
    for thread in threads:
        thread.start()
    one(batch[0])
    for thread in threads:
        thread.join()


def _hand_over(key: Hashable, again: Sequence[_Call] = ()) -> None:
    """The batch of ``key`` formed: ``again`` and the calls that came meanwhile are the next
    batch, led by the first of them; with none, the key is free."""
    with _LOCK:
        batch = list(again) + _QUEUES[key]
        if not batch:
            del _QUEUES[key]
            return
        _QUEUES[key] = []
    batch[0].batch = batch
    batch[0].turn.set()
