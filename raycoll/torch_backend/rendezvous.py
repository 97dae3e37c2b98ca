"""torch's store and rendezvous for the raycoll backend (imports torch; imported lazily by
:mod:`raycoll.torch_backend.process_group`).

The ranks already met through raycoll's coordinator, so ``init_process_group("raycoll")``
needs no rendezvous of torch's, and torch's store is the raycoll group's own
(:func:`raycoll.get_store`, kept by the coordinator: no server, no port), served to torch as
:class:`RaycollStore`. ``raycoll://``, and ``env://`` inside a raycoll rank (with or without
``MASTER_ADDR``: :func:`raycoll.spawn` sets it, like torchrun) rendezvous this way, so gloo,
torch's store-based barrier and any torch code that asks its group for a store meet on the
same keys as ``raycoll.get_store()``.

Rank and world size come from the rank's default raycoll group, checked against what the
url and ``RANK``/``WORLD_SIZE`` say; with ``MASTER_ADDR`` and a ``RANK``/``WORLD_SIZE`` of
the user's own, ``env://`` is torch's as usual.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Tuple
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from raycoll.process_group import ProcessGroup as RaycollGroup
from raycoll.store import Store, get_store
from raycoll.world import world

__all__ = ["RaycollStore"]


# ---------------------------------------------------------------------- the store
class RaycollStore(dist.Store):
    """torch's ``Store`` over raycoll's: the store of the rank's raycoll group, kept by its
    coordinator (:func:`raycoll.get_store`), so that torch's code that asks its process
    group for a store (``_get_default_store()``, gloo's rendezvous, the store-based barrier)
    reaches the same keys as ``raycoll.get_store()``, with no server and no port.

    torch calls these methods from C++ too (its Python store trampoline); waits are bounded
    by torch's timeout for the store (``init_process_group(timeout=)``) and raise raycoll's
    ``DistTimeoutError`` naming the keys.
    """

    def __init__(self, store: Store) -> None:
        super().__init__()
        self._store = store

    @property
    def raycoll_store(self) -> Store:
        """The raycoll store this one serves torch."""
        return self._store

    def _timed(self) -> Store:
        """raycoll's store, waiting as long as torch's timeout for this store says."""
        timeout = self.timeout  # type: ignore[attr-defined]  # torch's stubs omit it
        if timeout > timedelta(0) and timeout != self._store.timeout:
            self._store.set_timeout(timeout)
        return self._store

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._timed().get(key)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, int(value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def append(self, key: str, value: Any) -> None:
        self._store.append(key, value)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self._timed().multi_get(list(keys))

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self._store.multi_set(list(keys), list(values))

    def check(self, keys: List[str]) -> bool:
        return self._store.check(list(keys))

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        self._timed().wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def list_keys(self) -> List[str]:
        return self._store.list_keys()

    def has_extended_api(self) -> bool:
        return True


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
    """The ``raycoll://`` rendezvous: no network, the raycoll group already formed; torch's
    store is the group's (:class:`RaycollStore`)."""
    rank, size = _rank_and_size(url)
    yield _kept(RaycollStore(get_store())), rank, size
    raise RuntimeError("raycoll:// rendezvous cannot re-rendezvous: form the raycoll group again")


def _install_rendezvous() -> None:
    """``raycoll://``, and ``env://`` (the default of ``init_process_group``) inside a raycoll
    rank, rendezvous through raycoll, on the raycoll group's store; anything else as
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
        if os.environ.get("MASTER_ADDR"):
            try:
                _rank_and_size(url)
            except ValueError:  # the user's own RANK/WORLD_SIZE, not the raycoll group's
                return torch_env(url, **kwargs)
        return _raycoll_rendezvous(url, **kwargs)

    env_or_raycoll._raycoll = True  # type: ignore[attr-defined]
    handlers["env"] = env_or_raycoll
