"""Point to point, with ``torch.distributed``'s names and signatures: ``send``, ``recv``,
``isend``, ``irecv``, ``P2POp`` and ``batch_isend_irecv``.

Each resolves the group and the peer (a global rank, or a group rank with ``group_src`` /
``group_dst``), checks the arguments as the collectives do (:mod:`raycoll.collectives`), and
posts the operation on the backend of the tensor's device: it goes straight to the peer over
the group's direct connections (or through the coordinator where there are none), waiting
unless it is ``isend``/``irecv``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from raycoll.algorithms.flat import array_meta
from raycoll.backends.base import CollectiveBackend
from raycoll.collectives import Tensor, _backend, _peer, _resolve, _tensor
from raycoll.process_group import ProcessGroup
from raycoll.tensors import describe, is_tensor
from raycoll.transport.pipes import encode_meta
from raycoll.work import Work
from raycoll.world import GroupLike, world

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


def _p2p(op: str, tensor: Tensor, peer: Optional[int], group: GroupLike, tag: int,
         group_peer: Optional[int], async_op: bool, *, receive: bool) -> Any:
    pg = _resolve(group, op)
    if pg is None:
        return None
    name = "src" if receive else "dst"
    gp = _peer(pg, peer, group_peer, name, f"group_{name}", required=not receive)
    if gp is not None and gp == pg.rank():
        given = peer if peer is not None else group_peer
        raise ValueError(f"{op}: {name}={given} is this rank; a rank cannot "
                         f"{'receive from' if receive else 'send to'} itself")
    if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
        raise TypeError(f"tag must be an int, got {tag!r}")
    info = _tensor(tensor, "tensor", writable=receive)
    backend = _backend(pg, info)
    timeout = pg.timeout_s
    if receive:
        def post() -> Any:
            return backend.recv(tensor, gp, int(tag), timeout)
    else:
        assert gp is not None  # required for a send (checked by _peer)
        dst = gp

        def post() -> Any:
            return backend.send(tensor, dst, int(tag), timeout)
    describe_ = f"{op} on group {pg.name!r}"
    return pg.run_p2p(post, async_op, describe_, [tensor], op=op,
                      ordered=backend.stream_ordered)


def _short(tensor: Any, peer: Any, group: GroupLike, tag: Any, receive: bool) -> bool:
    """The short path of a blocking send or receive: a plain C-contiguous numpy array, a
    global peer rank and an int tag, on a group whose point-to-point runs on pair pipes
    already open to that peer (:meth:`PairPipes.send_now <raycoll.transport.pipes.PairPipes.
    send_now>`, ``recv_now``): a few microseconds of Python instead of tens. ``False`` where
    any of that does not hold or the pipe cannot take it at once: nothing was done, and the
    full path (which checks the arguments and raises their errors) runs."""
    if type(tensor) is not np.ndarray or type(tag) is not int or type(peer) is not int:
        return False
    w = world()
    pg = w.default if group is None else (w.groups.get(group) if type(group) is str else group)
    if type(pg) is not ProcessGroup:
        return False
    pipes = pg.pair_pipes()
    flags = tensor.flags
    if (pipes is None or peer not in pg.global_ranks or tensor.dtype.kind not in "biufc"
            or not flags.c_contiguous or (receive and not flags.writeable)):
        return False
    them = pg.global_ranks.index(peer)
    if them == pg.rank():
        return False
    code = encode_meta(array_meta(tensor))
    if receive:
        return bool(pipes.recv_now(tensor, them, tag, code, pg.timeout_s))
    return bool(pipes.send_now(tensor.reshape(-1).view(np.uint8), them, tag, code))


def send(tensor: Tensor, dst: Optional[int] = None, group: GroupLike = None, tag: int = 0,
         group_dst: Optional[int] = None) -> None:
    """Send ``tensor`` to ``dst``; returns once the message is on its way (a small one is
    buffered for the receiver; a large one once the receiver has taken it)."""
    if group_dst is None and _short(tensor, dst, group, tag, False):
        return
    _p2p("send", tensor, dst, group, tag, group_dst, False, receive=False)


def recv(tensor: Tensor, src: Optional[int] = None, group: GroupLike = None, tag: int = 0,
         group_src: Optional[int] = None) -> Optional[int]:
    """Receive into ``tensor`` from ``src`` (any rank when ``None``); returns the sender's rank."""
    if group_src is None and _short(tensor, src, group, tag, True):
        return src
    return _p2p("recv", tensor, src, group, tag, group_src, False, receive=True)


def isend(tensor: Tensor, dst: Optional[int] = None, group: GroupLike = None, tag: int = 0,
          group_dst: Optional[int] = None) -> Optional[Work]:
    """Send asynchronously (the data is captured at the call); returns a ``Work``."""
    return _p2p("isend", tensor, dst, group, tag, group_dst, True, receive=False)


def irecv(tensor: Tensor, src: Optional[int] = None, group: GroupLike = None, tag: int = 0,
          group_src: Optional[int] = None) -> Optional[Work]:
    """Receive asynchronously into ``tensor``; returns a ``Work`` (``source_rank()`` after)."""
    return _p2p("irecv", tensor, src, group, tag, group_src, True, receive=True)


class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``P2POp(isend, tensor, peer)``."""

    def __init__(self, op: Callable[..., Any], tensor: Tensor, peer: Optional[int] = None,
                 group: GroupLike = None, tag: int = 0, group_peer: Optional[int] = None) -> None:
        name = getattr(op, "__name__", "")
        if name not in ("isend", "irecv"):
            raise ValueError(f"P2POp op must be raycoll.isend or raycoll.irecv, got {op!r}")
        if peer is None and group_peer is None:
            raise ValueError("P2POp needs peer (a global rank) or group_peer (a group rank)")
        if not is_tensor(tensor):
            raise TypeError(f"P2POp tensor must be a tensor, got {type(tensor).__name__}")
        self.op = isend if name == "isend" else irecv
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Post every send and receive of the list at once; returns their ``Work`` handles."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("p2p_op_list must be a non-empty list of P2POp")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"p2p_op_list[{i}] must be a P2POp, got {type(p).__name__}")
    works = []
    with contextlib.ExitStack() as batch:
        # backends that group p2p calls (NCCL) issue the whole list as one group call
        for backend in _batch_backends(p2p_op_list):
            batch.enter_context(backend.batch_p2p())
        for p in p2p_op_list:
            if p.op is isend:
                work = isend(p.tensor, p.peer, p.group, p.tag, group_dst=p.group_peer)
            else:
                work = irecv(p.tensor, p.peer, p.group, p.tag, group_src=p.group_peer)
            if work is not None:
                works.append(work)
    return works


def _batch_backends(p2p_op_list: Sequence[P2POp]) -> List[CollectiveBackend]:
    """The distinct backends the operations of a batch go through (in first-use order)."""
    found: Dict[int, CollectiveBackend] = {}
    for p in p2p_op_list:
        pg = world().resolve(p.group)
        if isinstance(pg, ProcessGroup):
            backend = pg.backend(describe(p.tensor, "tensor").device)
            found.setdefault(id(backend), backend)
    return list(found.values())
