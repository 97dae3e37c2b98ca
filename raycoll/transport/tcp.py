"""Direct sockets between ranks: collectives across nodes, and point-to-point everywhere.

Ray stays the launcher, the discovery service and the failure detector; the bytes go
straight between the ranks' processes, as gloo's and NCCL's do (measured on the reference
machine with two Ray nodes: a socket round trip ~11 us and 2.2 GB/s, against ~0.5 ms a hop
and 0.8 GB/s for a compiled-graph channel and 1.2 GB/s for a cross-node ``ray.get``; see
benchmarks/BENCHMARKS.md).

- **Addresses.** Every process that joins a group listens on one TCP port (one listening
  socket per process, shared by all its groups) and reports it at rendezvous. It listens on
  the interface named by ``RAYCOLL_SOCKET_IFNAME`` (as ``GLOO_SOCKET_IFNAME``; ``lo`` keeps
  everything on 127.0.0.1), else on Ray's node address when the cluster has several nodes,
  else on 127.0.0.1.
- **Security.** The coordinator hands each generation of a group a random 16-byte secret
  over Ray's channels. A connection opens with a fixed-size hello (magic, group name,
  sender rank, purpose, secret); one that does not present the group's secret is closed
  before anything it sends reaches a buffer of the group.
- **Connections.** Lazily, one per (sender, receiver, purpose), over a Unix socket between
  ranks of one node (cheaper per message than TCP over loopback; ``RAYCOLL_UNIX_SOCKETS=0``
  turns it off), TCP between nodes: the sender connects; the
  receiver's listener hands the accepted socket to the group. ``"coll"`` connections carry
  collective rounds (:class:`TcpTransport`, strictly in the group's collective order);
  ``"p2p"`` connections carry point-to-point messages (:class:`Mailbox`). TCP_NODELAY on
  all; non-blocking, waited on with ``select``.
- **Frames.** ``header (magic, meta length, buffer count) | meta | buffer lengths |
  buffers``. The meta is a small pickle whose arrays travel as raw buffers: a sender
  hands the kernel its arrays' memory (``sendmsg``, no copy), a receiver reads them straight
  into their destination (``recv_into``): for rounds a per-peer buffer the algorithm reads
  in place, for a matched ``recv`` the user's array itself. A garbled frame (bad magic,
  absurd sizes) breaks the group with a clear error.
- **Failures.** A peer's process that dies closes its sockets: the survivors' reads end,
  and the coordinator (which learns of the death from the rank's lease) names the rank
  (``RankFailedError``). Destroying a group closes its sockets.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import logging
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raycoll import errors
from raycoll.transport.base import Message, RoundTransport, may_spin, project

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.backends.base import GroupContext

logger = logging.getLogger("raycoll")

__all__ = ["listen_address", "tcp_possible", "Links", "TcpTransport", "Mailbox", "IFNAME_ENV"]

IFNAME_ENV = "RAYCOLL_SOCKET_IFNAME"
#: ``RAYCOLL_UNIX_SOCKETS=0``: peers on one node connect over TCP too.
UNIX_ENV = "RAYCOLL_UNIX_SOCKETS"
_HELLO_MAGIC = b"RCL1"
_SECRET_BYTES = 16
#: magic, secret, sender rank, purpose, group-name length
_HELLO = struct.Struct("!4s16sIBH")
_PURPOSES = ("coll", "p2p")
#: A hello must arrive this fast, and its group be known here within this long.
HELLO_TIMEOUT_S = 10.0
_FRAME_MAGIC = 0x5243
#: magic, meta length, buffer count
_HDR = struct.Struct("!HII")
_MAX_META = 64 << 20
_MAX_BUFS = 1 << 16
_LEN = struct.Struct("!Q")
_ALIGN = 64
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
_BYE = "bye"
_ABORT = "abort"
_GOODBYES = (_BYE, _ABORT)
#: A closed connection waits this long for the coordinator to explain it before its peer
#: is declared dead (a process's death reaches the coordinator within milliseconds; a
#: whole node's only when Ray's health check declares it dead).
CLOSED_GRACE_S = 1.0
#: poll() events that say a connection's other end is closed.
_CLOSED_EVENTS = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
#: How long a receive polls its sockets before it sleeps in select, where each rank has a
#: core (a wake-up from select costs about as long as a small reply takes to come).
P2P_SPIN_S = 0.001


# ---------------------------------------------------------------------------- addresses
def _iface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``."""
    if name == "lo":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def listen_address() -> str:
    """Where this process listens (see the module docstring)."""
    name = os.environ.get(IFNAME_ENV)
    if name:
        return _iface_address(name)
    try:
        import ray

        if len([n for n in ray.nodes() if n.get("Alive")]) > 1:
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not connected: a single process, loopback serves
        pass
    return "127.0.0.1"


