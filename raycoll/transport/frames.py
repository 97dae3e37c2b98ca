"""The wire format of direct connections: frames, and reading and writing them on
non-blocking sockets (see :mod:`raycoll.transport.tcp` for the whole design).

A frame is ``header (magic, meta length, buffer count) | meta | buffer lengths | buffers``.
The meta is a small pickle whose arrays travel as raw buffers: a sender hands the kernel its
arrays' memory (``sendmsg``, no copy), a receiver reads them straight into their destination
(``recv_into``). A garbled frame (bad magic, absurd sizes) raises :class:`FrameError`.
The node segment carries its rounds of Python payloads as whole frames too
(``encode_round``, ``decode_frame``).
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["FrameError", "PeerClosed", "PeerLeft", "BYE", "ABORT", "GOODBYES", "encode_round",
           "decode_round", "decode_frame", "Writer"]

_FRAME_MAGIC = 0x5243
#: magic, meta length, buffer count
_HDR = struct.Struct("!HII")
_MAX_META = 64 << 20
_MAX_BUFS = 1 << 16
_LEN = struct.Struct("!Q")
#: At most this many pieces go to the kernel in one ``sendmsg`` (IOV_MAX is 1024).
_IOV = 512


class FrameError(ConnectionError):
    """A frame that does not parse: the stream is garbled."""


class PeerClosed(ConnectionError):
    """The peer's end of a connection closed without a goodbye: its process is gone."""


class PeerLeft(ConnectionError):
    """The peer closed the connection saying why: it destroyed its group (``"bye"``) or
    found it broken (``"abort"``)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


#: The frames a rank sends on each of its connections when it closes them: in good order,
#: or because it found the group broken. A connection closed with neither: its process died.
BYE = "bye"
ABORT = "abort"
GOODBYES = (BYE, ABORT)


#: Marks an array taken out of a round's payload: ``(_ARR, buffer index, dtype, shape)``.
#: Pickling a numpy array costs far more than pickling a small tuple; rounds carry arrays
#: at this level only.
_ARR = "\0raycoll-array"


def _pull_arrays(obj: Any, raws: List[memoryview], depth: int = 0) -> Any:
    """``obj`` with its arrays (up to three levels of tuples and lists) replaced by markers,
    their memory appended to ``raws``."""
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject is False:
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        raws.append(arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b""))
        return (_ARR, len(raws) - 1, arr.dtype.str, arr.shape)
    if depth < 3 and isinstance(obj, (tuple, list)):
        items = [_pull_arrays(v, raws, depth + 1) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else type(obj)(items)
    return obj


def _put_arrays(obj: Any, bufs: Sequence[Any], depth: int = 0) -> Any:
    """The inverse of :func:`_pull_arrays`: arrays viewing ``bufs`` (no copy)."""
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _ARR:
        _, i, dtype, shape = obj
        return np.frombuffer(bufs[i], dtype=np.dtype(dtype)).reshape(shape)
    if depth < 3 and isinstance(obj, (tuple, list)):
        items = [_put_arrays(v, bufs, depth + 1) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else type(obj)(items)
    return obj


def encode_round(obj: Any) -> List[memoryview]:
    """A round's message as frame pieces: its arrays travel as raw buffers (not copied)."""
    raws: List[memoryview] = []
    meta = pickle.dumps(_pull_arrays(obj, raws), protocol=5)
    head = _HDR.pack(_FRAME_MAGIC, len(meta), len(raws))
    lens = b"".join(_LEN.pack(r.nbytes) for r in raws)
    return [memoryview(head), memoryview(meta), memoryview(lens)] + raws


def decode_round(meta: bytes, bufs: Sequence[Any]) -> Any:
    return _put_arrays(pickle.loads(meta), bufs)


def decode_frame(frame: Any) -> Any:
    """The message of one whole frame held in memory (``b"".join(encode_round(obj))``); its
    arrays view ``frame``."""
    view = memoryview(frame)
    magic, meta_len, nbufs = _HDR.unpack_from(view)
    if magic != _FRAME_MAGIC:
        raise FrameError("not a raycoll frame")
    at = _HDR.size + meta_len
    meta = view[_HDR.size:at]
    lens = [_LEN.unpack_from(view, at + i * _LEN.size)[0] for i in range(nbufs)]
    at += nbufs * _LEN.size
    bufs = []
    for n in lens:
        bufs.append(view[at:at + n])
        at += n
    return decode_round(meta, bufs)


class Writer:
    """A frame being handed to a non-blocking socket."""

    def __init__(self, parts: List[memoryview]) -> None:
        self.parts = [p.cast("B") if p.format != "B" or p.ndim != 1 else p
                      for p in parts if p.nbytes]

    def push(self, sock: socket.socket) -> bool:
        """Send what the socket takes now; ``True`` once all went."""
        while self.parts:
            try:
                sent = sock.sendmsg(self.parts[:_IOV])
            except (BlockingIOError, InterruptedError):
                return False
            while sent:
                head = self.parts[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    self.parts.pop(0)
                else:
                    self.parts[0] = head[sent:]
                    sent = 0
        return True
