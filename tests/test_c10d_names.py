"""The rest of c10d's ``__all__``: every name of torch 2.13's ``distributed_c10d.__all__`` is in
raycoll; availability (``is_backend_available`` and the ``is_*_available``), debug levels,
``supports_complex`` (checked against what the collectives really do), ``default_pg_timeout``,
the default backend per device, the group count, the name raycoll cannot honour
(``ProcessGroupGloo``), which says why, and ``shrink_group`` checking its arguments as torch
does before it looks for a group (its behaviour: test_elastic.py)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Dict

import numpy as np
import pytest

import raycoll
from raycoll import debug


@pytest.mark.torch
def test_every_name_of_c10ds_all_is_in_raycoll():
    import torch.distributed.distributed_c10d as c10d

    # torch's deprecated reduce_op class: raycoll.reduce_op is raycoll's module of ReduceOp,
    # which answers as torch's class did (below)
    names = [n for n in c10d.__all__ if n != "reduce_op"]
    missing = [n for n in names if n not in raycoll.__all__ or not hasattr(raycoll, n)]
    assert missing == [] and len(names) == len(c10d.__all__) - 1


def test_reduce_op_answers_as_torchs_deprecated_class():
    for name in ("SUM", "PRODUCT", "MIN", "MAX"):
        with pytest.warns(FutureWarning, match="raycoll.reduce_op is deprecated"):
            assert getattr(raycoll.reduce_op, name) == getattr(raycoll.ReduceOp, name)
    with pytest.raises(AttributeError, match="has no attribute 'AVG'"):
        raycoll.reduce_op.AVG


# ---------------------------------------------------------------------- availability
def test_availability_answers_from_the_registry():
    assert raycoll.is_backend_available("objstore") is True
    assert raycoll.is_backend_available("gloo") is raycoll.is_gloo_available() is True
    assert raycoll.is_backend_available("GLOO") is True
    assert raycoll.is_backend_available("nccl") is raycoll.is_nccl_available()
    for name in ("mpi", "ucc", "xccl", "undefined", "no-such-backend"):
        assert raycoll.is_backend_available(name) is False, name
    assert (raycoll.is_mpi_available(), raycoll.is_ucc_available(),
            raycoll.is_xccl_available()) == (False, False, False)
    with pytest.raises(TypeError, match="backend must be a str, got int"):
        raycoll.is_backend_available(3)  # type: ignore[arg-type]


def test_a_registered_backend_is_available():
    name = "availabilitytest"
    assert raycoll.is_backend_available(name) is False
    raycoll.Backend.register_backend(name, lambda ctx: None, devices=["cpu"])
    assert raycoll.is_backend_available(name) is True


def test_gloo_really_is_served_as_raycolls_cpu_path():
    from raycoll.backends import backend_config

    # what is_gloo_available() promises: a group formed with "gloo" gets a CPU backend
    assert backend_config("gloo").get_device_backend_map()["cpu"] == "objstore"
    assert backend_config("cpu:gloo").get_device_backend_map() == {"cpu": "objstore"}
    with pytest.raises(NotImplementedError, match="raycoll.init_process_group\\('gloo'"):
        raycoll.ProcessGroupGloo(None, 0, 1, timedelta(seconds=1))


def test_is_torchelastic_launched_reads_torchelastics_variable(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert raycoll.is_torchelastic_launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    assert raycoll.is_torchelastic_launched() is True


@pytest.mark.torch
def test_is_torchelastic_launched_as_torch_decides_it(monkeypatch):
    import torch.distributed as dist

    for value in (None, "", "job-1"):
        if value is None:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
        assert raycoll.is_torchelastic_launched() == dist.is_torchelastic_launched(), value


def test_default_backend_per_device():
    cuda = "nccl" if raycoll.is_nccl_available() else "objstore"
    assert raycoll.get_default_backend_for_device("cpu") == "objstore"
    assert raycoll.get_default_backend_for_device("cuda:1") == cuda
    with pytest.raises(ValueError, match="device 'xpu' has no default backend"):
        raycoll.get_default_backend_for_device("xpu")
    with pytest.raises(TypeError, match="device must be a str or a torch.device"):
        raycoll.get_default_backend_for_device(0)


@pytest.mark.torch
def test_default_backend_takes_a_torch_device():
    import torch

    assert raycoll.get_default_backend_for_device(torch.device("cpu")) == "objstore"


def test_default_pg_timeout_is_thirty_minutes_and_the_groups_default():
    from raycoll.process_group import DEFAULT_TIMEOUT_S

    assert raycoll.default_pg_timeout == timedelta(minutes=30)
    assert raycoll.default_pg_timeout.total_seconds() == DEFAULT_TIMEOUT_S
    assert raycoll.GroupName("dp") == "dp"


@pytest.mark.torch
def test_default_pg_timeout_is_torchs():
    import torch.distributed.distributed_c10d as c10d

    assert raycoll.default_pg_timeout == c10d.default_pg_timeout


def test_shrink_group_checks_its_arguments_first_then_needs_a_group():
    with pytest.raises(TypeError, match="ranks_to_exclude must be a list"):
        raycoll.shrink_group((1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid shrink_flags value: 2"):
        raycoll.shrink_group([1], shrink_flags=2)
    with pytest.raises(raycoll.GroupNotFoundError, match="no default group"):
        raycoll.shrink_group([1])


# ---------------------------------------------------------------------- supports_complex
def _complex_ops(rank: int) -> Dict[str, bool]:
    out = {}
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"):
        op = raycoll.ReduceOp.PREMUL_SUM(2.0) if name == "PREMUL_SUM" else \
            getattr(raycoll.ReduceOp, name)
        try:
            raycoll.all_reduce(np.full(2, 1 + 1j), op=op)
            out[name] = True
        except raycoll.UnsupportedOpError:
            out[name] = False
    return out


@pytest.mark.timeout(60)
def test_supports_complex_says_what_the_collectives_do(ranks):
    done = ranks.run(_complex_ops, 2)[0]
    said = {name: raycoll.supports_complex(raycoll.ReduceOp.PREMUL_SUM(2.0) if name ==
                                           "PREMUL_SUM" else getattr(raycoll.ReduceOp, name))
            for name in done}
    assert said == done
    assert raycoll.supports_complex(raycoll.ReduceOp.PREMUL_SUM) is True  # no factor given


@pytest.mark.torch
def test_supports_complex_differs_from_torch_only_on_product():
    import torch.distributed as dist

    ops = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")
    differ = [n for n in ops if raycoll.supports_complex(getattr(dist.ReduceOp, n))
              != dist.supports_complex(getattr(dist.ReduceOp, n))]
    assert differ == ["PRODUCT"]  # raycoll multiplies complex tensors; torch refuses


# ---------------------------------------------------------------------- debug levels
@pytest.mark.torch
def test_debug_level_is_torchs_enum():
    import torch.distributed as dist

    for name in ("OFF", "INFO", "DETAIL"):
        assert int(getattr(raycoll.DebugLevel, name)) == int(getattr(dist.DebugLevel, name))


@pytest.mark.parametrize("torch_env,ours,want,traced", [
    (None, None, "OFF", False), ("info", None, "INFO", False), ("DETAIL", None, "DETAIL", True),
    ("OFF", "1", "DETAIL", True), ("INFO", "1", "DETAIL", True), (None, "0", "OFF", False),
])
def test_debug_level_reads_torchs_variable_and_raycolls(monkeypatch, torch_env, ours, want,
                                                        traced):
    for var, value in ((debug.TORCH_DEBUG_ENV, torch_env), (debug.DEBUG_ENV, ours)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert raycoll.get_debug_level() == getattr(raycoll.DebugLevel, want)
    assert debug.debug_enabled() is traced  # DETAIL turns the per-operation trace on


def test_debug_level_refuses_a_value_torch_refuses(monkeypatch):
    monkeypatch.setenv(debug.TORCH_DEBUG_ENV, "LOUD")
    monkeypatch.delenv(debug.DEBUG_ENV, raising=False)
    with pytest.raises(ValueError, match="TORCH_DISTRIBUTED_DEBUG must be OFF, INFO or DETAIL, "
                                         "got 'LOUD'"):
        raycoll.get_debug_level()
    assert debug.debug_enabled() is False  # raycoll's import never fails on it


def test_info_shows_raycolls_info_records(monkeypatch):
    log = logging.Logger("raycoll")  # a detached stand-in: the real one stays untouched
    monkeypatch.setattr(debug, "logger", log)
    monkeypatch.delenv(debug.DEBUG_ENV, raising=False)
    monkeypatch.setenv(debug.TORCH_DEBUG_ENV, "INFO")
    assert debug.configure_from_env() is False  # no trace at INFO
    assert log.level == logging.INFO and [h.get_name() for h in log.handlers] == ["raycoll-debug"]
    monkeypatch.setenv(debug.TORCH_DEBUG_ENV, "OFF")
    log2 = logging.Logger("raycoll")
    monkeypatch.setattr(debug, "logger", log2)
    assert debug.configure_from_env() is False and log2.handlers == []


def test_record_comm_is_a_context_manager_that_checks_its_name():
    with raycoll.record_comm("FSDP::all_gather"):
        pass
    with pytest.raises(TypeError, match="name must be a str"):
        with raycoll.record_comm(3):  # type: ignore[arg-type]
            pass


# ---------------------------------------------------------------------- groups
def _count(rank: int) -> Any:
    before = raycoll.get_pg_count()
    raycoll.new_group([0, 1])
    return before, raycoll.get_pg_count()


@pytest.mark.timeout(60)
def test_get_pg_count_counts_this_processs_groups(ranks):
    assert ranks.run(_count, 2) == [(1, 2), (1, 2)]
