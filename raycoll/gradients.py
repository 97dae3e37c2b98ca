"""``GradientAverager``: data-parallel gradient averaging that works under :class:`~raycoll.Join`.

It holds a model's parameter arrays and one gradient array per parameter (numpy arrays or
torch CPU tensors, viewed without copies). Each step, after the rank has written its local
gradients into :attr:`GradientAverager.grads`, :meth:`GradientAverager.average` averages them
across the ranks with one ``all_reduce`` of a single flat buffer that also carries a count of
the ranks that contributed. Under ``with raycoll.Join([averager]):`` a rank that has run out
of inputs shadows that ``all_reduce`` with zeros and a count of zero, so the ranks still
working divide by the number of ranks that actually contributed (or by the world size with
``Join(..., divide_by_initial_world_size=True)``, as DDP does by default). Once every rank
has joined, the post-hook makes every rank's parameters equal to those of the last joiner
(the rank that took the most steps), as DDP's join hook does.

Typical loop::

    avg = raycoll.GradientAverager([w, b])
    with raycoll.Join([avg]):
        for x, y in my_shard:
            gw, gb = local_gradients(w, b, x, y)
            avg.grads[0][...] = gw; avg.grads[1][...] = gb
            avg.average()                      # now the mean over contributing ranks
            w -= lr * avg.grads[0]; b -= lr * avg.grads[1]
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from raycoll.collectives import all_reduce, broadcast
from raycoll.process_group import ProcessGroup
from raycoll.world import GroupLike, world
from raycoll.join import Join, JoinHook, Joinable
from raycoll.reduce_op import ReduceOp
from raycoll.tensors import host_view, is_torch

__all__ = ["GradientAverager"]


def _views(values: Sequence[Any], name: str) -> List[np.ndarray]:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name} must be a non-empty list of arrays, got {values!r}")
    views = []
    for i, value in enumerate(values):
        view = host_view(value, f"{name}[{i}]")
        if view.dtype.kind != "f":
            raise TypeError(f"{name}[{i}] must have a floating dtype, got {view.dtype}")
        if not view.flags.writeable:
            raise ValueError(f"{name}[{i}] is read-only; pass a writable array (e.g. a .copy())")
        views.append(view)
    return views


def _zeros_like(value: Any) -> Any:
    if is_torch(value):  # a torch CPU tensor (host_view checked it)
        return value.detach().new_zeros(value.shape)
    return np.zeros_like(host_view(value))  # numpy, or a numpy array for a protocol object


class GradientAverager(Joinable):
    """Averages gradients across the ranks of ``group`` every step; a :class:`Joinable`.

    Arguments:
        params: the model's parameters (numpy arrays or torch CPU tensors, floating dtypes);
            updated in place only by the post-hook.
        grads: one gradient array per parameter, same shapes; zero arrays of the
            parameters' kind (numpy or torch) are allocated when omitted. :meth:`average` overwrites them in place.
        group: the process group (``None``: the default group).

    Attributes:
        params, grads: the arrays given (or allocated); write local gradients into ``grads``.
        contributors: how many ranks contributed to the last :meth:`average`.
        steps, shadow_steps: how many averages this rank took part in with its own
            gradients, and with zeros after it joined.
        synced_from: the global rank whose parameters the last post-hook copied everywhere.
    """

    def __init__(self, params: Sequence[Any], grads: Optional[Sequence[Any]] = None,
                 group: GroupLike = None) -> None:
        super().__init__()
        self._pviews = _views(params, "params")
        self.params: List[Any] = list(params)
        self.grads: List[Any]
        if grads is None:  # same kind as the parameters, so that ``p -= g`` stays in place
            self.grads = [_zeros_like(p) for p in self.params]
            self._gviews = [host_view(g) for g in self.grads]
        else:
            self._gviews = _views(grads, "grads")
            self.grads = list(grads)
            if len(self._gviews) != len(self._pviews):
                raise ValueError(f"grads must have one array per parameter: expected "
                                 f"{len(self._pviews)}, got {len(self._gviews)}")
            for i, (g, p) in enumerate(zip(self._gviews, self._pviews)):
                if g.shape != p.shape:
                    raise ValueError(f"grads[{i}] has shape {g.shape}, expected the shape of "
                                     f"params[{i}], {p.shape}")
        self._group = group
        sizes = [g.size for g in self._gviews]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        # One flat buffer: every gradient, then the number of ranks that contributed.
        self._gbuf = np.zeros(int(self._offsets[-1]) + 1, dtype=np.result_type(*self._gviews))
        self._pbuf = np.zeros(sum(p.size for p in self._pviews),
                              dtype=np.result_type(*self._pviews))
        self._divide_by_world = False
        self.contributors = 0
        self.steps = 0
        self.shadow_steps = 0
        self.synced_from: Optional[int] = None

    # ------------------------------------------------------------------ Joinable
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook for :class:`Join`. Keyword arguments (others are ignored, being meant
        for other joinables): ``divide_by_initial_world_size`` (default ``False``): divide
        by the world size instead of by the ranks that contributed."""
        self._divide_by_world = bool(kwargs.get("divide_by_initial_world_size", False))
        return _AveragerHook(self)

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> GroupLike:
        return self._group

    # ------------------------------------------------------------------ the step
    def average(self) -> int:
        """Average :attr:`grads` over the ranks, in place; returns how many contributed."""
        Join.notify_join_context(self)
        buf = self._gbuf
        for g, lo, hi in zip(self._gviews, self._offsets[:-1], self._offsets[1:]):
            buf[lo:hi] = g.reshape(-1)
        buf[-1] = 1
        all_reduce(buf, group=self._group)
        self.contributors = int(round(float(buf[-1])))
        divisor = self._pg().size() if self._divide_by_world else max(self.contributors, 1)
        for g, lo, hi in zip(self._gviews, self._offsets[:-1], self._offsets[1:]):
            g[...] = (buf[lo:hi] / divisor).reshape(g.shape)
        self.steps += 1
        return self.contributors

    def _pg(self) -> ProcessGroup:
        pg = world().resolve(self._group)
        if not isinstance(pg, ProcessGroup):
            raise ValueError("GradientAverager's group does not contain this rank")
        return pg

    def _shadow(self) -> None:
        self._gbuf[...] = 0
        all_reduce(self._gbuf, group=self._group)
        self.shadow_steps += 1

    def _sync_params(self, is_last_joiner: bool) -> None:
        pg = self._pg()
        me = pg.global_ranks[pg.rank()]
        # Several ranks may have joined last: the highest of them is the source, as in DDP.
        source = np.array([me if is_last_joiner else -1], dtype=np.int64)
        all_reduce(source, op=ReduceOp.MAX, group=self._group)
        src = int(source[0])
        buf = self._pbuf
        offset = 0
        if me == src:
            for p in self._pviews:
                buf[offset:offset + p.size] = p.reshape(-1)
                offset += p.size
        broadcast(buf, src=src, group=self._group)
        offset = 0
        for p in self._pviews:
            p[...] = buf[offset:offset + p.size].reshape(p.shape)
            offset += p.size
        self.synced_from = src


class _AveragerHook(JoinHook):
    def __init__(self, averager: GradientAverager) -> None:
        self._averager = averager

    def main_hook(self) -> None:
        self._averager._shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._averager._sync_params(is_last_joiner)
