"""The groups' key-value stores (c10d's ``Store``), served by the coordinator actor.

Every group has its own store here, its namespace the group's name (a root group's, or a
subgroup's ``root/ranks#n``), so that the keys of two groups never meet; the store of every
group of a root group goes when the root group's generation ends (every rank left), as the
internal key-value store does. Values are bytes. Ranks reach it through
:class:`raycoll.store.GroupStore`.

Two RPCs: :meth:`StoreMixin.store_op` runs one operation that never waits (``set``, ``add``,
``compare_set``, ...); each runs without an ``await``, so it is atomic against every other
rank's. :meth:`StoreMixin.store_wait` runs one that waits for keys (``get``, ``wait``,
``multi_get``, ``queue_pop``) up to its ``timeout_s``, then fails naming the keys that are
still missing. Both answer with a result tuple (:mod:`.logic`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, List, Sequence, Tuple

from raycoll.coordinator.logic import Result, err, ok
from raycoll.coordinator.state import CoordinatorState

__all__ = ["StoreMixin"]

#: The operations :meth:`StoreMixin.store_op` runs (each a ``_op_<name>`` method).
INSTANT_OPS = ("set", "add", "compare_set", "delete_key", "num_keys", "check", "append",
               "multi_set", "list_keys", "queue_push", "queue_len")
#: The operations :meth:`StoreMixin.store_wait` runs.
WAITING_OPS = ("get", "wait", "multi_get", "queue_pop")


class StoreMixin(CoordinatorState):
    """The store's RPCs: ``store_op`` (never waits) and ``store_wait`` (waits for keys)."""

    def store_op(self, ns: str, op: str, args: Tuple[Any, ...]) -> Result:
        """Run store operation ``op`` (one of :data:`INSTANT_OPS`) on group ``ns``'s store."""
        if op not in INSTANT_OPS:
            return err("protocol", f"unknown store operation {op!r}; known: {INSTANT_OPS}")
        handler: Callable[..., Result] = getattr(self, f"_op_{op}")
        return handler(ns, *args)

    async def store_wait(self, ns: str, op: str, args: Tuple[Any, ...], timeout_s: float) -> Result:
        """Run ``op`` (one of :data:`WAITING_OPS`) once its keys are there, waiting up to
        ``timeout_s``; a timeout names the keys still missing."""
        if op not in WAITING_OPS:
            return err("protocol", f"unknown store operation {op!r}; known: {WAITING_OPS}")
        if op == "queue_pop":
            keys: List[str] = [args[0]]

            def ready() -> bool:
                return bool(self._store_queues.get(ns, {}).get(keys[0]))

            if not args[1] and not ready():  # block=False on an empty queue
                return ok(None)
        else:
            keys = [args[0]] if op == "get" else list(args[0])

            def ready() -> bool:
                table = self._store.get(ns, {})
                return all(k in table for k in keys)

        outcome = await self._store_until(ns, keys, ready, timeout_s)
        if outcome is not None:
            return outcome
        table, queues = self._store[ns], self._store_queues[ns]
        if op == "get":
            return ok(table[keys[0]])
        if op == "multi_get":
            return ok([table[k] for k in keys])
        if op == "queue_pop":
            value = queues[keys[0]].pop(0)
            if not queues[keys[0]]:
                del queues[keys[0]]
            return ok(value)
        return ok()

    # ------------------------------------------------------------------ waiting
    async def _store_until(self, ns: str, keys: Sequence[str], ready: Callable[[], bool],
                           timeout_s: float) -> "Result | None":
        """Wait until ``ready()`` (re-checked whenever one of ``keys`` changes), up to
        ``timeout_s``: ``None`` once ready, else the error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        generation = self._generation
        while generation != self._generation or not ready():
            if generation != self._generation:
                return err("aborted", f"the store of group {ns!r} was destroyed (every rank "
                           f"left the group) while waiting for keys {list(keys)}")
            left = deadline - loop.time()
            if left <= 0:
                table = self._store.get(ns, {})
                missing = [k for k in keys if k not in table]
                return err("timeout", f"the store of group {ns!r} waited {timeout_s:g}s for "
                           f"keys {list(keys)}: {missing or list(keys)} never set")
            woken: "asyncio.Future[None]" = loop.create_future()
            for k in keys:
                self._store_waiters.setdefault((ns, k), []).append(woken)
            try:
                await asyncio.wait_for(asyncio.shield(woken), left)
            except asyncio.TimeoutError:
                pass
            finally:
                for k in keys:
                    waiting = self._store_waiters.get((ns, k), [])
                    if woken in waiting:
                        waiting.remove(woken)
                    if not waiting:
                        self._store_waiters.pop((ns, k), None)
        return None

    def _store_wake(self, ns: str, key: str) -> None:
        for woken in self._store_waiters.pop((ns, key), []):
            if not woken.done():
                woken.set_result(None)

    def _store_reset(self) -> None:
        """Every group's store goes with the generation; its waiters learn it at once."""
        self._store.clear()
        self._store_queues.clear()
        for ns, key in list(self._store_waiters):
            self._store_wake(ns, key)

    # ------------------------------------------------------------------ operations
    def _put(self, ns: str, key: str, value: bytes) -> None:
        self._store[ns][key] = value
        self._store_wake(ns, key)

    def _op_set(self, ns: str, key: str, value: bytes) -> Result:
        self._put(ns, key, value)
        return ok()

    def _op_add(self, ns: str, key: str, amount: int) -> Result:
        current = self._store[ns].get(key, b"0")
        try:
            now = int(current) + amount
        except ValueError:
            return err("value", f"store.add(key={key!r}) on group {ns!r}: the key holds "
                       f"{current[:60]!r}, not an integer (add needs a key set by add, or a "
                       "decimal integer)")
        self._put(ns, key, str(now).encode())
        return ok(now)

    def _op_compare_set(self, ns: str, key: str, expected: bytes, desired: bytes) -> Result:
        # c10d's TCPStore: a missing key is set when ``expected`` is empty; the answer is the
        # value now stored (``expected`` back for a missing key that was not set)
        table = self._store[ns]
        if key not in table:
            if expected:
                return ok(expected)
            self._put(ns, key, desired)
        elif table[key] == expected:
            self._put(ns, key, desired)
        return ok(table[key])

    def _op_delete_key(self, ns: str, key: str) -> Result:
        found = self._store[ns].pop(key, None) is not None
        if not self._store[ns]:
            del self._store[ns]
        return ok(found)

    def _op_num_keys(self, ns: str) -> Result:
        return ok(len(self._store.get(ns, {})))

    def _op_check(self, ns: str, keys: List[str]) -> Result:
        table = self._store.get(ns, {})
        return ok(all(k in table for k in keys))

    def _op_append(self, ns: str, key: str, value: bytes) -> Result:
        self._put(ns, key, self._store[ns].get(key, b"") + value)
        return ok()

    def _op_multi_set(self, ns: str, keys: List[str], values: List[bytes]) -> Result:
        for key, value in zip(keys, values):
            self._put(ns, key, value)
        return ok()

    def _op_list_keys(self, ns: str) -> Result:
        return ok(list(self._store.get(ns, {})))

    def _op_queue_push(self, ns: str, key: str, value: bytes) -> Result:
        self._store_queues[ns].setdefault(key, []).append(value)
        self._store_wake(ns, key)
        return ok()

    def _op_queue_len(self, ns: str, key: str) -> Result:
        return ok(len(self._store_queues.get(ns, {}).get(key, [])))


def table_sizes(store: Dict[str, Dict[str, Any]]) -> int:
    """How many keys the stores hold in all (a leak check)."""
    return sum(len(t) for t in store.values())
