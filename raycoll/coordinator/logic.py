"""The coordinator's pure logic: result encoding, matching, error texts, Join answers.

Plain Python over plain values (no Ray, no asyncio), so that it is unit-tested without a
cluster (``tests/test_coordinator_logic.py``) and usable by modules that only need a helper
(the shared-memory lane compares fingerprints, the objstore backend compares metadata, Join
computes its answers on the ranks) without reaching for the actor.

Results travel from the actor to the ranks as plain tuples, ``("ok", value)`` or
``("err", kind, message, extra)``; :func:`unwrap` turns the latter into raycoll's exceptions.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from raycoll import errors

__all__ = ["EVERY_RANK", "JOIN_OUT_OF_STEP", "Result", "ok", "err", "unwrap", "coordinator_name",
           "fmt_ranks", "fmt_meta", "fingerprint_mismatch", "meta_mismatch", "p2p_mismatch",
           "route", "timeout_error", "subgroup_keys", "join_outcome", "join_summary",
           "death_cause", "first_line"]

#: What a mismatch in a join round adds to its message.
JOIN_OUT_OF_STEP = ("(the ranks of a Join are out of step: does every rank use the same joinables "
                    "and throw_on_early_termination, does the first joinable call "
                    "Join.notify_join_context before its collectives, and does each main_hook "
                    "shadow exactly one iteration's collectives?)")

Result = Tuple[Any, ...]

#: In a progress report (group rank -> last completed collective), the key that stands for
#: every rank of the group: a rank on a round transport knows that every rank completed the
#: collective it completed, and says so in one entry instead of W.
EVERY_RANK = -1


def coordinator_name(job_id: str, group_name: str) -> str:
    """The Ray actor name of a root group's coordinator (namespaced by the job)."""
    return f"raycoll:{job_id}:{group_name}"


# ---------------------------------------------------------------------- results
def ok(value: Any = None) -> Result:
    """A successful result carrying ``value``."""
    return ("ok", value)


def err(kind: str, message: str, **extra: Any) -> Result:
    """A failed result: ``kind`` picks the exception (see :data:`ERRORS`), ``extra`` its fields."""
    return ("err", kind, message, extra)


#: Error kind -> the exception a rank raises for it (``"value"``: ValueError; other kinds:
#: CollectiveError).
ERRORS = {
    "mismatch": errors.CollectiveMismatchError,
    "peer_arg": errors.PeerArgumentError,
    "timeout": errors.DistTimeoutError,
    "rank_failed": errors.RankFailedError,
    "aborted": errors.GroupBrokenError,
    "protocol": errors.CollectiveError,
    "gone": errors.CoordinatorDiedError,
}


def unwrap(result: Result, ctx: Dict[str, Any]) -> Any:
    """``("ok", v)`` -> ``v``; ``("err", kind, msg, extra)`` -> raise the matching exception."""
    if result[0] == "ok":
        return result[1]
    _, kind, message, extra = result
    if kind == "value":
        raise ValueError(message)
    cls = ERRORS.get(kind, errors.CollectiveError)
    kwargs = dict(ctx)
    if cls is errors.DistTimeoutError:
        kwargs["missing"] = extra.get("missing", ())
    if cls is errors.RankFailedError:
        kwargs["failed_ranks"] = extra.get("failed_ranks", ())
    raise cls(message, **kwargs)


def first_line(exc: BaseException) -> str:
    """The last line of an exception's text (Ray's errors end with the reason), at most 300
    characters; the exception's type name when it has no text."""
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


# ---------------------------------------------------------------------- texts
def fmt_ranks(ranks: Iterable[int]) -> str:
    """``[0, 2]``: ranks as error messages list them."""
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def fmt_meta(meta: Any) -> str:
    """An array's ``(dtype, shape)`` metadata as error messages show it."""
    if isinstance(meta, tuple) and len(meta) == 2:
        return f"dtype={meta[0]}, shape={tuple(meta[1])}"
    return repr(meta)


# ---------------------------------------------------------------------- matching
def fingerprint_mismatch(fps: Dict[int, Dict[str, Any]], ranks: Sequence[int]) -> Optional[str]:
    """What the fingerprints ``fps`` (group rank -> fingerprint) disagree on, naming the
    ranks (global, from ``ranks``) on each side; ``None`` when they all agree."""
    first = next(iter(fps.values()), None)
    if all(fp == first for fp in fps.values()):  # the common case, at C speed
        return None
    keys = sorted({k for fp in fps.values() for k in fp})
    problems = []
    for k in keys:
        values: Dict[str, List[int]] = defaultdict(list)
        for r in sorted(fps):
            values[repr(fps[r].get(k))].append(ranks[r])
        if len(values) > 1:
            parts = ", ".join(f"ranks {fmt_ranks(rs)} passed {v}" for v, rs in values.items())
            problems.append(f"ranks disagree on {k}: {parts}")
    return "; ".join(problems) or None


