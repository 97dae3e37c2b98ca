/*
 * raycoll's pair pipes: point-to-point messages between two ranks of a group on one node, in
 * shared memory (see raycoll/transport/pipes.py for the Python side: matching by source and
 * tag, ordering, Work objects).
 *
 * One pipe per (group, pair of ranks on the node), made when the pair first sends or
 * receives: both ranks derive its name from the group's secret and the pair, and each tries
 * to create it (shm_open with O_EXCL, mode 0600); the one that loses the race maps the one
 * the other made, once its header is written. When both have mapped it the second unlinks
 * the name (a crash leaves nothing behind); a creator whose peer never came unlinks it when
 * it closes, unless it sent messages there: they stay for the peer (as a socket's data
 * outlives its sender's close), which unlinks the name when it maps the pipe. (A process
 * killed after it made a pipe, before its peer mapped it, leaves the name behind.)
 *
 * Layout (offsets in bytes, every part on a 64-byte line):
 *
 *   [0, 128)                      rc_pipe_header
 *   [128, 128 + 2 * 128)          rc_pipe_side, by side (side 0: the lower group rank)
 *   [384, 384 + 2 * 192)          rc_pipe_ring's control, by direction (direction d carries
 *                                 side d's messages to side 1 - d)
 *   [RC_PIPE_DATA_OFF + d * ring_bytes, +ring_bytes)  direction d's ring of bytes
 *
 * A direction is a single-producer single-consumer ring. A message is an rc_pipe_msg header
 * (RC_PIPE_MSG_BYTES, never split by the ring's end: message starts are multiples of 64 and
 * so is ring_bytes) and then its payload, which wraps at the ring's end; the next message
 * starts at the next multiple of 64. Positions are byte counts since the pipe was made
 * (uint64, never wrapping): the bytes in the ring are [tail, head), at ring offset pos %
 * ring_bytes.
 *   - The sender writes bytes at head (while head - tail < ring_bytes), then publishes them:
 *     a release store of head, then hseq is bumped and the receivers sleeping on it woken.
 *     A message that fits the free space whole is written in one go (the send completes
 *     without the receiver: eager); a larger one streams as space frees up.
 *   - The receiver reads [tail, head) after an acquire load of head, then frees what it read:
 *     a release store of tail, tseq bumped, the sleeping sender woken. When it has a whole
 *     message it stores taken (the message's number), or, for a message whose dtype or shape
 *     differ from the receive's, rejected first (then taken): a sender that waits for its
 *     message to be taken (a large one) learns that it was rejected.
 *   - A large message may instead be offered across memory (RC_PIPE_CMA): the ring holds its
 *     header only, which names the payload's address in the sender (whose buffer stays put
 *     while it waits); the receiver reads it with process_vm_readv straight into its buffer
 *     (one copy), bounded by its own buffer's length (exactly the message's), then stores
 *     answered and taken. Where it may not (no ptrace permission), it stores streamed and
 *     answered instead (and no_cma: no more offers), and the sender streams the payload
 *     through the ring after the header as above.
 * Every wait spins a while (where the ranks fit the cores), then sleeps on the futex word it
 * waits for, waking at least every tick to check the peer's process and abort flag, and
 * calls the caller's check (its deadline, the coordinator) as rc_waiter says (core.h).
 * A message left mid-way (a sender or receiver that failed in its middle) breaks the pipe:
 * that side raises its abort flag, and the peer's waits end with RC_ABORTED.
 */
#ifndef RAYCOLL_PIPE_H
#define RAYCOLL_PIPE_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RC_PIPE_MAGIC 0x3150495043594152ULL /* "RAYCPIP1", little-endian */
#define RC_PIPE_VERSION 1u
#define RC_PIPE_MSG_MAGIC 0x4753504du       /* "MPSG" */
#define RC_PIPE_META_BYTES 80u
#define RC_PIPE_MSG_BYTES 128u
#define RC_PIPE_DATA_OFF 4096u
#define RC_PIPE_NAME_MAX 64

#define RC_PIPE_CMA 1u

/* Results beside core.h's RC_*. */
#define RC_PIPE_AGAIN 20 /* a send that may not wait could not go whole now; a poll found no
                            message */
#define RC_PIPE_OTHER 21 /* the next message has another tag: it is left in the pipe */

/* The pipe's header: written once by the creator, magic last (release). */
typedef struct {
    uint64_t magic;      /* RC_PIPE_MAGIC */
    uint32_t version;    /* RC_PIPE_VERSION */
    uint32_t attached;   /* atomic: sides that mapped the pipe (the creator counts) */
    uint64_t ring_bytes; /* bytes of each direction's ring (a multiple of 4096) */
    uint64_t total_bytes;
    uint8_t pad[128 - 32];
} rc_pipe_header;

