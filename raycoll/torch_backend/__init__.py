"""raycoll as a ``torch.distributed`` backend: ``torch.distributed.init_process_group("raycoll")``.

Inside a raycoll rank (formed by :func:`raycoll.spawn`, :func:`raycoll.create_group` or
:func:`raycoll.init_process_group`), torch's own frontend runs over raycoll's data plane::

    import raycoll, torch, torch.distributed as dist

    def train(rank):
        dist.init_process_group("raycoll")   # rank, world size: this rank's raycoll group
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        ...
        dist.destroy_process_group()

    raycoll.spawn(train, world_size=4)

No ``MASTER_ADDR``, no port: the ranks already met through raycoll's coordinator, so torch
gets a store local to each rank (see :mod:`raycoll.torch_backend.rendezvous`) and the backend
maps torch's default group onto the rank's default raycoll group, and
``torch.distributed.new_group`` onto raycoll subgroups.

Registration never imports torch on raycoll's account. ``import raycoll`` registers the
backend at once when torch is already imported; otherwise it leaves a post-import hook on
``sys.meta_path`` that registers right after ``import torch`` finishes (torch itself imports
``torch.distributed``). A process that never imports torch pays nothing but that hook.
:func:`register` does it by hand.

The package: this module (no torch), :mod:`~raycoll.torch_backend.process_group` (the
torch-facing classes) and :mod:`~raycoll.torch_backend.rendezvous` (torch's store and
rendezvous), which import torch and are only imported once torch is, and
:mod:`~raycoll.torch_backend.names` (the group names torch keeps; no torch).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from typing import Any, Optional, Sequence

logger = logging.getLogger("raycoll")

__all__ = ["BACKEND_NAME", "register", "is_registered"]

#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND_NAME = "raycoll"

_lock = threading.Lock()
_registered = False
#: raycoll's modules that import torch. Imported before torch, one's own ``import torch``
#: runs the hook while it is half-defined: the hook registers once it is (see
#: ``_TorchImportHook``), so none of them imports this module back.
_TORCH_MODULES = ("raycoll.torch_backend.process_group", "raycoll.torch_backend.rendezvous")


def register() -> bool:
    """Register the ``"raycoll"`` backend with ``torch.distributed`` now (imports torch).

    Idempotent. Returns ``False`` when torch has no distributed support in this build.
    """
    return _register()


def _register(defined: Sequence[str] = ()) -> bool:
    """:func:`register`, where the modules ``defined`` (of ``_TORCH_MODULES``, at the end of
    their own import) count as imported."""
    if _registered:
        return True
    # Imported outside the lock: a first ``import torch`` runs the post-import hook, which
    # calls this function again (same thread) before the import returns.
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if any(m is not None and not _fully_imported(m)
           for m in map(sys.modules.get, set(_TORCH_MODULES) - set(defined))):
        return False  # its own ``import torch`` ran the hook: it registers once defined
    from raycoll.torch_backend import process_group

    _register_with(process_group, dist)
    return True


def _register_with(torch_pg: Any, dist: Any) -> None:
    """Register through ``raycoll.torch_backend.process_group`` (once per process)."""
    global _registered
    with _lock:
        if not _registered:
            torch_pg.register(dist)
            _registered = True


def is_registered() -> bool:
    """Whether ``torch.distributed`` knows the ``"raycoll"`` backend in this process."""
    return _registered


def _register_quietly(defined: Sequence[str] = ()) -> None:
    """Register, logging instead of raising: this runs inside someone's ``import torch``."""
    try:
        _register(defined)
    except Exception:  # noqa: BLE001 - never break the user's import of torch
        logger.warning("raycoll could not register its torch.distributed backend",
                       exc_info=True)


def _fully_imported(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _RegisterAfterLoad(importlib.abc.Loader):
    """Wraps the loader of ``torch`` or of one of ``_TORCH_MODULES``: executes the module as
    usual, then registers the backend (counting that module as defined)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        name = module.__name__
        _register_quietly(defined=(name,) if name in _TORCH_MODULES else ())

    def __getattr__(self, name: str) -> Any:  # resource readers, get_data, ...
        return getattr(self._loader, name)


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that only acts on the top-level ``torch`` import and on
    ``_TORCH_MODULES``: it asks the other finders for the spec and wraps its loader (a spec
    found without importing, e.g. by ``importlib.util.find_spec``, is harmless). It stays in
    place afterwards (removing a finder while importlib iterates the list would skip the next
    one)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if _registered or (fullname != "torch" and fullname not in _TORCH_MODULES):
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterLoad(spec.loader)
                return spec
        return None


def install() -> None:
    """Called by ``import raycoll``: register now if torch is imported, else hook its import."""
    torch = sys.modules.get("torch")
    if torch is None:
        if not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchImportHook())
    elif _fully_imported(torch):
        _register_quietly()
    else:  # raycoll imported from inside torch's own import: too early to register
        logger.debug("raycoll: torch is being imported; call raycoll.torch_backend.register()")