# ---------------------------------------------------------------------------- the listener
class _Listener:
    """This process's listening socket, and the groups it accepts connections for."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(128)
        socks = [self.sock]
        # Peers on this node connect through a Unix socket in the abstract namespace (no
        # file; gone with the process): cheaper per message than TCP over loopback.
        unix: Optional[str] = None
        if os.environ.get(UNIX_ENV, "1") != "0" and hasattr(socket, "AF_UNIX"):
            try:
                local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                name = f"\0raycoll-{os.getpid()}-{os.urandom(6).hex()}"
                local.bind(name)
                local.listen(128)
                socks.append(local)
                unix = name
            except OSError:
                unix = None
        #: ``(host, port, unix name or None)``, as reported at rendezvous.
        self.address = (host, self.sock.getsockname()[1], unix)
        self._lock = threading.Condition()
        self._groups: Dict[str, "Links"] = {}
        for sock in socks:
            threading.Thread(target=self._accept_loop, args=(sock,), name="raycoll-listener",
                             daemon=True).start()

    def register(self, links: "Links") -> None:
        with self._lock:
            self._groups[links.key] = links
            self._lock.notify_all()

    def unregister(self, links: "Links") -> None:
        with self._lock:
            if self._groups.get(links.key) is links:
                del self._groups[links.key]

    def _accept_loop(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hello, args=(conn,), name="raycoll-hello",
                             daemon=True).start()

    def _hello(self, conn: socket.socket) -> None:
        """Read a connection's hello; hand it to its group, or close it."""
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            raw = _recv_exact(conn, _HELLO.size)
            magic, secret, src, purpose, name_len = _HELLO.unpack(raw)
            if magic != _HELLO_MAGIC or purpose >= len(_PURPOSES) or name_len > 4096:
                raise FrameError("not a raycoll hello")
            key = _recv_exact(conn, name_len).decode()
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            with self._lock:
                while key not in self._groups and time.monotonic() < deadline:
                    self._lock.wait(0.1)
                links = self._groups.get(key)
            if links is None or not hmac.compare_digest(secret, links.secret) \
                    or not 0 <= src < links.size or src == links.rank:
                raise FrameError("wrong group, secret or rank")
            conn.settimeout(None)
            conn.setblocking(False)
            _tune(conn)
            links.accepted(src, _PURPOSES[purpose], conn)
        except Exception as exc:  # noqa: BLE001 - a stranger or a stale peer: drop it
            logger.debug("raycoll: refused a connection (%s: %s)", type(exc).__name__, exc)
            conn.close()


_LISTENER: Optional[_Listener] = None
_LISTENER_LOCK = threading.Lock()


def listener() -> Optional[_Listener]:
    """This process's listener (started on first use), or ``None`` if it cannot listen."""
    global _LISTENER
    with _LISTENER_LOCK:
        if _LISTENER is None:
            try:
                _LISTENER = _Listener(listen_address())
            except Exception as exc:  # noqa: BLE001 - then its groups use the object store
                logger.warning("raycoll: cannot listen for direct connections (%s: %s); "
                               "groups of this process use the coordinator for their data",
                               type(exc).__name__, exc)
                return None
        return _LISTENER


def _tune(sock: socket.socket) -> None:
    if sock.family != getattr(socket, "AF_UNIX", None):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed("closed during the hello")
        got += k
    return bytes(buf)


def tcp_possible(ctx: "GroupContext") -> bool:
    """Whether every rank of ``ctx`` can be reached directly (each reported an address)."""
    return ctx.size > 1 and ctx.secret is not None and all(a for a in ctx.addresses)


# ---------------------------------------------------------------------------- frames
#: Marks an array taken out of a round's payload: ``(_ARR, buffer index, dtype, shape)``.
#: Pickling a numpy array costs ~8x a small tuple; rounds carry arrays at this level only.
_ARR = "\0raycoll-array"


