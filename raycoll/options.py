"""Group options: the knobs of ``create_group(..., options=...)``, typed, frozen, validated.

Users pass a dict (or a :class:`GroupOptions`); :meth:`GroupOptions.of` turns it into the
frozen options once, where the group is formed, so that a misspelt key or a bad value is
refused there, naming the option, instead of being ignored or failing at the first
collective. The layers below read attributes (``options.lane_bytes``). An option left at
``None`` takes the default of the layer that reads it, which may depend on the group (for
example ``lane_bytes`` is larger for groups on direct connections); :func:`or_default` reads
it so.

This module imports only the plain-Python names of :mod:`raycoll.algorithms` (the
algorithms a group may be forced to, the cost model's check): every layer may use it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, TypeVar, Union

from raycoll.algorithms.schedule import ALGORITHMS

__all__ = ["GroupOptions", "OptionsLike", "or_default", "TRANSPORTS", "ALL_REDUCE_ALGOS", "PUTS",
           "SCHEDULED"]

#: The values of the option ``transport``.
TRANSPORTS = ("auto", "lane", "tcp", "store")
#: The options that force one collective's algorithm on direct connections, and the
#: collective each forces (values: :data:`raycoll.algorithms.schedule.ALGORITHMS`).
SCHEDULED = {"all_reduce_algo": "all_reduce", "reduce_scatter_algo": "reduce_scatter",
             "all_gather_algo": "all_gather", "broadcast_algo": "broadcast",
             "reduce_algo": "reduce"}
#: The values of the option ``all_reduce_algo`` (``None``: chosen per call): the steps
#: through the coordinator (``inline``, ``direct``, ``rs_ag``) and the algorithms over
#: direct connections.
ALL_REDUCE_ALGOS = ("inline", "rs_ag") + ALGORITHMS["all_reduce"]
#: The values of the option ``put``.
PUTS = ("auto", "combined", "per_peer")

T = TypeVar("T")


@dataclass(frozen=True)
class GroupOptions:
    """The options of a group formed by ``create_group(..., options=...)``.

    ``options`` may be a dict of these names or a ``GroupOptions``; an unknown name, or a
    value of the wrong type or out of range, raises ``ValueError`` naming the option. Every
    rank of a group reads the same options, so they decide alike.

    Transports (see :mod:`raycoll.transport`):

    - ``transport``: ``"auto"``, ``"lane"``, ``"tcp"`` or ``"store"`` (``None``: ``"auto"``);
      ``"store"`` keeps the group off the node segment and direct connections (the object
      store carries its collectives); ``"lane"`` is the node segment;
    - ``lane_bytes``: int >= 0, the most one step on the node segment carries (``None``: half
      of a rank's share of the segment; at least 64 bytes a rank);
    - ``lane_max_ranks``: int >= 0, no node segment for groups larger than this (``None``:
      the core's limit, 1,024 ranks);
    - ``node_segment_bytes``: int >= 8192, each rank's share of its node's shared-memory
      segment where the native core runs the lane (:mod:`raycoll.transport.segment`;
      ``None``: 4 MiB); a /dev/shm too small for it gets a smaller one, with a warning;
    - ``segment_spin_s``: seconds >= 0 a wait on the node segment spins before it sleeps in
      the kernel, where the node's ranks fit its cores (``None``: 200 us; never where they
      outnumber them).

    The CPU algorithms (:mod:`raycoll.backends.cpu`), mostly to force a choice when
    measuring:

    - ``stream_bytes``: int >= 1, a schedule over direct connections pipelines a large
      buffer in pieces of about this size (``None``: 4 MiB); it caps a node segment's step
      too, as ``lane_bytes`` does;
    - ``inline_bytes``: int >= 0, steps through the coordinator (the object store, the
      fallback) up to this size travel inside the coordinator call (``None``: 96 KiB);
    - ``direct_bytes``: int >= 0, and ``direct_max_ranks``: int >= 0, the reach of the
      one-step ``all_reduce`` on one node (``None``: 1 MiB and 4 ranks);
    - ``segment_bytes``: int >= 1, arrays are put as segments of at most this size
      (``None``: 8 MiB);
    - ``all_reduce_algo``: through the coordinator ``"inline"``, ``"direct"`` or ``"rs_ag"``;
      over direct connections ``"direct"``, ``"direct_rsag"``, ``"ring"``,
      ``"recursive_doubling"``, ``"halving_doubling"``, ``"hierarchical"`` or
      ``"hierarchical_doubling"``; ``None``: chosen per call (a choice the group's path
      does not have is left to it);
    - ``reduce_scatter_algo``, ``all_gather_algo``, ``broadcast_algo``, ``reduce_algo``: the
      algorithm of that collective over direct connections (the names of
      :data:`raycoll.algorithms.schedule.ALGORITHMS`), or ``None``: the cost model's choice;
    - ``cost_model``: the cost model's link costs, ``{"tcp": {"alpha": s, "beta": s},
      "unix": ..., "gamma": s, "nic": s}`` (any subset; ``raycoll-bench --calibrate`` prints
      one), or ``None``: the defaults measured here (:mod:`raycoll.algorithms.cost`);
    - ``put``: ``"auto"``, ``"combined"`` or ``"per_peer"``.

    GPU (:mod:`raycoll.backends.nccl`):

    - ``nccl_blocking_wait``: ``True`` makes waits block the host, like
      ``TORCH_NCCL_BLOCKING_WAIT`` (``None``: the environment's ``RAYCOLL_NCCL_BLOCKING_WAIT``).
    """

    transport: Optional[str] = None
    lane_bytes: Optional[int] = None
    lane_max_ranks: Optional[int] = None
    node_segment_bytes: Optional[int] = None
    segment_spin_s: Optional[float] = None
    stream_bytes: Optional[int] = None
    inline_bytes: Optional[int] = None
    direct_bytes: Optional[int] = None
    direct_max_ranks: Optional[int] = None
    segment_bytes: Optional[int] = None
    all_reduce_algo: Optional[str] = None
    reduce_scatter_algo: Optional[str] = None
    all_gather_algo: Optional[str] = None
    broadcast_algo: Optional[str] = None
    reduce_algo: Optional[str] = None
    cost_model: Optional[Mapping[str, Any]] = None
    put: str = "auto"
    nccl_blocking_wait: Optional[bool] = None

    def __post_init__(self) -> None:
        for name, (check, expected) in _RULES.items():
            value = getattr(self, name)
            if not check(value):
                raise ValueError(f"group option {name}: expected {expected}, got {value!r}")

    @classmethod
    def of(cls, options: "OptionsLike") -> "GroupOptions":
        """``options`` as a ``GroupOptions``: ``None`` gives the defaults, a
        ``GroupOptions`` is returned as it is, a dict is checked key by key (an unknown key
        raises ``ValueError`` naming it, its close matches and the valid keys)."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise TypeError("options must be a dict of group options or a GroupOptions, got "
                            f"{type(options).__name__}")
        for key in options:
            if key in _RETIRED:
                raise ValueError(_RETIRED[key])
            if key not in _NAMES:
                raise ValueError(_unknown(key))
        return cls(**dict(options))


