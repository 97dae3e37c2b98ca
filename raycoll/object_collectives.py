"""The object collectives, with ``torch.distributed``'s names and signatures.

``all_gather_object``, ``broadcast_object_list``, ``gather_object`` and
``scatter_object_list`` move Python objects through the Ray object store as they are (see
:mod:`raycoll.backends.objects`). ``send_object_list`` / ``recv_object_list`` go straight between the
pair over raycoll's point-to-point, as torch's do: the list is pickled (cloudpickle) into a
byte array that follows a two-number header (object count, byte count).
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional, cast

import numpy as np
import ray

from raycoll.backends import objects
from raycoll.collectives import Prepared, _given, _peer, _resolve, _run
from raycoll.p2p import recv, send
from raycoll.process_group import ProcessGroup
from raycoll.world import GroupLike

__all__ = [
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
]


def all_gather_object(object_list: List[Any], obj: Any, group: GroupLike = None) -> None:
    """Fill ``object_list`` with every rank's ``obj`` (through the object store)."""
    def prepare(pg: ProcessGroup) -> Prepared:
        if not isinstance(object_list, list):
            raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
        if len(object_list) != pg.size():
            raise ValueError(f"object_list must have one slot per rank: expected {pg.size()}, "
                             f"got {len(object_list)}")
        ref = objects.put(obj, "obj")
        return {}, lambda call: objects.all_gather(pg.context, call, ref, object_list)

    _run("all_gather_object", group, False, prepare)


def broadcast_object_list(object_list: List[Any], src: Optional[int] = None,
                          group: GroupLike = None, device: Any = None,
                          group_src: Optional[int] = None) -> None:
    """Replace ``object_list``'s items on every rank with those of ``src`` (default 0, as in
    torch)."""
    def prepare(pg: ProcessGroup) -> Prepared:
        root = _peer(pg, 0 if src is None and group_src is None else src, group_src, "src",
                     "group_src")
        if not isinstance(object_list, list):
            raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
        ref = objects.put(list(object_list), "object_list") if pg.rank() == root else None
        fp = {"root": root, "length": len(object_list)}
        return fp, lambda call: objects.broadcast(pg.context, call, ref, root, object_list)

    _run("broadcast_object_list", group, False, prepare)


def gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None,
                  dst: Optional[int] = None, group: GroupLike = None,
                  group_dst: Optional[int] = None) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on ``dst``."""
    def prepare(pg: ProcessGroup) -> Prepared:
        root = _peer(pg, 0 if dst is None and group_dst is None else dst, group_dst, "dst",
                     "group_dst")
        if pg.rank() == root:
            if not isinstance(object_gather_list, list) or len(object_gather_list) != pg.size():
                got = (len(object_gather_list) if isinstance(object_gather_list, list)
                       else type(object_gather_list).__name__)
                raise ValueError(f"object_gather_list on the destination rank must be a list "
                                 f"with one slot per rank ({pg.size()}), got {got}")
        elif _given(object_gather_list):
            raise ValueError("object_gather_list must not be given on a non-destination rank")
        ref = objects.put(obj, "obj")
        return {"root": root}, lambda call: objects.gather(pg.context, call, ref, root,
                                                           object_gather_list)

    _run("gather_object", group, False, prepare)


def scatter_object_list(scatter_object_output_list: List[Any],
                        scatter_object_input_list: Optional[List[Any]] = None,
                        src: Optional[int] = None, group: GroupLike = None,
                        group_src: Optional[int] = None) -> None:
    """Send ``scatter_object_input_list[i]`` from ``src``; rank i's lands in
    ``scatter_object_output_list[0]``."""
    def prepare(pg: ProcessGroup) -> Prepared:
        root = _peer(pg, 0 if src is None and group_src is None else src, group_src, "src",
                     "group_src")
        if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
            raise ValueError("scatter_object_output_list must be a non-empty list")
        refs = None
        if pg.rank() == root:
            if (not isinstance(scatter_object_input_list, list)
                    or len(scatter_object_input_list) != pg.size()):
                raise ValueError(f"scatter_object_input_list on the source rank must be a list "
                                 f"with one object per rank ({pg.size()})")
            refs = [objects.put(o, f"scatter_object_input_list[{i}]")
                    for i, o in enumerate(scatter_object_input_list)]
        return {"root": root}, lambda call: objects.scatter(pg.context, call, refs, root,
                                                            scatter_object_output_list)

    _run("scatter_object_list", group, False, prepare)


# ---------------------------------------------------------------------- point to point
def _p2p_peer(op: str, group: GroupLike, peer: Optional[int], group_peer: Optional[int],
              name: str, *, required: bool) -> Any:
    """(group, group rank of the peer or None), or None for a non-member (warned)."""
    pg = _resolve(group, op)
    if pg is None:
        return None
    gp = _peer(pg, peer, group_peer, name, f"group_{name}", required=required)
    if gp is not None and gp == pg.rank():
        kind = "destination" if name == "dst" else "source"
        raise ValueError(f"Invalid {kind} rank: {kind} rank should not be the same as the "
                         f"rank of the current process ({op}: {name}={peer}, "
                         f"group_{name}={group_peer})")
    return pg, gp


def send_object_list(object_list: List[Any], dst: Optional[int] = None, group: GroupLike = None,
                     device: Any = None, group_dst: Optional[int] = None,
                     use_batch: bool = False) -> None:
    """Send the picklable objects of ``object_list`` to ``dst`` (a global rank; or
    ``group_dst``, a group rank); returns once the receiver has taken them. ``device`` is
    accepted for torch's signature (objects travel through host memory whatever it is);
    ``use_batch`` sends through :func:`batch_isend_irecv` (same result)."""
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    found = _p2p_peer("send_object_list", group, dst, group_dst, "dst", required=True)
    if found is None:
        return None
    pg, gp = found
    try:
        payload = ray.cloudpickle.dumps(list(object_list), protocol=5)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types
        raise TypeError(f"object_list cannot be pickled ({type(exc).__name__}: {exc})") from exc
    header = np.array([len(object_list), len(payload)], dtype=np.int64)
    data = np.frombuffer(payload, dtype=np.uint8)  # read-only is fine: a send only reads
    for tensor in (header, data):
        if use_batch:
            from raycoll.p2p import P2POp, batch_isend_irecv, isend

            for work in batch_isend_irecv([P2POp(isend, tensor, group=pg, group_peer=gp)]):
                work.wait()
        else:
            send(tensor, group=pg, group_dst=gp)
    return None


def recv_object_list(object_list: List[Any], src: Optional[int] = None, group: GroupLike = None,
                     device: Any = None, group_src: Optional[int] = None,
                     use_batch: bool = False) -> int:
    """Receive into ``object_list`` (in place; one slot per object sent) the objects a
    ``send_object_list`` sent from ``src`` (a global rank; ``group_src`` a group rank; any
    rank when both are ``None``). Returns the sender's global rank; -1 on a non-member."""
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    found = _p2p_peer("recv_object_list", group, src, group_src, "src", required=False)
    if found is None:
        return -1
    pg, gp = found
    header = np.zeros(2, dtype=np.int64)
    sender = _recv(header, pg, gp, use_batch)
    count, nbytes = int(header[0]), int(header[1])
    data = np.empty(nbytes, dtype=np.uint8)
    _recv(data, pg, pg.global_ranks.index(sender), use_batch)  # the rest, from the same rank
    if count != len(object_list):
        raise ValueError(f"recv_object_list: rank {sender} sent {count} objects but "
                         f"object_list has {len(object_list)} slots (they must be equal)")
    object_list[:] = pickle.loads(data.tobytes())
    return sender


def _recv(tensor: np.ndarray, pg: ProcessGroup, gp: Optional[int], use_batch: bool) -> int:
    """Receive ``tensor`` from group rank ``gp`` (any when None); the sender's global rank."""
    if use_batch and gp is not None:
        from raycoll.p2p import P2POp, batch_isend_irecv, irecv

        (work,) = batch_isend_irecv([P2POp(irecv, tensor, group=pg, group_peer=gp)])
        work.wait()
        return pg.global_ranks[gp]
    return cast(int, recv(tensor, group=pg, group_src=gp))  # a member's recv: the sender
