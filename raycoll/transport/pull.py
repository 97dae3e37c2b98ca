"""Objects a process keeps for others to pull: the data plane of raycoll's Ray Direct
Transport (:mod:`raycoll.rdt`), knowing nothing of Ray or of tensors beyond their bytes.

A process that makes an object *keeps* it: :class:`Keeper` holds flat byte views of its
buffers (so that they stay alive and in place) under the object's id, with a 16-byte canary
of random bytes, until the object is *dropped* (Ray's garbage collection). What it hands out,
:class:`Kept`, tells a reader everything: the keeper's node, pid, each buffer's address and
length, the canary's, and the address and secret of the keeper's pull server.

A small object (at most ``RAYCOLL_RDT_INLINE_BYTES``, default 64 KiB, all buffers together)
travels inside :class:`Kept` itself, copied when it is kept: its reader copies it out and
no path below is taken (across nodes that saves a round trip to the keeper). A larger one
the reader *pulls* into buffers of its own, by one of two paths:

- **cross-memory read** (same node, native core present): one ``process_vm_readv`` for every
  buffer of the object and the canary after them (:func:`raycoll.native.core.cma_read`, one
  copy a byte, the keeper takes no part). The canary is zeroed before an object is dropped,
  so a read that finds it whole read buffers that were alive all along; a keeper that is
  gone (``ESRCH``) or replaced (another canary) is named. Where the kernel refuses
  (``EPERM``: no ptrace permission between the two processes) the reader falls back to the
  sockets for that keeper.
- **the keeper's pull server** (other nodes, and the fallback): a TCP connection to a thread
  of the keeper, one request (the secret and the object's id), one reply (a header, then
  every buffer of the object back to back, vectored). Connections are pooled per keeper, so
  that small objects cost one round trip. A reply cut short, a timeout, or
  :meth:`Puller.abort` closes that connection and fails the pull; the keeper and the reader
  go on.

A reader's buffers for large objects come from :class:`RecvPool`: anonymous mappings
(transparent huge pages asked for) that return to the pool when the arrays over them are
garbage collected, so that a steady stream of transfers reuses memory already mapped
instead of faulting fresh pages in (on this machine that halves a 64 MiB transfer). The pool
keeps at most ``RAYCOLL_RDT_POOL_MB`` (default 512) idle; ``0`` turns it off.

``RAYCOLL_RDT_CMA=0`` in a reader's environment turns the cross-memory reads off (every pull
then takes the sockets, as between nodes: for tests and comparisons).

Every failure is a :class:`PullError` naming the object and the keeper; nothing waits
without a deadline.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from raycoll.native import core
from raycoll.transport.links import listen_address

__all__ = ["Kept", "Keeper", "Puller", "PullError", "RecvPool", "keeper", "puller",
           "recv_pool", "CMA_ENV", "POOL_ENV", "POOL_MIN_BYTES", "INLINE_ENV",
           "INLINE_BYTES"]

_MAGIC = b"RCP1"
#: request: magic, secret, object-id length; then the id
_REQUEST = struct.Struct("!4s16sH")
#: reply: magic, status, total bytes
_REPLY = struct.Struct("!4sIQ")
_OK, _UNKNOWN, _REFUSED = 0, 1, 2
_CANARY_BYTES = 16
#: The most idle connections a reader keeps to one keeper, and the most keepers it keeps
#: idle connections to.
_POOL = 4
_KEEPERS = 64
_EPERM = 1
#: ``RAYCOLL_RDT_CMA=0``: no cross-memory reads in this process (sockets only).
CMA_ENV = "RAYCOLL_RDT_CMA"
#: Objects of at most this many bytes (``RAYCOLL_RDT_INLINE_BYTES``) travel in their metadata.
INLINE_ENV = "RAYCOLL_RDT_INLINE_BYTES"
INLINE_BYTES = int(os.environ.get(INLINE_ENV, str(64 << 10)))
#: The most idle bytes a reader's :class:`RecvPool` keeps, in MiB (``0``: no pool).
POOL_ENV = "RAYCOLL_RDT_POOL_MB"
#: Objects from this many bytes take pooled buffers (smaller ones: the allocator's).
POOL_MIN_BYTES = 1 << 20
_HUGE = 2 << 20


class PullError(RuntimeError):
    """A pull failed: the keeper is gone, dropped the object, refused, or timed out."""


@dataclass(frozen=True)
class Kept:
    """What a reader needs to pull one kept object."""

    obj_id: str
    node_id: str
    pid: int
    #: (address, length) of each buffer, in the keeper's memory
    ranges: Tuple[Tuple[int, int], ...]
    canary_addr: int
    canary: bytes
    host: str
    port: int
    secret: bytes
    #: the object's bytes, back to back, where it is small enough to travel here
    inline: Optional[bytes] = None

    @property
    def nbytes(self) -> int:
        """The object's bytes, all buffers together."""
        return sum(n for _, n in self.ranges)


