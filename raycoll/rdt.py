"""raycoll as a Ray Direct Transport (RDT): ``@ray.method(tensor_transport="raycoll")``.

Call :func:`register` once in the driver, before it creates the actors (Ray hands the
registration to the actors the driver creates afterwards). Then an actor method decorated
with ``@ray.method(tensor_transport="raycoll")`` keeps the CPU ``torch.Tensor`` objects it
returns in the actor, and the actor (or driver) that consumes the result reads them straight
from there::

    import raycoll.rdt

    ray.init()
    raycoll.rdt.register()

    @ray.remote
    class Producer:
        @ray.method(tensor_transport="raycoll")
        def make(self):
            return {"w": torch.ones(1024, 1024), "b": torch.zeros(1024)}

    @ray.remote
    class Consumer:
        def total(self, d):
            return float(d["w"].sum() + d["b"].sum())

    p, c = Producer.remote(), Consumer.remote()
    ray.get(c.total.remote(p.make.remote()))    # the tensors never enter the object store

On one node the consumer reads every tensor of the object in one cross-memory read of the
producer's memory (one copy a byte); across nodes it pulls them from the producer over one
TCP connection, all tensors in one message (:mod:`raycoll.transport.pull`). No group has to
be formed first. A transfer that fails (the producer died, the object was freed) or times
out raises :class:`~raycoll.errors.TransferError` in the consumer; both actors stay alive.

``ray.experimental.rdt`` is an alpha API of Ray: :func:`register` accepts the Ray versions
raycoll was tested with (:data:`TESTED_RAY`) and refuses others with a clear error unless
``allow_untested_ray=True``.
"""

from __future__ import annotations

import threading
from typing import Tuple

from raycoll.errors import BackendUnavailableError, RaycollError, TransferError

__all__ = ["register", "is_registered", "TESTED_RAY", "TRANSPORT", "TransferError"]

#: The Ray releases (major.minor) whose ``ray.experimental.rdt`` raycoll's transport was
#: tested with.
TESTED_RAY: Tuple[str, ...] = ("2.60",)
#: The name to give ``@ray.method(tensor_transport=...)``.
TRANSPORT = "raycoll"

_lock = threading.Lock()
_done = False


def _check_ray(allow_untested_ray: bool) -> None:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - raycoll requires Ray
        raise BackendUnavailableError("raycoll.rdt needs Ray") from exc
    version = getattr(ray, "__version__", "?")
    if ".".join(version.split(".")[:2]) not in TESTED_RAY and not allow_untested_ray:
        raise BackendUnavailableError(
            f"raycoll.rdt.register: Ray {version} is not a version raycoll's Ray Direct "
            f"Transport was tested with ({', '.join(TESTED_RAY)}); its alpha API "
            "(ray.experimental.rdt) changes between releases. Install a tested Ray, or pass "
            "allow_untested_ray=True to try anyway.")
    try:
        from ray.experimental.rdt import TensorTransportManager  # noqa: F401
        from ray.experimental.rdt import register_tensor_transport  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            f"raycoll.rdt.register: Ray {version} has no ray.experimental.rdt."
            "register_tensor_transport (Ray Direct Transport's custom transports); "
            f"raycoll's transport needs Ray {TESTED_RAY[-1]}") from exc
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError("raycoll.rdt.register: Ray Direct Transport moves "
                                      "torch tensors; install torch") from exc


def register(*, allow_untested_ray: bool = False) -> None:
    """Register raycoll as Ray Direct Transport ``"raycoll"`` (CPU ``torch.Tensor``) in this
    process. Call it in the driver before it creates the actors that use it; calling it again
    does nothing.

    Raises :class:`~raycoll.errors.BackendUnavailableError` on a Ray without the API, or one
    whose version raycoll was not tested with (unless ``allow_untested_ray``); and
    :class:`~raycoll.errors.RaycollError` when another transport already took the name.
    """
    global _done
    with _lock:
        if _done:
            return
        _check_ray(allow_untested_ray)
        import torch
        from ray.experimental.rdt import register_tensor_transport
        from ray.experimental.rdt import util as rdt_util

        from raycoll.rdt_transport import NAME, RaycollTensorTransport

        info = getattr(rdt_util, "transport_manager_info", {}).get(NAME)
        if info is not None:
            if info.transport_manager_class is not RaycollTensorTransport:
                raise RaycollError(f"raycoll.rdt.register: a tensor transport named "
                                   f"{NAME!r} is already registered "
                                   f"({info.transport_manager_class.__qualname__})")
        else:
            register_tensor_transport(TRANSPORT, ["cpu"], RaycollTensorTransport,
                                      torch.Tensor)
        _done = True


def is_registered() -> bool:
    """Whether :func:`register` ran in this process."""
    return _done
