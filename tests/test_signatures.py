"""Every name raycoll shares with torch.distributed has torch 2.13's signature.

For each public function (and each public method of a shared class) that both define, the
parameters torch declares must come first in raycoll's, with the same names, kinds, order and
defaults (a torch ``ReduceOp`` default is compared as raycoll maps it). raycoll may add
parameters after torch's, with defaults: a call written for torch binds the same way.
Where torch's pybind method is overloaded, its first overload is compared (for
``ProcessGroup``'s object API: the form with an Options object). pybind's ``arg0``, ``arg1``,
... are no names (such a parameter can only be passed by position): any positional
parameter of raycoll's matches one. A torch default that is an Options object made once (a
pybind default, shared by every call) matches raycoll's ``None`` (fresh options per call).
Members a public class inherits from raycoll's own bases are compared too.
Whatever differs otherwise is listed in ``EXCEPTIONS`` with the reason.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest

import raycoll

#: name -> why it differs (an entry that comes to match torch fails the test: remove it).
#: torch's private parameters (``_ranks`` of init_process_group) are not compared.
EXCEPTIONS: Dict[str, str] = {
    "BackendConfig.__init__": "backend has a default (None: the per-device default map) where "
                              "torch requires one; every torch call works",
    "Work.wait": "timeout defaults to None (torch: timedelta(0)); both mean 'no bound of its "
                 "own', and timedelta(0) is accepted",
    "Work.__init__": "raycoll makes its Work objects (torch's can be subclassed by Python "
                     "backends: raycoll's torch backend does that, in "
                     "raycoll.torch_backend.process_group)",
    "ProcessGroup.__init__": "raycoll makes its groups (init_process_group, new_group); torch's "
                             "overloaded pybind constructor has no single signature",
    "DebugLevel.__init__": "an enum.IntEnum: DebugLevel(value) looks the member up, as torch's "
                           "DebugLevel(value) does (Enum's own __init__ takes *args)",
    "ProcessGroupGloo.__init__": "raycoll has no ProcessGroupGloo objects (it serves 'gloo' "
                                 "with its own CPU path): constructing one raises, saying what "
                                 "to use",
}

Param = Tuple[str, str, Any]  # name, kind, default (inspect.Parameter.empty if none)


def _split_top_level(text: str) -> List[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def _params(obj: Any) -> Optional[List[Param]]:
    """The parameters of a Python function, or of a pybind11 method from its docstring (its
    first overload's, where it is overloaded)."""
    try:
        sig = inspect.signature(obj)
        return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]
    except (TypeError, ValueError):
        pass
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    if len(doc) > 1 and doc[1].strip() == "Overloaded function.":
        doc = [line[3:] for line in doc if line.startswith("1. ")]
    match = re.match(r"^\w+\((.*)\)\s*->", doc[0]) if doc else None
    if match is None:
        return None
    out: List[Param] = []
    for part in _split_top_level(match.group(1)):
        name, _, default = part.partition("=")
        out.append((name.split(":")[0].strip(), "POSITIONAL_OR_KEYWORD",
                    default.strip() or inspect.Parameter.empty))
    return out


_PYBIND_OPTIONS = re.compile(r"<torch\._C\._distributed_c10d\.\w+Options object at 0x[0-9a-f]+>")


def _same_default(ours: Any, theirs: Any) -> bool:
    if ours is None and isinstance(theirs, str) and _PYBIND_OPTIONS.fullmatch(theirs):
        return True
    if isinstance(theirs, str) and not isinstance(ours, str) and theirs == repr(ours):
        return True  # a pybind default, read from its docstring as text ('None', 'True')
    if ours is theirs or (ours is inspect.Parameter.empty) == (theirs is inspect.Parameter.empty) \
            and ours == theirs:
        return True
    if type(theirs).__name__ in ("RedOpType", "ReduceOp") and isinstance(ours, raycoll.ReduceOp):
        from raycoll.reduce_op import as_reduce_op

        return as_reduce_op(theirs) == ours
    return False


