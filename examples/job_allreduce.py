"""A small raycoll job, meant for `ray job submit`.

From the repository root:

    ray job submit --address http://<head>:8265 --working-dir . -- python examples/job_allreduce.py

or run it directly (`python examples/job_allreduce.py`) to use a local Ray instance.

Two ranks each all_reduce (SUM) an array holding `rank + 1` and all_gather_object
where they run (hostname, Ray node id). The driver checks the results and prints one
summary line; the exit status is non-zero when the check fails.
"""

import socket
import sys

import numpy as np
import ray

import raycoll

WORLD_SIZE = 2
LENGTH = 1024


def work(rank):
    world_size = raycoll.get_world_size()
    arr = np.full(LENGTH, rank + 1, dtype=np.float64)
    raycoll.all_reduce(arr)  # in place, SUM over ranks

    where = [None] * world_size
    node_id = ray.get_runtime_context().get_node_id()
    raycoll.all_gather_object(where, (raycoll.get_rank(), socket.gethostname(), node_id))
    return {"rank": raycoll.get_rank(), "world_size": world_size, "arr": arr, "where": where}


def check(results):
    """Returns a list of problems (empty when every rank got what it should)."""
    expected = float(sum(r + 1 for r in range(WORLD_SIZE)))
    problems = []
    if len(results) != WORLD_SIZE:
        return [f"expected {WORLD_SIZE} results, got {len(results)}"]
    for rank, res in enumerate(results):
        if res["rank"] != rank or res["world_size"] != WORLD_SIZE:
            problems.append(f"rank {rank}: reports rank={res['rank']} world_size={res['world_size']}")
        if not np.all(res["arr"] == expected):
            problems.append(f"rank {rank}: all_reduce gave {res['arr'][:4]}..., expected {expected}")
        if [w[0] for w in res["where"]] != list(range(WORLD_SIZE)):
            problems.append(f"rank {rank}: all_gather_object gave {res['where']}")
        if res["where"] != results[0]["where"]:
            problems.append(f"rank {rank}: all_gather_object differs from rank 0's")
    return problems


def main():
    ray.init()  # connects to the cluster when submitted as a job (RAY_ADDRESS is set)
    results = raycoll.spawn(work, WORLD_SIZE, actor_options={"num_cpus": 0})
    problems = check(results)
    if problems:
        print("raycoll job FAILED: " + "; ".join(problems), flush=True)
        return 1
    where = results[0]["where"]
    hosts = sorted({host for _, host, _ in where})
    nodes = len({node for _, _, node in where})
    total = results[0]["arr"][0]
    print(f"raycoll job OK: world_size={WORLD_SIZE} sum={total:g} nodes={nodes} hosts={','.join(hosts)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