/* One side's line, written by that side only. */
typedef struct {
    int32_t pid;     /* its process (its peer checks it while it waits) */
    uint32_t abort;  /* 0, or RC_ABORT_* (segment.h): it gave up on the pipe */
    uint32_t mapped; /* 1 once it mapped the pipe */
    uint8_t pad[128 - 12];
} rc_pipe_side;

/* One direction's control: a line for its sender, one for its receiver, one for waiters. */
typedef struct {
    /* written by the sender */
    uint64_t head;      /* bytes published (ever) */
    uint32_t hseq;      /* futex word: bumped after each publish */
    uint32_t pad0;
    uint64_t sent;      /* messages begun (the last one's number) */
    uint8_t pad1[64 - 24];
    /* written by the receiver */
    uint64_t tail;      /* bytes freed (ever) */
    uint32_t tseq;      /* futex word: bumped after each free, taken or rejected */
    uint32_t pad2;
    uint64_t taken;     /* the number of the last message read whole (or rejected) */
    uint64_t rejected;  /* the number of the last message rejected (dtype or shape) */
    uint64_t answered;  /* the last cross-memory message answered: taken, or streamed */
    uint64_t streamed;  /* the last cross-memory message the receiver could not read from
                           the sender's memory: the sender streams it through the ring */
    uint32_t no_cma;    /* 1 once a cross-memory read failed: the sender stops offering */
    uint8_t pad3[64 - 52];
    /* written by whoever sleeps */
    uint32_t head_waiters; /* receivers asleep on hseq */
    uint32_t tail_waiters; /* senders asleep on tseq */
    uint8_t pad4[64 - 8];
} rc_pipe_ring;

/* A message's header in the ring. */
typedef struct {
    uint32_t magic;    /* RC_PIPE_MSG_MAGIC */
    uint32_t meta_len; /* bytes of meta in use */
    int64_t tag;
    uint64_t nbytes;   /* the payload's bytes, after this header */
    uint64_t number;   /* the message's number on its direction (1, 2, ...) */
    uint32_t flags;    /* RC_PIPE_CMA: the payload is not in the ring but at addr in the
                          sender's memory (its pid: its side's line), nbytes long */
    uint32_t pad;
    uint64_t addr;
    uint8_t meta[RC_PIPE_META_BYTES]; /* what the receiver checks (dtype, shape): whole */
} rc_pipe_msg;

/* One process's view of a pipe. */
typedef struct rc_pipe {
    uint8_t *base;
    size_t len;
    rc_pipe_header *hdr;
    rc_pipe_side *sides;
    rc_pipe_ring *rings;
    uint64_t ring;        /* ring_bytes */
    int me;               /* this process's side */
    volatile int closing; /* set by close(): a running wait ends at once (RC_CLOSED) */
    int created;          /* this side created it */
    uint64_t spin_fails;  /* waits whose spin ran its whole length (the peer was not there) */
    /* the message being read (between a peek and its take), by this side */
    rc_pipe_msg cur;
    int have_cur;
    char name[RC_PIPE_NAME_MAX];
} rc_pipe;

size_t rc_pipe_total_bytes(uint64_t ring_bytes);
/* Create the pipe, or map the one the peer made (waiting up to wait_ns for its header): 0 or
 * an errno (err says why). *created: whether this side made it. */
int rc_pipe_open(rc_pipe *p, const char *name, int side, uint64_t ring_bytes, uint64_t wait_ns,
                 char *err, size_t errlen);
void rc_pipe_unmap(rc_pipe *p);
/* This side gives up on the pipe (the peer's waits end: RC_ABORTED); wakes every sleeper. */
void rc_pipe_abort(rc_pipe *p, uint32_t reason);

/* Send n bytes at data as one message (tag, meta). may_wait 0: RC_OK if it went whole now,
 * else RC_PIPE_AGAIN with nothing written. ack: wait until the receiver took it whole
 * (RC_MISMATCH if it rejected it); cma (with ack): offer the payload across memory. Failures: RC_DEAD / RC_ABORTED / RC_CLOSED / RC_CHECK;
 * one in the middle of the message raises this side's abort flag (call->broke). */
int rc_pipe_send(rc_pipe *p, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                 const uint8_t *data, uint64_t n, int may_wait, int ack, int cma,
                 rc_call *call);
/* Wait for the next message's header (may_wait 0: RC_PIPE_AGAIN if none is there) and keep it
 * as the current one (*msg: a copy). A header that does not parse breaks the pipe
 * (RC_GARBLED). */
int rc_pipe_peek(rc_pipe *p, int may_wait, rc_call *call, rc_pipe_msg *msg);
/* Read the current message's payload into dst (n bytes, exactly its nbytes), or skip it
 * (dst NULL: reject says whether the sender is told it was rejected). */
int rc_pipe_take(rc_pipe *p, uint8_t *dst, uint64_t n, int reject, rc_call *call);

#ifdef __cplusplus
}
#endif
#endif
