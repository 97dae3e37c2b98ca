"""Registering raycoll in Ray's own APIs once the modules they need are imported.

``import raycoll`` calls :func:`install`, which registers, in this process:

- backend ``"raycoll"`` of Ray's ``ray.util.collective``
  (:func:`raycoll.util.collective.ray_group.register`), as soon as ``ray.util.collective``
  is imported;
- the Ray Direct Transport ``"raycoll"`` (:func:`raycoll.rdt.register`), as soon as torch
  is imported (the transport moves torch tensors, and Ray's own check of a
  ``tensor_transport=`` name imports torch first).

Either happens at once if that module is imported already, else right after its import
(a ``sys.meta_path`` finder that wraps the module's loader, as
:mod:`raycoll.torch_backend` does for torch.distributed). Neither import is made here:
``ray.util.collective`` imports torch (seconds), which a process that uses neither should
not pay for. A registration that fails (a Ray without the API, a name taken) is logged at
debug level and leaves the explicit ``register()`` to raise the reason.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from typing import Any, Callable, Dict, Optional, Sequence

logger = logging.getLogger("raycoll")

__all__ = ["install", "after_import"]

_CALLBACKS: Dict[str, Callable[[], None]] = {}
_LOCK = threading.Lock()
_BUSY = threading.local()  # a find_spec of this thread in progress (finders ask each other)


def _quietly(name: str, callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception as exc:  # noqa: BLE001 - never break the user's import
        logger.debug("raycoll: registering after the import of %s failed: %s", name, exc)


def _fully_imported(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _AfterLoad(importlib.abc.Loader):
    """Wraps a module's loader: executes the module, then runs its callback."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        with _LOCK:
            callback = _CALLBACKS.pop(self._name, None)
        if callback is not None:
            _quietly(self._name, callback)

    def __getattr__(self, name: str) -> Any:  # resource readers, get_data, ...
        return getattr(self._loader, name)


class _Hook(importlib.abc.MetaPathFinder):
    """Acts only on the modules with a callback pending: asks the finders after it for the
    spec and wraps its loader. Stays in ``sys.meta_path`` (removing a finder while importlib
    iterates the list would skip the next one)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _CALLBACKS or getattr(_BUSY, "on", False):
            return None
        _BUSY.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _AfterLoad(spec.loader, fullname)
                    return spec
            return None
        finally:
            _BUSY.on = False


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` once module ``name`` is imported: now if it is, else right after its
    import. Failures are logged, never raised."""
    module = sys.modules.get(name)
    if module is not None and _fully_imported(module):
        _quietly(name, callback)
        return
    with _LOCK:
        _CALLBACKS[name] = callback
        if not any(isinstance(f, _Hook) for f in sys.meta_path):
            sys.meta_path.insert(0, _Hook())


def _register_collective() -> None:
    from raycoll.util.collective.ray_group import register

    register()


def _register_rdt() -> None:
    from raycoll import rdt

    rdt.register()


def install() -> None:
    """Called by ``import raycoll``: see the module's docstring."""
    after_import("ray.util.collective", _register_collective)
    after_import("torch", _register_rdt)
