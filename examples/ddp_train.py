"""torch's own DistributedDataParallel on Ray actors, through the raycoll backend.

    python examples/ddp_train.py [--world-size 2] [--base 30] [--extra 10] [--plot loss.png]

Every rank is a Ray actor started by ``raycoll.spawn``. Inside it, the training code is plain
torch: ``torch.distributed.init_process_group("raycoll")`` (no MASTER_ADDR, no port: rank and
world size come from the raycoll group), ``DistributedDataParallel``, and torch's own
``torch.distributed.algorithms.Join`` for uneven inputs: rank r has ``base + r * extra``
batches, so the ranks run out of data at different steps; a rank that has run out shadows the
others' gradient all_reduces until every rank is done. Without Join the ranks still training
would wait for it in their next all_reduce.

The driver prints the loss every few steps, checks that every rank ends with the same
parameters, and compares them with the same training in one process (at step t the gradient
is the sum over the ranks that still have a batch t, divided by the world size: DDP's
default under Join). ``--plot`` saves the loss curves (needs matplotlib). The exit status is
non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import ray

import raycoll


@dataclass(frozen=True)
class Config:
    """The experiment: sizes, learning rate, and the seed of the data and the model."""

    world_size: int = 2
    base: int = 30  # batches on rank 0
    extra: int = 10  # more batches per rank: rank r has base + r * extra
    batch: int = 32
    features: int = 16
    hidden: int = 64
    lr: float = 0.05
    seed: int = 0

    def num_batches(self, rank: int) -> int:
        return self.base + rank * self.extra


def make_model(cfg: Config) -> Any:
    import torch

    torch.manual_seed(cfg.seed)
    return torch.nn.Sequential(torch.nn.Linear(cfg.features, cfg.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(cfg.hidden, 1))


def shard(cfg: Config, rank: int) -> List[Tuple[Any, Any]]:
    """Rank ``rank``'s batches: a noisy nonlinear target, the same function on every rank."""
    import torch

    truth = torch.Generator().manual_seed(cfg.seed)
    w = torch.randn(cfg.features, 1, generator=truth)
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(cfg.num_batches(rank)):
        x = torch.randn(cfg.batch, cfg.features, generator=g)
        out.append((x, torch.sin(x @ w) + 0.05 * torch.randn(cfg.batch, 1, generator=g)))
    return out


def train_rank(rank: int, cfg: Config) -> Dict[str, Any]:
    """What every rank runs: plain torch DDP training under torch's Join."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("raycoll")
    try:
        model = DDP(make_model(cfg))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        losses = []
        with Join([model]):
            for x, y in shard(cfg, rank):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        params = [p.detach().clone() for p in model.module.parameters()]
        return {"rank": rank, "losses": losses, "params": params}
    finally:
        dist.destroy_process_group()


def train_single_process(cfg: Config) -> List[Any]:
    """The same training in one process: at step t, the gradients of the ranks that have a
    batch t, summed and divided by the world size."""
    import torch

    model = make_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    shards = [shard(cfg, r) for r in range(cfg.world_size)]
    for t in range(max(len(s) for s in shards)):
        total = None
        for s in (s for s in shards if len(s) > t):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(s[t][0]), s[t][1]).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            p.grad = g / cfg.world_size
        opt.step()
    return [p.detach() for p in model.parameters()]


def check(results: Sequence[Dict[str, Any]], cfg: Config) -> List[str]:
    """Problems with a run (empty when every check passes)."""
    import torch

    problems = []
    for res in results:
        if not all(torch.equal(a, b) for a, b in zip(res["params"], results[0]["params"])):
            problems.append(f"rank {res['rank']}'s parameters differ from rank 0's")
        if len(res["losses"]) != cfg.num_batches(res["rank"]):
            problems.append(f"rank {res['rank']} trained {len(res['losses'])} batches")
    want = train_single_process(cfg)
    if not all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(results[0]["params"], want)):
        problems.append("parameters differ from single-process training")
    return problems


def plot(results: Sequence[Dict[str, Any]], path: str) -> None:
    """Each rank's loss per step (the ranks with more data train longer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for res in results:
        ax.plot(res["losses"], label=f"rank {res['rank']} ({len(res['losses'])} batches)")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title("torch DDP on Ray actors (raycoll backend), uneven shards under Join")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(cfg: Config, verbose: bool = True) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Train with ``raycoll.spawn`` (starting a local Ray if none is running); check it."""
    results = raycoll.spawn(train_rank, cfg.world_size, args=(cfg,),
                            actor_options={"num_cpus": 0})
    problems = check(results, cfg)
    if verbose:
        steps = max(len(res["losses"]) for res in results)  # --extra may be negative
        for t in sorted({*range(0, steps, 10), steps - 1} - {-1}):
            active = [res["losses"][t] for res in results if len(res["losses"]) > t]
            print(f"step {t:3d}  loss {sum(active) / len(active):.5f}  "
                  f"({len(active)} ranks with data)")
        print("final parameters identical on every rank and equal to single-process training"
              if not problems else "FAILED: " + "; ".join(problems))
    return results, problems


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=Config.world_size)
    parser.add_argument("--base", type=int, default=Config.base)
    parser.add_argument("--extra", type=int, default=Config.extra)
    parser.add_argument("--plot", default=None, help="save the loss curves to this file")
    args = parser.parse_args(list(argv))
    cfg = Config(world_size=args.world_size, base=args.base, extra=args.extra)
    if not ray.is_initialized():  # the cluster in RAY_ADDRESS, else a Ray of its own
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            ray.init(address="local", include_dashboard=False)
    results, problems = run(cfg)
    if args.plot:
        plot(results, args.plot)
        print(f"loss curves saved to {args.plot}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