def meta_mismatch(send: Dict[int, Optional[List[Any]]], recv: Dict[int, Optional[List[Any]]],
                  ranks: Sequence[int]) -> Optional[str]:
    """Which pairs disagree: ``send[s][r]`` is what group rank ``s`` sends ``r`` (its
    ``(dtype, shape)``), ``recv[r][s]`` what ``r`` expects from ``s``; ``None`` if all agree."""
    problems = []
    size = len(send)
    for r in sorted(recv):
        expecting = recv[r]
        if expecting is None:
            continue
        for s in range(size):
            sender = send[s]
            sent = sender[r] if sender is not None else None
            expected = expecting[s]
            if sent != expected:
                problems.append(
                    f"rank {ranks[s]} sends rank {ranks[r]} "
                    f"{'nothing' if sent is None else fmt_meta(sent)} but rank {ranks[r]} expects "
                    f"{'nothing' if expected is None else fmt_meta(expected)}"
                )
    if len(problems) > 4:
        problems = problems[:4] + [f"... and {len(problems) - 4} more"]
    return "; ".join(problems) or None


def p2p_mismatch(key: str, ranks: Sequence[int], src: int, dst: int, tag: int,
                 send_meta: Any, recv_meta: Any) -> Optional[Result]:
    """The error of a send from group rank ``src`` matched with a receive at ``dst`` whose
    metadata differ; ``None`` when they agree."""
    if send_meta == recv_meta:
        return None
    return err("mismatch", f"send from rank {ranks[src]} to rank {ranks[dst]} (tag {tag}) on "
               f"group {key!r}: the sender sent {fmt_meta(send_meta)} but the receiver "
               f"expects {fmt_meta(recv_meta)}")


def route(payloads: Sequence[Optional[Sequence[Any]]]) -> Dict[int, List[Any]]:
    """Each group rank's share of a routed step: ``payloads[s][r]`` is what ``s`` sends
    ``r`` (``payloads[s]`` ``None``: ``s`` sends nothing); rank ``r`` gets the list by source."""
    size = len(payloads)
    if all(p is None for p in payloads):  # a barrier: every rank gets the same Nones, once
        nothing: List[Any] = [None] * size
        return dict.fromkeys(range(size), nothing)
    return {r: [(p[r] if p is not None else None) for p in payloads] for r in range(size)}


def timeout_error(key: str, op: str, seq: int, missing: Sequence[int],
                  lasts: Dict[int, Optional[Tuple[str, int]]], timeout_s: float) -> Result:
    """The error of collective ``seq`` timing out with global ranks ``missing`` absent: names
    them and the last collective each completed (``lasts``, by global rank)."""
    parts = []
    for g in missing:
        last = lasts.get(g)
        parts.append(f"rank {g} last completed {last[0]} #{last[1]}" if last else
                     f"rank {g} completed nothing on this group")
    detail = "; ".join(parts)
    return err(
        "timeout",
        f"{op} #{seq} on group {key!r} timed out after {timeout_s:g}s: ranks "
        f"{fmt_ranks(missing)} never arrived ({detail})",
        missing=list(missing),
    )


def subgroup_keys(key: str, groups: Iterable[str]) -> Set[str]:
    """Group ``key`` and those of ``groups`` under it (``key/...``): what breaking it breaks."""
    return {k for k in set(groups) | {key} if k == key or k.startswith(key + "/")}


# ---------------------------------------------------------------------- join
def join_outcome(ranks: Sequence[int], seqs: Sequence[Optional[int]], join_seq: Optional[int],
                 throw: bool) -> Tuple[Dict[str, Any], List[Tuple[int, int]], bool]:
    """One join round's answer for the rank that sent ``join_seq``, from every group rank's
    ``seqs`` (``None``: still has inputs): the answer, the join order ``(seq, group rank)``,
    and whether this Join is over (everyone joined, or a rank joined under ``throw``)."""
    nonjoined = [ranks[r] for r in range(len(seqs)) if seqs[r] is None]
    order = sorted((s, r) for r, s in enumerate(seqs) if s is not None)
    last_seq = order[-1][0] if order else None
    outcome = {
        "nonjoined": nonjoined,
        "join_order": [ranks[r] for _s, r in order],
        "all_joined": not nonjoined,
        "is_last_joiner": not nonjoined and join_seq is not None and join_seq == last_seq,
    }
    return outcome, order, not nonjoined or (throw and bool(order))


def join_summary(ranks: Sequence[int], seq: int, order: Sequence[Tuple[int, int]],
                 terminated: bool) -> Dict[str, Any]:
    """How the Join whose final round is ``seq`` ended (for group_status): the join order
    (global ranks), the ranks that joined last, and whether it was terminated early."""
    last_seq = order[-1][0] if order else None
    return {
        "join_order": [ranks[r] for _s, r in order],
        "last_joiners": [ranks[r] for s, r in order if s == last_seq],
        "final_seq": seq,
        "terminated_early": terminated,
    }


# ---------------------------------------------------------------------- liveness
def death_cause(exc: BaseException) -> str:
    """A one-line reason from a Ray actor-death error (its message spans many lines)."""
    text = str(exc)
    fields = dict(re.findall(r"^\s*(class_name|pid|ip): (\S+)$", text, flags=re.MULTILINE))
    because = re.search(r"The actor (?:is dead|died) because (.+?)(?:\.\s|\.$|$)", text,
                        flags=re.DOTALL)
    reason = because.group(1).strip() if because else type(exc).__name__
    node = re.search(r"Node Id: ([0-9a-f]{8})", text)
    if node:
        fields["node"] = node.group(1)
    where = ", ".join(f"{k} {fields[k]}" for k in ("class_name", "pid", "ip", "node") if k in fields)
    return f"{reason}" + (f" (actor {where})" if where else "")