OptionsLike = Union[GroupOptions, Mapping[str, Any], None]


def or_default(value: Optional[T], default: T) -> T:
    """An option's value, or ``default`` where it was left at ``None``."""
    return default if value is None else value


#: The errors for retired options: what replaced each.
_RETIRED = {
    # ``lane=False`` was an old spelling
    "lane": "group option 'lane' was removed: use transport='store' to keep a group off the "
            "shared-memory lane (and transport='auto', the default, for lane=True)",
    "node_lanes": "group option 'node_lanes' was retired with the node lanes (Ray channels "
                  "between a node's ranks in a group on several nodes): such a group runs "
                  "every step of its collectives on the native executor, over Unix sockets "
                  "inside a node and TCP between nodes; drop the option",
    "lane_yield_s": "group option 'lane_yield_s' was retired with the Ray-channel lane: a "
                    "node's ranks wait on the node segment (group option segment_spin_s: how "
                    "long a wait spins where the ranks fit the cores); drop the option",
    "stream": "group option 'stream' was retired with the streamed rounds: every collective "
              "runs on the native executor (the node segment, the native sockets), whatever "
              "its size; use transport='store' to send a group's collectives through the "
              "object store",
}


def _unknown(key: Any) -> str:
    close = difflib.get_close_matches(str(key), _NAMES, n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return f"unknown group option {key!r}{hint}; the group options are: {', '.join(_NAMES)}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(least: int) -> Tuple[Callable[[Any], bool], str]:
    return (lambda v: v is None or (_is_int(v) and v >= least)), f"an int >= {least} or None"


def _seconds() -> Tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        return v is None or ((_is_int(v) or isinstance(v, float)) and math.isfinite(v)
                             and v >= 0)

    return ok, "a number of seconds >= 0 or None"


def _flag(optional: bool) -> Tuple[Callable[[Any], bool], str]:
    return ((lambda v: isinstance(v, bool) or (optional and v is None)),
            "True, False or None" if optional else "True or False")


def _choice(values: Tuple[str, ...], optional: bool) -> Tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        return (optional and v is None) or (isinstance(v, str) and v in values)

    return ok, f"one of {values}{' or None' if optional else ''}"


def _cost_model() -> Tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        from raycoll.algorithms.cost import CostModel

        try:
            CostModel.of(v)
        except (TypeError, ValueError):
            return False
        return True

    return ok, ("None or a dict of link costs like {'tcp': {'alpha': 5e-05, 'beta': 4e-10}} "
                "(keys lane, unix, tcp, gamma, wake, nic; seconds >= 0)")


_RULES: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "transport": _choice(TRANSPORTS, optional=True),
    "lane_bytes": _count(0),
    "lane_max_ranks": _count(0),
    "node_segment_bytes": _count(8192),
    "segment_spin_s": _seconds(),
    "stream_bytes": _count(1),
    "inline_bytes": _count(0),
    "direct_bytes": _count(0),
    "direct_max_ranks": _count(0),
    "segment_bytes": _count(1),
    "all_reduce_algo": _choice(ALL_REDUCE_ALGOS, optional=True),
    **{name: _choice(ALGORITHMS[coll], optional=True) for name, coll in SCHEDULED.items()
       if name != "all_reduce_algo"},
    "cost_model": _cost_model(),
    "put": _choice(PUTS, optional=False),
    "nccl_blocking_wait": _flag(optional=True),
}
_NAMES = tuple(f.name for f in fields(GroupOptions))
