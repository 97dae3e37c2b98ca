"""Object collectives: Python objects travel through the Ray object store as they are.

Each object is ``ray.put`` once by the rank that owns it (no pickling into byte tensors, as
torch does); the references go through the coordinator and every reader ``ray.get``s only
what it needs. An object that cannot be serialized is rejected on the calling rank, before
anything is sent, and its peers are told.
"""

from __future__ import annotations

from typing import Any, List, Optional

import ray

from raycoll.backends.base import Call, GroupContext

__all__ = ["put", "all_gather", "broadcast", "gather", "scatter"]


def put(obj: Any, name: str) -> "ray.ObjectRef":
    """``ray.put(obj)``, with a clear ``TypeError`` naming ``name`` if it cannot be pickled."""
    try:
        return ray.put(obj)
    except Exception as exc:  # noqa: BLE001 - Ray raises several types for pickling failures
        raise TypeError(f"{name} cannot be serialized for the object store "
                        f"({type(exc).__name__}: {exc})") from exc


def all_gather(ctx: GroupContext, call: Call, ref: Any, out: List[Any]) -> None:
    """``out[:]`` = every rank's object, by rank (``ref``: this rank's, put already)."""
    got = ctx.exchange(call, 0, [ref] * ctx.size)
    sources = list(range(ctx.size))
    out[:] = ctx.get([ref if s == ctx.rank else got[s] for s in sources], sources, call)


def broadcast(ctx: GroupContext, call: Call, ref: Any, root: int, out: List[Any]) -> None:
    """``out[:]`` = the list ``root`` put as ``ref`` (on ``root`` itself ``out`` stays)."""
    payload = [ref] * ctx.size if ctx.rank == root else None
    got = ctx.exchange(call, 0, payload)
    if ctx.rank != root:
        out[:] = ctx.get([got[root]], [root], call)[0]


def gather(ctx: GroupContext, call: Call, ref: Any, root: int, out: Optional[List[Any]]) -> None:
    """On ``root``: ``out[:]`` = every rank's object, by rank; elsewhere nothing comes back."""
    got = ctx.exchange(call, 0, [ref if j == root else None for j in range(ctx.size)])
    if ctx.rank == root and out is not None:
        sources = list(range(ctx.size))
        out[:] = ctx.get([got[s] for s in sources], sources, call)


def scatter(ctx: GroupContext, call: Call, refs: Optional[List[Any]], root: int,
            out: List[Any]) -> None:
    """``out[0]`` = this rank's object of the ones ``root`` put (``refs``, one per rank)."""
    got = ctx.exchange(call, 0, refs)
    out[0] = ctx.get([got[root]], [root], call)[0]
