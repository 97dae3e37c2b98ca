"""What ``raycoll-bench`` computes and prints, without Ray: sizes, bandwidths, rows, the table.

- the pure logic: size parsing (nccl-tests units and ranges), nccl-tests' bus-bandwidth
  factors, element counts and the size actually run, :class:`Row` and :data:`ROW_FIELDS`
  (the fields of ``--json``);
- :class:`Options`: everything one run needs (the parsed command line);
- the output: the table's header, rows and footer, and ``--plot``'s figure.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raycoll.bench.peers import CHUNKED_OPS

__all__ = ["ROW_FIELDS", "Row", "Options", "parse_size", "parse_sizes", "bus_factor",
           "element_count", "run_bytes", "make_row", "stats", "header", "format_row", "footer",
           "write_plot", "require_matplotlib", "fmt_size", "FREE_PERIOD_ENV"]

#: Ray's environment variable for how often its raylets free unused objects.
FREE_PERIOD_ENV = "RAY_free_objects_period_milliseconds"

#: The fields of every row in ``--json`` output, in order.
ROW_FIELDS: Tuple[str, ...] = (
    "op", "bytes", "count", "dtype", "world_size", "nodes", "backend", "time_us", "min_us",
    "max_us", "algbw", "busbw", "wrong", "peer", "peer_time_us", "ratio",
)  # fmt: skip


# ---------------------------------------------------------------------- pure logic
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"4"``, ``"4K"``, ``"256KiB"``, ``"64M"``, ``"1G"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"--sizes: expected a size like 4, 4K, 256K, 64M or 1G; got {text!r}")
    return int(match.group(1)) * _UNITS[unit]


def parse_sizes(text: str) -> List[int]:
    """A comma list (``4,4K,64M``) or a range ``MIN:MAX:xFACTOR`` (``4:64M:x4``), or both."""
    sizes: List[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        if ":" not in part:
            sizes.append(parse_size(part))
            continue
        pieces = part.split(":")
        if len(pieces) not in (2, 3):
            raise ValueError(f"--sizes: a range is MIN:MAX[:xFACTOR]; got {part!r}")
        low, high = parse_size(pieces[0]), parse_size(pieces[1])
        factor_text = pieces[2].strip().lstrip("xX") if len(pieces) == 3 else "2"
        try:
            factor = int(factor_text)
        except ValueError:
            factor = 0
        if factor < 2 or low < 1 or high < low:
            raise ValueError(f"--sizes: a range needs 1 <= MIN <= MAX and a factor >= 2 "
                             f"(e.g. 4:64M:x4); got {part!r}")
        size = low
        while size <= high:
            sizes.append(size)
            size *= factor
    if not sizes:
        raise ValueError(f"--sizes: no size given in {text!r}")
    return sizes


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * factor."""
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    if op == "barrier":
        return 0.0
    return (n - 1) / n  # all_gather*, reduce_scatter*, all_to_all*, gather, scatter


def element_count(op: str, nbytes: int, itemsize: int, world_size: int) -> int:
    """Elements in each rank's buffer, or in each rank's chunk for chunked ops (>= 1)."""
    elements = nbytes // itemsize
    if op in CHUNKED_OPS:
        elements //= world_size
    return max(1, elements)


def run_bytes(op: str, count: int, itemsize: int, world_size: int) -> int:
    """The size actually run, in nccl-tests terms (0 for barrier)."""
    if op == "barrier":
        return 0
    return count * itemsize * (world_size if op in CHUNKED_OPS else 1)


@dataclass
class Row:
    """One line of the table (and one object of ``--json``)."""

    op: str
    bytes: int
    count: int
    dtype: str
    world_size: int
    nodes: int
    backend: str
    time_us: float
    min_us: float
    max_us: float
    algbw: float
    busbw: float
    wrong: Optional[int]
    peer: Optional[str] = None
    peer_time_us: Optional[float] = None
    ratio: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> Dict[str, Any]:
        data = asdict(self)
        extra = data.pop("extra")
        data.update(extra)
        return data


def stats(times: Sequence[float]) -> Tuple[float, float, float]:
    us = np.asarray(times, dtype=np.float64) * 1e6
    return float(np.median(us)), float(us.min()), float(us.max())


def make_row(op: str, nbytes: int, count: int, dtype: str, world_size: int, nodes: int,
             backend: str, times: Sequence[float], wrong: Optional[int]) -> Row:
    """A row from per-iteration times (seconds) of one op and size."""
    med, low, high = stats(times)
    algbw = nbytes / (med * 1e-6) / 1e9 if med > 0 else 0.0
    return Row(op, nbytes, count, dtype, world_size, nodes, backend, med, low, high, algbw,
               algbw * bus_factor(op, world_size), wrong)



# ---------------------------------------------------------------------- a run
@dataclass
class Options:
    """Everything one run of the benchmark needs (the parsed command line)."""

    ops: List[str]
    sizes: List[int]
    world_sizes: List[int]
    nodes: int = 1
    address: Optional[str] = None
    backend: str = "objstore"
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    check: bool = False
    vs: Optional[str] = None
    group_options: Dict[str, Any] = field(default_factory=dict)
    baselines: bool = False
    memory: bool = False
    free_period_ms: int = 10
    object_store_mb: Optional[int] = None
    progress: bool = True
    #: how the timed calls follow each other: ``back-to-back``, ``after-barrier`` (each
    #: right after an untimed barrier of the same library) or ``after-pause`` (each after
    #: an untimed ``PAUSE_S`` sleep: a loop that computes between collectives)
    pattern: str = "back-to-back"
    #: on a cluster joined with ``address`` (or this process's Ray): rank r on the r-th live
    #: node, round robin, not where Ray packs them (``--calibrate`` measures a link)
    spread: bool = False
    #: every rank on the first live node (by node id), where Ray might spread them
    #: (``--calibrate``'s ``segment`` class: its two ranks on one node)
    one_node: bool = False



