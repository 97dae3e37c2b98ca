"""Ship the user's code to the rank workers by value where they cannot import it.

Ray pickles a function with cloudpickle, which refers to a function of an importable module
by name: the worker imports the module to find it. That fails (``ModuleNotFoundError`` deep
inside a Ray traceback) when the module is on the driver's ``sys.path`` only: a test file
pytest put there, a module next to a notebook, a directory a script inserted into
``sys.path``. Ray adds the driver script's own directory to its workers' paths, not those.

:func:`ship` finds the modules that ``fn`` and its arguments come from (and the user modules
those refer to), asks the actors which of them they cannot import, and registers those with
``cloudpickle.register_pickle_by_value``: their code then travels inside the pickle, as
``__main__``'s always does. A module it cannot ship that way is refused before anything
runs, with an error that names it and the fix.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import types
from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple

import ray
from ray import cloudpickle

from raycoll import errors

#: Top-level packages never shipped: raycoll's own and what it is built on.
_OURS = frozenset({"raycoll", "ray", "numpy", "cupy", "torch", "__main__", "builtins"})


@functools.lru_cache(maxsize=None)
def _installed_roots() -> Tuple[str, ...]:
    """Directories of the standard library and installed distributions."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _is_user_module(module: types.ModuleType) -> bool:
    """A module of the user's own (not built in, not in the standard library or an
    installed distribution's site directory)."""
    name = module.__name__
    if name.partition(".")[0] in _OURS or name in sys.builtin_module_names:
        return False
    path = getattr(module, "__file__", None)
    if not path:
        return False  # built in, frozen or a namespace package: nothing to ship
    path = os.path.realpath(path)
    return not any(path.startswith(root) for root in _installed_roots())


def _modules_of(obj: Any, depth: int = 0) -> Iterable[str]:
    """Names of the modules ``obj`` (a function, class, instance or container of them) needs
    by reference when pickled."""
    if depth > 3:
        return
    if isinstance(obj, functools.partial):
        yield from _modules_of(obj.func, depth + 1)
        for a in (*obj.args, *obj.keywords.values()):
            yield from _modules_of(a, depth + 1)
        return
    if isinstance(obj, types.MethodType):
        yield from _modules_of(obj.__func__, depth + 1)
        yield from _modules_of(obj.__self__, depth + 1)
        return
    if isinstance(obj, types.ModuleType):
        yield obj.__name__
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for a in obj:
            yield from _modules_of(a, depth + 1)
        return
    if isinstance(obj, dict):
        for a in obj.values():
            yield from _modules_of(a, depth + 1)
        return
    if isinstance(obj, types.FunctionType):
        yield obj.__module__
        # the globals it uses (a __main__ function's are pickled by value, but what they
        # name from other modules is pickled by reference)
        for name in _names(obj.__code__):
            if name in obj.__globals__:
                value = obj.__globals__[name]
                if isinstance(value, (types.ModuleType, type, types.FunctionType)):
                    yield from _modules_of(value, depth + 1)
        for cell in obj.__closure__ or ():
            try:
                yield from _modules_of(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
        return
    cls = obj if isinstance(obj, type) else type(obj)
    module = getattr(cls, "__module__", None)
    if isinstance(module, str):
        yield module


def _names(code: types.CodeType) -> Set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _user_modules(roots: Sequence[Any]) -> Dict[str, types.ModuleType]:
    """The user modules ``roots`` need, and those these modules refer to, by name."""
    found: Dict[str, types.ModuleType] = {}
    todo = [n for r in roots for n in _modules_of(r)]
    while todo:
        name = todo.pop()
        module = sys.modules.get(name)
        if name in found or module is None or not _is_user_module(module):
            continue
        found[name] = module
        for value in list(vars(module).values()):
            if isinstance(value, (types.ModuleType, type, types.FunctionType)):
                todo.extend(_modules_of(value, 3))  # its module only, not its globals
    return found


def _by_value(name: str) -> bool:
    check = getattr(cloudpickle.cloudpickle, "_is_registered_pickle_by_value", None)
    module = sys.modules.get(name)
    return bool(check and module is not None and check(module))


def _unimportable(_actor_self: Any, names: List[str]) -> List[str]:
    """(Runs in an actor.) The top-level modules of ``names`` this process cannot import."""
    missing = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def ship(actors: Sequence[Any], roots: Sequence[Any], timeout_s: float) -> List[str]:
    """Register by value the user modules ``roots`` need that some of ``actors`` cannot
    import; returns their names. Raises ``CodeNotShippableError`` for one it cannot
    ship."""
    modules = _user_modules(roots)
    # a module registered by value (it or a package above it) travels already
    tops = sorted({n.partition(".")[0] for n in modules if not _by_value(n)})
    if not tops:
        return []
    refs = [a.__ray_call__.remote(_unimportable, tops) for a in actors]
    try:
        missing = sorted({n for got in ray.get(refs, timeout=timeout_s) for n in got})
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        missing = tops  # the actors did not answer (yet): shipping by value is always safe
    compiled = [n for n in missing if not _pure_python(sys.modules[n])]
    if compiled:
        where = sys.modules[compiled[0]].__file__
        raise errors.CodeNotShippableError(
            f"the rank workers cannot import module {compiled[0]!r} (it is on this process's "
            "sys.path only), and compiled code cannot be shipped by value: install it "
            "(pip install -e <its project>), add its directory to PYTHONPATH before Ray "
            f"starts, or ray.init(runtime_env={{'py_modules': [...]}}) (its file: {where})")
    for name in missing:
        cloudpickle.register_pickle_by_value(sys.modules[name])
    return missing


def _pure_python(module: types.ModuleType) -> bool:
    """Whether ``module`` (a package: each of its loaded submodules) is Python source."""
    prefix = module.__name__ + "."
    parts = [m for n, m in list(sys.modules.items())
             if m is not None and (n == module.__name__ or n.startswith(prefix))]
    return all(str(getattr(m, "__file__", None) or "x.py").endswith(".py") for m in parts)
