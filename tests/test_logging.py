"""The ``raycoll`` logger and the ``RAYCOLL_DEBUG`` trace, captured inside real rank actors."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

import raycoll
from raycoll import debug

PACKAGE = Path(raycoll.__file__).resolve().parent


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.traces: List[Dict[str, Any]] = []
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "raycoll_trace", None)
        if fields is not None:
            self.traces.append(dict(fields, levelno=record.levelno))
            self.messages.append(record.getMessage())


def _traced_ops(rank: int) -> Dict[str, Any]:
    """Runs on each rank: capture the trace of a few operations of known sizes."""
    log = logging.getLogger("raycoll")
    auto = [h.get_name() for h in log.handlers]
    capture = _Capture()
    log.addHandler(capture)
    try:
        t = np.ones(1000, dtype=np.float32)
        raycoll.all_reduce(t)
        outs = [np.zeros(10, dtype=np.float64) for _ in range(2)]
        raycoll.all_gather(outs, np.full(10, rank, dtype=np.float64))
        buf = np.zeros(4, dtype=np.int32)
        if rank == 0:
            raycoll.send(np.arange(4, dtype=np.int32), dst=1)
        else:
            raycoll.recv(buf, src=0)
        raycoll.broadcast(t, src=0, async_op=True).wait(timeout=60)
        objs: List[Any] = [None, None]
        raycoll.all_gather_object(objs, {"rank": rank})
        try:
            raycoll.broadcast(np.zeros(3 + rank, dtype=np.float32), src=0)
        except raycoll.CollectiveMismatchError:
            pass
    finally:
        log.removeHandler(capture)
    return {"traces": capture.traces, "messages": capture.messages, "auto_handlers": auto,
            "level": log.level, "enabled": debug.debug_enabled()}


@pytest.mark.timeout(240)
def test_debug_env_traces_every_operation_inside_actors(ray_local):
    options = {"num_cpus": 0, "runtime_env": {"env_vars": {debug.DEBUG_ENV: "1"}}}
    results = raycoll.spawn(_traced_ops, 2, actor_options=options, timeout=120)
    for rank, result in enumerate(results):
        assert result["enabled"]
        # visible without any user configuration: DEBUG level and raycoll's own stderr handler
        assert result["level"] == logging.DEBUG
        assert "raycoll-debug" in result["auto_handlers"]
        traces = result["traces"]
        assert [t["op"] for t in traces] == [
            "all_reduce", "all_gather", "send" if rank == 0 else "recv", "broadcast",
            "all_gather_object", "broadcast"]
        assert all(t["levelno"] == logging.DEBUG and t["rank"] == rank for t in traces)
        assert [t["seq"] for t in traces if t["seq"] is not None] == [1, 2, 3, 4, 5]
        assert [t["bytes"] for t in traces] == [4000, 160, 16, 4000, None, 12 + 4 * rank]
        assert [t["status"] for t in traces] == ["ok"] * 5 + ["CollectiveMismatchError"]
        assert all(t["time_ms"] >= 0 for t in traces)
        assert result["messages"][0].startswith(
            f"raycoll trace rank={rank} group=") and "op=all_reduce seq=1 bytes=4000" \
            in result["messages"][0]


def _untraced(rank: int) -> Dict[str, Any]:
    log = logging.getLogger("raycoll")
    level = log.level
    capture = _Capture()
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    try:
        raycoll.all_reduce(np.ones(8))
    finally:
        log.removeHandler(capture)
        log.setLevel(level)
    return {"traces": capture.traces, "enabled": debug.debug_enabled()}


@pytest.mark.skipif(debug.debug_enabled(), reason="RAYCOLL_DEBUG is set for this run")
@pytest.mark.timeout(120)
def test_no_trace_without_the_env_var(ranks):
    for result in ranks.run(_untraced, 2):
        assert result == {"traces": [], "enabled": False}


def test_configure_from_env_adds_one_handler_unless_the_user_has_one(monkeypatch):
    log = logging.Logger("raycoll")  # a detached stand-in: the real one stays untouched
    monkeypatch.setattr(debug, "logger", log)
    monkeypatch.delenv(debug.DEBUG_ENV, raising=False)
    assert debug.configure_from_env() is False and log.handlers == []
    monkeypatch.setenv(debug.DEBUG_ENV, "0")
    assert debug.configure_from_env() is False and log.handlers == []
    monkeypatch.setenv(debug.DEBUG_ENV, "1")
    assert debug.configure_from_env() is True
    assert debug.configure_from_env() is True
    assert [h.get_name() for h in log.handlers] == ["raycoll-debug"]
    assert log.level == logging.DEBUG
    user = logging.NullHandler()
    log.handlers = [user]
    assert debug.configure_from_env() is True and log.handlers == [user]
    # a handler on an ancestor (the root logger after logging.basicConfig) shows the trace
    log.handlers = []
    log.parent = logging.Logger("root")
    log.parent.addHandler(logging.NullHandler())
    assert debug.configure_from_env() is True and log.handlers == []


def test_library_never_prints():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "print":
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    # the benchmark CLI's job is to print its table, and the netns harness's command
    # (python -m raycoll.testing_netns) prints the address to connect to; everything else logs
    commands = ("raycoll/bench", "raycoll/testing_netns.py")
    offenders = [o for o in offenders if not o.startswith(commands)]
    assert offenders == [], f"print() in the library (use the 'raycoll' logger): {offenders}"


def test_every_module_logs_under_the_raycoll_logger():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for line in text.splitlines():
            if "getLogger(" in line:
                assert 'getLogger("raycoll")' in line or "getLogger(__name__)" in line, \
                    f"{path}: {line.strip()}"