def _pull_arrays(obj: Any, raws: List[memoryview], depth: int = 0) -> Any:
    """``obj`` with its arrays (up to three levels of tuples and lists) replaced by markers,
    their memory appended to ``raws``."""
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject is False:
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        raws.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b""))
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


def encode_raw(meta: Any, data: memoryview) -> List[memoryview]:
    """A frame of a pickled ``meta`` and one raw buffer."""
    m = pickle.dumps(meta, protocol=5)
    return [memoryview(_HDR.pack(_FRAME_MAGIC, len(m), 1)), memoryview(m),
            memoryview(_LEN.pack(data.nbytes)), data]


class _Writer:
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


#: ``place(meta, lengths) -> destination buffers`` for a frame's raw buffers.
Placer = Callable[[bytes, List[int]], List[memoryview]]


class _Reader:
    """Frames read from a non-blocking socket: headers through a staging buffer (one
    ``recv`` takes a small frame whole, and the start of the next), large buffers straight
    into their destination."""

    STAGE = 256 * 1024

    def __init__(self) -> None:
        self._stage = bytearray(self.STAGE)
        self._view = memoryview(self._stage)
        self._lo = self._hi = 0  # staged bytes not yet consumed
        self._reset()

    def _reset(self) -> None:
        self._step = 0
        self._meta = b""
        self._lens: List[int] = []
        self._bufs: List[memoryview] = []
        self._i = 0
        self._got = 0

    @property
    def busy(self) -> bool:
        """Whether a frame is partly read."""
        return self._step > 0 or self._hi > self._lo

    def _recv(self, sock: socket.socket, into: memoryview) -> int:
        try:
            k = sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return -1
        if k == 0:
            raise PeerClosed("the peer closed the connection"
                             + (" in the middle of a message" if self.busy else ""))
        return k

    def _staged(self, sock: socket.socket, n: int) -> Optional[memoryview]:
        """``n`` staged bytes (consumed), reading more if needed; ``None`` if not there yet."""
        while self._hi - self._lo < n:
            if len(self._stage) - self._lo < n:  # compact, or grow for a large header
                rest = bytes(self._view[self._lo:self._hi])
                if len(self._stage) < n:
                    self._stage = bytearray(max(n, 2 * len(self._stage)))
                    self._view = memoryview(self._stage)
                self._view[:len(rest)] = rest
                self._lo, self._hi = 0, len(rest)
            k = self._recv(sock, self._view[self._hi:])
            if k < 0:
                return None
            self._hi += k
        out = self._view[self._lo:self._lo + n]
        self._lo += n
        if self._lo == self._hi:
            self._lo = self._hi = 0
        return out

    def pull(self, sock: socket.socket, place: Placer) -> Optional[Tuple[bytes, List[Any]]]:
        """Read what has come; ``(meta, buffers)`` once a frame is complete."""
        if self._step == 0:
            head = self._staged(sock, _HDR.size)
            if head is None:
                return None
            magic, meta_len, nbufs = _HDR.unpack(head)
            if magic != _FRAME_MAGIC or meta_len > _MAX_META or nbufs > _MAX_BUFS:
                raise FrameError(f"garbled frame (magic {magic:#x}, meta {meta_len} B, "
                                 f"{nbufs} buffers)")
            self._step, self._need = 1, (meta_len, nbufs)
        if self._step == 1:
            meta_len, nbufs = self._need
            raw = self._staged(sock, meta_len + _LEN.size * nbufs)
            if raw is None:
                return None
            self._meta = bytes(raw[:meta_len])
            self._lens = [_LEN.unpack_from(raw, meta_len + _LEN.size * i)[0]
                          for i in range(nbufs)]
            self._bufs = place(self._meta, self._lens)
            if [b.nbytes for b in self._bufs] != self._lens:
                raise FrameError("a frame's buffers do not match their lengths")
            self._step, self._i, self._got = 2, 0, 0
        while self._i < len(self._bufs):
            buf = self._bufs[self._i]
            if self._got == 0 and self._hi > self._lo:  # staged bytes first
                k = min(buf.nbytes, self._hi - self._lo)
                buf[:k] = self._view[self._lo:self._lo + k]
                self._lo += k
                if self._lo == self._hi:
                    self._lo = self._hi = 0
                self._got = k
            while self._got < buf.nbytes:
                k = self._recv(sock, buf[self._got:])
                if k < 0:
                    return None
                self._got += k
            self._i, self._got = self._i + 1, 0
        out = (self._meta, self._bufs)
        self._reset()
        return out


