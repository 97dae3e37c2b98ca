"""torch CPU tensors work wherever numpy arrays do, in place and without copies."""

from __future__ import annotations

import numpy as np
import pytest

import raycoll

from helpers import TORCH_MISSING

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch", reason=TORCH_MISSING)


def _torch_ops(rank, world_size):
    import torch

    out = {}
    t = torch.full((2, 3), float(rank + 1))
    ptr = t.data_ptr()
    raycoll.all_reduce(t, op=raycoll.ReduceOp.AVG)
    out["avg"], out["same_storage"] = t.tolist(), t.data_ptr() == ptr
    lst = [torch.empty(2, dtype=torch.int64) for _ in range(world_size)]
    raycoll.all_gather(lst, torch.tensor([rank, -rank]))
    out["gather"] = [x.tolist() for x in lst]
    big = torch.arange(50_000, dtype=torch.float32) * (rank + 1)
    raycoll.all_reduce(big)
    out["big_sum"] = float(big.sum())
    flat = torch.empty(world_size * 2)
    raycoll.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    out["into"] = flat.tolist()
    mixed = np.full(2, 10.0) if rank % 2 else torch.full((2,), 10.0, dtype=torch.float64)
    raycoll.all_reduce(mixed)  # numpy on some ranks, torch on others
    out["mixed"] = mixed.tolist()
    g = torch.ones(3, requires_grad=True)
    raycoll.broadcast(g.detach(), src=0)
    b = torch.zeros(4, dtype=torch.bool)
    b[rank % 4] = True
    raycoll.all_reduce(b, op=raycoll.ReduceOp.BOR)
    out["bor"] = b.tolist()
    c = torch.full((2,), complex(rank, 1), dtype=torch.complex64)
    raycoll.all_reduce(c)
    out["complex"] = [complex(v) for v in c.tolist()]
    w = torch.full((2,), float(rank))
    fut = raycoll.all_reduce(w, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)  # as a DDP comm hook chains
    out["future"] = [isinstance(fut, torch.futures.Future), chained.wait().tolist(),
                     fut.value()[0] is w]
    if rank == 0:
        raycoll.send(torch.arange(4), dst=1)
    elif rank == 1:
        r = torch.empty(4, dtype=torch.int64)
        raycoll.recv(r, src=0)
        out["recv"] = r.tolist()
    return out


@pytest.mark.timeout(120)
def test_torch_cpu_tensors(ranks):
    results = ranks.run(_torch_ops, 3, 3)
    for rank, got in enumerate(results):
        assert got["avg"] == [[2.0] * 3] * 2 and got["same_storage"]
        assert got["gather"] == [[r, -r] for r in range(3)]
        assert got["big_sum"] == pytest.approx(6 * sum(range(50_000)))
        assert got["into"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert got["mixed"] == [30.0, 30.0]
        assert got["bor"] == [True, True, True, False]
        assert got["complex"] == [complex(3, 3)] * 2
        assert got["future"] == [True, [6.0, 6.0], True]  # a torch future of the outputs
    assert results[1]["recv"] == [0, 1, 2, 3]