class Keeper:
    """This process's kept objects and its pull server (started on the first keep)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: Dict[str, Tuple[List[np.ndarray], np.ndarray, List[object]]] = {}
        self._secret = os.urandom(16)
        self._server: Optional[socket.socket] = None
        self._address: Tuple[str, int] = ("", 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def keep(self, obj_id: str, views: Sequence[np.ndarray], node_id: str,
             owners: Sequence[object] = (), host: Optional[str] = None) -> Kept:
        """Keep ``views`` (flat, C-contiguous uint8 arrays) under ``obj_id``; ``owners`` stay
        alive with them (the tensors the views share memory with). ``host``: the address
        the pull server listens on, the first time (default: raycoll's listen address)."""
        flat = []
        for i, v in enumerate(views):
            if v.dtype != np.uint8 or v.ndim != 1 or not v.flags.c_contiguous:
                raise ValueError(f"buffer {i} of object {obj_id} must be a flat, contiguous "
                                 f"uint8 view, got {v.dtype} of shape {v.shape}")
            flat.append(v)
        ranges = tuple((int(v.ctypes.data) if v.nbytes else 0, int(v.nbytes)) for v in flat)
        if sum(v.nbytes for v in flat) <= INLINE_BYTES:
            return Kept(obj_id=obj_id, node_id=node_id, pid=os.getpid(), ranges=ranges,
                        canary_addr=0, canary=b"", host="", port=0, secret=b"",
                        inline=b"".join(v.tobytes() for v in flat))
        canary = np.frombuffer(bytearray(os.urandom(_CANARY_BYTES)), dtype=np.uint8)
        host, port = self._serve(host)
        with self._lock:
            self._objects[obj_id] = (flat, canary, list(owners))
        return Kept(obj_id=obj_id, node_id=node_id, pid=os.getpid(), ranges=ranges,
                    canary_addr=int(canary.ctypes.data), canary=canary.tobytes(),
                    host=host, port=port, secret=self._secret)

    def drop(self, obj_id: str) -> bool:
        """Stop keeping ``obj_id`` (its canary zeroed first); whether it was kept."""
        with self._lock:
            got = self._objects.pop(obj_id, None)
        if got is None:
            return False
        got[1][:] = 0
        return True

    # ------------------------------------------------------------------ the pull server
    def _serve(self, host: Optional[str]) -> Tuple[str, int]:
        with self._lock:
            if self._server is None:
                host = host or listen_address()
                srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                srv.bind((host, 0))
                srv.listen(64)
                self._server, self._address = srv, (host, srv.getsockname()[1])
                threading.Thread(target=self._accept, args=(srv,), daemon=True,
                                 name="raycoll-pull-server").start()
            return self._address

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._answer, args=(conn,), daemon=True,
                             name="raycoll-pull-conn").start()

    def _answer(self, conn: socket.socket) -> None:
        """Serve one reader's requests, one after another, until it closes."""
        with conn:
            while True:
                try:
                    head = _recv_head(conn, _REQUEST.size)
                    if head is None:
                        return
                    magic, secret, n = _REQUEST.unpack(head)
                    obj_id = _recv_exact(conn, n).decode()
                    if magic != _MAGIC or secret != self._secret:
                        conn.sendall(_REPLY.pack(_MAGIC, _REFUSED, 0))
                        return
                    with self._lock:
                        got = self._objects.get(obj_id)
                    if got is None:
                        conn.sendall(_REPLY.pack(_MAGIC, _UNKNOWN, 0))
                        continue
                    views = [v for v in got[0] if v.nbytes]
                    total = sum(v.nbytes for v in views)
                    _send_all(conn, [memoryview(_REPLY.pack(_MAGIC, _OK, total))]
                              + [v.data for v in views])
                except (OSError, EOFError, ValueError, struct.error):
                    return  # the reader closed, or sent what is not a request


