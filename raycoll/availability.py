"""c10d's availability queries, as raycoll answers them, and ``ProcessGroupGloo``.

``is_backend_available(name)`` asks raycoll's backend registry (:mod:`raycoll.backends`).
``"gloo"`` is available wherever raycoll runs: the name serves raycoll's own CPU path
(``"objstore"``; see :func:`raycoll.backends.backend_config`), so ``is_gloo_available()`` is
true, while raycoll has no ``ProcessGroupGloo`` objects (constructing one says so and what to
use). MPI, UCC and XCCL are never available; NCCL where cupy, NCCL and a GPU are.
``get_default_backend_for_device`` answers from raycoll's default device map.
"""

from __future__ import annotations

import os
from typing import Any

from raycoll.backends import Backend, BackendConfig, is_nccl_available

__all__ = ["is_backend_available", "is_gloo_available", "is_mpi_available", "is_ucc_available",
           "is_xccl_available", "is_torchelastic_launched", "get_default_backend_for_device",
           "ProcessGroupGloo"]


def is_gloo_available() -> bool:
    """True: ``"gloo"`` names raycoll's own CPU path (``"objstore"``) wherever raycoll runs
    (or a backend registered under that name); no gloo library is involved."""
    return True


def is_mpi_available() -> bool:
    """False: raycoll has no MPI backend."""
    return False


def is_ucc_available() -> bool:
    """False: raycoll has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: raycoll has no XCCL (Intel GPU) backend."""
    return False


def is_backend_available(backend: str) -> bool:
    """Whether groups can use ``backend`` here, as c10d answers it: the built-in names through
    their ``is_*_available`` (``"gloo"``: always, ``"nccl"``: with cupy, NCCL and a GPU;
    ``"mpi"``, ``"ucc"``, ``"xccl"``: never), any other name when it is registered
    (``"objstore"``, or one added with ``Backend.register_backend``)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}: {backend!r:.80}")
    name = backend.strip().lower()
    if name in Backend.registered():
        return name != "nccl" or is_nccl_available()
    return {"gloo": is_gloo_available, "mpi": is_mpi_available, "ucc": is_ucc_available,
            "xccl": is_xccl_available}.get(name, lambda: False)()


def is_torchelastic_launched() -> bool:
    """Whether this process was started by ``torch.distributed.elastic`` (torchrun), decided as
    torch decides it: ``TORCHELASTIC_RUN_ID`` is in the environment. ``raycoll.spawn`` sets
    torchrun's rank variables, not this one: its ranks are not torchelastic's."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def get_default_backend_for_device(device: Any) -> str:
    """The backend raycoll's default map gives ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``
    or a ``torch.device``): ``"objstore"`` for cpu (where torch says ``"gloo"``, which raycoll
    reads as ``"objstore"``), ``"nccl"`` for cuda where NCCL is usable, else ``"objstore"``
    (staged through host memory)."""
    kind = getattr(device, "type", None) or (device if isinstance(device, str) else None)
    if not isinstance(kind, str):
        raise TypeError(f"device must be a str or a torch.device, got "
                        f"{type(device).__name__}: {device!r:.80}")
    kind = kind.split(":", 1)[0].strip().lower()
    backends = BackendConfig(None).get_device_backend_map()
    if kind not in backends:
        raise ValueError(f"device {device!r} has no default backend; raycoll's default map "
                         f"covers {sorted(backends)}")
    return backends[kind]


class ProcessGroupGloo:
    """torch's gloo process group class, which raycoll does not have: raycoll serves the
    name ``"gloo"`` with its own CPU path. Constructing one raises ``NotImplementedError``
    saying what to use instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "raycoll has no ProcessGroupGloo objects: it serves 'gloo' with its own CPU path "
            "('objstore'), with no store or port of gloo's. Form a group with "
            "raycoll.init_process_group('gloo', ...) or raycoll.new_group(ranks, "
            "backend='gloo') and use the raycoll.ProcessGroup it gives (its object API "
            "included: pg.allreduce([t], opts))")
