"""The cost model that picks an algorithm: alpha per message, beta per byte, per link class.

A step of a :class:`~raycoll.algorithms.schedule.Schedule` costs each rank

    sum over the messages it sends    (alpha[link] + beta[link] * bytes)
  + sum over the messages it receives (beta[link] * bytes, + gamma * bytes where it reduces)

(a message is everything one rank sends one peer in one step; alpha is a message's latency
and fixed overhead, beta the time a byte takes at each end, gamma a reduced byte). Where
``nic`` is set (seconds a byte takes through a node's network link, each way), the ranks of
a node share that link: a step also costs each node ``nic`` times the bytes its ranks send
to other nodes, and the bytes they receive from them (on a real network two ranks of a node
sending across at once take twice as long; between Ray nodes on one machine, loopback, no
link is shared: 0, the default). The step takes as long as its slowest rank or node link; a
schedule, the sum of its steps. :func:`choose` is the
model's minimum over a collective's algorithms for (bytes, node map); ties go to the
algorithm listed first in :data:`~raycoll.algorithms.schedule.ALGORITHMS`. Every rank holds
the same model and the same topology, so every rank makes the same choice.

On a host whose ranks outnumber its cores (a group on one host only: one Ray node, or Ray
nodes on one machine; every rank then knows the same core count), every step also costs
``wake``: its ranks run in turn, each waiting to be scheduled. The defaults were measured on this project's 2-core machine
(benchmarks/HISTORY.md, "Many ranks"); ``raycoll-bench --calibrate`` measures a
cluster's and prints the ``cost_model`` group option that carries them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Tuple

from raycoll.algorithms.catalog import build
from raycoll.algorithms.schedule import ALGORITHMS, Schedule, check_algorithm
from raycoll.algorithms.topology import LINK_CLASSES, Topology

__all__ = ["DEFAULT", "CostModel", "LinkCost", "choose", "predict"]


@dataclass(frozen=True)
class LinkCost:
    """One link class: ``alpha`` seconds a message, ``beta`` seconds a byte at each end."""

    alpha: float
    beta: float


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"cost_model: {name} must be a finite number >= 0 (seconds), "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """Link costs by class (``unix``, ``tcp``, ``segment``, ``socket``), ``gamma`` (seconds a reduced byte),
    ``wake`` and ``nic`` (see the module docstring)."""

    links: Mapping[str, LinkCost] = field(default_factory=dict)
    gamma: float = 0.0
    #: seconds every step costs on a node whose ranks outnumber its cores: a step waits for
    #: its ranks to be scheduled in turn (a chain of wake-ups), whatever it moves
    wake: float = 0.0
    #: seconds a byte takes through a node's network link, each way, shared by its ranks
    #: (0: no shared link, as between Ray nodes on one machine)
    nic: float = 0.0

    @classmethod
    def of(cls, spec: Optional[Mapping[str, Any]]) -> "CostModel":
        """The default model with ``spec`` laid over it: ``{"tcp": {"alpha": 5e-5, "beta":
        4e-10}, "gamma": 2e-10}`` (any subset; the form ``raycoll-bench --calibrate``
        prints). ``None``: the default."""
        if spec is None:
            return DEFAULT
        if isinstance(spec, CostModel):
            return spec
        if not isinstance(spec, Mapping):
            raise TypeError(f"cost_model: expected a dict like {{'tcp': {{'alpha': 5e-05, "
                            f"'beta': 4e-10}}}}, got {type(spec).__name__}")
        links = dict(DEFAULT.links)
        scalars = {"gamma": DEFAULT.gamma, "wake": DEFAULT.wake, "nic": DEFAULT.nic}
        for key, value in spec.items():
            if key in scalars:
                scalars[key] = _positive(key, value)
                continue
            if key == "lane":  # the Ray-channel lane went with issue 43
                raise ValueError("cost_model: key 'lane' was retired with the Ray-channel lane: "
                                 "ranks on one node link over 'unix' (socket schedules) or "
                                 "'segment' (the node segment)")
            if key not in LINK_CLASSES:
                raise ValueError(f"cost_model: unknown key {key!r}; expected one of "
                                 f"{', '.join(LINK_CLASSES)}, gamma, wake or nic")
            if not isinstance(value, Mapping) or set(value) - {"alpha", "beta"}:
                raise ValueError(f"cost_model[{key!r}]: expected a dict with 'alpha' and/or "
                                 f"'beta' (seconds), got {value!r}")
            base = links[key]
            links[key] = LinkCost(_positive(f"{key}.alpha", value.get("alpha", base.alpha)),
                                  _positive(f"{key}.beta", value.get("beta", base.beta)))
        return cls(links, scalars["gamma"], scalars["wake"], scalars["nic"])

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {k: {"alpha": v.alpha, "beta": v.beta}
                               for k, v in self.links.items()}
        out["gamma"] = self.gamma
        out["wake"] = self.wake
        out["nic"] = self.nic
        return out

    def time(self, schedule: Schedule, topology: Topology, itemsize: int,
             reduces: bool = True, oversubscribed: bool = False) -> float:
        """The predicted seconds of ``schedule`` on ``topology`` (see the module docstring);
        ``oversubscribed``: its ranks outnumber their node's cores (each step costs ``wake``
        more)."""
        total = self.wake * len(schedule.steps) if oversubscribed else 0.0
        for per_rank, per_link in self._steps(schedule, topology, itemsize, reduces):
            total += max(max(per_rank.values(), default=0.0),
                         max(per_link.values(), default=0.0))
        return total

    def work(self, schedule: Schedule, topology: Topology, itemsize: int,
             reduces: bool = True) -> Dict[int, float]:
        """Each rank's seconds of work over all of ``schedule``'s steps (what it sends,
        receives and reduces, as :meth:`time` prices a step; no waiting): what the ranks
        of a node sharing its cores add up to (:mod:`raycoll.algorithms.planner`)."""
        out: Dict[int, float] = {}
        for per_rank, _ in self._steps(schedule, topology, itemsize, reduces):
            for rank, t in per_rank.items():
                out[rank] = out.get(rank, 0.0) + t
        return out

    def _steps(self, schedule: Schedule, topology: Topology, itemsize: int,
               reduces: bool) -> Iterator[Tuple[Dict[int, float], Dict[Tuple[int, int], float]]]:
        """Each step's seconds by rank and by node link (0 out / 1 in, node)."""
        for step in schedule.steps:
            per_rank: Dict[int, float] = {}
            per_link: Dict[Tuple[int, int], float] = {}
            pairs: Dict[Tuple[int, int], Tuple[int, bool]] = {}
            for t in step:
                size, red = pairs.get((t.src, t.dst), (0, False))
                pairs[(t.src, t.dst)] = (size + t.size * itemsize, red or t.reduce)
            for (src, dst), (nbytes, red) in pairs.items():
                link = self.links[topology.link(src, dst)]
                per_rank[src] = per_rank.get(src, 0.0) + link.alpha + link.beta * nbytes
                recv = link.beta * nbytes + (self.gamma * nbytes if red and reduces else 0.0)
                per_rank[dst] = per_rank.get(dst, 0.0) + recv
                if self.nic and not topology.same(src, dst):
                    out_of = (0, topology.node_of[src])
                    into = (1, topology.node_of[dst])
                    per_link[out_of] = per_link.get(out_of, 0.0) + self.nic * nbytes
                    per_link[into] = per_link.get(into, 0.0) + self.nic * nbytes
            yield per_rank, per_link


