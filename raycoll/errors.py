"""raycoll's exceptions: one tree, so that callers can tell whose fault a failure was.

::

    RaycollError (RuntimeError)             anything raycoll raises on its own account
    ├── GroupError                          the group itself cannot be used
    │   ├── GroupNotFoundError              no such group in this process (never formed)
    │   └── GroupDestroyedError             closed by you: destroy_group / destroy_process_group
    ├── CollectiveError                     a collective could not complete; names op and seq
    │   ├── CollectiveMismatchError         ranks called it with different shape/dtype/op/root
    │   ├── PeerArgumentError               another rank rejected its own arguments
    │   ├── DistTimeoutError (TimeoutError) some ranks did not arrive in time; names them
    │   └── GroupBrokenError                broken by the world; the cause is chained
    │       ├── RankFailedError             a rank's actor died
    │       └── CoordinatorDiedError        the group's coordinator actor is gone
    ├── BackendUnavailableError             the backend for a device is missing (no cupy, ...)
    ├── SpawnError                          raycoll.spawn: a rank's function raised
    ├── CodeNotShippableError (ImportError) the ranks cannot import the function's module and
    │                                       it cannot travel by value (compiled code)
    ├── TransferError                       a Ray Direct Transport transfer over raycoll failed
    │                                       (the source actor gone, the object freed, aborted;
    │                                       docs/rdt.md)
    └── RaySessionError                     Ray is not initialized here, or an actor handle
                                            belongs to a Ray session that has ended

Invalid arguments on the calling rank raise the built-in ``ValueError`` / ``TypeError``, as
``torch.distributed`` does, before anything is sent. Two subclasses also derive from what
torch's backends (and ``ray.util.collective``) raise there, so that code catching either works::

    TensorSizeError (ValueError, RuntimeError)      a tensor list of the wrong length, a
                                                    tensor of the wrong size (all_gather, ...)
    TensorTypeError (TypeError, RuntimeError)       tensors of a list that differ in dtype or
                                                    layout (gloo's "invalid tensor type")
    InvalidArgumentError (ValueError, RuntimeError) any other argument the ProcessGroup object
                                                    API refuses (gloo's "invalid root rank")
    UnsupportedOpError (ValueError, TypeError)      a ReduceOp the dtype does not support
                                                    (MAX on complex, BAND on float, ...)

The peers of a collective whose arguments a rank rejected are told, and raise
``PeerArgumentError``. Ray's own exceptions are translated at the edge (the backends, and
the driver-side functions) into these, with the original chained as ``__cause__``.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "RaycollError",
    "GroupError",
    "GroupNotFoundError",
    "GroupDestroyedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "PeerArgumentError",
    "DistTimeoutError",
    "GroupBrokenError",
    "RankFailedError",
    "CoordinatorDiedError",
    "BackendUnavailableError",
    "SpawnError",
    "CodeNotShippableError",
    "RaySessionError",
    "TransferError",
    "TensorSizeError",
    "TensorTypeError",
    "InvalidArgumentError",
    "UnsupportedOpError",
]


class RaycollError(RuntimeError):
    """Base class of every exception raycoll raises on its own account."""


class GroupError(RaycollError):
    """The process group cannot be used from this process."""


class GroupNotFoundError(GroupError, ValueError):
    """No group of that name exists in this process."""


class GroupDestroyedError(GroupError):
    """The group was destroyed (by you) and takes no more calls."""


class CollectiveError(RaycollError):
    """A collective could not complete.

    Attributes name the collective (``op``), its sequence number on the group (``seq``), the
    group (``group``) and the rank that raised (``rank``) when known.
    """

    def __init__(
        self,
        message: str,
        *,
        op: Optional[str] = None,
        seq: Optional[int] = None,
        group: Optional[str] = None,
        rank: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.group = group
        self.rank = rank


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called the same collective with arguments that do not fit together."""


class PeerArgumentError(CollectiveError, ValueError):
    """Another rank rejected its own arguments for this collective, so it cannot run."""


class DistTimeoutError(CollectiveError, TimeoutError):
    """Some ranks did not reach the collective in time. ``missing`` lists them (global ranks).

    The message always holds torch's phrase "Timed out" (scripts match on it): it is
    prefixed where the text does not already say it."""

    def __init__(self, message: str, *, missing: Sequence[int] = (), **kwargs: object) -> None:
        if "Timed out" not in message:
            message = f"Timed out: {message}"
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.missing = tuple(missing)


class GroupBrokenError(CollectiveError):
    """The group is broken by something outside the caller's control; see ``__cause__``."""


class RankFailedError(GroupBrokenError):
    """A rank of the group died. ``failed_ranks`` lists them (global ranks)."""

    def __init__(self, message: str, *, failed_ranks: Sequence[int] = (), **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.failed_ranks = tuple(failed_ranks)


class CoordinatorDiedError(GroupBrokenError):
    """The group's coordinator actor is gone (destroyed, or its owner exited)."""


class BackendUnavailableError(RaycollError):
    """The backend a tensor needs is not available here (for example NCCL without cupy)."""


class SpawnError(RaycollError):
    """A rank's function raised inside :func:`raycoll.spawn`; the rank's error is the cause."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class CodeNotShippableError(RaycollError, ImportError):
    """:func:`raycoll.spawn`'s function (or an argument) comes from a module the rank
    workers cannot import and that cannot be shipped by value; raised before it runs."""


class RaySessionError(RaycollError):
    """Ray is not initialized in this process, or an actor handle given to raycoll belongs to
    a Ray session that has ended (``ray.shutdown()``, or ``ray.init()`` again, since the actor
    was created) or to another cluster: call ``ray.init()`` and create the actors again.
    Ray's own error, where there is one, is the cause."""


class TransferError(RaycollError):
    """A tensor transfer of raycoll's Ray Direct Transport (:mod:`raycoll.rdt`) failed: the
    actor that kept the object is gone, freed it, refused, or the transfer timed out or was
    aborted. The message names the object and where it was kept; both actors stay alive."""


class TensorSizeError(ValueError, RuntimeError):
    """A tensor list of the wrong length or a tensor of the wrong size: a ``ValueError`` (an
    invalid argument) that is also the ``RuntimeError`` torch's and Ray's collectives raise."""


class TensorTypeError(TypeError, RuntimeError):
    """Tensors that should share a dtype or layout do not (or a tensor of a layout the call
    cannot take, a sparse one): the ``TypeError`` raycoll's functions raise, and the
    ``RuntimeError`` torch's backends (gloo) raise there."""


class InvalidArgumentError(ValueError, RuntimeError):
    """An argument of the ``ProcessGroup`` object API (``pg.broadcast([t], opts)``...) that
    the call refuses: a root rank out of range, a list of the wrong length. A ``ValueError``
    (an invalid argument) that is also the ``RuntimeError`` torch's backends raise there."""


class UnsupportedOpError(ValueError, TypeError):
    """A ``ReduceOp`` not defined on the tensor's dtype: torch's ``ValueError``, and the
    ``TypeError`` raycoll raised before."""