class _Scratch:
    """A reusable receive buffer (arrays read from it are views, valid until its next use)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def place(self, _meta: bytes, lens: List[int]) -> List[memoryview]:
        offsets, total = [], 0
        for n in lens:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        if self._buf.nbytes < total:  # a new one: views of the old may still be alive
            self._buf = np.empty(max(total, 2 * self._buf.nbytes), dtype=np.uint8)
        view = memoryview(self._buf)
        return [view[o:o + n] for o, n in zip(offsets, lens)]


def _fresh(_meta: bytes, lens: List[int]) -> List[memoryview]:
    return [memoryview(np.empty(n, dtype=np.uint8)) for n in lens]


# ---------------------------------------------------------------------------- connections
class _Out:
    """An outgoing connection, written in the order its messages were posted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.turn = threading.Condition()
        self.next_ticket = 0
        self.serving = 0
        self.broken: Optional[BaseException] = None


class Links:
    """One group's direct connections on this rank (by group rank and purpose)."""

    def __init__(self, *, key: str, rank: int, size: int, secret: bytes,
                 addresses: Sequence[Any], nodes: Sequence[str]) -> None:
        self.key = key
        self.nodes = list(nodes)
        self.rank = rank
        self.size = size
        self.secret = secret
        self.addresses = list(addresses)
        self._lock = threading.Condition()
        self._out: Dict[Tuple[int, str], _Out] = {}
        self._in: Dict[Tuple[int, str], socket.socket] = {}
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._listener = listener()
        if self._listener is not None:
            self._listener.register(self)

    # -- incoming
    def accepted(self, src: int, purpose: str, sock: socket.socket) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            old = self._in.pop((src, purpose), None)
            self._in[(src, purpose)] = sock
            self._lock.notify_all()
        if old is not None:
            old.close()
        self.wake()

    def incoming(self, src: int, purpose: str) -> Optional[socket.socket]:
        return self._in.get((src, purpose))

    def wake(self) -> None:
        """End a ``select`` waiting here (a new connection came)."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def wait(self, read: Sequence[socket.socket], write: Sequence[socket.socket],
             seconds: float) -> None:
        """Until one of ``read`` is readable, one of ``write`` writable, a new connection
        comes, or ``seconds`` pass."""
        if self._closed:
            time.sleep(seconds)
            return
        try:
            r, _, _ = select.select([self._wake_r, *read], list(write), [], max(0.0, seconds))
        except (OSError, ValueError):  # a socket closed under us: the next read says why
            return
        if self._wake_r in r:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    # -- outgoing
    def outgoing(self, dst: int, purpose: str, timeout_s: float) -> _Out:
        """The connection to group rank ``dst`` for ``purpose`` (connecting if needed)."""
        with self._lock:
            out = self._out.get((dst, purpose))
            if out is not None and out.broken is None:
                return out
            if self._closed:
                raise PeerClosed(f"group {self.key!r} is closed on this rank")
        host, port, unix = (tuple(self.addresses[dst]) + (None,))[:3]
        if unix and self.nodes[dst] == self.nodes[self.rank]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(min(timeout_s, 30.0))
            try:
                sock.connect(unix)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((host, port), timeout=min(timeout_s, 30.0))
        try:
            _tune(sock)
            name = self.key.encode()
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, self.secret, self.rank,
                                     _PURPOSES.index(purpose), len(name)) + name)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
                raise PeerClosed(f"group {self.key!r} is closed on this rank")
            out = _Out(sock)
            self._out[(dst, purpose)] = out
            return out

    def drop(self, dst: int, purpose: str, out: _Out) -> None:
        """Close an outgoing connection whose stream is no longer whole."""
        with self._lock:
            if self._out.get((dst, purpose)) is out:
                del self._out[(dst, purpose)]
        out.sock.close()

    def sockets(self) -> int:
        return len(self._out) + len(self._in)

    def closed_peers(self) -> List[int]:
        """Group ranks whose incoming connections are closed (their processes are gone),
        also where data they sent before closing is still unread (``POLLRDHUP``, where the
        platform has it: a peek sees that data, not the end)."""
        gone = set()
        poller, owners = select.poll(), {}
        for (src, _purpose), sock in list(self._in.items()):
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    gone.add(src)
                    continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                gone.add(src)
                continue
            owners[sock.fileno()] = src
            poller.register(sock, _CLOSED_EVENTS)
        gone |= {owners[fd] for fd, events in poller.poll(0) if events & _CLOSED_EVENTS}
        return sorted(gone)

    def suspects(self, src: Optional[int], exc: BaseException) -> List[int]:
        """Group ranks that connection failure ``exc`` (reading from ``src``) suggests are
        dead: those whose connections closed without a goodbye."""
        if not isinstance(exc, (PeerClosed, ConnectionResetError, BrokenPipeError)):
            return []
        return sorted(set(self.closed_peers()) | ({src} if src is not None else set()))

    def close(self, goodbye: str = _BYE) -> None:
        """Close every connection, first telling the peers why (``"bye"``: the group was
        destroyed here; ``"abort"``: it is broken)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outs = list(self._out.values())
            socks = [o.sock for o in outs] + list(self._in.values())
            self._out.clear()
            self._in.clear()
            self._lock.notify_all()
        if self._listener is not None:
            self._listener.unregister(self)
        for out in outs:
            try:  # best effort: a peer still reading learns we left, not died
                _Writer(encode_round(goodbye)).push(out.sock)
            except OSError:
                pass
        for sock in socks:
            try:
                sock.close()
            except OSError:
                pass
        self._wake_r.close()
        self._wake_w.close()


