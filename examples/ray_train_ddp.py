"""DDP with Ray Train on raycoll: ``TorchTrainer(..., torch_config=RaycollConfig())``.

    python examples/ray_train_ddp.py [--epochs 5] [--workers 2] [--storage DIR]
                                     [--fail-at-epoch N] [--plot loss.png]

A plain Ray Train script; the one raycoll line is ``torch_config=RaycollConfig()`` (with
``TorchConfig(backend="gloo")`` instead it runs on gloo, unchanged). Every worker trains a
small MLP on synthetic regression data made here, with ``ray.train.torch.prepare_model``
(DDP over the workers' raycoll group) and ``prepare_data_loader`` (each worker a shard,
reshuffled every epoch). Each epoch ends with ``ray.train.report`` of the epoch's loss
(averaged over the workers) and a checkpoint; a worker group that starts with
``ray.train.get_checkpoint()`` resumes from it.

Restarts: ``--fail-at-epoch N`` makes world rank 1 die once at the start of epoch N; its
peer's next collective fails (``RankFailedError``, unless Ray Train, which watches its
workers, has already ended it), Ray Train (``FailureConfig(max_failures=1)``) starts a new
worker group on a new raycoll group, and it resumes from the last checkpoint Ray Train
registered. Running the
script again with the same ``--storage`` and ``--name`` and more ``--epochs`` resumes the
finished run where it stopped (Ray Train restores a run from its storage).

The driver prints the loss of every epoch (taken from the last checkpoint, which carries the
history), the epochs it resumed at, and ``--plot`` saves the loss curve (needs matplotlib).
The exit status is non-zero when the run failed or the loss did not go down. Starts a local
Ray of 2 CPUs, or joins the cluster in ``RAY_ADDRESS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Sequence

import ray

FEATURES = 16


def make_data(n: int = 2048, seed: int = 0) -> Any:
    """Synthetic regression: ``y = sin(x @ w) + noise``, the same on every worker."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g) / FEATURES ** 0.5
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def train_fn(config: Dict[str, Any]) -> None:
    """Every Ray Train worker: DDP training, a checkpoint an epoch, resume from the last."""
    import torch
    import torch.distributed as dist
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)  # the workers share the machine's cores
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    state: Dict[str, Any] = {"epoch": -1, "losses": [], "resumed_at": []}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restarted worker group, or a run restored from storage
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state.pop("model"))
        opt.load_state_dict(state.pop("optimizer"))
        state["resumed_at"].append(state["epoch"] + 1)
    model = ray.train.torch.prepare_model(model)  # DDP, over raycoll under RaycollConfig
    loader = torch.utils.data.DataLoader(make_data(), batch_size=config["batch"], shuffle=True)
    loader = ray.train.torch.prepare_data_loader(loader)  # a DistributedSampler per worker
    for epoch in range(state["epoch"] + 1, config["epochs"]):
        if epoch == config.get("fail_at_epoch") and rank == 1 \
                and not os.path.exists(config["fail_marker"]):
            open(config["fail_marker"], "w").close()
            os._exit(1)  # a worker dies; Ray Train restarts the worker group
        if world > 1:
            loader.sampler.set_epoch(epoch)
        total = torch.zeros(2)  # sum of batch losses, number of batches
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            total += torch.tensor([loss.item(), 1.0])
        dist.all_reduce(total)  # the epoch's loss over every worker's batches
        state["losses"].append(float(total[0] / total[1]))
        state["epoch"] = epoch
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({**state, "model": model.module.state_dict(),
                            "optimizer": opt.state_dict()}, os.path.join(d, "state.pt"))
            ray.train.report({"epoch": epoch, "loss": state["losses"][-1]},
                             checkpoint=ray.train.Checkpoint.from_directory(d)
                             if rank == 0 else None)


def fit(args: argparse.Namespace) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raycoll.train import RaycollConfig

    storage = os.path.abspath(args.storage)
    config = {"epochs": args.epochs, "batch": 32, "lr": 0.01,
              "fail_at_epoch": args.fail_at_epoch,
              "fail_marker": os.path.join(storage, f".{args.name}-failed-once")}
    trainer = TorchTrainer(
        train_fn, train_loop_config=config,
        torch_config=RaycollConfig(),
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=args.name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=1)))
    return trainer.fit()


def plot(losses: List[float], resumed_at: List[int], path: str) -> None:
    """The loss per epoch, with the epochs the run resumed at marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses, marker="o", label="training loss (all workers)")
    for i, epoch in enumerate(resumed_at):
        ax.axvline(epoch, color="grey", linestyle="--",
                   label="resumed from a checkpoint" if i == 0 else None)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("MSE loss")
    ax.set_title("DDP with Ray Train on raycoll (RaycollConfig)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "raycoll-train"),
                        help="Ray Train's storage path (checkpoints); shared by every node")
    parser.add_argument("--name", default=None,
                        help="the run's name under --storage (default: a new one per run)")
    parser.add_argument("--fail-at-epoch", type=int, default=None,
                        help="world rank 1 dies once at the start of this epoch")
    parser.add_argument("--plot", default=None, help="save the loss curve to this PNG file")
    args = parser.parse_args(list(argv))
    args.name = args.name or time.strftime("ray_train_ddp-%Y%m%d-%H%M%S")
    if not ray.is_initialized():  # the cluster in RAY_ADDRESS, else a Ray of its own
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            ray.init(address="local", num_cpus=2, include_dashboard=False)
    result = fit(args)
    print(f"run {args.name!r} under {os.path.abspath(args.storage)}")
    if result.error is not None or result.checkpoint is None:
        print(f"FAILED: {result.error!r}")
        return 1
    import torch

    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "state.pt"))
    losses = state["losses"]
    for epoch, loss in enumerate(losses):
        print(f"epoch {epoch}  loss {loss:.5f}")
    print(f"resumed from a checkpoint at epoch(s): {state['resumed_at'] or 'none'}")
    print(f"first loss {losses[0]:.5f}, final loss {losses[-1]:.5f}")
    if args.plot:
        plot(losses, state["resumed_at"], args.plot)
        print(f"loss curve saved to {args.plot}")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