def _mismatch(ours: List[Param], theirs: List[Param]) -> Optional[str]:
    if len(ours) < len(theirs):
        return f"fewer parameters: {[p[0] for p in ours]} vs torch's {[p[0] for p in theirs]}"
    for (n, k, d), (tn, tk, td) in zip(ours, theirs):
        if re.fullmatch(r"arg\d+", tn) and k in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            pass  # pybind's placeholder: torch's parameter has no name
        elif n != tn or k != tk:
            return f"parameter {n} ({k}) where torch has {tn} ({tk})"
        if not _same_default(d, td):
            return f"parameter {n} defaults to {d!r}, torch's to {td!r}"
    for n, k, d in ours[len(theirs):]:
        if d is inspect.Parameter.empty and k not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            return f"extra parameter {n} has no default"
    return None


def _shared() -> List[Tuple[str, Any, Any]]:
    """(label, raycoll object, torch object) for every shared function and method."""
    import torch.distributed as dist
    from torch.distributed.algorithms import join

    pairs = []
    for name in sorted(raycoll.__all__):
        theirs = getattr(dist, name, None) or getattr(join, name, None)
        if theirs is None:
            continue
        ours = getattr(raycoll, name)
        if not inspect.isclass(ours):
            if inspect.isroutine(ours):  # not a value (default_pg_timeout) or a type alias
                pairs.append((name, ours, theirs))
            continue
        own = {m for base in ours.__mro__ if base.__module__.startswith("raycoll")
               for m in vars(base)}
        for member in sorted(own | {"__init__"}):
            if member.startswith("_") and member not in ("__init__", "_source_rank"):
                continue
            static = inspect.getattr_static(ours, member, None)
            if not (inspect.isfunction(static) or isinstance(static, (staticmethod, classmethod))):
                continue
            if not hasattr(theirs, member) or member == "__init__" and theirs.__init__ is \
                    object.__init__:
                continue
            pairs.append((f"{name}.{member}", getattr(ours, member), getattr(theirs, member)))
    return pairs


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_shared_names_have_torchs_signatures():
    mismatches, unreadable, stale = {}, [], []
    pairs = _shared()
    for label, ours, theirs in pairs:
        mine, torchs = _params(ours), _params(theirs)
        if mine is None or torchs is None:
            if label not in EXCEPTIONS:
                unreadable.append(label)
            continue
        if torchs is not None:
            torchs = [p for p in torchs if not p[0].startswith("_")]
        if mine and mine[0][0] == "self" and torchs and torchs[0][0] == "self":
            mine, torchs = mine[1:], torchs[1:]
        problem = _mismatch(mine, torchs)
        if problem is not None and label not in EXCEPTIONS:
            mismatches[label] = problem
        if problem is None and label in EXCEPTIONS:
            stale.append(label)
    assert len(pairs) > 40  # the comparison really ran over the API
    assert unreadable == [], f"signatures that could not be read: {unreadable}"
    assert mismatches == {}, "signatures that differ from torch 2.13's (fix, or list in " \
                             f"EXCEPTIONS with the reason): {mismatches}"
    assert stale == [], f"EXCEPTIONS entries that now match torch (remove them): {stale}"


def test_mismatch_rules_without_torch():
    """The comparison itself: a prefix with trailing defaults passes, anything else fails."""
    e = inspect.Parameter.empty
    torchs = [("tensor", "POSITIONAL_OR_KEYWORD", e), ("group", "POSITIONAL_OR_KEYWORD", None)]
    assert _mismatch(torchs + [("extra", "KEYWORD_ONLY", 1)], torchs) is None
    assert "no default" in _mismatch(torchs + [("extra", "KEYWORD_ONLY", e)], torchs)
    assert "defaults to" in _mismatch([torchs[0], ("group", "POSITIONAL_OR_KEYWORD", 0)], torchs)
    assert "where torch has" in _mismatch(torchs[::-1], torchs)
    assert "fewer" in _mismatch(torchs[:1], torchs)
