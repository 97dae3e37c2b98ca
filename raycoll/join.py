"""``Join``, ``Joinable`` and ``JoinHook``: uneven inputs, as ``torch.distributed.algorithms.join``.

When ranks of a data-parallel job have different numbers of inputs, the first to run out
would leave the others hanging in their next collective. Inside ``with Join([...]):`` a rank
that has exhausted its inputs instead *shadows* the collectives of the ranks still working
(each joinable's :meth:`JoinHook.main_hook`), once per iteration, until every rank has
joined; then every rank runs :meth:`JoinHook.post_hook` (``is_last_joiner`` tells the ranks
that joined last, e.g. to broadcast their final model state).

How it runs here: each iteration is one *join round*, an all-gather of every rank's join
sequence number (``None`` while it has inputs), like torch's one small all-reduce: on the
group's node segment when it has one (every rank computes the answer; the coordinator only
hears of each join and of the end, for group_status), else on the coordinator (one small
round trip). A rank still working posts
its round from :meth:`Join.notify_join_context` without waiting for it (it returns a
:class:`Work`), so the round overlaps the rank's own work; a joined rank waits for the
round's answer, which says whether ranks are left with inputs (run one shadow round) or
everyone has joined (run the post-hooks; ``is_last_joiner`` comes from the join order the
coordinator saw). With ``throw_on_early_termination=True`` the working ranks wait for the
round too, and every rank raises ``RuntimeError`` in the round where the first rank joined.
The coordinator keeps who has joined and in what order, so :func:`raycoll.group_status`
shows it from the driver.

Semantics and signatures follow torch 2.x: ``Join(joinables, enable=True,
throw_on_early_termination=False, **kwargs)`` (``kwargs`` go to every
``joinable.join_hook(**kwargs)``); only the first joinable's ``notify_join_context`` counts;
all joinables must use the same process group (``None`` is the default group). Unlike torch,
leaving the context switches the joinables' join config back off, so a joinable used outside
any ``Join`` afterwards costs nothing per iteration.
"""

from __future__ import annotations

import concurrent.futures
import warnings
from abc import ABC, abstractmethod
from types import TracebackType
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple, Type, cast

from raycoll import errors
from raycoll.coordinator.logic import JOIN_OUT_OF_STEP, join_outcome
from raycoll.process_group import ProcessGroup
from raycoll.world import GroupLike, _NonMember, world
from raycoll.work import Work

if TYPE_CHECKING:  # pragma: no cover
    import ray

__all__ = ["JoinHook", "Joinable", "Join"]

#: Past this many shadow rounds a joined rank warns about the input skew (as torch does).
WARN_THRESHOLD = 1000

#: What a join round answers (see ``Coordinator.join_round``).
RoundResult = Dict[str, Any]


class JoinHook:
    """The two entry points a joinable gives the join context manager.

    Override :meth:`main_hook` to shadow, on a joined rank, the collectives that one
    iteration of the ranks still working issues; override :meth:`post_hook` for what to do
    once every rank has joined.
    """

    def main_hook(self) -> None:
        """Run on a joined rank once per iteration while some rank still has inputs."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank has joined.

        Arguments:
            is_last_joiner: ``True`` if this rank is one of the last to join.
        """


class _JoinConfig(NamedTuple):
    """What the join context manager sets on each joinable (torch's fields, plus the Join)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool
    join: Optional["Join"] = None

    @staticmethod
    def construct_disabled_join_config() -> "_JoinConfig":
        """The config of a joinable outside any join context: join logic disabled."""
        return _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Joinable(ABC):
    """Base class of classes that can take part in a :class:`Join` context.

    Subclasses call ``super().__init__()``, implement :meth:`join_hook`, :attr:`join_device`
    and :attr:`join_process_group`, and call :meth:`Join.notify_join_context` before their
    per-iteration collectives.
    """

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The :class:`JoinHook` of this joinable; ``kwargs`` are the ``Join``'s keyword
        arguments, the same for every joinable of the context."""

    @property
    @abstractmethod
    def join_device(self) -> Any:
        """The device of this joinable's tensors (``"cpu"``, ``"cuda"``, a torch device)."""

    @property
    @abstractmethod
    def join_process_group(self) -> GroupLike:
        """The group of the join context's rounds: a ``ProcessGroup``, a name, or ``None``
        for the default group."""


