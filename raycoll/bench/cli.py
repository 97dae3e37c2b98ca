"""The ``raycoll-bench`` command line: its options, their checks, and :func:`main`."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from raycoll.bench.peers import OPS, PATTERNS, canonical_op
from raycoll.bench.runner import PEERS, configure_ray_env, run_bench
from raycoll.bench.tables import (
    FREE_PERIOD_ENV,
    Options,
    Row,
    footer,
    format_row,
    header,
    parse_sizes,
    require_matplotlib,
    write_plot,
)

__all__ = ["main", "build_parser", "parse_options"]


def _parse_set(items: Iterable[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE; got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raycoll-bench",
        description="Benchmark raycoll collectives on Ray actors (nccl-tests style).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--op", default="all_reduce",
                   help=f"comma list of operations, or 'all': {', '.join(OPS)}")
    p.add_argument("--sizes", default="4,4K,256K,4M,64M",
                   help="comma list (4,4K,64M) or range MIN:MAX:xFACTOR (4:64M:x4)")
    p.add_argument("--world-size", default="2", help="ranks; a comma list runs each in turn")
    p.add_argument("--nodes", type=int, default=1,
                   help="start N Ray nodes on this machine (ray.cluster_utils.Cluster)")
    p.add_argument("--address", default=None, help="join an existing Ray cluster")
    p.add_argument("--backend", default="objstore", help="raycoll backend (e.g. objstore)")
    p.add_argument("--dtype", default="float32", help="numpy dtype of the buffers")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size")
    p.add_argument("--check", action="store_true", help="verify results, count wrong elements")
    p.add_argument("--pattern", choices=PATTERNS, default="back-to-back",
                   help="time each call right after the last, after an untimed barrier of "
                        "the same library, or after an untimed 1 ms pause (a loop that "
                        "computes between collectives)")
    p.add_argument("--vs", choices=sorted(PEERS), default=None,
                   help="run this library too, interleaved, and print the time ratio")
    p.add_argument("--baselines", action="store_true",
                   help="also measure Ray's floors: an actor-call round trip and a plain "
                        "ray.get of the largest size (cross-node with --nodes)")
    p.add_argument("--memory", action="store_true",
                   help="sample object-store use: peak above the baseline during each row, "
                        "and what is left once it is done")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a raycoll group option, e.g. inline_bytes=65536 (repeatable)")
    p.add_argument("--ray-free-period-ms", type=int, default=10,
                   help="when this run starts Ray: how often its raylets free unused objects "
                        f"({FREE_PERIOD_ENV}; Ray's default is 1000); 0 keeps Ray's default")
    p.add_argument("--object-store-mb", type=int, default=None,
                   help="object store size per node when this run starts Ray")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot time against size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the cost model's link costs here (two ranks on direct "
                        "connections; --nodes 2 for TCP between nodes) and print the "
                        "cost_model group option")
    return p


def parse_options(argv: Optional[Sequence[str]] = None) -> Tuple[Options, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = [s.strip() for s in args.op.split(",") if s.strip()]
        ops = list(OPS) if names == ["all"] else [canonical_op(n) for n in names]
        if not ops:
            raise ValueError(f"--op: expected an operation or 'all'; got {args.op!r}")
        sizes = parse_sizes(args.sizes)
        worlds = [int(w) for w in args.world_size.split(",") if w.strip()]
        if not worlds or min(worlds) < 1:
            raise ValueError(f"--world-size: expected positive ints; got {args.world_size!r}")
        if args.nodes < 1 or (args.nodes > 1 and args.address):
            raise ValueError(f"--nodes: expected >= 1, and not with --address; got {args.nodes}")
        if args.nodes > min(worlds):
            raise ValueError(f"--nodes={args.nodes}: needs --world-size >= nodes; "
                             f"got {args.world_size}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError(f"--iters/--warmup: expected >= 1 / >= 0; "
                             f"got {args.iters} / {args.warmup}")
        dtype = np.dtype(args.dtype)
        if dtype.kind not in "iuf":
            raise ValueError(f"--dtype: expected an integer or float dtype; got {args.dtype!r}")
        group_options = _parse_set(args.set)
        if args.plot:
            require_matplotlib()
    except (ValueError, TypeError, ImportError) as exc:
        parser.error(str(exc))
    opts = Options(ops=ops, sizes=sizes, world_sizes=worlds, nodes=args.nodes,
                   address=args.address, backend=args.backend, dtype=dtype.name,
                   iters=args.iters, warmup=args.warmup, check=args.check, vs=args.vs,
                   pattern=args.pattern,
                   group_options=group_options, baselines=args.baselines, memory=args.memory,
                   free_period_ms=args.ray_free_period_ms,
                   object_store_mb=args.object_store_mb, progress=not args.no_progress)
    return opts, args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``raycoll-bench`` entry point; returns the exit status (1 if any result was wrong)."""
    opts, args = parse_options(argv)
    if args.calibrate:
        from raycoll.bench.calibrate import calibrate

        model = calibrate(opts)
        print("# the cost model's link costs measured here; pass them to a group as")
        print("# create_group(..., options={'cost_model': <this>})")
        print(json.dumps(model))
        return 0
    with_peer = opts.vs is not None
    configure_ray_env(opts)
    print(header(opts), flush=True)

    def emit(row: Row) -> None:
        print(format_row(row, with_peer), flush=True)

    rows = run_bench(opts, emit)
    text = footer(rows)
    if text:
        print(text, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([r.as_json() for r in rows], fh, indent=1)
            fh.write("\n")
    if args.plot:
        write_plot(rows, args.plot)
    return 1 if any(r.wrong for r in rows) else 0

