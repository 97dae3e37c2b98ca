"""c10d's key-value store: :class:`Store`, :class:`PrefixStore` and :func:`get_store`.

Every group has a store, served by its coordinator actor (no server of its own, no port):
``raycoll.get_store(group=None)`` on any rank of the group returns a handle on it. As
torch's stores, it maps string keys to bytes values (``set`` takes ``str`` or bytes);
``get`` and ``wait`` block until the keys are set, up to the store's timeout (the group's
timeout unless :meth:`Store.set_timeout` says otherwise), then raise
:class:`~raycoll.errors.DistTimeoutError` naming the keys still missing; ``add`` and
``compare_set`` are atomic across ranks (the coordinator runs each alone). A store outlives
no group: once the group is destroyed its handles refuse every call, and the coordinator
drops the keys when the root group's ranks have all left. Keys of two groups never meet.

:class:`PrefixStore` puts ``prefix/`` before every key of any store, raycoll's or torch's,
as ``torch.distributed.PrefixStore`` does. With the torch backend
(:mod:`raycoll.torch_backend`), the store torch's ``init_process_group`` keeps is this one:
torch code that asks its group for a store reaches the same keys.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

from raycoll import errors
from raycoll.process_group import DEFAULT_TIMEOUT_S, ProcessGroup
from raycoll.work import to_seconds
from raycoll.world import GroupLike, _NonMember, world

__all__ = ["Store", "PrefixStore", "GroupStore", "get_store", "as_bytes"]


def as_bytes(value: Any, name: str = "value") -> bytes:
    """A store value as bytes: ``str`` (UTF-8) or a bytes-like object, as torch's take them."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be str or bytes, got {type(value).__name__}: {value!r:.80}")


def _key(key: Any, name: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__}: {key!r:.80}")
    return key


def _keys(keys: Any, name: str = "keys") -> List[str]:
    if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
        raise TypeError(f"{name} must be a list of str, got {type(keys).__name__}: {keys!r:.80}")
    return [_key(k, f"{name}[{i}]") for i, k in enumerate(keys)]


