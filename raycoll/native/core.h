/*
 * raycoll's native executor: what a plan is, what a call brings, and the run loop's results.
 *
 * Python plans (raycoll/algorithms/segment_plans.py for a node segment,
 * raycoll/algorithms/native_plans.py for a schedule over sockets); this executes. A plan is
 * a list of operations of 8 int64 words (kind, a, a_off, n, b, b_off, flags, extra) over the
 * call's buffers (ids >= 0, checked against their lengths before anything moves), this rank's
 * half of the node segment's next step (RC_BUF_NEXT), the node segment's halves (segment.h)
 * and the group's sockets (net.h). Nothing here knows groups, Ray or Python.
 */
#ifndef RAYCOLL_CORE_H
#define RAYCOLL_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A buffer of a call. */
typedef struct {
    uint8_t *ptr;
    uint64_t len;
    int writable;
} rc_buf;

/* Operation kinds. On the node segment (segment.h):
 *   WRITE   buf a[a_off, +n) into this rank's half of the coming step at b_off
 *   SYNC    publish the step, wait for every local rank (flags: RC_STEP_FIRST on a call's
 *           first step: fingerprints and calls compared before anything is read)
 *   COPY    local rank b's half of this step [b_off, +n) into buf a at a_off
 *   REDUCE  buf a[a_off, +n) = every local rank's half [b_off, +n) reduced in rank order
 *           (flags & RC_FLAG_FINAL: then AVG's division / PREMUL's factor)
 * Over sockets (net.h):
 *   SEND    buf a[a_off, +n) to peer b (consecutive SENDs to one peer: one message)
 *   RECV    peer b's next message (consecutive RECVs from one peer: its parts, in order)
 *           into buf a at a_off, n bytes
 *   XFER    move the SENDs and RECVs since the last XFER (extra: the step's number, which the
 *           messages' headers carry)
 * Local:
 *   LOCAL   memmove buf b[b_off, +n) into buf a at a_off
 *   FINAL   AVG's division / PREMUL's factor over buf a[a_off, +n)
 *   RED2    buf a[a_off, +n) = itself op buf b[b_off, +n)
 *   MREDUCE buf a[a_off, +n) = buf b's flags sources at b_off, b_off + extra, ... reduced in
 *           order (flags >= 1; the sources may not overlap the destination)
 * Across processes, on the node segment's ranks (segment.h: a SYNC with RC_STEP_PUBLISH
 * publishes the call's buffers; process_vm_readv reads them):
 *   CREAD   local rank b's published buffer flags [b_off, +n) into buf a at a_off
 *   CREDUCE buf a[a_off, +n) = every local rank's [b_off, +n) of its published buffer
 *           flags & 0xff (this rank's own, locally: it may be buf a's same range), reduced in
 *           rank order (flags & 0x100: then AVG's division / PREMUL's factor)
 */
enum {
    RC_OP_WRITE = 1,
    RC_OP_SYNC = 2,
    RC_OP_COPY = 3,
    RC_OP_REDUCE = 4,
    RC_OP_LOCAL = 5,
    RC_OP_FINAL = 6,
    RC_OP_SEND = 7,
    RC_OP_RECV = 8,
    RC_OP_XFER = 9,
    RC_OP_RED2 = 10,
    RC_OP_MREDUCE = 11,
    RC_OP_CREAD = 12,
    RC_OP_CREDUCE = 13,
};
#define RC_CFLAG_FINAL 0x100
/* The most buffers one run takes. */
#define RC_MAX_BUFS 4096
#define RC_BUF_NEXT (-2)
#define RC_FLAG_FINAL 1
#define RC_OP_WORDS 8

/* Results of a run (the rank or peer is in *peer where one is named). */
enum {
    RC_OK = 0,
    RC_MISMATCH = 1,  /* fingerprints differ: on the segment's first step, or in a message's
                         header (*peer sent it); nothing of the call was read */
    RC_ABORTED = 3,   /* local rank *peer gave up on the group (its abort flag) */
    RC_DEAD = 4,      /* local rank *peer's process is gone */
    RC_CHECK = 5,     /* the check callback raised (its exception is set) */
    RC_BADPLAN = 6,   /* an operation out of bounds (*peer: its index); nothing was published */
    RC_CLOSED = 7,    /* this rank closed the segment while it waited */
    RC_SEQ = 8,       /* *peer is at a later call: this rank's call took other paths there
                         (it rejected its arguments, say), so it fails here */
    RC_RETRY = 9,     /* (internal) this rank's step stood in for a peer's earlier call */
    RC_PEER_CLOSED = 10, /* peer *peer's connection closed (its process died, or it left) */
    RC_FOREIGN = 11,  /* peer *peer sent a frame of the Python transports (a goodbye, before
                         it closed its end: it left, it did not die) */
    RC_GARBLED = 12,  /* peer *peer's stream does not parse (a bad header, or a message
                         whose trailer is not its own: cut mid-way, or garbage) */
    RC_IOERR = 13,    /* a socket call failed (errno in the call's io_errno) */
};