# ---------------------------------------------------------------------- output
def fmt_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def header(opts: Options) -> str:
    peer = opts.vs or ""
    lines = [
        f"# raycoll-bench: backend={opts.backend} dtype={opts.dtype} iters={opts.iters} "
        f"warmup={opts.warmup} check={'on' if opts.check else 'off'} nodes={opts.nodes} "
        f"pattern={opts.pattern}"
        + (f" vs={peer}" if peer else "")
        + (f" options={opts.group_options}" if opts.group_options else "")
        + (f" {FREE_PERIOD_ENV}={os.environ[FREE_PERIOD_ENV]}"
           if FREE_PERIOD_ENV in os.environ else ""),
        "# time: median over iterations of the slowest rank; algbw = bytes/time; "
        "busbw = algbw * nccl-tests factor",
    ]
    if peer:
        lines.append(f"# ratio = {peer} time / raycoll time (> 1: raycoll is faster)")
    if opts.memory:
        lines.append("# store+: peak object-store use above the baseline during the row (sampled); "
                     "after: above the baseline once the row is done")
    cols = (f"#{'op':>22} {'ranks':>5} {'size':>12} {'count':>11} {'type':>8} "
            f"{'time':>10} {'min':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}")
    units = (f"#{'':>22} {'':>5} {'(B)':>12} {'(elements)':>11} {'':>8} "
             f"{'(us)':>10} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}")
    if opts.memory:
        cols += f" {'store+':>9} {'after':>9}"
        units += f" {'(MiB)':>9} {'(MiB)':>9}"
    if peer:
        cols += f" {peer:>14} {'ratio':>7}"
        units += f" {'(us)':>14} {'':>7}"
    return "\n".join(lines + [cols, units])


def format_row(row: Row, with_peer: bool) -> str:
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    text = (f" {row.op:>22} {row.world_size:>5} {row.bytes:>12} {row.count:>11} {row.dtype:>8} "
            f"{row.time_us:>10.1f} {row.min_us:>10.1f} {row.algbw:>7.2f} {row.busbw:>7.2f} "
            f"{wrong:>7}")
    if "store_peak_bytes" in row.extra:
        mib = 1 << 20
        text += (f" {(row.extra['store_peak_bytes'] - row.extra['store_baseline_bytes']) / mib:>9.1f}"
                 f" {(row.extra['store_after_bytes'] - row.extra['store_baseline_bytes']) / mib:>9.1f}")
    if with_peer:
        if row.peer_time_us is None:
            text += f" {'n/a':>14} {'':>7}"
        else:
            text += f" {row.peer_time_us:>14.1f} {row.ratio or 0.0:>7.2f}"
    return text


def footer(rows: Sequence[Row]) -> str:
    lines = []
    wrong = [r.wrong for r in rows if r.wrong is not None]
    if wrong:
        lines.append(f"# Out of bounds values : {sum(wrong)} {'OK' if sum(wrong) == 0 else 'FAILED'}")
    if rows and "ray_rtt_us" in rows[0].extra:
        extra = rows[0].extra
        lines.append(f"# Ray actor-call round trip (median): {extra['ray_rtt_us']:.1f} us")
        if extra["ray_get_bytes"] >= 1 << 20:  # a bandwidth only means something for MiBs
            lines.append(f"# plain ray.get of {fmt_size(extra['ray_get_bytes'])}: "
                         f"{extra['ray_get_GBps']:.2f} GB/s")
    ratios = [r.ratio for r in rows if r.ratio]
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        lines.append(f"# Geometric mean of ratios: {geo:.2f}")
    return "\n".join(lines)


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib, which is not installed: pip install "
                          f"matplotlib (or pip install 'raycoll[bench]'); {exc}") from exc
    matplotlib.use("Agg")
    return matplotlib


def write_plot(rows: Sequence[Row], path: str) -> None:
    """Time against size (or against world size when only one size ran), log-log."""
    require_matplotlib()
    import matplotlib.pyplot as plt
    sizes = {r.bytes for r in rows}
    by_world = len(sizes) == 1 and len({r.world_size for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(8, 5))
    series: Dict[Tuple[str, Any], List[Tuple[float, float, Optional[float]]]] = {}
    for r in rows:
        key = (r.op, r.bytes if by_world else r.world_size)
        x = float(r.world_size if by_world else max(r.bytes, 1))
        series.setdefault(key, []).append((x, r.time_us, r.peer_time_us))
    for (op, label), points in sorted(series.items(), key=lambda kv: str(kv[0])):
        points.sort()
        xs = [p[0] for p in points]
        tag = f"{op} {fmt_size(label)}B" if by_world else f"{op} x{label}"
        line = ax.plot(xs, [p[1] for p in points], marker="o", label=f"raycoll {tag}")[0]
        peer = [(p[0], p[2]) for p in points if p[2] is not None]
        if peer:
            name = next((r.peer for r in rows if r.peer), "peer")
            ax.plot([p[0] for p in peer], [p[1] for p in peer], linestyle="--", marker="x",
                    color=line.get_color(), label=f"{name} {tag}")
    ax.set_xscale("log", base=2 if by_world else 10)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)" if by_world else "size (bytes)")
    ax.set_ylabel("time (us, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