#: Measured here (benchmarks/HISTORY.md, "Many ranks"): a message's fixed cost is mostly
#: Python's (framing, one ``sendmsg``, a poll), a byte's a kernel copy at each end. The
#: native executor's classes (:mod:`raycoll.algorithms.planner`): ``segment``, a step of a
#: node segment's ranks (a 4 B all_reduce of 2 ranks on one node: 3-6 us) and a byte copied
#: in or out; ``socket``, a native message (4 B between 2 ranks on 2 Ray nodes, back to back:
#: about 16 us, BENCHMARKS.md) and a byte at each end, as ``tcp``'s.
DEFAULT = CostModel(
    links={"unix": LinkCost(45e-6, 0.25e-9), "tcp": LinkCost(60e-6, 0.35e-9),
           "segment": LinkCost(4e-6, 0.1e-9), "socket": LinkCost(16e-6, 0.35e-9)},
    gamma=0.3e-9,
    wake=0.1e-3,
)


def predict(collective: str, topology: Topology, nbytes: int, itemsize: int = 4,
            model: CostModel = DEFAULT, root: int = 0,
            algorithms: Optional[Iterable[str]] = None,
            oversubscribed: bool = False) -> Dict[str, float]:
    """Predicted seconds of each of ``collective``'s algorithms (or of ``algorithms``) for
    ``nbytes`` a rank on ``topology`` (``oversubscribed``: see :meth:`CostModel.time`)."""
    n = nbytes // itemsize
    out = {}
    for algo in (algorithms if algorithms is not None else ALGORITHMS[collective]):
        check_algorithm(collective, algo)
        schedule = build(collective, algo, topology, n, root)
        out[algo] = model.time(schedule, topology, itemsize, oversubscribed=oversubscribed)
    return out


def choose(collective: str, topology: Topology, nbytes: int, itemsize: int = 4,
           model: CostModel = DEFAULT, root: int = 0,
           algorithms: Optional[Iterable[str]] = None, oversubscribed: bool = False) -> str:
    """The algorithm of ``collective`` the model predicts fastest (the first listed on a tie)."""
    times = predict(collective, topology, nbytes, itemsize, model, root, algorithms,
                    oversubscribed)
    return min(times, key=lambda a: (times[a], list(times).index(a)))
