"""Creating a group's NCCL communicator on one device: every rank publishes its node and GPU
in the coordinator's key-value store, rank 0 adds the NCCL unique id, and each rank waits
(bounded by the operation's timeout, naming the ranks that never came) before the blocking
``ncclCommInitRank``, which runs on a daemon thread so that it too is bounded. Ranks that
share a GPU are refused with a clear error (NCCL cannot run two ranks of one communicator on
one GPU; ``cuda:objstore`` can).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from raycoll import errors
from raycoll.backends.nccl.device import NcclOwner, What

logger = logging.getLogger("raycoll")

__all__ = ["create_communicator"]


def create_communicator(owner: NcclOwner, device: int, index: int, what: What) -> Any:
    """Rendezvous through the coordinator's kv store, then ``ncclCommInitRank``."""
    ctx, nccl = owner.ctx, owner.nccl
    deadline = time.monotonic() + what.timeout_s
    if ctx.size == 1:
        uid = nccl.get_unique_id()
    else:
        uid = _exchange_uid(owner, device, index, what, deadline)
    box: Dict[str, Any] = {}
    done = threading.Event()

    def init() -> None:
        try:
            with owner.cp.cuda.Device(device):
                box["comm"] = nccl.NcclCommunicator(ctx.size, uid, ctx.rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=init, name=f"raycoll-nccl-init-cuda{device}", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
        raise errors.DistTimeoutError(
            f"{what} on group {ctx.group_name!r}: creating the NCCL communicator on "
            f"cuda:{device} did not finish within {what.timeout_s:g}s (a rank died or "
            "cannot reach the others over the network)", **owner.err_ctx(what))
    if "error" in box:
        exc = box["error"]
        raise errors.GroupBrokenError(
            f"{what} on group {ctx.group_name!r}: creating the NCCL communicator on "
            f"cuda:{device} failed: {type(exc).__name__}: {exc}", **owner.err_ctx(what)
        ) from exc
    logger.debug("group %r rank %d: NCCL communicator %d on cuda:%d (NCCL %d)",
                 ctx.group_name, ctx.rank, index, device, owner.version)
    return box["comm"]


def _exchange_uid(owner: NcclOwner, device: int, index: int, what: What,
                  deadline: float) -> Any:
    """Publish this rank's node and GPU (rank 0 adds the unique id); wait for every rank's
    (until ``deadline``), refuse two ranks on one GPU, and return rank 0's unique id."""
    ctx = owner.ctx
    me = ctx.rank
    base = f"raycoll/nccl/{ctx.group_name}/{index}"
    mine = {"node": ctx.node_ids[me], "gpu": _gpu_id(owner.cp, device), "device": device,
            "uid": owner.nccl.get_unique_id() if me == 0 else None}
    where = owner.err_ctx(what)
    ctx.client.kv_set(f"{base}/{me}", mine, what.timeout_s, where)
    left = max(deadline - time.monotonic(), 0.001)
    refs = [ctx.client.submit_kv_get(f"{base}/{r}", left) for r in range(ctx.size)]
    infos: List[Dict[str, Any]] = []
    missing: List[int] = []
    for r, ref in enumerate(refs):
        try:
            infos.append(ctx.client.wait(ref, left, **where))
        except errors.DistTimeoutError:
            missing.append(ctx.global_ranks[r])
            infos.append({})
    if missing:
        raise errors.DistTimeoutError(
            f"{what} on group {ctx.group_name!r}: ranks {missing} did not start creating "
            f"the group's NCCL communicator within {what.timeout_s:g}s (every rank of the "
            "group must issue a GPU operation on it)", missing=missing, **where)
    seen: Dict[Tuple[str, str], int] = {}
    for r, info in enumerate(infos):
        if info.get("gpu") is None:
            continue
        key = (str(info.get("node")), str(info.get("gpu")))
        if key in seen:
            raise errors.BackendUnavailableError(
                f"{what} on group {ctx.group_name!r}: ranks {ctx.global_ranks[seen[key]]} and "
                f"{ctx.global_ranks[r]} use the same GPU ({key[1]}); NCCL needs one GPU per "
                "rank: give each actor its own GPU (num_gpus=1), or stage GPU tensors "
                "through the object store with backend='cpu:objstore,cuda:objstore'")
        seen[key] = r
    return infos[0]["uid"]


def _gpu_id(cp: Any, device: int) -> Optional[str]:
    """The PCI bus id of ``device`` (what tells two ranks sharing a GPU apart), if known."""
    try:
        return str(cp.cuda.Device(device).pci_bus_id)
    except Exception:  # noqa: BLE001 - older cupy: ask the runtime
        try:
            return str(cp.cuda.runtime.deviceGetPCIBusId(device))
        except Exception:  # noqa: BLE001 - unknown: skip the duplicate check
            return None
