"""torch's store and rendezvous for the raycoll backend (imports torch; imported lazily by
:mod:`raycoll.torch_backend.process_group`).

The ranks already met through raycoll's coordinator, so ``init_process_group("raycoll")``
needs no rendezvous of torch's, yet torch's frontend insists on a store:

- ``raycoll://``, and ``env://`` without ``MASTER_ADDR`` inside a raycoll rank:
  :class:`LocalStore`, local to each rank; a key another rank would have had to set fails at
  once, naming the fix, instead of waiting out torch's timeout.
- ``env://`` with ``MASTER_ADDR`` (as :func:`raycoll.spawn` sets it, like torchrun):
  :class:`DeferredStore`, torch's own TCPStore made when something first uses it (gloo, the
  store-based barrier); raycoll's backend never does, so it opens no port.

Rank and world size come from the rank's default raycoll group, checked against what the
url and ``RANK``/``WORLD_SIZE`` say.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from raycoll.process_group import ProcessGroup as RaycollGroup
from raycoll.world import world

__all__ = ["LocalStore", "DeferredStore"]


# ---------------------------------------------------------------------- the store
class LocalStore(dist.Store):
    """A key-value store local to one rank: torch's frontend wants one, raycoll needs none.

    ``set``/``get``/``add``/``compare_set`` work on this rank's keys. Waiting for a key this
    rank never set would mean waiting for another rank, which this store cannot see: it
    raises at once, saying so (e.g. ``TORCH_DIST_INIT_BARRIER=1``, or gloo started without
    ``MASTER_ADDR`` inside a raycoll rank).
    """

    def __init__(self) -> None:
        super().__init__()
        self._data: Dict[str, bytes] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _bytes(value: Any) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def _missing(self, key: str) -> KeyError:
        return KeyError(
            f"raycoll's torch store is local to each rank (raycoll's coordinator did the "
            f"rendezvous): key {key!r} was never set on this rank, and waiting for another "
            "rank to set it would hang. For gloo or nccl inside raycoll ranks set MASTER_ADDR "
            "and MASTER_PORT (or pass init_method); with backend='raycoll' unset "
            "TORCH_DIST_INIT_BARRIER")

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = self._bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            if key not in self._data:
                raise self._missing(key)
            return self._data[key]

    def add(self, key: str, value: int) -> int:
        with self._lock:
            now = int(self._data.get(key, b"0")) + int(value)
            self._data[key] = str(now).encode()
            return now

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        with self._lock:
            current = self._data.get(key)
            if (current is None and not self._bytes(expected)) or current == self._bytes(expected):
                self._data[key] = self._bytes(desired)
                return self._data[key]
            return current if current is not None else self._bytes(expected)

    def append(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = self._data.get(key, b"") + self._bytes(value)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def check(self, keys: List[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        with self._lock:
            missing = [k for k in keys if k not in self._data]
        if missing:
            raise self._missing(missing[0])

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)


class DeferredStore(dist.Store):
    """A store made on first use by ``make`` (torch's ``env://`` TCPStore at ``MASTER_ADDR``):
    ``init_process_group('raycoll')`` never touches its store, so under :func:`raycoll.spawn`
    (which sets ``MASTER_ADDR``/``MASTER_PORT`` as torchrun does) a raycoll group opens no
    port and waits on no rank, while gloo (or ``TORCH_DIST_INIT_BARRIER``) gets torch's store
    the moment it asks."""

    def __init__(self, make: Callable[[], dist.Store]) -> None:
        super().__init__()
        self._make = make
        self._inner: Optional[dist.Store] = None
        self._lock = threading.Lock()

    @property
    def made(self) -> bool:
        """Whether the underlying store exists yet."""
        return self._inner is not None

    def _store(self) -> dist.Store:
        with self._lock:
            if self._inner is None:
                self._inner = self._make()
            return self._inner

    def set(self, key: str, value: Any) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return self._store().get(key)

    def add(self, key: str, value: int) -> int:
        return self._store().add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._store().compare_set(key, expected, desired)

    def append(self, key: str, value: Any) -> None:
        # torch's stubs omit Store.append and Store.multi_set, which its C++ Store has
        self._store().append(key, value)  # type: ignore[attr-defined]

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self._store().multi_get(keys)

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self._store().multi_set(keys, values)  # type: ignore[attr-defined]  # see append

    def check(self, keys: List[str]) -> bool:
        return self._store().check(keys)

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store().delete_key(key)

    def num_keys(self) -> int:
        return self._store().num_keys()


#: The stores handed to torch, kept alive here: torch keeps only their C++ half, and a Python
#: store whose Python object is gone answers torch's calls with "Not implemented".
_KEPT: List[dist.Store] = []


def _kept(store: dist.Store) -> dist.Store:
    _KEPT.append(store)
    return store


# ---------------------------------------------------------------------- rendezvous
def _default_group() -> Optional[RaycollGroup]:
    """This rank's default raycoll group, of the Ray session connected now (a driver that
    restarted Ray has none left from before)."""
    w = world()
    w.drop_ended()
    return w.default


def _rank_and_size(url: str) -> Tuple[int, int]:
    """Rank and world size from this rank's default raycoll group, checked against what the
    url (``init_process_group(rank=, world_size=)``) and ``RANK``/``WORLD_SIZE`` say."""
    pg = _default_group()
    if pg is None:
        raise ValueError(
            "init_process_group(backend='raycoll') runs inside a raycoll rank, and this process "
            "has no raycoll group: start it with raycoll.spawn(fn, world_size), "
            "raycoll.create_group(actors) from the driver, or raycoll.init_process_group(...) "
            "here first (under Ray Train: TorchTrainer(..., "
            "torch_config=raycoll.train.RaycollConfig()), not TorchConfig(backend='raycoll'))")
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for key, env, have in (("rank", "RANK", pg.rank()), ("world_size", "WORLD_SIZE", pg.size())):
        for where, text in ((f"{key}=", query.get(key)), (f"${env}=", os.environ.get(env))):
            if text is not None and int(text) not in (-1, have):
                raise ValueError(
                    f"init_process_group(backend='raycoll'): {where}{text} does not match this "
                    f"rank's raycoll group {pg.name!r}, where it is {have}; pass no {key} (it "
                    "comes from the raycoll group)")
    return pg.rank(), pg.size()


def _raycoll_rendezvous(url: str, **_kwargs: Any) -> Iterator[Tuple[dist.Store, int, int]]:
    """The ``raycoll://`` rendezvous: no network, the raycoll group already formed."""
    rank, size = _rank_and_size(url)
    yield _kept(LocalStore()), rank, size
    raise RuntimeError("raycoll:// rendezvous cannot re-rendezvous: form the raycoll group again")


