"""The backend registry, ``Backend`` names and ``BackendConfig`` (device -> backend maps).

As in c10d, a group's backend is chosen per device: ``"objstore"``, ``"nccl"``,
``"cpu:objstore,cuda:nccl"``, or ``None`` for the default map (cpu -> objstore, cuda -> nccl
where NCCL is available). ``Backend.register_backend(name, factory, devices=[...])`` adds a
third-party backend: ``factory(ctx: GroupContext) -> CollectiveBackend``. The registry is
loud: a duplicate name is refused and a failed lookup lists the names that exist.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Tuple, Union

from raycoll.backends.base import CollectiveBackend, GroupContext
from raycoll.errors import BackendUnavailableError

__all__ = ["Backend", "BackendConfig", "Factory", "is_nccl_available"]

Factory = Callable[[GroupContext], CollectiveBackend]

_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class _Entry:
    factory: Factory
    devices: Tuple[str, ...]
    available: Callable[[], Optional[str]]  # None when usable, else why not


_lock = threading.Lock()
_registry: Dict[str, _Entry] = {}


class Backend(str):
    """A backend name, as ``torch.distributed.Backend``: ``Backend("OBJSTORE") == "objstore"``."""

    UNDEFINED = "undefined"
    OBJSTORE = "objstore"
    NCCL = "nccl"

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise TypeError(f"Backend name must be a str, got {type(name).__name__}")
        value = name.lower()
        if value != cls.UNDEFINED and value not in _registry:
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
        available: Optional[Callable[[], Optional[str]]] = None,
    ) -> None:
        """Register ``func`` as the factory of backend ``name`` for ``devices``.

        ``extended_api`` is accepted for signature compatibility with c10d and ignored.
        ``available()`` may return a reason why the backend cannot be used here.
        """
        if not isinstance(name, str) or not name or not name.isidentifier():
            raise ValueError(f"backend name must be a non-empty identifier, got {name!r}")
        if not callable(func):
            raise TypeError(f"backend factory for {name!r} must be callable, got {func!r}")
        if devices is None:
            devs: Tuple[str, ...] = ("cpu", "cuda")
        elif isinstance(devices, str):
            devs = (devices,)
        else:
            devs = tuple(devices)
        bad = [d for d in devs if d not in _DEVICES]
        if bad or not devs:
            raise ValueError(f"devices must be a subset of {_DEVICES}, got {devs!r}")
        key = name.lower()
        with _lock:
            if key in _registry:
                raise ValueError(f"backend {key!r} is already registered")
            _registry[key] = _Entry(func, devs, available or (lambda: None))
        setattr(cls, key.upper(), key)

    @classmethod
    def registered(cls) -> Dict[str, Tuple[str, ...]]:
        """Registered backend names and the devices each serves."""
        with _lock:
            return {name: entry.devices for name, entry in _registry.items()}


def _entry(name: str) -> _Entry:
    with _lock:
        entry = _registry.get(name)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_registry)}")
    return entry


def is_nccl_available() -> bool:
    """True when the NCCL backend can run here (cupy with NCCL, and a GPU)."""
    entry = _registry.get("nccl")
    return entry is not None and entry.available() is None


class BackendConfig:
    """A device -> backend-name map parsed from a backend string, as c10d's ``BackendConfig``."""

    def __init__(self, backend: Optional[Union[str, "BackendConfig"]] = None) -> None:
        if isinstance(backend, BackendConfig):
            self.device_backend_map: Dict[str, str] = dict(backend.device_backend_map)
            return
        if backend is None or str(backend).lower() == Backend.UNDEFINED:
            cuda = "nccl" if is_nccl_available() else "objstore"
            self.device_backend_map = {"cpu": "objstore", "cuda": cuda}
            return
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, a BackendConfig or None, got {backend!r}")
        text = backend.strip().lower()
        mapping: Dict[str, str] = {}
        if ":" in text:
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
                entry = _entry(name)
                if device not in entry.devices:
                    raise ValueError(f"backend {name!r} does not serve device {device!r} "
                                     f"(it serves {list(entry.devices)})")
                mapping[device] = name
        else:
            entry = _entry(text)
            mapping = {device: text for device in entry.devices}
        self.device_backend_map = mapping

    def get_device_backend_map(self) -> Dict[str, str]:
        """The device -> backend name map, e.g. ``{"cpu": "objstore", "cuda": "nccl"}``."""
        return dict(self.device_backend_map)

    def __repr__(self) -> str:
        return ",".join(f"{d}:{b}" for d, b in self.device_backend_map.items())

    def create(self, device: str, ctx: GroupContext, group_name: str) -> CollectiveBackend:
        """Instantiate the backend serving ``device`` for a group, or explain why not."""
        name = self.device_backend_map.get(device)
        if name is None:
            raise BackendUnavailableError(
                f"group {group_name!r} has no backend for {device!r} tensors (backends: {self!r}); "
                f"form the group with e.g. backend='cpu:objstore,cuda:nccl'"
            )
        entry = _entry(name)
        reason = entry.available()
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {name!r} for {device!r} tensors of group {group_name!r} is not "
                f"available here: {reason}"
            )
        return entry.factory(ctx)


def _register_builtin() -> None:
    from raycoll.backends.objstore import ObjstoreBackend

    Backend.register_backend("objstore", ObjstoreBackend, devices=ObjstoreBackend.devices)


_register_builtin()
