"""Data-parallel training on shards of different sizes, with raycoll.Join.

    python examples/uneven_inputs.py [--world-size 3] [--base 20] [--extra 5]

Each rank trains the same small numpy model (linear regression, mean squared error) on its
own shard; rank r has ``base + r * extra`` batches, so the ranks run out of data at different
steps. Gradients are averaged with :class:`raycoll.GradientAverager` inside ``raycoll.Join``:
a rank that has run out shadows the others' gradient all_reduce with zeros, the ranks still
training divide by how many ranks actually contributed, and when every rank is done the
post-hook copies the last joiner's parameters to everyone. Without Join, rank 0 would leave
the others hanging in their next all_reduce.

The driver prints the loss (averaged over the ranks still training) every few steps, the
final parameters of every rank (identical), and compares them with single-process training
on the same data: at step t it takes the mean of the gradients of the ranks that still have a
batch t, which is exactly what the averager computes. The exit status is non-zero when a
check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import ray

import raycoll

Batch = Tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Config:
    """The experiment: sizes, learning rate, and the true model the data comes from."""

    world_size: int = 3
    base: int = 20  # batches on rank 0
    extra: int = 5  # more batches per rank: rank r has base + r * extra
    batch: int = 16
    features: int = 4
    lr: float = 0.05
    noise: float = 0.1
    seed: int = 0

    def num_batches(self, rank: int) -> int:
        return self.base + rank * self.extra


def shard(cfg: Config, rank: int) -> List[Batch]:
    """Rank ``rank``'s batches, drawn from the same true model on every rank."""
    truth = np.random.default_rng(cfg.seed).standard_normal(cfg.features + 1)
    rng = np.random.default_rng([cfg.seed, rank + 1])
    out = []
    for _ in range(cfg.num_batches(rank)):
        x = rng.standard_normal((cfg.batch, cfg.features))
        y = x @ truth[:-1] + truth[-1] + cfg.noise * rng.standard_normal(cfg.batch)
        out.append((x, y))
    return out


def loss_and_grads(w: np.ndarray, b: np.ndarray, batch: Batch) -> Tuple[float, np.ndarray, np.ndarray]:
    """Mean squared error of one batch, and its gradients with respect to ``w`` and ``b``."""
    x, y = batch
    err = x @ w + b[0] - y
    return float(np.mean(err ** 2)), 2.0 * x.T @ err / len(y), np.array([2.0 * err.mean()])


def train_rank(rank: int, cfg: Config) -> Dict[str, Any]:
    """What every rank runs: its shard, under Join, with gradients averaged every step."""
    w = np.zeros(cfg.features)
    b = np.zeros(1)
    averager = raycoll.GradientAverager([w, b])
    losses = []
    with raycoll.Join([averager]):
        for batch in shard(cfg, rank):
            loss, gw, gb = loss_and_grads(w, b, batch)
            averager.grads[0][...] = gw
            averager.grads[1][...] = gb
            averager.average()  # the mean over the ranks that still have data
            w -= cfg.lr * averager.grads[0]  # in place: the averager holds these arrays
            b -= cfg.lr * averager.grads[1]
            losses.append(loss)
    return {"rank": rank, "w": w, "b": b, "losses": losses, "steps": averager.steps,
            "shadow_steps": averager.shadow_steps, "synced_from": averager.synced_from}


def train_single_process(cfg: Config) -> Tuple[np.ndarray, np.ndarray]:
    """The same training in one process: step t averages the gradients of the shards that
    have a batch t (summed in rank order, as the group reduces them)."""
    shards = [shard(cfg, r) for r in range(cfg.world_size)]
    w, b = np.zeros(cfg.features), np.zeros(1)
    for t in range(max(len(s) for s in shards)):
        grads = [loss_and_grads(w, b, s[t])[1:] for s in shards if len(s) > t]
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for one_w, one_b in grads:
            gw += one_w
            gb += one_b
        w -= cfg.lr * (gw / len(grads))
        b -= cfg.lr * (gb / len(grads))
    return w, b


def check(results: Sequence[Dict[str, Any]], cfg: Config) -> List[str]:
    """Problems with a run (empty when every check passes)."""
    problems = []
    last = cfg.world_size - 1
    for r, res in enumerate(results):
        if not (np.array_equal(res["w"], results[0]["w"]) and np.array_equal(res["b"], results[0]["b"])):
            problems.append(f"rank {r}'s parameters differ from rank 0's")
        if res["steps"] != cfg.num_batches(r):
            problems.append(f"rank {r} averaged {res['steps']} times, expected {cfg.num_batches(r)}")
        if res["steps"] + res["shadow_steps"] != cfg.num_batches(last):
            problems.append(f"rank {r} took part in {res['steps'] + res['shadow_steps']} "
                            f"all_reduces, expected {cfg.num_batches(last)}")
        if res["synced_from"] != last:
            problems.append(f"rank {r} synced from rank {res['synced_from']}, expected {last}")
    w, b = train_single_process(cfg)
    if not (np.allclose(results[0]["w"], w, rtol=1e-12, atol=1e-12)
            and np.allclose(results[0]["b"], b, rtol=1e-12, atol=1e-12)):
        problems.append(f"parameters {results[0]['w']}, {results[0]['b']} differ from "
                        f"single-process training: {w}, {b}")
    return problems


def run(cfg: Config, verbose: bool = True) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Train with ``raycoll.spawn`` (starting a local Ray if none is running); check it."""
    results = raycoll.spawn(train_rank, cfg.world_size, args=(cfg,),
                            actor_options={"num_cpus": 0})
    problems = check(results, cfg)
    if verbose:
        steps = cfg.num_batches(cfg.world_size - 1)
        for t in list(range(0, steps, 5)) + [steps - 1]:
            active = [res["losses"][t] for res in results if len(res["losses"]) > t]
            print(f"step {t:3d}  loss {np.mean(active):.5f}  ({len(active)} ranks with data)")
        for res in results:
            print(f"rank {res['rank']}: {res['steps']} batches, {res['shadow_steps']} shadowed; "
                  f"w={np.round(res['w'], 6)} b={np.round(res['b'], 6)}")
        print("final parameters identical on every rank and equal to single-process training"
              if not problems else "FAILED: " + "; ".join(problems))
    return results, problems


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=Config.world_size)
    parser.add_argument("--base", type=int, default=Config.base)
    parser.add_argument("--extra", type=int, default=Config.extra)
    args = parser.parse_args(list(argv))
    cfg = Config(world_size=args.world_size, base=args.base, extra=args.extra)
    if not ray.is_initialized():  # the cluster in RAY_ADDRESS, else a Ray of its own
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            ray.init(address="local", include_dashboard=False)
    _, problems = run(cfg)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
