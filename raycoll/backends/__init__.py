"""The backend registry, ``Backend`` names and ``BackendConfig`` (device -> backend maps).

As in c10d, a group's backend is chosen per device kind ("cpu", "cuda"):

- ``"objstore"``: CPU arrays through the Ray object store, and GPU tensors staged through
  host memory and the object store (like c10d's gloo, which also takes CUDA tensors);
- ``"nccl"``: GPU tensors through NCCL communicators (cupy); CPU tensors are refused;
- ``"cpu:objstore,cuda:nccl"``, ``"cuda:objstore"``, ...: an explicit map (devices left out
  have no backend in the group, and their tensors are refused with a clear error);
- ``None`` (the default): cpu -> objstore; cuda -> nccl where NCCL is usable in the rank's
  process (cupy with NCCL, and a GPU), else cuda -> objstore (staged), so that GPU tensors
  always work and get NCCL's speed whenever it is there. NCCL needs one GPU per rank: ranks
  that share a GPU get an error naming the ranks at the first GPU collective; form such
  groups with ``"cpu:objstore,cuda:objstore"``. The cuda choice is made lazily, at the first
  GPU tensor, so CPU-only ranks never import cupy.

``Backend.register_backend(name, factory, devices=[...])`` adds a third-party backend, as in
c10d: ``factory(ctx: GroupContext) -> CollectiveBackend``, used for every listed device. The
registry is loud: a duplicate name is refused and a failed lookup lists the names that exist.
Registration is per process: register in every rank (and in the driver that validates the
backend string) before forming a group that uses it.

:func:`backend_config` is ``BackendConfig`` as groups are formed with it: ``"gloo"`` there
names raycoll's own CPU path (``"objstore"``), so that torch scripts run unchanged.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

from raycoll.backends import _cuda
from raycoll.backends.base import CollectiveBackend, GroupContext
from raycoll.errors import BackendUnavailableError

__all__ = ["Backend", "BackendConfig", "Factory", "backend_config", "is_nccl_available"]

logger = logging.getLogger("raycoll")

Factory = Callable[[GroupContext], CollectiveBackend]
Availability = Callable[[], Optional[str]]  # None when usable, else the reason why not

_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class _Impl:
    factory: Factory
    available: Availability


_lock = threading.Lock()
_registry: Dict[str, Dict[str, _Impl]] = {}  # name -> device -> implementation


def _always() -> Optional[str]:
    return None


class Backend(str):
    """A backend name, as ``torch.distributed.Backend``: ``Backend("OBJSTORE") == "objstore"``."""

    UNDEFINED = "undefined"
    OBJSTORE = "objstore"
    NCCL = "nccl"
    #: torch's CPU backend: where raycoll takes a backend, it names raycoll's own CPU path
    #: (``"objstore"``), so scripts that say ``Backend.GLOO`` run unchanged.
    GLOO = "gloo"

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise TypeError(f"Backend name must be a str, got {type(name).__name__}")
        value = name.lower()
        if value not in (cls.UNDEFINED, cls.GLOO) and value not in _registry:
            raise ValueError(f"unknown backend {name!r}; registered: {sorted(_registry)}")
        return super().__new__(cls, value)

    @classmethod
    def register_backend(
        cls,
        name: str,
        func: Factory,
        extended_api: bool = False,
        devices: Optional[Union[str, Iterable[str]]] = None,
        *,
        available: Optional[Availability] = None,
    ) -> None:
        """Register ``func`` as the factory of backend ``name`` for ``devices``.

        ``devices`` defaults to both "cpu" and "cuda". ``extended_api`` is accepted for
        signature compatibility with c10d and ignored. ``available()`` may return a reason
        why the backend cannot be used in this process (checked when a group first needs it).
        """
        if not isinstance(name, str) or not name or not name.isidentifier():
            raise ValueError(f"backend name must be a non-empty identifier, got {name!r}")
        if not callable(func):
            raise TypeError(f"backend factory for {name!r} must be callable, got {func!r}")
        if available is not None and not callable(available):
            raise TypeError(f"available for {name!r} must be callable, got {available!r}")
        if devices is None:
            devs: Tuple[str, ...] = _DEVICES
        elif isinstance(devices, str):
            devs = (devices,)
        else:
            devs = tuple(devices)
        bad = [d for d in devs if d not in _DEVICES]
        if bad or not devs:
            raise ValueError(f"devices must be a non-empty subset of {_DEVICES}, got {devs!r}")
        impl = _Impl(func, available or _always)
        _register(name, {device: impl for device in devs})

    @classmethod
    def registered(cls) -> Dict[str, Tuple[str, ...]]:
        """Registered backend names and the devices each serves."""
        with _lock:
            return {name: tuple(impls) for name, impls in _registry.items()}


def _register(name: str, impls: Dict[str, _Impl]) -> None:
    key = name.lower()
    with _lock:
        if key in _registry:
            raise ValueError(f"backend {key!r} is already registered "
                             f"(serving {sorted(_registry[key])})")
        _registry[key] = dict(impls)
    setattr(Backend, key.upper(), key)


def _impls(name: str) -> Dict[str, _Impl]:
    with _lock:
        impls = _registry.get(name)
    if impls is None:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_registry)}")
    return impls


def is_nccl_available() -> bool:
    """True when the NCCL backend can run in this process (cupy with NCCL, and a GPU)."""
    return _cuda.nccl_unavailable_reason() is None


class BackendConfig:
    """A device -> backend-name map parsed from a backend string, as c10d's ``BackendConfig``."""

    def __init__(self, backend: Optional[Union[str, "BackendConfig"]] = None) -> None:
        self._auto_cuda = False
        if isinstance(backend, BackendConfig):
            self._map: Dict[str, str] = dict(backend._map)
            self._auto_cuda = backend._auto_cuda
            return
        if backend is None or (isinstance(backend, str)
                               and backend.strip().lower() == Backend.UNDEFINED):
            self._map = {"cpu": "objstore"}
            self._auto_cuda = True
            return
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, a BackendConfig or None, got {backend!r}")
        self._map = _parse(backend)

    @property
    def device_backend_map(self) -> Dict[str, str]:
        """Device kind -> backend name (the default map decides cuda on first use)."""
        if self._auto_cuda:
            self._map["cuda"] = "nccl" if is_nccl_available() else "objstore"
            self._auto_cuda = False
        return self._map

    def get_device_backend_map(self) -> Dict[str, str]:
        """The device -> backend name map, e.g. ``{"cpu": "objstore", "cuda": "nccl"}``."""
        return dict(self.device_backend_map)

    def serves(self, device: str) -> bool:
        """Whether the group has a backend for ``device`` tensors (decides nothing lazily)."""
        return device in self._map or (device == "cuda" and self._auto_cuda)

    def __repr__(self) -> str:
        if self._auto_cuda:
            return "cpu:objstore,cuda:(nccl if available, else objstore)"
        return ",".join(f"{d}:{b}" for d, b in self._map.items())

    def create(self, device: str, ctx: GroupContext, group_name: str) -> CollectiveBackend:
        """Instantiate the backend serving ``device`` for a group, or explain why not."""
        name = self.device_backend_map.get(device)
        if name is None:
            raise BackendUnavailableError(
                f"group {group_name!r} has no backend for {device!r} tensors (backends: {self!r}); "
                "form the group with e.g. backend='cpu:objstore,cuda:nccl' (or 'cuda:objstore' "
                "to stage GPU tensors through host memory)"
            )
        impl = _impls(name)[device]
        reason = impl.available()
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {name!r} for {device!r} tensors of group {group_name!r} is not "
                f"available here: {reason}"
            )
        return impl.factory(ctx)


