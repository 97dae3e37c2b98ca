"""Data-parallel training on torch.distributed (gloo, CPU): the "before" of docs/porting.md.

A small linear model on a synthetic regression task. Every rank starts from rank 0's model
(broadcast), trains on its own shard (rows ``rank::world_size``) and averages gradients with
``all_reduce`` after each backward; the final parameters are saved to ``--out`` (.npz).

    python examples/porting/train_torch.py --world-size 2 --steps 50
"""

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make_data(n=512, features=8, seed=0):
    """The full data set: y = X @ w + b + noise, identical in every process."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n, features).astype(np.float32)
    w = rng.randn(features, 1).astype(np.float32)
    y = x @ w + 0.5 + 0.01 * rng.randn(n, 1).astype(np.float32)
    return x, y


def train(rank, world_size, steps, lr, out):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # deliberately different: the broadcast below makes them equal
    x, y = make_data()
    x, y = torch.from_numpy(x[rank::world_size]), torch.from_numpy(y[rank::world_size])
    model = torch.nn.Linear(x.shape[1], 1)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}")
    params = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    if rank == 0:
        np.savez(out, **params)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", default="params.npz")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.spawn(train, args=(args.world_size, args.steps, args.lr, args.out),
             nprocs=args.world_size)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
