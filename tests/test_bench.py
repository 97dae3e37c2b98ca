"""``raycoll-bench``: its size parsing and bandwidth factors, and the CLI as a user runs it.

The CLI tests use tiny sizes and one or two iterations: they check that every operation runs
and verifies correctly (``--check`` counts zero wrong elements), that ``--json`` rows carry
the documented fields, and that ``--vs gloo`` adds the peer's time and the ratio. They assert
nothing about speed: the figures live in benchmarks/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import numpy as np
import pytest

from raycoll import bench
from raycoll.bench.peers import OPS, effective_nbytes
from raycoll.bench.ranks import pattern


# ---------------------------------------------------------------------- pure logic
def test_parse_sizes_lists_units_and_ranges() -> None:
    assert bench.parse_sizes("4,4K,256K,4M,64M") == [4, 4096, 256 << 10, 4 << 20, 64 << 20]
    assert bench.parse_sizes("4:64M:x4") == [4 * 4 ** k for k in range(13)]
    assert bench.parse_sizes("1K:4K") == [1024, 2048, 4096]  # the factor defaults to 2
    assert bench.parse_sizes("8, 1KiB ,2MB") == [8, 1024, 2 << 20]


@pytest.mark.parametrize("text", ["", "4Q", "-4", "64M:4", "4:64M:x1", "4:8:16:32", "x"])
def test_parse_sizes_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="--sizes"):
        bench.parse_sizes(text)


def test_bus_factors_are_nccl_tests_factors() -> None:
    assert bench.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bench.bus_factor("broadcast", 4) == 1.0
    assert bench.bus_factor("reduce", 4) == 1.0
    for op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert bench.bus_factor(op, 4) == pytest.approx(0.75)
    row = bench.make_row("all_reduce", 1 << 20, 1 << 18, "float32", 2, 1, "objstore",
                         [1e-3, 2e-3, 4e-3], 0)
    assert row.time_us == pytest.approx(2000.0)
    assert (row.min_us, row.max_us) == (pytest.approx(1000.0), pytest.approx(4000.0))
    assert row.algbw == pytest.approx((1 << 20) / 2e-3 / 1e9)
    assert row.busbw == pytest.approx(row.algbw)  # 2(n-1)/n = 1 for two ranks


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("nbytes,world", [(4, 2), (100, 3), (4 << 20, 4)])
def test_sizes_run_match_the_peers(op: str, nbytes: int, world: int) -> None:
    count = bench.element_count(op, nbytes, 4, world)
    assert bench.run_bytes(op, count, 4, world) == effective_nbytes(op, nbytes, "float32", world)


def test_bad_arguments_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--sizes", "64M:4"], "--sizes"), (["--op", "allgatherz"], "op"),
                         (["--world-size", "0"], "--world-size"),
                         (["--nodes", "3", "--world-size", "2"], "--nodes"),
                         (["--dtype", "complex64"], "--dtype"), (["--set", "novalue"], "--set")):
        with pytest.raises(SystemExit) as info:
            bench.main(argv)
        assert info.value.code == 2
        assert needle in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_running(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit):
        bench.main(["--plot", "out.png"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [bench.make_row("all_reduce", n, n // 4, "float32", 2, 1, "objstore", [n * 1e-9 + 1e-4], 0)
            for n in (4, 4096, 1 << 20)]
    path = tmp_path / "plot.png"
    bench.write_plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- the CLI on real Ray
def _rows(path: Path) -> list:
    rows = json.loads(path.read_text())
    assert isinstance(rows, list) and rows
    for row in rows:
        assert set(bench.ROW_FIELDS) <= set(row), set(bench.ROW_FIELDS) - set(row)
    return rows


@pytest.mark.timeout(300)
def test_every_op_runs_and_checks_clean(ray_local: None, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    # 4 B rides inline through the coordinator; 2 MiB takes the object-store path
    # (reduce-scatter + all-gather for all_reduce, segmented puts of 256 KiB).
    status = bench.main(["--op", "all", "--sizes", "4,2M", "--world-size", "3", "--check",
                         "--iters", "1", "--warmup", "0", "--json", str(out), "--no-progress",
                         "--set", "segment_bytes=262144"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "# Out of bounds values : 0 OK" in printed
    rows = _rows(out)
    assert sorted({r["op"] for r in rows}) == sorted(OPS)
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["world_size"] == 3 and row["nodes"] == 1 and row["backend"] == "objstore"
        assert row["min_us"] <= row["time_us"] <= row["max_us"]
        assert row["bytes"] == effective_nbytes(row["op"], row["bytes"], "float32", 3)
        assert row["peer_time_us"] is None and row["ratio"] is None
        assert row["op"] in printed
    big = [r for r in rows if r["op"] == "all_reduce" and r["bytes"] == 2 << 20]
    assert big and big[0]["busbw"] == pytest.approx(big[0]["algbw"] * 4 / 3)


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_vs_gloo_adds_the_peer_time_and_ratio(ray_local: None, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    status = bench.main(["--op", "all_reduce,all_to_all_single", "--sizes", "4K",
                         "--world-size", "2", "--vs", "gloo", "--check", "--iters", "2",
                         "--warmup", "1", "--json", str(out), "--no-progress",
                         "--dtype", "int32", "--pattern", "after-barrier"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "pattern=after-barrier" in printed
    rows = _rows(out)
    assert [r["op"] for r in rows] == ["all_reduce", "all_to_all_single"]
    for row in rows:
        assert row["peer"] == "gloo" and row["wrong"] == 0 and row["dtype"] == "int32"
        assert row["peer_time_us"] > 0
        assert row["ratio"] == pytest.approx(row["peer_time_us"] / row["time_us"])
    assert "ratio = gloo time / raycoll time" in printed


@pytest.mark.timeout(300)
def test_calibrate_prints_a_cost_model_a_group_accepts(ray_local: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from raycoll import GroupOptions
    from raycoll.algorithms.cost import CostModel

    status = bench.main(["--calibrate", "--sizes", "4,1M", "--iters", "5", "--warmup", "2",
                         "--no-progress"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    model = json.loads(printed.strip().splitlines()[-1])
    from raycoll.native import core

    # one node: two ranks, a Unix socket; and two ranks on the node segment (the core's)
    assert set(model) == {"unix", "socket", "gamma"} | ({"segment"} if core else set())
    assert model["socket"] == model["unix"]  # (native sockets: the planner's class)
    if core:
        assert model["segment"]["alpha"] > 0 and model["segment"]["beta"] >= 0
    assert model["unix"]["alpha"] > 0 and model["unix"]["beta"] >= 0 and model["gamma"] > 0
    assert GroupOptions.of({"cost_model": model}).cost_model == model
    assert CostModel.of(model).links["unix"].alpha == model["unix"]["alpha"]
    rows = [r for r in printed.splitlines() if r.startswith("#")]
    assert "cost_model" in rows[-1]


def test_segment_beta_solves_the_plans_price_for_the_time_measured() -> None:
    """``--calibrate``'s segment class: the beta that prices the 2-rank streamed all_reduce
    at a time is the beta that time was priced with."""
    from raycoll.algorithms import segment_plans
    from raycoll.algorithms.cost import CostModel
    from raycoll.algorithms.planner import plan_time
    from raycoll.bench.calibrate import SEGMENT_PROBE_BYTES, segment_beta

    n, half, one_step = SEGMENT_PROBE_BYTES, 2 << 20, 64 << 10
    plans = [segment_plans.all_reduce(n // 4, 4, 2, me, half, one_step) for me in range(2)]
    for cores in (1, 2):
        model = CostModel.of({"segment": {"alpha": 5e-6, "beta": 0.2e-9}, "gamma": 0.1e-9})
        seconds = plan_time(plans, ("n", "n"), model, cores)  # type: ignore[arg-type]
        got = segment_beta(seconds, n, 5e-6, 0.1e-9, half, one_step, cores)
        assert got == pytest.approx(0.2e-9)
    assert segment_beta(0.0, n, 5e-6, 0.1e-9, half, one_step, 2) == 0.0  # never below 0


@pytest.mark.timeout(120)
def test_module_entry_point_prints_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "raycoll.bench", "--help"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--op", "--sizes", "--world-size", "--nodes", "--address", "--backend",
                 "--iters", "--warmup", "--check", "--vs", "--json", "--plot"):
        assert flag in proc.stdout


def test_checked_patterns_are_exact_in_small_dtypes() -> None:
    # 16 ranks of the pattern sum exactly even in float16, so --check never counts rounding.
    total = np.sum([pattern(r, 0, 1000, np.dtype("float16")) for r in range(16)], axis=0)
    exact = np.sum([pattern(r, 0, 1000, np.dtype("int64")) for r in range(16)], axis=0)
    assert np.array_equal(total.astype(np.int64), exact)


def test_timed_calls_follow_the_pattern() -> None:
    from raycoll.bench.peers import PAUSE_S, timed_calls

    log: List[str] = []
    times = timed_calls(lambda: log.append("step"), 3, "after-barrier",
                        lambda: log.append("barrier"))
    assert log == ["barrier", "step"] * 3 and len(times) == 3
    log.clear()
    began = time.perf_counter()
    timed_calls(lambda: log.append("step"), 4, "after-pause")
    assert log == ["step"] * 4 and time.perf_counter() - began >= 4 * PAUSE_S
    with pytest.raises(ValueError, match="pattern: expected one of back-to-back"):
        timed_calls(lambda: None, 1, "sometimes")
    with pytest.raises(ValueError, match="needs the library's barrier"):
        timed_calls(lambda: None, 1, "after-barrier")
