"""Ray Train's restart after a worker death, raycoll vs gloo, same run.

    python benchmarks/train_restart.py [--repeats 3] [--steps 8] [--kill-at 4] [--json]

One driver, one local Ray (4 logical CPUs). A fit is a ``TorchTrainer`` run of 2 workers
(1 CPU each), ``FailureConfig(max_failures=1)``, with ``torch_config`` either
``RaycollConfig()`` or ``TorchConfig(backend="gloo")``. Each worker trains ddp_step's MLP
(``--params`` million parameters of width ``--width``) under ``prepare_model`` (DDP), one
step of ddp_step's step loop at a time, with a checkpoint (``ray.train.report``) after every
step, and resumes from ``ray.train.get_checkpoint()``. At step ``--kill-at`` of the first
worker group, world rank 1 writes the time and ends its process (``os._exit(1)``); its peer
fails in DDP's all_reduce, Ray Train starts a new worker group, and it resumes.

Timestamps (``time.monotonic()``: CLOCK_MONOTONIC, one for every process of the machine;
the wall clock of the reference VM steps), written by the workers into a directory per fit:
each worker's ``train_fn`` start (after the backend formed the process group) in both worker
groups, the kill, the peer's error (which one, and its message), each new worker's end of
its first step and of ``train_fn``. Per fit: ``fit()`` -> both first workers in train_fn;
kill -> the peer's error; kill -> both new workers in train_fn; kill -> both done with the
first step after the restart; train_fn done -> ``fit()`` returned; the fit's wall time; and
the backend's ``on_start`` (forming the process group over the live workers) of the first
worker group and of the restarted one, as Ray Train's controller logs it (to 0.01 s).
The fits alternate between the backends (the first alternating per repeat) after one
untimed short fit per backend (Ray's worker processes, imports). Medians over repeats; the
ratio gloo / raycoll per repeat (same machine state) and its median: above 1, raycoll took
less time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_step  # noqa: E402 - beside this file
from train_ddp_step import BACKENDS, fit  # noqa: E402

MEASURES = ("startup_s", "detect_s", "restart_s", "first_step_s", "shutdown_s", "fit_s",
            "on_start1_s", "on_start2_s")
LABELS = {"startup_s": "fit() -> train_fn started", "detect_s": "kill -> peer's error",
          "restart_s": "kill -> train_fn restarted", "first_step_s": "kill -> first step done",
          "shutdown_s": "train_fn done -> fit returned", "fit_s": "fit total",
          "on_start1_s": "backend on_start, first group", "on_start2_s": "backend on_start, restart"}


def _controller_logs() -> Set[Path]:
    """Ray Train's controller logs of this Ray session (one file per run)."""
    node = ray._private.worker._global_node
    return set((Path(node.get_session_dir_path()) / "logs" / "train").glob(
        "ray-train-sys-controller-*.log"))


def _on_start_times(logs: Set[Path]) -> List[float]:
    """The seconds of each worker group's backend ``on_start`` in a run's controller log:
    Ray Train logs each callback's time in ``after_worker_group_start``, to 0.01 s, as
    "BackendSetupCallback: 0.04s" (its ``after_worker_group_training_start`` line, also
    naming BackendSetupCallback, is ``on_training_start``'s)."""
    times: List[float] = []
    for path in logs:
        for line in path.read_text().splitlines():
            if "after_worker_group_start callbacks" in line:
                times += [float(v) for v in re.findall(r"BackendSetupCallback: ([0-9.]+)s", line)]
    return times


def _stamp(tmp: str, name: str, *lines: Any) -> None:
    with open(os.path.join(tmp, name), "w") as f:
        f.write("\n".join(str(v) for v in lines))


def _train_fn(config: Dict[str, Any]) -> None:
    """Every worker: DDP steps with a checkpoint each; rank 1 dies once at ``kill_at``."""
    import torch
    import ray.train
    import ray.train.torch

    now = time.monotonic()
    torch.set_num_threads(1)
    tmp, rank = config["tmp"], ray.train.get_context().get_world_rank()
    restarted = os.path.exists(os.path.join(tmp, "killed"))
    gen = 2 if restarted else 1
    _stamp(tmp, f"begin{gen}-{rank}", repr(now))
    model = ddp_step.make_model(config["params"], config["width"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"))
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    model = ray.train.torch.prepare_model(model)
    x = torch.randn(config["batch"], config["width"], generator=torch.Generator().manual_seed(rank))
    one_step = {"warmup": 0, "steps": 1}
    for step in range(start, config["steps"]):
        if step == config.get("kill_at") and rank == 1 and not restarted:
            _stamp(tmp, "killed", repr(time.monotonic()))
            os._exit(1)
        try:
            ddp_step._step_times(model, x, one_step)
        except Exception as e:  # the peer of the dead worker
            said = f"{type(e).__name__}: {e}"
            _stamp(tmp, f"error-{rank}", repr(time.monotonic()), next(
                (n for n in ("RankFailedError", "CoordinatorDiedError") if n in said),
                type(e).__name__), said.replace("\n", " ")[:2000])
            raise
        if restarted and step == start:
            _stamp(tmp, f"first{gen}-{rank}", repr(time.monotonic()))
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "step": step},
                           os.path.join(d, "model.pt"))
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d)
                             if rank == 0 else None)
    _stamp(tmp, f"end-{rank}", repr(time.monotonic()))