def peer_failure(links: Links, global_ranks: Sequence[int], where: str, src: Optional[int],
                 exc: BaseException, **ctx: Any) -> errors.RaycollError:
    """The error for connection failure ``exc`` (reading from group rank ``src``) that the
    coordinator could not explain: peers whose connections closed without a goodbye are
    dead (``RankFailedError`` naming them); anything else breaks the group."""
    me = global_ranks[links.rank]
    gone = links.suspects(src, exc)
    if gone:
        who = [global_ranks[g] for g in gone]
        names = " and ".join(f"rank {g}" for g in who)
        return errors.RankFailedError(
            f"{where}: {names} closed {'its' if len(who) == 1 else 'their'} connections to "
            f"rank {me} without a goodbye: {'its process' if len(who) == 1 else 'their processes'}"
            " died; the group is broken", failed_ranks=who, **ctx)
    if isinstance(exc, PeerLeft) and src is not None:
        did = ("left the group (destroyed it)" if exc.why == _BYE
               else "found the group broken and closed its connections")
        return errors.GroupBrokenError(
            f"{where}: rank {global_ranks[src]} {did} while rank {me} still needed it; the "
            "group is broken", **ctx)
    return errors.GroupBrokenError(
        f"{where}: the direct connection failed on rank {me} ({type(exc).__name__}: {exc}); "
        "the group is broken", **ctx)


def send_all(links: Links, out: _Out, writer: _Writer, deadline: float,
             check: Callable[[], None]) -> None:
    """Push ``writer`` to ``out`` until done; ``check()`` every so often; ``TimeoutError``
    at ``deadline``."""
    next_check = time.monotonic() + 0.5
    while not writer.push(out.sock):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError
        if now > next_check:
            check()
            next_check = now + 0.5
        links.wait([], [out.sock], min(0.1, deadline - now))