def _parse(backend: str) -> Dict[str, str]:
    text = backend.strip().lower()
    mapping: Dict[str, str] = {}
    if ":" not in text:
        if "," in text:
            raise ValueError(f"invalid backend string {backend!r}: give one name (e.g. 'nccl') "
                             "or 'device:name' pairs (e.g. 'cpu:objstore,cuda:nccl')")
        return {device: text for device in _impls(text)}
    for part in text.split(","):
        device, sep, name = part.strip().partition(":")
        device, name = device.strip(), name.strip()
        if not sep or device not in _DEVICES or not name:
            raise ValueError(
                f"invalid backend string {backend!r}: expected 'device:name' pairs "
                f"like 'cpu:objstore,cuda:nccl' with devices in {_DEVICES}"
            )
        if device in mapping:
            raise ValueError(f"invalid backend string {backend!r}: {device!r} given twice")
        impls = _impls(name)
        if device not in impls:
            raise ValueError(f"backend {name!r} does not serve device {device!r} "
                             f"(it serves {sorted(impls)})")
        mapping[device] = name
    return mapping


#: torch's name for its CPU backend names raycoll's own CPU path here: "objstore" (CPU
#: tensors, and CUDA tensors staged through host memory, as gloo takes them).
GLOO, GLOO_AS = "gloo", "objstore"
_gloo_logged = False


def _alias(name: str) -> str:
    return GLOO_AS if name.strip() == GLOO else name.strip()


def backend_config(backend: Any) -> BackendConfig:
    """``BackendConfig(backend)``, where ``"gloo"`` (alone or in a ``device:name`` map such as
    ``"cpu:gloo,cuda:nccl"``) names raycoll's ``"objstore"``, unless a backend was registered
    under that name. Logged once per process, at INFO, on the ``raycoll`` logger."""
    if not isinstance(backend, str) or GLOO in Backend.registered():
        return BackendConfig(backend)
    pairs = [part.partition(":") for part in backend.strip().lower().split(",")]
    text = ",".join(f"{d.strip()}:{_alias(n)}" if sep else _alias(d) for d, sep, n in pairs)
    if not any((n.strip() if sep else d.strip()) == GLOO for d, sep, n in pairs):
        return BackendConfig(backend)
    try:
        config = BackendConfig(text)
    except ValueError as exc:
        raise ValueError(f"backend={backend!r} (read as {text!r}): {exc}") from None
    global _gloo_logged
    if not _gloo_logged:
        _gloo_logged = True
        logger.info("raycoll: backend=%r runs as %r: 'gloo' names raycoll's own CPU path "
                    "(%r) here; no gloo is started", backend, text, GLOO_AS)
    return config


def _register_builtin() -> None:
    from raycoll.backends.nccl import NcclBackend
    from raycoll.backends.cpu import ObjstoreBackend
    from raycoll.backends.staged import StagedBackend

    _register("objstore", {"cpu": _Impl(ObjstoreBackend, _always),
                           "cuda": _Impl(StagedBackend, _always)})
    _register("nccl", {"cuda": _Impl(NcclBackend, _cuda.nccl_unavailable_reason)})


_register_builtin()