def _read(tmp: Path, name: str) -> List[str]:
    path = tmp / name
    return path.read_text().splitlines() if path.exists() else []


def _last(tmp: Path, what: str) -> float:
    """The later of the two workers' ``what`` stamps (NaN where one is missing)."""
    stamps = [_read(tmp, f"{what}-{r}") for r in (0, 1)]
    return max(float(s[0]) for s in stamps) if all(stamps) else float("nan")


def _measure(tmp: Path, fit_start: float, fit_s: float) -> Dict[str, Any]:
    killed = float(_read(tmp, "killed")[0])
    error = _read(tmp, "error-0")
    return {"startup_s": _last(tmp, "begin1") - fit_start,
            "detect_s": float(error[0]) - killed if error else float("nan"),
            "error": error[1] if error else "none seen", "said": error[2:],
            "restart_s": _last(tmp, "begin2") - killed,
            "first_step_s": _last(tmp, "first2") - killed,
            "shutdown_s": fit_start + fit_s - _last(tmp, "end"), "fit_s": fit_s}


def _report(args: argparse.Namespace, runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Print the medians over repeats and the per-repeat ratios; return them."""
    numel = sum(p.numel() for p in ddp_step.make_model(args.params, args.width).parameters())
    print(f"\nRay Train restart after a worker death: 2 workers, DDP of {numel / 1e6:.2f}M "
          f"parameters, kill at step {args.kill_at} of {args.steps}, {args.repeats} repeats "
          f"each, interleaved; medians (s)")
    print(f"  {'':30s} {'raycoll':>8s} {'gloo':>8s}   gloo/raycoll (per repeat)")
    summary: Dict[str, Any] = {"runs": runs}
    for k in MEASURES:
        med = {b: statistics.median(run[k] for run in runs[b]) for b in BACKENDS}
        ratios = [g[k] / c[k] if c[k] else float("inf")
                  for g, c in zip(runs["gloo"], runs["raycoll"])]
        summary[k] = {**med, "gloo_over_raycoll": statistics.median(ratios)}
        print(f"  {LABELS[k]:30s} {med['raycoll']:8.2f} {med['gloo']:8.2f}   "
              f"{statistics.median(ratios):.2f}x ({', '.join(f'{v:.2f}' for v in ratios)})")
    return summary


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument("--params", type=float, default=0.5, help="millions of parameters")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(list(argv))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    root = Path(tempfile.mkdtemp(prefix="raycoll-train-restart-"))
    cfg = {"steps": args.steps, "kill_at": args.kill_at, "params": args.params,
           "width": args.width, "batch": args.batch}
    for backend in BACKENDS:  # untimed: Ray's worker processes, imports, first-use actors
        (root / f"warm-{backend}").mkdir()
        fit(_train_fn, backend, {**cfg, "steps": 1, "kill_at": None,
                                 "tmp": str(root / f"warm-{backend}")}, str(root / "storage"))
    runs: Dict[str, List[Dict[str, Any]]] = {b: [] for b in BACKENDS}
    for r in range(args.repeats):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            for attempt in range(2):
                tmp = root / f"{backend}-{r}-{attempt}"
                tmp.mkdir()
                logs = _controller_logs()
                fit_start = time.monotonic()
                try:
                    result, fit_s = fit(_train_fn, backend, {**cfg, "tmp": str(tmp)},
                                        str(root / "storage"), max_failures=1)
                    break
                except Exception as e:  # noqa: BLE001 - Ray Train raises the run's error
                    # Ray Train's PlacementGroupCleaner (Ray 2.60) may remove a live run's
                    # placement group on this loaded machine (train_ddp_step.py): once more
                    if attempt or "placement group was removed" not in str(e):
                        raise
                    print(f"  ({backend}, repeat {r}: the run's placement group was removed "
                          "under it by Ray Train's cleaner; fitting again)", flush=True)
            if result.error is not None:
                raise RuntimeError(f"{backend}, repeat {r}: {result.error!r}")
            run = _measure(tmp, fit_start, fit_s)
            on_start = _on_start_times(_controller_logs() - logs) + [float("nan")] * 2
            run["on_start1_s"], run["on_start2_s"] = on_start[:2]
            runs[backend].append(run)
            print(f"repeat {r} {backend:8s} " + "  ".join(
                f"{k[:-2]} {run[k]:6.2f} s" for k in MEASURES)
                  + f"  (load {os.getloadavg()[0]:.1f})\n    the peer raised "
                  + (run["said"] or [run["error"]])[0][:200], flush=True)
    ray.shutdown()
    summary = _report(args, runs)
    summary["config"] = cfg
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