# ---------------------------------------------------------------------------- rounds
class TcpTransport(RoundTransport):
    """Collective rounds over direct connections (every rank sends every peer its
    projection of its payload each round, and reads each peer's)."""

    name = "direct connection"
    kind = "tcp"

    def __init__(self, ctx: "GroupContext", links: Links) -> None:
        super().__init__(ctx, "tcp", [j for j in range(ctx.size) if j != ctx.rank])
        self.links = links
        self._writers: Dict[int, _Writer] = {}
        self._message: Optional[Message] = None
        self._readers = {s: _Reader() for s in self._peers}
        self._scratch = {s: _Scratch() for s in self._peers}
        self._outs: Dict[int, _Out] = {}
        self._reading: Optional[int] = None  # the peer read last (whose failure is named)
        self.poll_min_s, self.poll_max_s = 0.002, 0.05
        self.failure_grace_s = CLOSED_GRACE_S

    def _out(self, dst: int) -> _Out:
        out = self._outs.get(dst)
        if out is None:
            out = self._outs[dst] = self.links.outgoing(dst, "coll", self.ctx.timeout_s)
        return out

    def _write(self, message: Message, spin: bool) -> bool:
        if self._message is not message:
            kind, _epoch, key, fp, payload = message
            self._message = message
            self._writers = {j: _Writer(encode_round((kind, key, fp, project(payload, j))))
                             for j in self._peers}
        for j, writer in list(self._writers.items()):
            if writer.push(self._out(j).sock):
                del self._writers[j]
        if self._writers:
            return False
        self._message = None
        return True

    def _read(self, s: int, spin: bool) -> Optional[Message]:
        sock = self.links.incoming(s, "coll")
        if sock is None:
            return None
        self._reading = s
        got = self._readers[s].pull(sock, self._scratch[s].place)
        if got is None:
            return None
        meta, bufs = got
        message = decode_round(meta, bufs)
        if message in _GOODBYES:
            raise PeerLeft(f"rank {self.ctx.global_ranks[s]} closed the connection", message)
        kind, key, fp, payload = message
        return kind, self.epoch, tuple(key), fp, payload

    def _suspects(self, exc: BaseException) -> Sequence[int]:
        return self.links.suspects(self._reading, exc)

    def _unexplained(self, call: Any, exc: BaseException) -> errors.RaycollError:
        return peer_failure(self.links, self.ctx.global_ranks,
                            f"{call.op} #{call.seq} on group {self.ctx.group_name!r}",
                            self._reading, exc, **self.ctx.ctx(call))

    def _idle(self, seconds: float, pending: Sequence[int]) -> None:
        read = [sock for s in pending if (sock := self.links.incoming(s, "coll")) is not None]
        write = [self._outs[j].sock for j in self._writers if j in self._outs]
        self.links.wait(read, write, seconds)

    def _write_reject(self, message: Message) -> None:
        kind, _epoch, key, fp, payload = message
        for j in self._peers:
            _Writer(encode_round((kind, key, fp, payload))).push(self._out(j).sock)

    def _shut(self) -> None:
        self.links.close(_ABORT)  # broken: the peers must fail too


# ---------------------------------------------------------------------------- point to point
class _Posted:
    """A receive waiting for its message."""

    __slots__ = ("src", "tag", "arr", "meta", "done", "claimed", "source", "error")

    def __init__(self, src: Optional[int], tag: int, arr: np.ndarray, meta: Any) -> None:
        self.src, self.tag, self.arr, self.meta = src, tag, arr, meta
        self.done = False
        self.claimed = False
        self.source: Optional[int] = None
        self.error: Optional[BaseException] = None


def _fmt_meta(meta: Any) -> str:
    dtype, shape = meta
    return f"dtype={dtype}, shape={tuple(shape)}"


