"""A Ray cluster with a real network on one machine: nodes in network namespaces.

:class:`NetnsCluster` starts a Ray head and ``N`` worker nodes on this machine, each worker in
a Linux network namespace of its own, joined to a bridge by a veth pair whose rate is shaped
with ``tc`` (``tbf``, both directions): every byte between two nodes (raycoll's sockets, Ray's
object transfers, gloo's pairs) crosses two shaped links and the bridge, as between the NICs
of real machines, while ranks on one node still talk over its own loopback and shared memory.

Layout (one cluster at a time on a machine; everything is named ``rcn-<tag>-...``)::

    host namespace:  bridge rcn-<tag>-br 10.213.47.1/24   the Ray head (no CPUs) and the driver
    namespace rcn-<tag>-<i>:  veth rcn-<tag>-<i>n 10.213.47.<10+i>/24   worker node i (1..N)
                     <-> rcn-<tag>-<i> on the bridge (host side)

Each worker node has the custom resource ``netns_node<i>`` (``actor_options(i)`` places an
actor there) and the label ``raycoll-netns-node=<i>``; its processes see
``RAYCOLL_SOCKET_IFNAME`` = its veth, so ranks listen on the veth's address. The head stays in
the host namespace so that a driver there (a test, a benchmark) connects with
``ray.init(address=cluster.address)``: Ray wants a driver on one of its nodes' addresses.

Faults: :meth:`NetnsCluster.link_down` / :meth:`~NetnsCluster.link_up` (a node cut off while
its processes live), :meth:`~NetnsCluster.partition` / :meth:`~NetnsCluster.heal` (blackhole
routes between two sets of nodes, each still reaching the head), :meth:`~NetnsCluster.set_rate`
(shape a link to a crawl). :meth:`~NetnsCluster.sent_bytes` reads what each node sent (the
host end's receive counter of its veth).

Teardown (:meth:`~NetnsCluster.shutdown`, also at interpreter exit, and for clusters whose
owner died, at the next start: :func:`sweep_stale`) kills only the processes inside its
namespaces and those carrying its marker in their environment (``RAYCOLL_NETNS=<tag>``, set
for every ``ray start`` it runs), never ``ray stop``; then removes the links, the bridge, the
namespaces and its Ray temp dir. Needs root, ``ip`` and ``tc`` (:func:`netns_unavailable`
says why not). Command line: ``python -m raycoll.testing_netns --nodes 2 --rate 1gbit``
starts one, prints its address and holds it until interrupted; ``--sweep`` removes stale
ones.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Union

__all__ = ["NetnsCluster", "NetnsNode", "netns_unavailable", "sweep_stale", "netns_snapshot",
           "SUBNET", "PREFIX", "MARKER_ENV", "LABEL"]

#: The cluster's private /24 (first three octets): the bridge is .1, node i is .(10 + i).
SUBNET = "10.213.47"
#: Every namespace, link and temp dir the harness makes starts with this.
PREFIX = "rcn-"
#: Environment variable marking every process a cluster started (value: its tag).
MARKER_ENV = "RAYCOLL_NETNS"
#: Node label key (value: the node's index, "head" for the head).
LABEL = "raycoll-netns-node"
_TMP = "/tmp"
Rate = Union[str, int, float, None]


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed: {proc.stderr.strip()}")


def _cpu_lists(pin: Sequence[str], nodes: int) -> List[List[int]]:
    """``pin`` (one ``taskset`` CPU list a node: ``"0"``, ``"0,2"``, ``"0-3"``) as CPU
    numbers, each one this machine has."""
    if isinstance(pin, str) or len(pin) != nodes:
        raise ValueError(f"pin: expected one CPU list for each of the {nodes} nodes, "
                         f"got {pin!r}")
    have = os.cpu_count() or 1
    out = []
    for text in pin:
        cpus: List[int] = []
        try:
            for part in str(text).split(","):
                lo, _, hi = part.partition("-")
                cpus += range(int(lo), int(hi or lo) + 1)
        except ValueError:
            cpus = []
        if not cpus or min(cpus) < 0 or max(cpus) >= have:
            raise ValueError(f"pin: expected CPU lists like '0', '0,2' or '0-1' of CPUs in "
                             f"0..{have - 1}, got {text!r}")
        out.append(sorted(set(cpus)))
    return out


def _bits_per_s(rate: Rate) -> Optional[int]:
    """``"1gbit"``, ``"500mbit"``, ``"100kbit"`` or bits per second; None: not shaped."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        return int(rate)
    text = rate.strip().lower()
    for suffix, factor in (("gbit", 10 ** 9), ("mbit", 10 ** 6), ("kbit", 10 ** 3), ("bit", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    raise ValueError(f"rate must look like '1gbit', '500mbit' or bits per second, got {rate!r}")


def netns_unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here (not Linux, not root, no ``ip``/``tc``,
    ``ip netns add`` refused), or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    probe = f"{PREFIX}probe-{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"ip netns add failed: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


# ----------------------------------------------------------------------- processes
def _marked_pids(tag: Optional[str] = None) -> Dict[int, str]:
    """Processes whose environment holds ``RAYCOLL_NETNS`` (= ``tag`` if given): pid -> tag."""
    found: Dict[int, str] = {}
    needle = f"{MARKER_ENV}=".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(needle):
                value = item[len(needle):].decode(errors="replace")
                if tag is None or value == tag:
                    found[int(entry)] = value
                break
    return found


def _ns_pids(ns: str) -> Set[int]:
    out = _ip("netns", "pids", ns, check=False)
    return {int(p) for p in out.split() if p.isdigit()}


def _kill(pids: Set[int], wait_s: float = 10.0) -> None:
    """SIGKILL ``pids`` (all started by the harness) and wait until they are gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = set()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[-1][:1] != "Z":
                        alive.add(pid)
            except OSError:
                pass
        if not alive:
            return
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ----------------------------------------------------------------------- machine state
def _namespaces() -> List[str]:
    return sorted(line.split()[0] for line in _ip("netns", "list", check=False).splitlines()
                  if line.strip())


def _links() -> List[str]:
    names = []
    for line in _ip("-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return sorted(names)


def netns_snapshot() -> Dict[str, Any]:
    """What the harness could leave behind, for a before/after comparison: namespaces, links,
    IPv4 addresses and routes of the host namespace, and processes carrying the marker."""
    return {"namespaces": _namespaces(), "links": _links(),
            "addresses": sorted(_ip("-4", "-o", "addr", "show").splitlines()),
            "routes": sorted(_ip("-4", "route", "show").splitlines()),
            "marked_pids": sorted(_marked_pids())}


def _remove(tag: str) -> None:
    """Remove everything of the cluster ``tag``: its processes, links, namespaces, temp dir."""
    base = f"{PREFIX}{tag}"
    namespaces = [ns for ns in _namespaces() if ns.startswith(base + "-")]
    pids: Set[int] = set(_marked_pids(tag))
    for ns in namespaces:
        pids |= _ns_pids(ns)
    pids.discard(os.getpid())
    _kill(pids)
    for link in _links():
        if link.startswith(base + "-"):
            _ip("link", "del", link, check=False)  # a veth goes with its peer
    for ns in namespaces:
        inside = _ns_pids(ns)
        _kill(inside)
        pids |= inside
        _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(_TMP, base), ignore_errors=True)
    _unlink_semaphores(pids)


def _unlink_semaphores(pids: Set[int]) -> None:
    """Remove what the killed raylets ``pids`` left in /dev/shm: the semaphores of Ray's
    shared-memory channels (``sem.hdr<pid>-*``, ``sem.obj<pid>-*``), which Ray never
    unlinks (not even at a graceful shutdown)."""
    if not pids or not os.path.isdir("/dev/shm"):
        return
    prefixes = tuple(f"sem.{kind}{pid}-" for pid in pids for kind in ("hdr", "obj"))
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefixes):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def sweep_stale() -> List[str]:
    """Remove the clusters whose owner process is gone (a crashed test or benchmark): their
    namespaces, links, marked processes and temp dirs. Returns the tags removed."""
    tags: Set[str] = set()
    for name in _namespaces() + _links() + os.listdir(_TMP):
        if name.startswith(PREFIX) and not name.startswith(PREFIX + "probe"):
            tags.add(name[len(PREFIX):].split("-")[0])
    tags |= set(_marked_pids().values())
    removed = []
    for tag in sorted(tags):
        owner = os.path.join(_TMP, f"{PREFIX}{tag}", "owner")
        try:
            with open(owner) as f:
                pid = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        if pid and _alive(pid):
            continue
        _remove(tag)
        removed.append(tag)
    return removed


@dataclass(frozen=True)
class NetnsNode:
    """One worker node: its index (1..N), namespace, veth names and address."""

    index: int
    namespace: str
    #: the veth inside the namespace (the node's "NIC"; RAYCOLL_SOCKET_IFNAME there)
    ifname: str
    #: its peer on the bridge, in the host namespace
    host_ifname: str
    address: str

    @property
    def resource(self) -> str:
        """The custom resource that places an actor on this node."""
        return f"netns_node{self.index}"


class NetnsCluster:
    """A Ray head and ``nodes`` worker nodes in namespaces, linked at ``rate`` (see the module).

    ``nodes``: how many worker nodes; ``rate``: each link's rate (``"1gbit"``, ``"10gbit"``,
    bits per second, or None for unshaped), or one rate per node; ``cpus``: each worker's
    logical CPUs; ``pin``: one CPU list a node (``taskset``'s, e.g. ``["0", "1"]``), whose
    processes (its ``ray start``, so its raylet and every worker it starts) then run on those
    CPUs only, its ``CPU`` resource their count (ranks that fit their node's cores: one rank a
    node on a core of its own); ``node_dead_after_s``: how long Ray's health check lets a silent node live
    (long by default, so that a link taken down and brought back keeps its node);
    ``env``: more environment for every node's processes. Use as a context manager, or call
    :meth:`start` and :meth:`shutdown`.
    """

    def __init__(self, nodes: int = 2, rate: Union[Rate, Sequence[Rate]] = "1gbit", cpus: int = 4,
                 object_store_memory: int = 300 * 1024 ** 2, node_dead_after_s: float = 120.0,
                 env: Optional[Dict[str, str]] = None,
                 pin: Optional[Sequence[str]] = None) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be an int in 1..200, got {nodes!r}")
        self.pin: Optional[List[List[int]]] = None if pin is None else _cpu_lists(pin, nodes)
        rates = list(rate) if isinstance(rate, (list, tuple)) else [rate] * nodes
        if len(rates) != nodes:
            raise ValueError(f"rate must be one rate or {nodes} rates, got {len(rates)}")
        self.rates: List[Optional[int]] = [_bits_per_s(r) for r in rates]
        self.tag = f"{os.getpid() % 0x10000:04x}"
        self.base = f"{PREFIX}{self.tag}"
        self.bridge = f"{self.base}-br"
        self.head_address = f"{SUBNET}.1"
        self.nodes = [NetnsNode(i, f"{self.base}-{i}", f"{self.base}-{i}n", f"{self.base}-{i}",
                                f"{SUBNET}.{10 + i}") for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.object_store_memory = object_store_memory
        self.node_dead_after_s = node_dead_after_s
        self.extra_env = dict(env or {})
        self.temp_dir = os.path.join(_TMP, self.base)
        self.port = 0
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """The head's GCS address, for ``ray.init(address=...)`` from the host namespace."""
        return f"{self.head_address}:{self.port}"

    def __enter__(self) -> "NetnsCluster":
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.shutdown()

    def start(self) -> "NetnsCluster":
        """Sweep stale clusters, make the network, start the head and the worker nodes, and
        wait until Ray sees them all. Raises RuntimeError (after tearing down) on failure."""
        reason = netns_unavailable()
        if reason:
            raise RuntimeError(f"cannot make network namespaces: {reason}")
        sweep_stale()
        taken = [line for line in _ip("-4", "-o", "addr", "show").splitlines()
                 + _ip("-4", "route", "show").splitlines() if f"{SUBNET}." in line]
        if taken:
            raise RuntimeError(f"{SUBNET}.0/24 is in use on this machine (another cluster of "
                               f"this harness, or the host): {taken}")
        os.makedirs(self.temp_dir, exist_ok=True)
        with open(os.path.join(self.temp_dir, "owner"), "w") as f:
            f.write(f"{os.getpid()}\n")
        self._started = True
        atexit.register(self.shutdown)
        try:
            self._make_network()
            self._start_ray()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _make_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.head_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node, rate in zip(self.nodes, self.rates):
            _ip("netns", "add", node.namespace)
            _ip("link", "add", node.host_ifname, "type", "veth", "peer", "name", node.ifname)
            _ip("link", "set", node.ifname, "netns", node.namespace)
            _ip("link", "set", node.host_ifname, "master", self.bridge, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.namespace, "link", "set", node.ifname, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            self._shape(node, rate, "add")

    def _shape(self, node: NetnsNode, bits: Optional[int], how: str) -> None:
        """tbf at ``bits``/s on both ends of the node's veth (each end shapes what it sends)."""
        for ns, dev in ((node.namespace, node.ifname), (None, node.host_ifname)):
            pre = ["-n", ns] if ns else []
            if bits is None:
                if how != "add":
                    subprocess.run(["tc", *pre, "qdisc", "del", "dev", dev, "root"],
                                   capture_output=True)
                continue
            burst = max(bits // 8 // 250, 64 * 1024)  # 4 ms at the rate, at least 64 KiB
            _tc(*pre, "qdisc", "replace" if how != "add" else "add", "dev", dev, "root", "tbf",
                "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms")

    def _env(self, ifname: Optional[str]) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        env.pop("RAYCOLL_SOCKET_IFNAME", None)
        if ifname:
            env["RAYCOLL_SOCKET_IFNAME"] = ifname
        threshold = max(1, int(self.node_dead_after_s))
        env.update({MARKER_ENV: self.tag, "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": str(threshold),
                    "RAY_gcs_rpc_server_reconnect_timeout_s": str(threshold + 60),
                    "RAY_USAGE_STATS_ENABLED": "0",
                    # a node registers with the GCS within 30 s by default: on a loaded
                    # machine (a test suite beside other jobs) a start timed out
                    "RAY_raylet_start_wait_time_s": "120",
                    # Ray's token authentication: a head started with a token file present turns
                    # it on, a driver with RAY_AUTH_MODE unset does not send the token; the
                    # cluster lives on a private bridge of this machine: off, unless set
                    "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})
        env.update(self.extra_env)
        return env

    def _ray_start(self, ns: Optional[str], args: List[str], env: Dict[str, str],
                   cpus: Optional[List[int]] = None) -> None:
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_bin if os.path.exists(ray_bin) else "ray", "start", *args,
               "--disable-usage-stats", f"--object-store-memory={self.object_store_memory}"]
        if cpus:
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
        if ns:
            cmd = ["ip", "netns", "exec", ns, *cmd]
        # a head's start took 41 s to over 120 s on a loaded machine (2 cores, load 30-40)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")

    def _start_ray(self) -> None:
        with socket.socket() as s:  # a free port on the bridge's address for the GCS
            s.bind((self.head_address, 0))
            self.port = s.getsockname()[1]
        self._ray_start(None, ["--head", f"--node-ip-address={self.head_address}",
                               f"--port={self.port}", "--num-cpus=0",
                               f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
                               f"--labels={LABEL}=head",
                               "--resources=" + json.dumps({"netns_head": 1})],
                        self._env(self.bridge))
        for node in self.nodes:
            cpus = self.pin[node.index - 1] if self.pin else None
            self._ray_start(node.namespace, [
                f"--address={self.address}", f"--node-ip-address={node.address}",
                f"--num-cpus={len(cpus) if cpus else self.cpus}",
                f"--labels={LABEL}={node.index}",
                "--resources=" + json.dumps({node.resource: 1000})], self._env(node.ifname),
                cpus)
        self.wait_for_nodes()

    def wait_for_nodes(self, timeout_s: float = 60.0) -> None:
        """Wait until Ray lists the head and every worker node alive."""
        script = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                  "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + timeout_s
        alive = 0
        while time.monotonic() < deadline:
            proc = subprocess.run([sys.executable, "-c", script, self.address],
                                  capture_output=True, text=True, timeout=60,
                                  env=self._env(None))
            lines = proc.stdout.strip().splitlines()
            alive = int(lines[-1]) if lines and lines[-1].isdigit() else 0
            if alive >= len(self.nodes) + 1:
                return
            time.sleep(0.5)
        raise RuntimeError(f"only {alive} of {len(self.nodes) + 1} Ray nodes came up "
                           f"within {timeout_s} s")

    def shutdown(self) -> None:
        """Kill the cluster's processes and remove its links, bridge, namespaces and temp dir
        (idempotent). A driver connected to it should ``ray.shutdown()`` first."""
        if not self._started:
            return
        self._started = False
        _remove(self.tag)
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass

    # ------------------------------------------------------------------ placement
    def node(self, index: int) -> NetnsNode:
        """Worker node ``index`` (1..N)."""
        if not 1 <= index <= len(self.nodes):
            raise ValueError(f"node index must be in 1..{len(self.nodes)}, got {index}")
        return self.nodes[index - 1]

    def actor_options(self, index: int, **options: Any) -> Dict[str, Any]:
        """``.options()`` that place an actor on worker node ``index`` (0 CPUs by default)."""
        options.setdefault("num_cpus", 0)
        resources = dict(options.pop("resources", {}) or {})
        resources[self.node(index).resource] = 1
        return {**options, "resources": resources}

    # ------------------------------------------------------------------ faults and counters
    def link_down(self, index: int) -> None:
        """Cut node ``index`` off: its bridge-side veth down (its processes live on)."""
        _ip("link", "set", self.node(index).host_ifname, "down")

    def link_up(self, index: int) -> None:
        """Bring node ``index``'s link back."""
        _ip("link", "set", self.node(index).host_ifname, "up")

    def set_rate(self, index: int, rate: Rate) -> None:
        """Shape node ``index``'s link to ``rate`` (both directions; None: unshaped)."""
        bits = _bits_per_s(rate)
        self._shape(self.node(index), bits, "change")
        self.rates[index - 1] = bits

    def partition(self, side_a: Sequence[int], side_b: Sequence[int]) -> None:
        """Drop all traffic between the nodes of ``side_a`` and those of ``side_b`` (blackhole
        routes in their namespaces); both sides still reach the head."""
        self._routes(side_a, side_b, "add")

    def heal(self, side_a: Sequence[int], side_b: Sequence[int]) -> None:
        """Undo :meth:`partition`."""
        self._routes(side_a, side_b, "del")

    def _routes(self, side_a: Sequence[int], side_b: Sequence[int], how: str) -> None:
        for here, there in ((side_a, side_b), (side_b, side_a)):
            for i in here:
                for j in there:
                    _ip("-n", self.node(i).namespace, "route", how, "blackhole",
                        f"{self.node(j).address}/32", check=how == "add")

    def sent_bytes(self) -> Dict[int, int]:
        """Bytes each worker node has sent over its link so far (all traffic: Ray's too)."""
        out = {}
        for node in self.nodes:
            with open(f"/sys/class/net/{node.host_ifname}/statistics/rx_bytes") as f:
                out[node.index] = int(f.read())
        return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m raycoll.testing_netns``: start a cluster and hold it, or sweep stale ones."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m raycoll.testing_netns",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    parser.add_argument("--rate", default="1gbit", help="each link's rate (default 1gbit)")
    parser.add_argument("--cpus", type=int, default=4, help="logical CPUs per worker node")
    parser.add_argument("--pin", default=None,
                        help="one taskset CPU list a node, separated by '/': e.g. 0/1")
    parser.add_argument("--sweep", action="store_true",
                        help="only remove clusters whose owner is gone, then exit")
    args = parser.parse_args(argv)
    if args.sweep:
        print("removed:", " ".join(sweep_stale()) or "nothing")
        return 0
    # SIGTERM (kill, timeout) tears down as Ctrl-C does: Python's default would skip it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pin = args.pin.split("/") if args.pin else None
    with NetnsCluster(args.nodes, rate=args.rate, cpus=args.cpus, pin=pin) as cluster:
        print(f"ray.init(address={cluster.address!r})  # nodes: "
              + ", ".join(f"{n.namespace} {n.address}" for n in cluster.nodes), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
