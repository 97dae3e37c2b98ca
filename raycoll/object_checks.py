"""The argument conventions of torch's ``ProcessGroup`` object API, as gloo checks them.

torch's object calls take tensors in lists and an Options object, or (the overloads) a bare
tensor with ``root``/``op``/``timeout``. :func:`options` turns either form into raycoll's
Options; the ``check_*`` functions make gloo's structural checks in gloo's order, with gloo's
words first (torch's tests and users match on them): "invalid root rank", "requires non-empty
tensor list", "Incorrect input list size 3. Input list size should be 4". They raise
:class:`~raycoll.errors.InvalidArgumentError` (a ``ValueError`` that is also torch's
``RuntimeError``); :func:`torch_errors` gives the checks the module functions make (dtype,
size) the same pair of types.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Type, TypeVar

from raycoll import errors
from raycoll.call_options import UNSET_TIMEOUT
from raycoll.reduce_op import ReduceOp
from raycoll.tensors import is_tensor

__all__ = ["options", "tensor_list", "check_root", "check_root_tensor", "single",
           "rooted", "torch_errors"]

T = TypeVar("T")


def _is_op(value: Any) -> bool:
    return isinstance(value, ReduceOp) or type(value).__name__ in ("ReduceOp", "RedOpType")


def options(opts: Any, cls: Type[T], op: str, *, root: Optional[int] = None,
            reduce_op: Any = None, timeout: Any = None) -> T:
    """``opts`` as ``cls``. ``None``, or an overload's positional value in its place (a
    ``ReduceOp``, a root rank, a ``timedelta``), gives the defaults with ``root``,
    ``reduce_op`` and ``timeout`` set; raycoll's Options or torch's (fields read and
    checked)."""
    if _is_op(opts):
        opts, reduce_op = None, opts
    elif isinstance(opts, int) and not isinstance(opts, bool):
        opts, root = None, opts
    elif isinstance(opts, timedelta):
        opts, timeout = None, opts
    if opts is None:
        made = cls()
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]  # Options dataclasses
        for name, value in (("rootRank", root), ("reduceOp", reduce_op), ("timeout", timeout)):
            if value is not None:
                if name not in names:
                    raise TypeError(f"{op}() got an unexpected keyword argument for {name}")
                setattr(made, name, value)
        return made
    if root is not None or reduce_op is not None or timeout is not None:
        raise TypeError(f"{op}: pass either opts or root/op/timeout, not both")
    if isinstance(opts, cls):
        return opts
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]  # Options dataclasses
    lacking = [n for n in known if not hasattr(opts, n)]
    if lacking:
        raise TypeError(f"{op}: opts must be a raycoll.{cls.__name__} (or torch's), got "
                        f"{type(opts).__name__} without {', '.join(lacking)}")
    return cls(**{n: getattr(opts, n) for n in known})


def timeout_given(value: Any) -> Any:
    """torch's ``timeout=None`` of the overloads as the Options' unset value."""
    return None if value is None or value == UNSET_TIMEOUT else value


def tensor_list(values: Any, name: str, op: str) -> List[Any]:
    """A list of tensors (a bare tensor: a list of one)."""
    if is_tensor(values):
        return [values]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of tensors, got {type(values).__name__}")
    return list(values)


def check_root(root: int, size: int, op: str) -> None:
    if not 0 <= root < size:
        raise errors.InvalidArgumentError(
            f"invalid root rank: {root} ({op}: opts.rootRank must be a rank in the group, "
            f"0 to {size - 1})")


def check_root_tensor(index: int, count: int, op: str) -> None:
    if not 0 <= index < count:
        raise errors.InvalidArgumentError(
            f"invalid root tensor: {index} ({op}: opts.rootTensor must index the list of "
            f"{count} tensor(s))")


def single(values: List[Any], what: str, op: str) -> Any:
    """The one tensor of a list that must hold one ("requires a single-element ...")."""
    if len(values) != 1:
        raise errors.InvalidArgumentError(
            f"requires a single-element {what} ({op}: got {len(values)} elements)")
    return values[0]


def rooted(values: Any, name: str, what: str, size: int, is_root: bool, op: str,
           word: str) -> Optional[List[Any]]:
    """The one list of ``[[t0, ..., t(W-1)]]``, on the root; ``[]`` (or ``[[]]``) elsewhere.
    ``what``: gloo's name for the list ("output list"), ``word``: "Output" or "Input"."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of lists of tensors, got "
                        f"{type(values).__name__}")
    if not is_root:
        if len(values) and not (len(values) == 1 and not values[0]):
            raise errors.InvalidArgumentError(
                f"requires empty {word.lower()} on non-root ({op}: {name} has "
                f"{len(values)} list(s) on a rank that is not the root)")
        return None
    inner = single(list(values), what, op)
    if not isinstance(inner, (list, tuple)):
        raise TypeError(f"{op}: {name}[0] must be a list of tensors, got "
                        f"{type(inner).__name__}")
    if len(inner) != size:
        raise errors.InvalidArgumentError(
            f"Incorrect {word.lower()} list size {len(inner)}. {word} list size should be "
            f"{size} ({op}: one tensor per rank)")
    return list(inner)


@contextlib.contextmanager
def torch_errors() -> Iterator[None]:
    """Argument errors as torch's object API raises them: a ``ValueError`` or ``TypeError``
    that is not already a ``RuntimeError`` comes out as raycoll's subclass that is both
    (the message and the cause kept)."""
    try:
        yield
    except RuntimeError:
        raise
    except TypeError as exc:
        raise errors.TensorTypeError(str(exc)) from exc
    except ValueError as exc:
        raise errors.InvalidArgumentError(str(exc)) from exc