class Mailbox:
    """Point-to-point messages of one group on this rank, over its ``"p2p"`` connections.

    A send is handed to the kernel at once when the connection is free (a small message
    completes then, as in torch); the rest of a large one is written by whoever waits for
    the send. Messages from one rank to another keep their order. Receives match messages in
    the order they were posted (by source and tag); a message that comes before its receive
    is kept. Whoever waits for a receive reads the sockets (one reader at a time), straight
    into a matched receive's array.
    """

    def __init__(self, links: Links, *, group: str, global_ranks: Sequence[int],
                 check: Callable[[Sequence[int], float], None],
                 explain: Callable[[Sequence[int]], Optional[BaseException]],
                 spin_s: float = 0.0) -> None:
        self.links = links
        self.group = group
        self.global_ranks = tuple(global_ranks)
        self._check = check
        self._explain = explain
        #: a receive polls its sockets this long before it sleeps in select (a wake-up from
        #: select costs more than a short reply takes to come); 0 where ranks share cores
        self.spin_s = spin_s
        self._cv = threading.Condition()
        self._posted: List[_Posted] = []
        self._stash: List[Tuple[int, int, Any, np.ndarray]] = []
        self._reading = False
        self._readers: Dict[int, _Reader] = {}
        self._failed: Dict[int, BaseException] = {}
        #: per source: the message being read (its tag, meta and the receive it goes to)
        self._current: Dict[int, Tuple[int, Any, Optional[_Posted]]] = {}

    # -- sending
    def send(self, arr: np.ndarray, dst: int, tag: int, meta: Any,
             timeout_s: float) -> Callable[[], None]:
        data = np.ascontiguousarray(arr)
        out = self.links.outgoing(dst, "p2p", timeout_s)
        writer = _Writer(encode_raw((tag, meta), memoryview(data).cast("B")))
        with out.turn:
            ticket = out.next_ticket
            out.next_ticket += 1
            if out.serving == ticket and out.broken is None and writer.push(out.sock):
                out.serving += 1
                out.turn.notify_all()
                return lambda: None
        return lambda: self._finish_send(out, writer, ticket, dst, tag, timeout_s, data)

    def _finish_send(self, out: _Out, writer: _Writer, ticket: int, dst: int, tag: int,
                     timeout_s: float, _data: np.ndarray) -> None:
        deadline = time.monotonic() + timeout_s
        what = (f"send from rank {self.global_ranks[self.links.rank]} to rank "
                f"{self.global_ranks[dst]} (tag {tag}) on group {self.group!r}")
        with out.turn:
            while out.serving != ticket and out.broken is None:
                if not out.turn.wait(max(0.0, deadline - time.monotonic())):
                    break
            if out.broken is not None or out.serving != ticket:
                raise out.broken or self._timed_out(what, [dst], timeout_s)
        try:
            send_all(self.links, out, writer, deadline,
                     lambda: self._check([dst], time.monotonic() - deadline + timeout_s))
        except TimeoutError:
            error = self._timed_out(f"{what} was not received within {timeout_s:g}s", [dst],
                                    timeout_s)
            self._break_out(out, dst, error)
            raise error from None
        except errors.RaycollError as exc:
            self._break_out(out, dst, exc)
            raise
        except OSError as exc:
            error = self._explain(self.links.suspects(dst, exc)) or peer_failure(
                self.links, self.global_ranks, what, dst, exc, group=self.group, op="send")
            self._break_out(out, dst, error)
            raise error from exc
        with out.turn:
            out.serving += 1
            out.turn.notify_all()

    def _break_out(self, out: _Out, dst: int, error: BaseException) -> None:
        """A message went out in part: the connection is no longer whole."""
        with out.turn:
            out.broken = error
            out.turn.notify_all()
        self.links.drop(dst, "p2p", out)

    def _timed_out(self, message: str, peers: Sequence[int], timeout_s: float) -> BaseException:
        who = [self.global_ranks[p] for p in peers]
        return errors.DistTimeoutError(message, missing=who, group=self.group,
                                       rank=self.global_ranks[self.links.rank])

    # -- receiving
    def recv(self, arr: np.ndarray, src: Optional[int], tag: int, meta: Any,
             timeout_s: float) -> Callable[[], int]:
        posted = _Posted(src, tag, arr, meta)
        with self._cv:
            for i, (s, t, m, data) in enumerate(self._stash):
                if (src is None or s == src) and t == tag:
                    del self._stash[i]
                    self._deliver(posted, s, m, data)
                    break
            else:
                self._posted.append(posted)
        return lambda: self._wait(posted, timeout_s)

    def _deliver(self, posted: _Posted, src: int, meta: Any, data: Optional[np.ndarray]) -> None:
        """Complete ``posted`` with a message from ``src`` (``data``: ``None`` when it was
        read straight into the posted array)."""
        posted.done, posted.source = True, src
        if meta != posted.meta:
            posted.error = errors.CollectiveMismatchError(
                f"send from rank {self.global_ranks[src]} to rank "
                f"{self.global_ranks[self.links.rank]} (tag {posted.tag}) on group "
                f"{self.group!r}: the sender sent {_fmt_meta(meta)} but the receiver expects "
                f"{_fmt_meta(posted.meta)}", group=self.group, op="recv",
                rank=self.global_ranks[self.links.rank])
        elif data is not None:
            flat = data.view(posted.arr.dtype).reshape(posted.arr.shape)
            np.copyto(posted.arr, flat)

    def _wait(self, posted: _Posted, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        begun = time.monotonic()
        next_check = begun + 0.1
        every = 0.1
        # read at once (the message is often there already), then poll until spin_until
        # unless the caller computes beside this wait (an async receive nobody waits for)
        spin_until = begun + self.spin_s if self.spin_s and may_spin() else begun
        while True:
            with self._cv:
                while not posted.done and self._reading:
                    self._cv.wait(0.05)
                    if time.monotonic() > deadline:
                        break
                if posted.done:
                    if posted.error is not None:
                        raise posted.error
                    return int(posted.source)  # type: ignore[arg-type]
                now = time.monotonic()
                if now > deadline:
                    self._posted = [p for p in self._posted if p is not posted]
                    who = ("any rank" if posted.src is None
                           else f"rank {self.global_ranks[posted.src]}")
                    raise self._timed_out(
                        f"recv at rank {self.global_ranks[self.links.rank]} from {who} "
                        f"(tag {posted.tag}) on group {self.group!r} got no message within "
                        f"{timeout_s:g}s", [] if posted.src is None else [posted.src],
                        timeout_s)
                self._reading = True
            try:
                self._pump(posted, min(0.05, deadline - now), wait=now > spin_until)
                if time.monotonic() >= next_check and not posted.done:
                    peers = [posted.src] if posted.src is not None else [
                        j for j in range(self.links.size) if j != self.links.rank]
                    self._check(peers, time.monotonic() - begun)
                    every = min(2 * every, 1.0)
                    next_check = time.monotonic() + every
            except BaseException:
                with self._cv:
                    self._posted = [p for p in self._posted if p is not posted]
                raise
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

    def _pump(self, posted: _Posted, seconds: float, wait: bool = True) -> None:
        """Read what has come on the p2p connections (this thread is the reader); ``wait``:
        first wait up to ``seconds`` for something to come."""
        srcs = ([posted.src] if posted.src is not None
                else [j for j in range(self.links.size) if j != self.links.rank])
        socks = {}
        live = [s for s in srcs if s not in self._failed]
        if not live:  # every rank this receive can come from failed or left
            raise self._failed[srcs[0]]
        for s in live:
            sock = self.links.incoming(s, "p2p")
            if sock is not None:
                socks[s] = sock
        if wait:
            self.links.wait(list(socks.values()), [], seconds)
        for s, sock in socks.items():
            reader = self._readers.get(s)
            if reader is None:
                reader = self._readers[s] = _Reader()
            try:
                while True:
                    got = reader.pull(sock, lambda m, lens, s=s: self._place(s, m, lens))
                    if got is None:
                        break
                    self._arrived(s, got)
            except PeerLeft as exc:  # fails only the receives that wait for it
                self._failed[s] = peer_failure(
                    self.links, self.global_ranks, f"recv on group {self.group!r}", s, exc,
                    group=self.group, op="recv")
                if not posted.done and posted.src == s:
                    raise self._failed[s] from exc
            except (OSError, FrameError) as exc:
                error = self._explain(self.links.suspects(s, exc)) or peer_failure(
                    self.links, self.global_ranks, f"recv on group {self.group!r}", s, exc,
                    group=self.group, op="recv")
                self._failed[s] = error
                raise error from exc

    def _place(self, src: int, meta_bytes: bytes, lens: List[int]) -> List[memoryview]:
        """Where a message's data goes: a matching receive's array, or a new buffer."""
        message = pickle.loads(meta_bytes)
        if message in _GOODBYES:
            raise PeerLeft(f"rank {self.global_ranks[src]} closed the connection", message)
        tag, meta = message
        with self._cv:
            for p in self._posted:
                if not p.claimed and (p.src is None or p.src == src) and p.tag == tag:
                    p.claimed = True
                    self._current[src] = (tag, meta, p)
                    if meta == p.meta and p.arr.flags.c_contiguous and p.arr.flags.writeable \
                            and len(lens) == 1 and lens[0] == p.arr.nbytes:
                        return [memoryview(p.arr).cast("B")]
                    return _fresh(meta_bytes, lens)
        self._current[src] = (tag, meta, None)
        return _fresh(meta_bytes, lens)

    def _arrived(self, src: int, got: Tuple[bytes, List[Any]]) -> None:
        tag, meta, posted = self._current.pop(src)
        buf = got[1][0] if got[1] else memoryview(b"")
        direct = posted is not None and buf.obj is not None and posted.arr.flags.c_contiguous \
            and isinstance(buf.obj, np.ndarray) and np.shares_memory(buf.obj, posted.arr)
        data = None if direct else np.frombuffer(buf, dtype=np.uint8)
        with self._cv:
            if posted is None:  # a receive may have been posted while the message came in
                posted = next((p for p in self._posted if not p.claimed and p.tag == tag
                               and (p.src is None or p.src == src)), None)
            if posted is None:
                self._stash.append((src, tag, meta, data))
            else:
                self._posted = [p for p in self._posted if p is not posted]
                self._deliver(posted, src, meta, data)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stash.clear()
            self._posted.clear()
            self._cv.notify_all()
