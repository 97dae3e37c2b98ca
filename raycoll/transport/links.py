"""Direct connections of a group on this rank: where this process listens, the hello that
admits a connection to its group, the goodbye that closes one, and :class:`Links`, one
group's connections by peer and purpose (docs/transports.md, "tcp", has the whole
design). The native core carries everything between the two (collectives' messages:
``raycoll/native/net.h``; point-to-point's: ``raycoll/native/sockpipe.h``).
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from raycoll import errors

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import GroupContext

logger = logging.getLogger("raycoll")

__all__ = ["listen_address", "listener", "tcp_possible", "Links", "Out", "peer_failure",
           "PeerClosed", "PeerLeft", "GOODBYE", "IFNAME_ENV", "UNIX_ENV", "HELLO_TIMEOUT_S",
           "CLOSED_GRACE_S"]

IFNAME_ENV = "RAYCOLL_SOCKET_IFNAME"
#: ``RAYCOLL_UNIX_SOCKETS=0``: peers on one node connect over TCP too.
UNIX_ENV = "RAYCOLL_UNIX_SOCKETS"
_HELLO_MAGIC = b"RCL1"
_SECRET_BYTES = 16
#: magic, secret, sender rank, purpose, group-name length
_HELLO = struct.Struct(f"!4s{_SECRET_BYTES}sIBH")
_PURPOSES = ("p2p", "ncoll")
#: A hello must arrive this fast, and its group be known here within this long.
HELLO_TIMEOUT_S = 10.0
#: A closed connection waits this long for the coordinator to explain it before its peer
#: is declared dead (a process's death reaches the coordinator within milliseconds; a
#: whole node's only when Ray's health check declares it dead).
CLOSED_GRACE_S = 1.0
#: poll() events that say a connection's other end is closed.
_CLOSED_EVENTS = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
#: What a rank writes on each of its connections as it closes them, destroying its group or
#: finding it broken: the two bytes the native core takes for a goodbye (``RC_FOREIGN_0``,
#: ``RC_FOREIGN_1`` in ``raycoll/native/net.h``), shorter than any message header, so that a
#: peer still reading learns that this rank left (``PeerLeft``), not that it died.
GOODBYE = b"RC"


class HelloError(ConnectionError):
    """A connection's hello that does not parse, or names another group, secret or rank."""


class PeerClosed(ConnectionError):
    """The peer's end of a connection closed without a goodbye: its process is gone."""


class PeerLeft(ConnectionError):
    """The peer closed the connection after its goodbye: it destroyed its group, or found
    it broken."""


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
    """Where this process listens: the interface ``RAYCOLL_SOCKET_IFNAME`` names, else Ray's
    node address on a cluster of several nodes, else 127.0.0.1."""
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
                raise HelloError("not a raycoll hello")
            key = _recv_exact(conn, name_len).decode()
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            with self._lock:
                while key not in self._groups and time.monotonic() < deadline:
                    self._lock.wait(0.1)
                links = self._groups.get(key)
            if links is None or not hmac.compare_digest(secret, links.secret) \
                    or not 0 <= src < links.size or src == links.rank:
                raise HelloError("wrong group, secret or rank")
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


#: How long a rank tries to connect to a suspected peer's listener (see ``Links.suspects``).
REFUSED_PROBE_S = 0.5

#: The send buffer of a Unix socket: the default (about 200 KiB) wakes the reader for every
#: few tens of KiB of a large message (a syscall and a wake-up each); the kernel caps it at
#: ``net.core.wmem_max``. TCP's buffers tune themselves.
UNIX_SNDBUF = 4 << 20


def _tune(sock: socket.socket) -> None:
    if sock.family != getattr(socket, "AF_UNIX", None):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
    except OSError:  # a kernel that refuses keeps its default
        pass


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


