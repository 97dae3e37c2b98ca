"""All-reduce GPU tensors across Ray actors with raycoll.

With one GPU per rank the group's default backend uses NCCL; ranks that share a GPU stage GPU
tensors through host memory and the object store (``cuda:objstore``). The same code runs
either way: only the backend string and the actors' GPU share differ.

    python examples/gpu_allreduce.py              # one rank per GPU of the cluster (NCCL)
    python examples/gpu_allreduce.py --share 4    # 4 ranks sharing one GPU (cuda:objstore)

Each rank sums a cupy array (a torch CUDA tensor when cupy is absent) holding ``rank + 1``,
and averages another asynchronously, waiting on the ``Work``: the rank's current CUDA stream
waits for the collective, as with torch.distributed. The driver checks the
results and prints one line per rank; the exit status is non-zero when a check fails, and 0
with a message when the cluster has no GPU.
"""

import argparse
import sys

import ray

import raycoll


def work(rank, n):
    try:
        import cupy as xp

        x = xp.full(n, rank + 1, dtype=xp.float32)
        y = xp.full(n, rank + 1, dtype=xp.float32)
        device = xp.cuda.runtime.getDevice()
    except ImportError:  # torch works too
        import torch

        x = torch.full((n,), rank + 1.0, device="cuda")
        y = torch.full((n,), rank + 1.0, device="cuda")
        device = torch.cuda.current_device()
    raycoll.all_reduce(x)  # in place: every rank gets the sum
    handle = raycoll.all_reduce(y, op=raycoll.ReduceOp.AVG, async_op=True)
    handle.wait()  # the current stream waits for the collective; the host goes on
    uniform = bool((x == x[0]).all()) and bool((y == y[0]).all())
    return {"rank": rank, "device": int(device), "sum": float(x[0]), "avg": float(y[0]),
            "uniform": uniform, "library": type(x).__module__.split(".")[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=int, default=0,
                        help="run this many ranks on one GPU through cuda:objstore")
    parser.add_argument("--n", type=int, default=1 << 20, help="elements per rank")
    args = parser.parse_args()
    if not ray.is_initialized():
        ray.init()
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus == 0:
        print("this Ray cluster has no GPU: nothing to run (see examples/quickstart.py for CPU)")
        return 0
    if args.share:
        world, backend, per_rank = args.share, "cpu:objstore,cuda:objstore", 1.0 / args.share
    else:
        world, backend, per_rank = gpus, None, 1  # None: NCCL where available
    results = raycoll.spawn(work, world_size=world, args=(args.n,), backend=backend,
                            actor_options={"num_gpus": per_rank, "num_cpus": 0})
    want = world * (world + 1) / 2
    ok = True
    for res in results:
        good = res["sum"] == want and res["avg"] == (world + 1) / 2 and res["uniform"]
        ok = ok and good
        print(f"rank {res['rank']} on cuda:{res['device']} ({res['library']}): sum {res['sum']:g} "
              f"avg {res['avg']:g} {'ok' if good else 'WRONG'}")
    print(f"{'ok' if ok else 'FAILED'}: {world} ranks, backend {backend or 'default (nccl)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