/* The waiting policy of one run. */
typedef struct {
    uint64_t spin_ns;      /* spin this long before sleeping (0: ranks outnumber the cores) */
    uint64_t tick_ns;      /* longest single sleep: liveness and abort flags are checked at
                              least this often */
    uint64_t check_ns;     /* call the check callback after this much waiting ... */
    uint64_t check_max_ns; /* ... then at intervals doubling up to this */
} rc_wait_policy;

/* Called (with the waited time and the ranks or peers not yet heard from) while a run
 * waits; nonzero ends the run with RC_CHECK: RC_CHECK_SOFT where the caller's error leaves
 * the group usable (a peer rejected its arguments, a mismatch found on another path), any
 * other nonzero value (RC_CHECK_HARD: a timeout, an interrupt, an error of any other kind)
 * where it does not. */
typedef int (*rc_check_fn)(void *arg, double waited_s, const int *pending, int npending);
#define RC_CHECK_HARD 1
#define RC_CHECK_SOFT 2

/* Everything one run needs beside the plan and the buffers. */
typedef struct {
    int dtype;        /* RC_DT_* (reduce.h), for the reductions and FINAL */
    int op;           /* RC_RED_* */
    double factor;    /* PREMUL_SUM's factor */
    int divisor;      /* AVG's divisor: the ranks reduced */
    uint64_t call_seq;
    const uint8_t *fp; /* the call's fingerprint (the segment compares it whole) */
    uint32_t fp_len;
    uint64_t fp_hash; /* ... and its hash (the sockets' headers carry it) */
    rc_wait_policy wait;
    rc_check_fn check;
    void *check_arg;
    /* The group rank of each of the segment's local ranks (rank_map_len of them), or NULL:
     * a segment wait names its pending ranks to the check through it (a plan that also runs
     * sockets names their peers by group rank; without a map, local ranks are named). A
     * process-local table, not shared memory. */
    const int32_t *rank_map;
    int rank_map_len;
    /* set by the run (outputs) */
    int io_errno;     /* RC_IOERR: the errno */
    int check_rc;     /* RC_CHECK: what the check returned (RC_CHECK_SOFT, RC_CHECK_HARD) */
    int broke;        /* the run failed in a way that breaks the group, and said so itself:
                         it raised this rank's abort flag on the segment and shut the
                         sockets of the call (see rc_exec) */
    int cut;          /* connections shut because a message on them was left mid-way */
} rc_call;

struct rc_seg;
struct rc_net;

/* Run a plan (nops operations of RC_OP_WORDS words) on the node segment seg and the sockets
 * net (either may be NULL where the plan uses none of its operations). Returns RC_*.
 *
 * Failures are the executor's own, whatever its caller does next:
 *   - nothing moves before every operation is checked (RC_BADPLAN: nothing was published);
 *   - a failure that leaves the ranks' streams and steps whole (a mismatch or a call out of
 *     step found at the call's first step, before any byte was read; a soft check failure
 *     in the first step's wait) returns and leaves the group usable;
 *   - any other failure once the call has published its first step or begun its first
 *     transfer (a timeout, an interrupt, an error of any class in the check, a dead or
 *     aborted peer, a closed segment, a socket error, a bad cross-memory read) raises this
 *     rank's abort flag on the segment (its peers stop waiting and fail: RC_ABORTED) and
 *     shuts every socket of the call (its peers read the end of the stream), and sets
 *     call->broke;
 *   - a message left mid-way on a connection (sent or read in part) always shuts that
 *     connection (call->cut): a stream that lost its framing is never read or written
 *     again. */
int rc_exec(struct rc_seg *seg, struct rc_net *net, const int64_t *ops, size_t nops,
            const rc_buf *bufs, int nbufs, rc_call *call, int *peer);

/* ---------------------------------------------------------------- shared by the waits */
static inline uint64_t rc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void rc_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The caller's check and the deadline of a wait: a wait calls rc_waiter_due() on its way and
 * rc_waiter_check() when it says so. */
typedef struct {
    uint64_t start;
    uint64_t check_at;
    uint64_t check_every;
} rc_waiter;

static inline void rc_waiter_start(rc_waiter *w, const rc_call *call) {
    w->start = rc_now_ns();
    w->check_every = call->wait.check_ns ? call->wait.check_ns : 100000000ull;
    w->check_at = w->start + w->check_every;
}

/* The next check's time: the interval doubles up to check_max_ns (1 s where unset). */
static inline void rc_waiter_next(rc_waiter *w, const rc_call *call) {
    uint64_t most = call->wait.check_max_ns ? call->wait.check_max_ns : 1000000000ull;
    w->check_every = w->check_every * 2 < most ? w->check_every * 2 : most;
    w->check_at = rc_now_ns() + w->check_every;
}

/* Nonzero (RC_CHECK, with call->check_rc) if the check callback failed. Without a callback
 * the check's time still moves on (a wait never spins on an overdue check). */
static inline int rc_waiter_check(rc_waiter *w, rc_call *call, const int *pending,
                                  int npending) {
    uint64_t now = rc_now_ns();
    if (now < w->check_at) return 0;
    if (call->check != NULL) {
        int got = call->check(call->check_arg, (double)(now - w->start) / 1e9, pending, npending);
        if (got) {
            call->check_rc = got;
            return RC_CHECK;
        }
    }
    rc_waiter_next(w, call);
    return 0;
}

#ifdef __cplusplus
}
#endif
#endif
