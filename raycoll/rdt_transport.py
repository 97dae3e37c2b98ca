"""raycoll's Ray Direct Transport: the ``TensorTransportManager`` that Ray calls (registered
by :func:`raycoll.rdt.register`; the user-facing module is :mod:`raycoll.rdt`).

It is *one-sided*, as NIXL and CUDA IPC are in Ray: the actor that returns the tensors keeps
them (:class:`raycoll.transport.pull.Keeper`) and takes no part in a transfer; the actor (or
driver) that consumes them pulls them (:class:`raycoll.transport.pull.Puller`): on one node
by one cross-memory read of every tensor of the object, across nodes from the keeper's pull
server, all tensors in one reply. So Ray sends no task to the source actor for a transfer,
no collective group has to be formed first (unlike Ray's "gloo" and "nccl" transports), and a
transfer can be aborted (``can_abort_transport() -> True``): it fails the consumer with
:class:`raycoll.errors.TransferError` and leaves both actors and any raycoll group alone.

This module imports ``ray.experimental.rdt`` (an alpha API of Ray) and torch at import time;
:func:`raycoll.rdt.register` checks the Ray version before it imports it.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import ray
import torch
from ray._private import ray_constants
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from raycoll.errors import TransferError
from raycoll.transport.links import IFNAME_ENV, listen_address
from raycoll.transport.pull import POOL_MIN_BYTES, Kept, PullError, keeper, puller, recv_pool

__all__ = ["RaycollTensorTransport", "RaycollTransportMetadata",
           "RaycollCommunicatorMetadata", "NAME"]

#: The transport's name as Ray keeps it (``tensor_transport="raycoll"`` in any case).
NAME = "RAYCOLL"

_node = threading.local()


def _node_id() -> str:
    got = getattr(_node, "id", None)
    if got is None:
        got = _node.id = ray.get_runtime_context().get_node_id()
    return got


@functools.lru_cache(maxsize=1)
def _listen_host() -> str:
    """Where a producer's pull server listens: ``RAYCOLL_SOCKET_IFNAME``'s address, else the
    node's IP (reachable from every node, also those that join later)."""
    if os.environ.get(IFNAME_ENV):
        return listen_address()
    return str(ray.util.get_node_ip_address())


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of contiguous CPU tensor ``t`` (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _empty(tensor_meta: List[Any]) -> List[torch.Tensor]:
    """Tensors to receive into: small objects from torch's allocator, large ones (all their
    tensors in one block, each 64-byte aligned) from this process's receive pool."""
    sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
             for shape, dtype in tensor_meta]
    pool = recv_pool()
    if sum(sizes) < POOL_MIN_BYTES or pool.cap <= 0:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in tensor_meta]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 64) * 64
    block = pool.take(total)
    out = []
    for (shape, dtype), off, n in zip(tensor_meta, offsets, sizes):
        if n == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(torch.from_numpy(block[off:off + n]).view(dtype).reshape(shape))
    return out


@dataclass
class RaycollTransportMetadata(TensorTransportMetadata):
    """The tensors' shapes and dtypes (Ray's fields) and where they are kept."""

    kept: Optional[Kept] = None


@dataclass
class RaycollCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: a pull needs no communicator (the kept object's metadata says it all)."""


class RaycollTensorTransport(TensorTransportManager):
    """raycoll as an RDT tensor transport for CPU ``torch.Tensor`` objects."""

    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Any actor can keep and pull: no group to form, raycoll imports where it runs.
        return True

    def extract_tensor_transport_metadata(self, obj_id: str,
                                          rdt_object: List[Any]) -> RaycollTransportMetadata:
        tensors = []
        for i, t in enumerate(rdt_object):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor_transport='raycoll' moves torch tensors; item {i} of "
                                f"the object is a {type(t).__name__}")
            if t.device.type != "cpu":
                raise TypeError(f"tensor_transport='raycoll' moves CPU tensors; item {i} is on "
                                f"{t.device} (use Ray's 'nccl' transport for GPU tensors)")
            # A view that is not contiguous is kept as a contiguous copy (read in one piece).
            if t.is_conj() or t.is_neg():  # lazy conjugate / negative views: materialize
                t = t.resolve_conj().resolve_neg()
            tensors.append(t if t.is_contiguous() else t.contiguous())
        try:
            views = [_bytes(t) for t in tensors]
        except (RuntimeError, TypeError) as exc:  # sparse, quantized, ...: no flat bytes
            raise TypeError(f"tensor_transport='raycoll' moves dense tensors: {exc}") from exc
        kept = keeper().keep(obj_id, views, _node_id(), owners=tensors, host=_listen_host())
        return RaycollTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in tensors],
                                        tensor_device="cpu" if tensors else None, kept=kept)

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: Optional[str] = None) -> RaycollCommunicatorMetadata:
        return RaycollCommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                              communicator_metadata: Any,
                              target_buffers: Optional[List[Any]] = None) -> List[Any]:
        meta = tensor_transport_metadata
        if not isinstance(meta, RaycollTransportMetadata) or meta.kept is None:
            raise TransferError(f"object {obj_id}: metadata of another transport "
                                f"({type(meta).__name__}) given to raycoll's")
        if target_buffers:
            tensors = list(target_buffers)
            for i, t in enumerate(tensors):
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise TransferError(f"object {obj_id}: target buffer {i} must be a "
                                        f"contiguous CPU tensor, got one on {t.device}")
        else:
            tensors = _empty(meta.tensor_meta)
        try:
            puller().pull(meta.kept, [_bytes(t) for t in tensors], _node_id(),
                          ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)
        except PullError as exc:
            raise TransferError(f"tensor_transport='raycoll': {exc}") from exc
        return tensors

    def send_multiple_tensors(self, tensors: List[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> None:
        raise NotImplementedError("raycoll's transport is one-sided: the receiver pulls")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any,
                        tensors: List[Any]) -> None:
        keeper().drop(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        puller().abort(obj_id)