def _open(sock: socket.socket) -> bool:
    """Whether connection ``sock`` is open both ways with nothing to read on it (no byte of
    an earlier message waiting; a peer never writes to a connection it reads)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | _CLOSED_EVENTS)
        events = poller.poll(0)
    except (OSError, ValueError):
        return False
    return not any(ev & (_CLOSED_EVENTS | select.POLLIN) for _fd, ev in events)


def tcp_possible(ctx: "GroupContext") -> bool:
    """Whether every rank of ``ctx`` can be reached directly (each reported an address)."""
    return ctx.size > 1 and ctx.secret is not None and all(a for a in ctx.addresses)

# ---------------------------------------------------------------------------- connections
class Out:
    """An outgoing connection (the native core writes it: collectives' messages, or a
    socket pipe's)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock


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
        self._out: Dict[Tuple[int, str], Out] = {}
        self._in: Dict[Tuple[int, str], socket.socket] = {}
        self._closed = False
        #: connections this rank made (``outgoing``) and took over from the group's earlier
        #: generation (``adopt``), ever: what a test reads to see that a shrink or a grow
        #: kept the survivors' connections
        self.connected = 0
        self.adopted = 0
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

    def incoming(self, src: int, purpose: str, wait_s: float = 0.0) -> Optional[socket.socket]:
        """Group rank ``src``'s connection to this rank for ``purpose``, if it came, waiting
        up to ``wait_s`` for it (woken by :meth:`accepted` or :meth:`close`)."""
        key = (src, purpose)
        if wait_s > 0 and key not in self._in:
            with self._lock:
                self._lock.wait_for(lambda: key in self._in or self._closed, wait_s)
        return self._in.get(key)

    def wake(self) -> None:
        """End a :meth:`wait` (a new connection came)."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def wait(self, seconds: float) -> None:
        """Until a new connection comes, or ``seconds`` pass."""
        if self._closed:
            time.sleep(seconds)
            return
        try:
            poller = select.poll()
            poller.register(self._wake_r.fileno(), select.POLLIN)
            ready = poller.poll(max(0.0, seconds) * 1000.0)
        except (OSError, ValueError):  # closed under us: the caller's next look says why
            return
        if ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    # -- outgoing
    def outgoing(self, dst: int, purpose: str, timeout_s: float) -> Out:
        """The connection to group rank ``dst`` for ``purpose`` (connecting if needed)."""
        with self._lock:
            out = self._out.get((dst, purpose))
            if out is not None:
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
            out = Out(sock)
            self._out[(dst, purpose)] = out
            self.connected += 1
            return out

    def whole(self, purpose: str, peers: Sequence[int],
              check: Callable[[str, int], bool]) -> List[Tuple[str, int]]:
        """This rank's connections for ``purpose`` with group ranks ``peers`` whose streams
        are whole, as far as it can tell (not shut, no byte waiting to be read, and
        ``check(direction, peer)``), as ``(direction, peer)``, direction ``"out"`` or
        ``"in"``: what a later generation of the group may take over
        (:mod:`raycoll.elastic_links`)."""
        found: List[Tuple[str, int]] = []
        with self._lock:
            if self._closed:
                return found
            for peer in peers:
                out = self._out.get((peer, purpose))
                if out is not None and _open(out.sock) and check("out", peer):
                    found.append(("out", peer))
                sock = self._in.get((peer, purpose))
                if sock is not None and _open(sock) and check("in", peer):
                    found.append(("in", peer))
        return found

    def hand_over(self, purpose: str, keys: Sequence[Tuple[str, int]]) -> Dict[Tuple[str, int], Any]:
        """Take connections ``keys`` (``(direction, peer)``, from :meth:`whole`) for
        ``purpose`` out of these links: returned (an :class:`Out`, or an incoming socket),
        no longer held here (closing the links leaves them open)."""
        taken: Dict[Tuple[str, int], Any] = {}
        with self._lock:
            for direction, peer in keys:
                table: Dict[Tuple[int, str], Any] = self._out if direction == "out" else self._in
                conn = table.pop((peer, purpose), None)
                if conn is not None:
                    taken[(direction, peer)] = conn
        return taken

    def adopt(self, purpose: str, conns: Dict[Tuple[str, int], Any]) -> None:
        """Hold connections of an earlier generation of this group (from
        :meth:`hand_over`, keyed by this group's ranks now) as this group's for
        ``purpose``: no new connection, no hello."""
        with self._lock:
            if self._closed:
                raise PeerClosed(f"group {self.key!r} is closed on this rank")
            for (direction, peer), conn in conns.items():
                if direction == "out":
                    self._out[(peer, purpose)] = conn
                else:
                    self._in[(peer, purpose)] = conn
            self.adopted += len(conns)
            self._lock.notify_all()

    def sockets(self, purpose: Optional[str] = None) -> int:
        """How many connections this rank holds in the group (for ``purpose`` only, if
        given), both directions."""
        with self._lock:
            keys = list(self._out) + list(self._in)
        return sum(1 for _dst, p in keys if purpose is None or p == purpose)

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
        dead: those whose connections closed without a goodbye, and, on their nodes, the
        ranks this one has no connection from (an algorithm pairs a rank with few peers)
        whose listener no longer takes connections: a node that went away took them too."""
        if not isinstance(exc, (PeerClosed, ConnectionResetError, BrokenPipeError)):
            return []
        gone = set(self.closed_peers()) | ({src} if src is not None else set())
        nodes = {self.nodes[g] for g in gone}
        with self._lock:
            heard = {s for s, _purpose in self._in}
        for r in range(self.size):
            if r != self.rank and r not in gone and r not in heard \
                    and self.nodes[r] in nodes and self._refused(r):
                gone.add(r)
        return sorted(gone)

    def _refused(self, dst: int) -> bool:
        """Whether group rank ``dst``'s listener refuses a connection now (its process is
        gone; a host that does not answer within ``REFUSED_PROBE_S`` counts as alive)."""
        host, port, unix = (tuple(self.addresses[dst]) + (None,))[:3]
        try:
            if unix and self.nodes[dst] == self.nodes[self.rank]:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(REFUSED_PROBE_S)
                    sock.connect(unix)
            else:
                socket.create_connection((host, port), timeout=REFUSED_PROBE_S).close()
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
        return False

    def close(self) -> None:
        """Close every connection, first saying goodbye (:data:`GOODBYE`): the group was
        destroyed here, or found broken."""
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
                out.sock.send(GOODBYE)
            except OSError:
                pass
        for sock in socks:
            try:  # shut, not only closed: the native core's own descriptors of the same
                # connections (dups) would keep them open, and a run waiting on one must end
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
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
        return errors.GroupBrokenError(
            f"{where}: rank {global_ranks[src]} left the group (destroyed it, or found it "
            f"broken) while rank {me} still needed it; the group is broken", **ctx)
    return errors.GroupBrokenError(
        f"{where}: the direct connection failed on rank {me} ({type(exc).__name__}: {exc}); "
        "the group is broken", **ctx)
