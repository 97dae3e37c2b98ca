"""Types of raycoll's compiled core (raycoll/native/module.c, pipemodule.c): see segment.h,
pipe.h and reduce.h."""

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

OP_WRITE: int
OP_SYNC: int
OP_COPY: int
OP_REDUCE: int
OP_LOCAL: int
OP_FINAL: int
BUF_NEXT: int
FLAG_FINAL: int
STEP_FIRST: int
OK: int
MISMATCH: int
ABORTED: int
DEAD: int
BADPLAN: int
CLOSED: int
SEQ: int
ABORT_FAILED: int
ABORT_CLOSED: int
FP_BYTES: int
PAGE: int
MAX_RANKS: int
OP_WORDS: int
OP_SEND: int
OP_RECV: int
OP_XFER: int
OP_RED2: int
OP_MREDUCE: int
OP_CREAD: int
OP_CREDUCE: int
CFLAG_FINAL: int
PEER_CLOSED: int
FOREIGN: int
GARBLED: int
IOERR: int
CONN_BYTES: int
MSG_MAGIC: int
END_MAGIC: int
CHECK: int
RETRY: int
SANITIZE: str

Wait = Tuple[int, int, int, int]
Check = Optional[Callable[[float, Tuple[int, ...]], None]]
#: (status, peer, errno, broke, the check's exception or None)
Outcome = Tuple[int, int, int, int, Optional[BaseException]]

class SegmentError(OSError): ...

class Segment:
    attached: int
    step: int
    half_bytes: int
    spin_fails: int
    closed: bool
    def __init__(self, name: str, nranks: int, rank: int, half_bytes: int,
                 create: bool) -> None: ...
    def run(self, plan: Any, bufs: Sequence[Any], dtype: int, op: int, factor: float,
            divisor: int, call_seq: int, fp: bytes, wait: Wait,
            check: Check) -> Outcome: ...
    def abort(self, reason: int = ...) -> None: ...
    def close(self) -> None: ...
    def info(self, rank: int, parity: int) -> Dict[str, Any]: ...
    def half_offset(self, rank: int, parity: int) -> int: ...
    def probe_cma(self) -> bool: ...
    def __buffer__(self, flags: int) -> memoryview: ...

PIPE_AGAIN: int
PIPE_OTHER: int
PIPE_META_BYTES: int

#: (status, tag, nbytes, meta, broke, the check's exception or None)
Received = Tuple[int, int, int, bytes, int, Optional[BaseException]]

class Pipe:
    state: Dict[str, Any]
    closed: bool
    spin_fails: int
    def __init__(self, name: str, side: int, ring_bytes: int, wait_s: float) -> None: ...
    def send(self, buf: Any, tag: int, meta: bytes, may_wait: bool, ack: bool, cma: bool,
             wait: Wait, check: Check) -> Tuple[int, int, Optional[BaseException]]: ...
    def peek(self, may_wait: bool, wait: Wait, check: Check) -> Received: ...
    def take(self, buf: Any, reject: bool, wait: Wait,
             check: Check) -> Tuple[int, int, Optional[BaseException]]: ...
    def recv(self, buf: Any, tag: int, meta: bytes, wait: Wait, check: Check) -> Received: ...
    def abort(self, reason: int = ...) -> None: ...
    def close(self) -> None: ...

class SockPipe:
    state: Dict[str, Any]
    closed: bool
    attached: bool
    spin_fails: int
    def __init__(self, out_fd: int, in_fd: int) -> None: ...
    def send(self, buf: Any, tag: int, meta: bytes, may_wait: bool, ack: bool, cma: bool,
             wait: Wait, check: Check) -> Tuple[int, int, Optional[BaseException]]: ...
    def peek(self, may_wait: bool, wait: Wait, check: Check) -> Received: ...
    def take(self, buf: Any, reject: bool, wait: Wait,
             check: Check) -> Tuple[int, int, Optional[BaseException]]: ...
    def recv(self, buf: Any, tag: int, meta: bytes, wait: Wait, check: Check) -> Received: ...
    def attach_in(self, fd: int) -> None: ...
    def close(self) -> None: ...

def execute(seg: Optional[Segment], plan: Any, bufs: Sequence[Any], dtype: int, op: int,
            factor: float, divisor: int, call_seq: int, fp: bytes, wait: Wait, check: Check,
            net: Optional[Tuple[Any, Any, Any, int]], rank_map: bytes = ...) -> Outcome: ...
def set_soft_errors(classes: Tuple[type, ...]) -> None: ...
def reduce(dtype: int, op: int, dst: Any, srcs: Sequence[Any]) -> None: ...
def finalize(dtype: int, op: int, buf: Any, divisor: int, factor: float) -> None: ...
def supported(dtype: int, op: int) -> bool: ...
def dtype_size(dtype: int) -> int: ...
def unlink(name: str) -> bool: ...
def cma_read(pid: int, remote: Sequence[Tuple[int, int]],
             bufs: Sequence[Any]) -> Tuple[int, int]: ...
def total_bytes(nranks: int, half_bytes: int) -> int: ...
