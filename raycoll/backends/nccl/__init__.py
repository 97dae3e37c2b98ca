"""The NCCL backend: GPU tensors (cupy arrays, torch CUDA tensors) through NCCL communicators.

One ``cupy.cuda.nccl.NcclCommunicator`` per (group, device), created lazily by the first GPU
operation on the group: every rank publishes its node and GPU in the coordinator's key-value
store, rank 0 adds the NCCL unique id, and each rank waits (bounded by the collective's
timeout, naming the ranks that never came) before the blocking ``ncclCommInitRank``. Ranks
that share a GPU are refused with a clear error (NCCL cannot run two ranks of one
communicator on one GPU; ``cuda:objstore`` can). With several devices per rank, ranks must
first use them in the same order (the n-th communicator of a group pairs the n-th devices).

Operations are stream-ordered, as in torch's ``ProcessGroupNCCL``: the raycoll stream of the
device waits for the caller's current stream, NCCL (and any pre/post step) is enqueued on the
raycoll stream, and an event is recorded. The operation returns a :class:`DevicePending` at
once; ``wait()`` (for synchronous calls, at once) makes the caller's current stream wait for
the event, ``is_completed()`` queries it. Tensors and temporaries stay referenced until the
device is done with them. ``options={"nccl_blocking_wait": True}`` (or
``RAYCOLL_NCCL_BLOCKING_WAIT=1``) makes waits block the host instead, like
``TORCH_NCCL_BLOCKING_WAIT``.

A watchdog per device aborts the communicator (``ncclCommAbort``) when an operation, or the
host-side enqueue of one, outlives its timeout; the waiters get
:class:`~raycoll.errors.DistTimeoutError`, the group is broken (later calls raise
``GroupBrokenError``), and it can be destroyed and formed again. NCCL errors are translated
into ``GroupBrokenError`` with the NCCL error as the cause.

Reductions map to NCCL's ops; what NCCL lacks is done on the raycoll stream: AVG (integers,
or NCCL < 2.10) and PREMUL_SUM (``factor * sum``, as the object-store backend does) as SUM
then an elementwise step; BAND/BOR/BXOR on integers by all-gather then a local reduction (on
bool: MIN/MAX/all-gather). bfloat16 arithmetic goes through float32. Data movement (broadcast,
gathers, scatter, all_to_all, p2p) moves bytes, so any dtype works. p2p and all_to_all use
NCCL group calls; ``batch_isend_irecv`` issues its operations as one group call. Tags are
ignored (NCCL matches messages between a pair in order), as in torch; ``recv`` needs ``src``.

The modules, by concern: ``plan`` (how each ReduceOp runs on NCCL per dtype, pure), ``comm``
(creating a communicator: the unique-id exchange and the bounded ``ncclCommInitRank``),
``device`` (streams, events, in-flight work, the watchdog), ``backend`` (the collectives).
"""

from raycoll.backends.nccl.backend import BLOCKING_ENV, NcclBackend
from raycoll.backends.nccl.plan import AVG_MIN_VERSION, ReducePlan, reduce_plan

__all__ = ["NcclBackend", "ReducePlan", "reduce_plan", "AVG_MIN_VERSION", "BLOCKING_ENV"]