class Store:
    """c10d's ``Store``: the base class of raycoll's key-value stores.

    :func:`get_store` returns the store of a group; :class:`PrefixStore` wraps one. A subclass
    implements the primitives (``set``, ``get``, ``add``, ...); the base provides
    ``barrier``, the timeout and the multi-key forms.
    """

    def __init__(self, timeout: Any = None) -> None:
        seconds = to_seconds(timeout)
        self._timeout = timedelta(seconds=DEFAULT_TIMEOUT_S if seconds is None else seconds)

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not implement Store.{method}")

    @property
    def timeout(self) -> timedelta:
        """How long ``get`` and ``wait`` wait for keys by default."""
        return self._timeout

    def set_timeout(self, timeout: Any) -> None:
        """Set :attr:`timeout` (a ``timedelta`` or seconds, more than zero)."""
        seconds = to_seconds(timeout)
        if seconds is None or seconds <= 0:
            raise ValueError(f"timeout must be a timedelta or seconds > 0, got {timeout!r}")
        self._timeout = timedelta(seconds=seconds)

    def _seconds(self, timeout: Any) -> float:
        """A wait's bound: ``timeout``, or the store's when ``None`` or zero (torch's
        ``kNoTimeout``: raycoll never waits without a bound)."""
        if timeout is None or timeout == timedelta(0) or (
                isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                and timeout == 0):
            return self._timeout.total_seconds()
        return float(to_seconds(timeout) or 0)

    def set(self, key: str, value: Any) -> None:
        """Set ``key`` to ``value`` (``str`` or bytes), waking whoever waits for it."""
        raise self._missing("set")

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to :attr:`timeout`."""
        raise self._missing("get")

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the integer at ``key`` (0 if unset), atomically; the new value."""
        raise self._missing("add")

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is unset and
        ``expected_value`` is empty), atomically; returns the value now stored (for an unset
        key left alone, ``expected_value``, as torch's stores answer)."""
        raise self._missing("compare_set")

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        """Wait until every key of ``keys`` is set, up to ``timeout`` (default: the store's);
        past it ``DistTimeoutError`` names the missing keys."""
        raise self._missing("wait")

    def check(self, keys: List[str]) -> bool:
        """Whether every key of ``keys`` is set (never waits)."""
        raise self._missing("check")

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        raise self._missing("delete_key")

    def num_keys(self) -> int:
        """How many keys the store holds."""
        raise self._missing("num_keys")

    def append(self, key: str, value: Any) -> None:
        """Append ``value`` to the bytes at ``key`` (set it if unset)."""
        raise self._missing("append")

    def list_keys(self) -> List[str]:
        """Every key the store holds."""
        raise self._missing("list_keys")

    def queue_push(self, key: str, value: Any) -> None:
        """Push ``value`` at the back of the queue ``key``."""
        raise self._missing("queue_push")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the front of the queue ``key``, waiting up to :attr:`timeout` for one when
        ``block`` (else ``LookupError`` when it is empty)."""
        raise self._missing("queue_pop")

    def queue_len(self, key: str) -> int:
        """How many values the queue ``key`` holds."""
        raise self._missing("queue_len")

    def clone(self) -> "Store":
        """A new handle on the same store."""
        raise self._missing("clone")

    def multi_get(self, keys: List[str]) -> List[bytes]:
        """The values of ``keys``, waiting for each up to :attr:`timeout`."""
        return [self.get(k) for k in _keys(keys)]

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        """Set each key of ``keys`` to the value at the same place of ``values``."""
        keys = _keys(keys)
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            raise ValueError(f"values must be a list as long as keys ({len(keys)}), got "
                             f"{values!r:.80}")
        for k, v in zip(keys, values):
            self.set(k, v)

    def has_extended_api(self) -> bool:
        """Whether the store has ``append``, ``multi_get`` and ``multi_set`` (it has)."""
        return True

    def barrier(self, key: str, world_size: int, timeout: Any = None) -> None:
        """Wait until ``world_size`` callers have reached the barrier named ``key`` (c10d's
        ``Store.barrier``), up to ``timeout`` (default: the store's)."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        key = _key(key)
        if self.add(f"{key}/num_members", 1) == world_size:
            self.set(f"{key}/last_members", "<val_ignored>")
        self.wait([f"{key}/last_members"], timeout)


class GroupStore(Store):
    """The store of one group, kept by the group's coordinator (see :func:`get_store`)."""

    def __init__(self, group: ProcessGroup, timeout: Any = None) -> None:
        super().__init__(group.timeout_s if timeout is None else timeout)
        self._group = group

    def __repr__(self) -> str:
        return f"<raycoll.GroupStore of group {self._group.name!r}>"

    @property
    def group(self) -> ProcessGroup:
        """The group whose store this is."""
        return self._group

    def _where(self, op: str) -> Dict[str, Any]:
        _usable(self._group)
        return {"op": f"store.{op}", "group": self._group.name,
                "rank": self._group.global_ranks[self._group.rank()]}

    def _op(self, op: str, *args: Any) -> Any:
        where = self._where(op)
        return self._group.client.store_op(self._group.name, op, args, where)

    def _wait_for(self, op: str, args: Sequence[Any], timeout: Any = None) -> Any:
        where = self._where(op)
        return self._group.client.store_wait(self._group.name, op, tuple(args),
                                             self._seconds(timeout), where)

    def set(self, key: str, value: Any) -> None:
        self._op("set", _key(key), as_bytes(value))

    def get(self, key: str) -> bytes:
        result: bytes = self._wait_for("get", (_key(key),))
        return result

    def add(self, key: str, value: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"value must be an int, got {type(value).__name__}: {value!r:.80}")
        result: int = self._op("add", _key(key), int(value))
        return result

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        result: bytes = self._op("compare_set", _key(key), as_bytes(expected_value,
                                 "expected_value"), as_bytes(desired_value, "desired_value"))
        return result

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        self._wait_for("wait", (_keys(keys),), timeout)

    def check(self, keys: List[str]) -> bool:
        return bool(self._op("check", _keys(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._op("delete_key", _key(key)))

    def num_keys(self) -> int:
        return int(self._op("num_keys"))

    def append(self, key: str, value: Any) -> None:
        self._op("append", _key(key), as_bytes(value))

    def multi_get(self, keys: List[str]) -> List[bytes]:
        result: List[bytes] = self._wait_for("multi_get", (_keys(keys),))
        return result

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        keys = _keys(keys)
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            raise ValueError(f"values must be a list as long as keys ({len(keys)}), got "
                             f"{values!r:.80}")
        self._op("multi_set", keys, [as_bytes(v, f"values[{i}]") for i, v in enumerate(values)])

    def list_keys(self) -> List[str]:
        return list(self._op("list_keys"))

    def queue_push(self, key: str, value: Any) -> None:
        self._op("queue_push", _key(key), as_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        value: Optional[bytes] = self._wait_for("queue_pop", (_key(key), bool(block)))
        if value is None:
            raise LookupError(f"queue {key!r} of the store of group {self._group.name!r} is "
                              "empty (queue_pop with block=False)")
        return value

    def queue_len(self, key: str) -> int:
        return int(self._op("queue_len", _key(key)))

    def clone(self) -> "GroupStore":
        return GroupStore(self._group, self._timeout)


class PrefixStore(Store):
    """``torch.distributed.PrefixStore``: every key of ``store`` (any store, raycoll's or
    torch's) gets ``prefix + "/"`` before it. ``num_keys`` counts the whole underlying store,
    as torch's does."""

    def __init__(self, prefix: str, store: Any) -> None:
        prefix = _key(prefix, "prefix")
        missing = [m for m in ("set", "get", "add", "wait") if not callable(getattr(store, m, None))]
        if missing:
            raise TypeError(f"store must be a store (raycoll.Store or torch.distributed.Store), "
                            f"got {type(store).__name__} (no {', '.join(missing)})")
        timeout = getattr(store, "timeout", None)
        super().__init__(timeout if isinstance(timeout, timedelta) else None)
        self._prefix = prefix
        self._store = store

    def __repr__(self) -> str:
        return f"<raycoll.PrefixStore {self._prefix!r} over {self._store!r}>"

    @property
    def underlying_store(self) -> Any:
        """The store this one wraps."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Any:
        """The first store under this one that is not a PrefixStore (torch's name)."""
        store = self._store
        while isinstance(store, PrefixStore) or hasattr(store, "underlying_store"):
            store = store.underlying_store
        return store

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{_key(key)}"

    def set(self, key: str, value: Any) -> None:
        self._store.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(self._k(key)))

    def add(self, key: str, value: int) -> int:
        return int(self._store.add(self._k(key), value))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return bytes(self._store.compare_set(self._k(key), expected_value, desired_value))

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        keys = [self._k(k) for k in _keys(keys)]
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def check(self, keys: List[str]) -> bool:
        return bool(self._store.check([self._k(k) for k in _keys(keys)]))

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(self._k(key)))

    def num_keys(self) -> int:
        return int(self._store.num_keys())

    def append(self, key: str, value: Any) -> None:
        self._store.append(self._k(key), value)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return [bytes(v) for v in self._store.multi_get([self._k(k) for k in _keys(keys)])]

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self._store.multi_set([self._k(k) for k in _keys(keys)], values)

    def list_keys(self) -> List[str]:
        start = f"{self._prefix}/"
        return [k[len(start):] for k in self._store.list_keys() if k.startswith(start)]

    def queue_push(self, key: str, value: Any) -> None:
        self._store.queue_push(self._k(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return bytes(self._store.queue_pop(self._k(key), block))

    def queue_len(self, key: str) -> int:
        return int(self._store.queue_len(self._k(key)))

    def clone(self) -> "PrefixStore":
        return PrefixStore(self._prefix, self._store.clone())


def _usable(pg: ProcessGroup) -> None:
    """Refuse a destroyed group; a broken one's store still serves (its coordinator lives:
    the store is where ranks can agree on what to do next)."""
    try:
        pg.check_usable()
    except errors.GroupBrokenError:
        pass


def get_store(group: GroupLike = None) -> Store:
    """The store of ``group`` (default: this rank's default group), shared by its ranks.

    A :class:`Store` kept by the group's coordinator: no server, no port. Its timeout is the
    group's; :meth:`Store.set_timeout` changes it for this handle.
    """
    w = world()
    with w.lock:
        if isinstance(group, ProcessGroup):
            pg: Optional[ProcessGroup] = group
        elif group is None:
            pg = w.default
        else:
            pg = w.groups.get(group) if isinstance(group, str) else None
    if pg is None:
        resolved = w.resolve(group)  # raises the error that says why (none, destroyed, type)
        if isinstance(resolved, _NonMember):
            raise ValueError("group is GroupMember.NON_GROUP_MEMBER: this rank is not in that "
                             "group, so it has no store of it")
        pg = resolved
    _usable(pg)
    return GroupStore(pg)