class RecvPool:
    """Reusable receive memory: :meth:`take` gives a flat uint8 array over an anonymous
    mapping, which comes back to the pool (up to ``cap`` idle bytes, the oldest dropped
    first) once that array and every view of it are garbage collected."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._idle: "OrderedDict[int, List[mmap.mmap]]" = OrderedDict()
        self._idle_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (rounded up to 2 MiB underneath)."""
        size = -(-max(nbytes, 1) // _HUGE) * _HUGE
        mm = None
        with self._lock:
            free = self._idle.get(size)
            if free:
                mm = free.pop()
                self._idle_bytes -= size
                if not free:
                    del self._idle[size]
        if mm is None:
            mm = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
        arr = np.frombuffer(mm, dtype=np.uint8)
        weakref.finalize(arr, self._give_back, mm, size)
        return arr[:nbytes]

    def _give_back(self, mm: mmap.mmap, size: int) -> None:
        with self._lock:
            if size > self.cap:
                return
            while self._idle_bytes + size > self.cap and self._idle:
                old, free = next(iter(self._idle.items()))
                free.pop(0)
                self._idle_bytes -= old
                if not free:
                    del self._idle[old]
            self._idle.setdefault(size, []).append(mm)
            self._idle.move_to_end(size)
            self._idle_bytes += size


class Puller:
    """This process's side of pulls: pooled connections to keepers, the aborts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Dict[Tuple[str, int], List[socket.socket]] = {}
        self._active: Dict[str, socket.socket] = {}
        self._aborted: set = set()
        #: keepers (node, pid) whose memory this process may not read
        self._no_cma: set = set()
        self.by_path = {"inline": 0, "cma": 0, "socket": 0}
        self.cma = os.environ.get(CMA_ENV, "1").strip().lower() not in ("0", "false", "no",
                                                                          "off")

    def pull(self, kept: Kept, bufs: Sequence[np.ndarray], node_id: str,
             timeout_s: float) -> str:
        """Pull ``kept`` into ``bufs`` (writable uint8 arrays of exactly its buffers'
        lengths); the path it took (``"inline"``, ``"cma"`` or ``"socket"``)."""
        if len(bufs) != len(kept.ranges):
            raise PullError(f"object {kept.obj_id}: {len(kept.ranges)} buffers kept, "
                            f"{len(bufs)} to receive into")
        for i, (b, (_, n)) in enumerate(zip(bufs, kept.ranges)):
            if b.nbytes != n:
                raise PullError(f"object {kept.obj_id}: buffer {i} has {b.nbytes} bytes, the "
                                f"kept one {n}")
        if kept.inline is not None:
            at = 0
            for b in bufs:
                b[:] = np.frombuffer(kept.inline, dtype=np.uint8, count=b.nbytes, offset=at)
                at += b.nbytes
            self.by_path["inline"] += 1
            return "inline"
        if (core is not None and self.cma and kept.node_id == node_id
                and (kept.node_id, kept.pid) not in self._no_cma and self._cma(kept, bufs)):
            self.by_path["cma"] += 1
            return "cma"
        self._socket(kept, bufs, timeout_s)
        self.by_path["socket"] += 1
        return "socket"

    def abort(self, obj_id: str) -> bool:
        """End a pull of ``obj_id`` in progress (its connection closed); whether one was."""
        with self._lock:
            sock = self._active.pop(obj_id, None)
            if sock is not None:
                self._aborted.add(obj_id)
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _who(self, kept: Kept) -> str:
        return f"object {kept.obj_id} kept by pid {kept.pid} on node {kept.node_id[:12]}"

    def _cma(self, kept: Kept, bufs: Sequence[np.ndarray]) -> bool:
        canary = np.empty(_CANARY_BYTES, dtype=np.uint8)
        remote = [r for r in kept.ranges if r[1]] + [(kept.canary_addr, _CANARY_BYTES)]
        local = [b for b in bufs if b.nbytes] + [canary]
        status, err = core.cma_read(kept.pid, remote, local)
        if status == core.DEAD:
            raise PullError(f"{self._who(kept)}: that process is gone (it died or exited)")
        if status != core.OK:
            if err == _EPERM:  # no ptrace permission: the sockets serve this keeper
                self._no_cma.add((kept.node_id, kept.pid))
                return False
            raise PullError(f"{self._who(kept)}: the cross-memory read failed "
                            f"({os.strerror(err) if err else 'nothing read'}); the object "
                            "was freed or its process replaced")
        if canary.tobytes() != kept.canary:
            raise PullError(f"{self._who(kept)}: the object was freed during or before the "
                            "read (its canary is gone)")
        return True

    # ------------------------------------------------------------------ sockets
    def _connect(self, kept: Kept, timeout_s: float) -> Tuple[socket.socket, bool]:
        """A connection to ``kept``'s keeper, and whether it is an idle one reused."""
        key = (kept.host, kept.port)
        with self._lock:
            idle = self._pool.get(key)
            if idle:
                return idle.pop(), True
        try:
            sock = socket.create_connection(key, timeout=timeout_s)
        except OSError as exc:
            raise PullError(f"{self._who(kept)}: cannot reach its pull server at "
                            f"{kept.host}:{kept.port} ({exc}); the process is gone") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _socket(self, kept: Kept, bufs: Sequence[np.ndarray], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            sock, reused = self._connect(kept, timeout_s)
            with self._lock:
                self._active[kept.obj_id] = sock
            replied, ok = [False], False
            try:
                self._exchange(sock, kept, bufs, timeout_s, deadline, replied)
                ok = True
                return
            except (OSError, EOFError) as exc:
                if kept.obj_id in self._aborted:
                    raise PullError(f"{self._who(kept)}: the transfer was aborted") from exc
                if reused and not replied[0] and not isinstance(exc, socket.timeout):
                    continue  # an idle connection the keeper had closed: once more, afresh
                if isinstance(exc, socket.timeout):
                    raise PullError(f"{self._who(kept)}: no reply within {timeout_s:.3g} s") \
                        from exc
                raise PullError(f"{self._who(kept)}: the connection failed ({exc}); the "
                                "process is gone or the transfer was aborted") from exc
            finally:
                with self._lock:
                    self._active.pop(kept.obj_id, None)
                    self._aborted.discard(kept.obj_id)
                    idle = self._pool.pop((kept.host, kept.port), [])
                    self._pool[(kept.host, kept.port)] = idle  # the newest, last
                    if ok and len(idle) < _POOL:
                        idle.append(sock)
                        sock = None  # type: ignore[assignment]
                    while len(self._pool) > _KEEPERS:  # the least recently used keepers'
                        for old in self._pool.pop(next(iter(self._pool))):
                            old.close()
                if sock is not None:
                    sock.close()

    def _exchange(self, sock: socket.socket, kept: Kept, bufs: Sequence[np.ndarray],
                  timeout_s: float, deadline: float, replied: List[bool]) -> None:
        """One request and its reply, into ``bufs`` (``replied[0]``: a reply began)."""
        sock.settimeout(timeout_s)
        oid = kept.obj_id.encode()
        sock.sendall(_REQUEST.pack(_MAGIC, kept.secret, len(oid)) + oid)
        magic, status, total = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
        replied[0] = True
        if magic != _MAGIC or status != _OK:
            why = {_UNKNOWN: "it no longer keeps it (freed)",
                   _REFUSED: "it refused the request"}.get(status, "a garbled reply")
            raise PullError(f"{self._who(kept)}: {why}")
        if total != kept.nbytes:
            raise PullError(f"{self._who(kept)}: {total} bytes sent, {kept.nbytes} kept")
        for b in bufs:
            _recv_into(sock, b.data.cast("B"), deadline)


def _recv_head(sock: socket.socket, n: int) -> Optional[bytes]:
    """``n`` bytes, or ``None`` where the peer closed before sending any."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise EOFError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    got = _recv_head(sock, n)
    if got is None:
        raise EOFError(f"the connection closed before any of {n} bytes")
    return got


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got, n = 0, len(view)
    while got < n:
        if time.monotonic() > deadline:
            raise socket.timeout("the transfer ran past its deadline")
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise EOFError(f"the connection closed after {got} of {n} bytes")
        got += k


def _send_all(sock: socket.socket, views: List[memoryview]) -> None:
    """Send every view, vectored (``sendmsg``), resuming after partial sends."""
    views = [v.cast("B") for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


_keeper: Optional[Keeper] = None
_puller: Optional[Puller] = None
_pool: Optional[RecvPool] = None
_init = threading.Lock()


def keeper() -> Keeper:
    """This process's :class:`Keeper`."""
    global _keeper
    with _init:
        if _keeper is None:
            _keeper = Keeper()
        return _keeper


def puller() -> Puller:
    """This process's :class:`Puller`."""
    global _puller
    with _init:
        if _puller is None:
            _puller = Puller()
        return _puller


def recv_pool() -> RecvPool:
    """This process's :class:`RecvPool` (its cap from ``RAYCOLL_RDT_POOL_MB``)."""
    global _pool
    with _init:
        if _pool is None:
            _pool = RecvPool(int(float(os.environ.get(POOL_ENV, "512")) * (1 << 20)))
        return _pool
