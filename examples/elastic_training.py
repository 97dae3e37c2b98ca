"""Elastic data-parallel training on Ray actors: a rank is killed, the others go on.

Run:  python examples/elastic_training.py [--ranks 4] [--steps 60] [--kill-at 20] [--standby]

Four actors train a linear model by data-parallel SGD (numpy; each rank computes the
gradient of its own batch, ``all_reduce`` averages them). At step ``--kill-at`` the driver
kills one rank's process (SIGKILL, as ``kill -9``). What happens next:

1. the survivors' ``all_reduce`` fails within about a second with ``RankFailedError``
   naming the dead rank; each survivor calls ``raycoll.shrink_group([dead])`` itself, on
   the spot, and redoes the step with the group of the survivors (their model, optimizer
   state and data position were never lost);
2. the driver sees the actor die, starts a replacement (``--standby``: one started ahead,
   as a warm spare), and calls
   ``raycoll.grow_group("dp", [new])`` while every survivor calls
   ``raycoll.admit_new_ranks()`` at its next step boundary;
3. the replacement takes rank 0's state (``raycoll.broadcast_state_dict``: over the data
   plane, not through the driver), and the four go on: the loss curve continues.

It prints the loss every few steps and what each change took.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any, Dict, List, Optional

import numpy as np
import ray

import raycoll

DIM = 32
BATCH = 64
LR = 0.02
GROUP = "dp"


def _batch(step: int, rank: int, world_size: int, true_w: np.ndarray) -> Any:
    """This rank's batch of step ``step``: a slice of the step's global batch."""
    rng = np.random.default_rng(1000 * step + rank * 7 + world_size)
    x = rng.standard_normal((BATCH, DIM))
    y = x @ true_w + 0.01 * rng.standard_normal(BATCH)
    return x, y


@ray.remote(num_cpus=0)
class Trainer:
    """One data-parallel rank: its model, its momentum, where it is in the data."""

    def __init__(self) -> None:
        self.w = np.zeros(DIM)
        self.momentum = np.zeros(DIM)
        self.step_no = 0
        self.true_w = np.linspace(-1.0, 1.0, DIM)
        self.last_change_s = 0.0

    def pid(self) -> int:
        return os.getpid()

    def step(self) -> Dict[str, Any]:
        """One training step; if a rank died, shrink the group and do the step again."""
        while True:
            rank, size = raycoll.get_rank(), raycoll.get_world_size()
            x, y = _batch(self.step_no, rank, size, self.true_w)
            err = x @ self.w - y
            grad = x.T @ err / len(y)
            loss = np.array([float(err @ err) / len(y)])
            try:
                raycoll.all_reduce(grad, op=raycoll.ReduceOp.AVG)
                raycoll.all_reduce(loss, op=raycoll.ReduceOp.AVG)
                break
            except raycoll.RankFailedError as exc:  # the survivors go on without it
                start = time.perf_counter()
                raycoll.shrink_group(sorted(exc.failed_ranks))
                self.last_change_s = time.perf_counter() - start
        self.momentum = 0.5 * self.momentum + grad
        self.w -= LR * self.momentum
        self.step_no += 1
        return {"step": self.step_no, "loss": float(loss[0]), "rank": raycoll.get_rank(),
                "size": raycoll.get_world_size(), "shrink_s": self.last_change_s}

    def state_dict(self) -> Dict[str, Any]:
        return {"w": self.w, "momentum": self.momentum, "step": self.step_no}

    def admit(self) -> int:
        """At a step boundary: let the newcomers in, then hand them rank 0's state."""
        raycoll.admit_new_ranks()
        self._take(raycoll.broadcast_state_dict(self.state_dict(), src=0))
        return raycoll.get_world_size()

    def join(self) -> int:
        """A replacement, once it is in the group: take the state of rank 0."""
        self._take(raycoll.broadcast_state_dict(None, src=0))
        return self.step_no

    def _take(self, state: Dict[str, Any]) -> None:
        self.w, self.momentum, self.step_no = state["w"], state["momentum"], state["step"]


def _steps(trainers: List[Any], timeout: float = 120.0,
           kill_pid: Optional[int] = None) -> List[Optional[Dict[str, Any]]]:
    """One step on every trainer (``kill_pid``: SIGKILL that process once the step is under
    way); ``None`` for a trainer that died."""
    out: List[Optional[Dict[str, Any]]] = []
    refs = [t.step.remote() for t in trainers]
    if kill_pid is not None:
        time.sleep(0.005)
        os.kill(kill_pid, signal.SIGKILL)  # kill -9 of one rank's process, mid-step
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=timeout))
        except ray.exceptions.RayActorError:
            out.append(None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--standby", action="store_true",
                        help="start the replacement actor ahead (a warm spare), not after the kill")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    trainers = [Trainer.remote() for _ in range(args.ranks)]
    raycoll.create_group(trainers, group_name=GROUP)
    standby = Trainer.remote() if args.standby else None
    losses: List[float] = []
    for step in range(args.steps):
        if step == args.kill_at:
            pid = ray.get(trainers[args.victim].pid.remote())
            killed = time.monotonic()
            results = _steps(trainers, kill_pid=pid)
            print(f"step {step}: killed rank {args.victim} (pid {pid}) during the step")
            survivors = [t for i, t in enumerate(trainers) if i != args.victim]
            done = [r for i, r in enumerate(results) if i != args.victim]
            while done[0]["size"] == args.ranks:  # type: ignore[index]  # the step ended before the death: the
                done = _steps(survivors)  # next one meets it (and shrinks)
            assert all(r is not None for r in done), done
            print(f"  survivors ({len(survivors)}) finished a step on the shrunk group "
                  f"{time.monotonic() - killed:.2f}s after the kill, shrink_group took "
                  f"{max(r['shrink_s'] for r in done if r) * 1e3:.1f} ms; "
                  f"loss {done[0]['loss']:.4f}")  # type: ignore[index]
            losses.append(done[0]["loss"])  # type: ignore[index]
            start = time.monotonic()
            new = standby if standby is not None else Trainer.remote()
            ray.get(new.pid.remote())  # the replacement is up
            print(f"  the replacement actor is up {time.monotonic() - start:.2f}s later "
                  f"({'started ahead' if standby is not None else 'started now'})")
            grow_start = time.monotonic()
            admitted = [t.admit.remote() for t in survivors]
            raycoll.grow_group(GROUP, [new])
            resumed_at = ray.get(new.join.remote())
            sizes = ray.get(admitted)
            trainers = survivors + [new]
            print(f"  grew back to {sizes[0]} ranks in {time.monotonic() - grow_start:.2f}s; "
                  f"the replacement resumes at step {resumed_at}")
            first = _steps(trainers)
            print(f"  first step with the replacement done {time.monotonic() - killed:.2f}s "
                  f"after the kill; loss {first[0]['loss']:.4f}")  # type: ignore[index]
            losses.append(first[0]["loss"])  # type: ignore[index]
            continue
        results = _steps(trainers)  # type: ignore[assignment]
        losses.append(results[0]["loss"])  # type: ignore[index]
        if step % 5 == 0:
            print(f"step {step}: loss {losses[-1]:.4f} on {results[0]['size']} ranks")  # type: ignore[index]
    print(f"final loss {losses[-1]:.5f} (first {losses[0]:.3f}): "
          f"{'converged' if losses[-1] < 0.01 * losses[0] else 'NOT converged'}")
    raycoll.destroy_group(GROUP)
    ray.shutdown()


if __name__ == "__main__":
    main()