def _deferred_env_rendezvous(url: str, torch_env: Callable[..., Any],
                             kwargs: Dict[str, Any]) -> Iterator[Tuple[dist.Store, int, int]]:
    """``env://`` with ``MASTER_ADDR`` inside a raycoll rank whose ``RANK``/``WORLD_SIZE``
    agree with its raycoll group: torch's own store, made on first use (DeferredStore)."""
    rank, size = _rank_and_size(url)
    query = f"rank={rank}&world_size={size}"
    full = url + ("&" if urlparse(url).query else "?") + query

    def make() -> dist.Store:
        return next(iter(torch_env(full, **kwargs)))[0]

    yield _kept(DeferredStore(make)), rank, size
    raise RuntimeError("env:// in a raycoll rank cannot re-rendezvous: form the group again")


def _install_rendezvous() -> None:
    """``raycoll://``, and ``env://`` (the default of ``init_process_group``) inside a raycoll
    rank, rendezvous through raycoll: without ``MASTER_ADDR`` on a store local to the rank,
    with it (as under spawn) on torch's store made when first used; anything else as
    before."""
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function

    handlers = rdzv._rendezvous_handlers
    if "raycoll" not in handlers:
        rdzv.register_rendezvous_handler("raycoll", _raycoll_rendezvous)
    torch_env = handlers.get("env")
    if torch_env is None or getattr(torch_env, "_raycoll", False):
        return

    def env_or_raycoll(url: str, **kwargs: Any) -> Iterator[Tuple[dist.Store, int, int]]:
        if _default_group() is None:
            return torch_env(url, **kwargs)
        if not os.environ.get("MASTER_ADDR"):
            return _raycoll_rendezvous(url, **kwargs)
        try:
            _rank_and_size(url)
        except ValueError:  # the user's own RANK/WORLD_SIZE, not the raycoll group's
            return torch_env(url, **kwargs)
        return _deferred_env_rendezvous(url, torch_env, kwargs)

    env_or_raycoll._raycoll = True  # type: ignore[attr-defined]
    handlers["env"] = env_or_raycoll