def _resolve(group: GroupLike, what: str) -> ProcessGroup:
    pg = world().resolve(group)
    if isinstance(pg, _NonMember):
        raise ValueError(f"{what} is a group this rank is not a member of "
                         "(GroupMember.NON_GROUP_MEMBER); Join needs a group containing this rank")
    return pg


class Join:
    """The join context manager for uneven inputs (``torch.distributed.algorithms.join.Join``).

    Arguments:
        joinables: the participating :class:`Joinable` s; their hooks run in this order.
        enable: ``False`` turns the context manager off (only when inputs are known to be
            even): ``notify_join_context`` returns ``None`` and leaving does nothing.
        throw_on_early_termination: raise ``RuntimeError`` on every rank as soon as any rank
            has exhausted its inputs, instead of shadowing.
        kwargs: passed to every ``joinable.join_hook(**kwargs)``.

    Every rank of the group must enter the context with the same joinables (in the same
    order) and the same ``throw_on_early_termination``; a disagreement on the latter is
    reported on every rank as a :class:`~raycoll.CollectiveMismatchError`.
    """

    def __init__(self, joinables: List[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any) -> None:
        if isinstance(joinables, Joinable) or not isinstance(joinables, (list, tuple)):
            raise TypeError(f"joinables must be a list of Joinable, got {type(joinables).__name__}")
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        for i, joinable in enumerate(joinables):
            if not isinstance(joinable, Joinable):
                raise TypeError(f"joinables[{i}] must be a raycoll.Joinable, got "
                                f"{type(joinable).__name__}")
        self._joinables = list(joinables)
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = bool(enable)
        self._throw_on_early_termination = bool(throw_on_early_termination)
        self._process_group, self._device = self._extract_dist_info()
        self._rank = self._process_group.global_ranks[self._process_group.rank()]
        self._pending: Optional[Work] = None
        self._set_joinable_configs()

    # ------------------------------------------------------------------ setup
    def _set_joinable_configs(self) -> None:
        first = True
        for joinable in self._joinables:
            joinable._join_config = _JoinConfig(
                enable=self._enable,
                throw_on_early_termination=self._throw_on_early_termination,
                is_first_joinable=first,
                join=self,
            )
            first = False

    def _reset_joinable_configs(self) -> None:
        for joinable in self._joinables:
            if joinable._join_config.join is self:
                joinable._join_config = _JoinConfig.construct_disabled_join_config()

    def _extract_dist_info(self) -> Tuple[ProcessGroup, Any]:
        """The joinables' common process group, and the first joinable's device."""
        process_group: Optional[ProcessGroup] = None
        device: Any = None
        for i, joinable in enumerate(self._joinables):
            pg = _resolve(joinable.join_process_group,
                          f"joinables[{i}].join_process_group ({type(joinable).__name__})")
            if process_group is None:
                process_group = pg
            elif pg is not process_group:
                raise ValueError(
                    "Using join context manager with multiple process groups: joinables[0] "
                    f"uses group {process_group.name!r} but joinables[{i}] "
                    f"({type(joinable).__name__}) uses group {pg.name!r}")
            if device is None:
                device = joinable.join_device
        if process_group is None:  # pragma: no cover - joinables is non-empty
            raise ValueError("The join context manager requires at least one joinable")
        return process_group, device

    @property
    def process_group(self) -> ProcessGroup:
        """The group the join rounds run on."""
        return self._process_group

    # ------------------------------------------------------------------ the context
    def __enter__(self) -> "Join":
        return self

    def __exit__(self, type: Optional[Type[BaseException]], value: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        """Shadow the working ranks' iterations until every rank has joined; then run the
        post-hooks. An exception raised in the body propagates without any of this.

        Raises:
            RuntimeError: with ``throw_on_early_termination=True``, when ranks are left
                with inputs ("Rank R exhausted all inputs.").
        """
        try:
            if not self._enable or type is not None:
                return None
            self._check_pending()
            self._join_loop()
        finally:
            self._pending = None
            self._reset_joinable_configs()
        return None

    def _join_loop(self) -> None:
        pg = self._process_group
        join_seq: Optional[int] = None
        shadow_rounds = 0
        while True:
            if shadow_rounds == WARN_THRESHOLD + 1:
                warnings.warn(
                    f"Detected uneven input skew of greater than {WARN_THRESHOLD}. This means "
                    f"that rank {self._rank} has at least {WARN_THRESHOLD} fewer inputs than "
                    "other currently-active ranks. This level of skew could lead to "
                    "performance degradation during training.", stacklevel=3)
            call = pg.new_call("join")
            if join_seq is None:
                join_seq = call.seq
            result = _run_round(pg, call, join_seq, self._throw_on_early_termination)
            if result["all_joined"]:
                is_last_joiner = bool(result["is_last_joiner"])
                break
            if self._throw_on_early_termination:
                raise RuntimeError(
                    f"Rank {self._rank} exhausted all inputs. (Join on group {pg.name!r} with "
                    f"throw_on_early_termination=True; ranks {result['nonjoined']} still had "
                    "inputs and raise too.)")
            for hook in self._join_hooks:
                hook.main_hook()
            shadow_rounds += 1
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    # ------------------------------------------------------------------ per iteration
    @staticmethod
    def notify_join_context(joinable: Joinable) -> Optional[Work]:
        """Tell the join context that this rank has not joined yet (call once per iteration,
        before the joinable's own collectives).

        Only the first joinable of the context does anything; for the others, and outside a
        context or with ``enable=False``, this returns ``None``. Otherwise it posts this
        iteration's join round and returns its :class:`Work` at once; with
        ``throw_on_early_termination=True`` it waits for the round and raises
        ``RuntimeError`` if some rank has exhausted its inputs.
        """
        config = getattr(joinable, "_join_config", None)
        if not isinstance(config, _JoinConfig):
            raise RuntimeError(f"Check that the {type(joinable)} constructor calls the "
                               "``Joinable`` constructor (super().__init__())")
        if not config.is_first_joinable or not config.enable or config.join is None:
            return None
        return config.join._notify()

    def _notify(self) -> Work:
        self._check_pending()
        pg = self._process_group
        call = pg.new_call("join")
        if not self._throw_on_early_termination:
            work = _post_round(pg, call)
            self._pending = work
            return work
        result = _run_round(pg, call, None, True)
        if result["join_order"]:
            raise RuntimeError(
                "Detected at least one rank that exhausted inputs. Throwing across all ranks. "
                f"(ranks {result['join_order']} exhausted their inputs; raised on rank "
                f"{self._rank} of group {pg.name!r}.)")
        return Work.completed(result, describe=f"join #{call.seq} on group {pg.name!r}")

    def _check_pending(self) -> None:
        """Raise the error of the previous, unwaited join round, if it failed."""
        work, self._pending = self._pending, None
        if work is not None and work.is_completed():
            work.wait()
        elif work is not None:
            self._pending = work


# ---------------------------------------------------------------------- join rounds
def _round_in_order(pg: ProcessGroup, call: Any, join_seq: Optional[int],
                    throw: bool) -> RoundResult:
    """A join round run in the group's issue order: on the round transport if the group has
    one by then, else through the coordinator."""
    if pg.lane_active:
        return _transport_round(pg, call, join_seq, throw)
    ref = _submit(pg, call, join_seq, throw)
    return pg.client.wait(ref, call.timeout_s, **pg.error_context(call))


def _local_result(pg: ProcessGroup, join_seq: Optional[int]) -> RoundResult:
    me = pg.global_ranks[pg.rank()]
    return {"nonjoined": [] if join_seq is not None else [me],
            "join_order": [me] if join_seq is not None else [],
            "all_joined": join_seq is not None, "is_last_joiner": join_seq is not None}


def _submit(pg: ProcessGroup, call: Any, join_seq: Optional[int], throw: bool) -> "ray.ObjectRef":
    return pg.client.submit_join_round(pg.name, pg.global_ranks, call.seq, pg.rank(),
                                       join_seq, throw, call.timeout_s)


def _run_round(pg: ProcessGroup, call: Any, join_seq: Optional[int], throw: bool) -> RoundResult:
    """Run one join round in the group's issue order and wait for its answer."""
    if pg.size() == 1:
        return _local_result(pg, join_seq)
    out: List[RoundResult] = []
    pg.run(call, lambda: out.append(_round_in_order(pg, call, join_seq, throw)), async_op=False)
    return out[0]


def _transport_round(pg: ProcessGroup, call: Any, join_seq: Optional[int],
                     throw: bool) -> RoundResult:
    """A join round on the group's round transport: an all-gather of every rank's join
    sequence number (one small collective on the transport, as torch's one small
    all-reduce), each rank computing the answer; the coordinator hears only of joins and of
    the end, for group_status. Called in the group's issue order, so every rank takes this
    path for the same round (the transport is set up or not alike on every rank)."""
    client = pg.client
    fp_call = pg.with_fingerprint(call, throw_on_early_termination=bool(throw))
    try:
        seqs = pg.gather_round(fp_call, join_seq)
    except errors.CollectiveMismatchError as exc:  # out of step: nothing can go on
        err = errors.CollectiveMismatchError(f"{exc} {JOIN_OUT_OF_STEP}",
                                             **pg.error_context(call))
        client.submit_abort(pg.name, "mismatch", str(err), {}, pg._root.generation)
        raise err from exc
    if seqs is None:  # cannot happen: the transport was checked active in issue order
        raise errors.CollectiveError(f"join #{call.seq} on group {pg.name!r}: the lane is gone",
                                     **pg.error_context(call))
    outcome, order, ended = join_outcome(pg.global_ranks, seqs, join_seq, throw)
    if join_seq is not None and join_seq == call.seq:  # this rank joined in this round
        client.submit_join_report(pg.name, pg.global_ranks, pg.rank(), join_seq)
    if ended:
        client.submit_join_end(pg.name, pg.global_ranks, call.seq, order,
                               not outcome["all_joined"])
    return outcome


def _post_round(pg: ProcessGroup, call: Any) -> Work:
    """Post a working rank's join round now; its answer completes the returned ``Work``.

    On a group with a round transport the round is one small collective on it, queued in
    the group's issue order like any async collective. Otherwise it is sent straight to the
    coordinator (not queued behind this rank's earlier async collectives: the coordinator
    matches rounds by sequence number, so order does not matter) and nothing waits for it, so
    it overlaps the iteration's own work. Which of the two is decided in issue order (the
    transport is set up inside a collective, at the same point on every rank).
    """
    describe = f"join #{call.seq} on group {pg.name!r}"
    if pg.size() == 1:
        return Work.completed(_local_result(pg, None), describe=describe)
    if pg.lane_active or pg.outstanding():
        return cast(Work, pg.run(call, lambda: _round_in_order(pg, call, None, False),
                                 async_op=True))
    ref = _submit(pg, call, None, False)
    ctx = pg.error_context(call)
    client = pg.client
    inner: "concurrent.futures.Future[Any]" = concurrent.futures.Future()

    def done(_f: "concurrent.futures.Future[Any]") -> None:
        try:  # the reply is in: this returns at once, translating any failure
            inner.set_result(client.wait(ref, call.timeout_s, **ctx))
        except BaseException as exc:  # noqa: BLE001 - delivered through the Work
            inner.set_exception(exc)

    ref.future().add_done_callback(done)
    return Work(inner, describe=describe)
