"""raycoll in one minute: torch.distributed-style collectives among Ray actors.

Run:  python examples/quickstart.py
Starts a small local Ray (or joins RAY_ADDRESS), then shows the two ways to use raycoll:
SPMD with ``raycoll.spawn`` and a group formed from the driver among your own actors.
"""

import numpy as np
import ray

import raycoll


def train_step(rank: int, world_size: int) -> dict:
    """Runs on every rank (a Ray actor), like a torch.multiprocessing.spawn target."""
    grad = np.full(4, float(rank + 1), dtype=np.float32)
    raycoll.all_reduce(grad, op=raycoll.ReduceOp.AVG)       # in place, like torch
    everyone = [np.empty(2, dtype=np.int64) for _ in range(world_size)]
    raycoll.all_gather(everyone, np.array([rank, rank * rank]))
    hosts = [None] * world_size
    raycoll.all_gather_object(hosts, ray.get_runtime_context().get_node_id()[:8])
    return {"rank": raycoll.get_rank(), "avg_grad": grad.tolist(),
            "gathered": [e.tolist() for e in everyone], "nodes": hosts}


@ray.remote(num_cpus=0)
class Worker:
    """Your own actor class: raycoll needs nothing from it."""

    def __init__(self) -> None:
        self.value = np.zeros(3)

    def step(self) -> list:
        self.value += raycoll.get_rank() + 1
        raycoll.all_reduce(self.value, group="dp")           # the group formed by the driver
        return self.value.tolist()


def main() -> None:
    # A Ray of its own ("local"), even where another one runs on this machine.
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    world_size = 2
    for result in raycoll.spawn(train_step, world_size, args=(world_size,),
                                actor_options={"num_cpus": 0}):
        # rank r: avg_grad [1.5, 1.5, 1.5, 1.5], gathered [[0, 0], [1, 1]], nodes: one id twice
        print("spawn:", result)

    workers = [Worker.remote() for _ in range(3)]
    raycoll.create_group(workers, group_name="dp")
    # each worker's value is 1 + 2 + 3: [[6.0, 6.0, 6.0]] * 3
    print("driver-formed group 'dp':", ray.get([w.step.remote() for w in workers], timeout=60))
    raycoll.destroy_group("dp")
    print("raycoll quickstart OK")
    ray.shutdown()


if __name__ == "__main__":
    main()
