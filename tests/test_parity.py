"""torch.distributed 2.13 parity: calls a ported torch script makes, behaving as torch's do."""

from __future__ import annotations

import numpy as np
import pytest

import raycoll


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        return type(exc).__name__, str(exc)


def _object_p2p(rank):
    lst = [f"from-{rank}", rank] if rank == 0 else [None, None]
    raycoll.broadcast_object_list(lst)  # src defaults to 0, as in torch
    out = {"broadcast": lst}
    if rank == 0:
        got = {}
        for _ in range(2):  # any source
            slots = [None] * 3
            sender = raycoll.recv_object_list(slots)
            got[sender] = slots
        out["got"] = got
        raycoll.barrier()
        slots = [None]
        out["named"] = (raycoll.recv_object_list(slots, src=1), slots)
        out["short"] = _outcome(lambda: raycoll.recv_object_list([None], src=2))
        out["self"] = _outcome(lambda: raycoll.send_object_list([1], dst=0))
    elif rank == 1:
        raycoll.send_object_list(["foo", 12, {1: 2}], dst=0)
        raycoll.barrier()  # rank 0's any-source receives are done
        raycoll.send_object_list([np.arange(3)], dst=0)
        out["unpicklable"] = _outcome(
            lambda: raycoll.send_object_list([(x for x in [])], dst=0))
    else:
        raycoll.send_object_list([None, (rank,), lambda: 42], group_dst=0, use_batch=True)
        raycoll.barrier()
        raycoll.send_object_list(["one", "two"], dst=0)  # rank 0 offers one slot: refused
    x = np.ones(2)
    raycoll.all_reduce(x)  # the group is still usable
    out["after"] = x.tolist()
    return out


@pytest.mark.timeout(120)
def test_send_and_recv_object_list(ranks):
    r0, r1, r2 = ranks.run(_object_p2p, 3)
    for r in (r0, r1, r2):
        assert r["broadcast"] == ["from-0", 0]
        assert r["after"] == [3.0, 3.0]
    assert sorted(r0["got"]) == [1, 2]  # recv_object_list returns the sender's rank
    assert r0["got"][1] == ["foo", 12, {1: 2}]
    none, tup, fn = r0["got"][2]
    assert none is None and tup == (2,) and fn() == 42
    sender, slots = r0["named"]
    assert sender == 1 and slots[0].tolist() == [0, 1, 2]
    kind, message = r0["short"]
    assert kind == "ValueError" and "rank 2 sent 2 objects" in message and "1 slots" in message
    kind, message = r0["self"]
    assert kind == "ValueError" and "Invalid destination rank" in message
    kind, message = r1["unpicklable"]
    assert kind == "TypeError" and "cannot be pickled" in message
