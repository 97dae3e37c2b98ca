/*
 * raycoll's socket pipes: point-to-point messages between two ranks of a group on different
 * nodes, over the group's "p2p" direct connections (raycoll/transport/links.py makes them),
 * with the pair pipes' interface (pipe.h): raycoll/transport/pipes.py matches messages to
 * receives for both kinds, one copy of that logic.
 *
 * A socket pipe holds two connections to its peer: out (made by this rank, carrying this
 * rank's messages to the peer, and the peer's replies back) and in (made by the peer,
 * carrying the peer's messages, and this rank's replies back). The in connection comes when
 * the peer first sends: until then the pipe receives nothing (pipes.py attaches it).
 *
 * A message is an rc_pipe_msg header (pipe.h's, RC_PIPE_MSG_BYTES, magic RC_SOCK_MSG_MAGIC)
 * and its payload. A message whose flags carry RC_SOCK_ACK (a large one) is answered by its
 * receiver once read whole or skipped: an rc_sock_reply on the same connection, the other
 * way (RC_SOCK_TAKEN or RC_SOCK_REJECTED: its dtype or shape differ from the receive's), and
 * its sender waits for that answer (as a pair pipe's sender waits for "taken").
 *   - A send that may not wait (an eager one) goes only when the kernel's send buffer has
 *     room for it whole with a margin (SIOCOUTQ against SO_SNDBUF), else RC_PIPE_AGAIN with
 *     nothing written; should the kernel take it in part anyway, the rest is written at once,
 *     waiting as a blocking send waits (a tick, no check).
 *   - Waits: each I/O call is tried without blocking; while it would block the wait spins
 *     (retrying) for the policy's spin_ns, then sleeps in poll() at most a tick at a time,
 *     checking the closing flag and calling the caller's check as rc_waiter says (core.h).
 *   - Failures: the end of a stream is RC_PEER_CLOSED (the peer's process died, or it closed
 *     the connection); the Python transports' goodbye frame (a peer that destroyed its group:
 *     its first bytes are "RC") is RC_FOREIGN; a header that does not parse is RC_GARBLED. A
 *     message left mid-way (sent or read in part: a timeout, a check's error, a peer gone)
 *     shuts that connection (call->broke): its framing is lost, it is never used again.
 */
#ifndef RAYCOLL_SOCKPIPE_H
#define RAYCOLL_SOCKPIPE_H

#include <stdint.h>

#include "core.h"
#include "pipe.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RC_SOCK_MSG_MAGIC 0x47535053u   /* "SPSG" */
#define RC_SOCK_REPLY_MAGIC 0x50525053u /* "SPRP" */
#define RC_SOCK_ACK 2u                  /* rc_pipe_msg.flags: answer when read */
#define RC_SOCK_TAKEN 1u
#define RC_SOCK_REJECTED 2u

typedef struct {
    uint32_t magic; /* RC_SOCK_REPLY_MAGIC */
    uint32_t kind;  /* RC_SOCK_TAKEN / RC_SOCK_REJECTED */
    uint64_t number;
} rc_sock_reply;

typedef struct rc_sock {
    int out_fd;           /* this rank's connection to the peer (a dup; -1: none) */
    int in_fd;            /* the peer's connection to this rank (a dup; -1: not yet come) */
    volatile int closing; /* set by close(): a running wait ends at once (RC_CLOSED) */
    int out_broken;       /* out was shut: a message left mid-way */
    int in_broken;
    uint64_t sent;        /* messages sent (the last one's number) */
    uint64_t spin_fails;  /* waits whose spin ran its whole length */
    rc_pipe_msg cur;      /* the message being read (between a peek and its take) */
    int have_cur;
    uint8_t hbuf[RC_PIPE_MSG_BYTES]; /* a header read in part (a poll that found half) */
    uint32_t hgot;
} rc_sock;

/* A pipe over dups of out_fd and in_fd (either may be -1): 0 or an errno. */
int rc_sock_open(rc_sock *s, int out_fd, int in_fd);
/* The peer's connection, once it came: 0 or an errno (EBUSY: one is attached already). */
int rc_sock_attach_in(rc_sock *s, int in_fd);
/* Close the dups (no call may be running). */
void rc_sock_close(rc_sock *s);
/* As rc_pipe_send (pipe.h): may_wait, ack (wait for the receiver's answer: RC_MISMATCH if it
 * rejected the message); RC_PIPE_AGAIN (may_wait 0) with nothing written. */
int rc_sock_send(rc_sock *s, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                 const uint8_t *data, uint64_t n, int may_wait, int ack, rc_call *call);
/* As rc_pipe_peek: the next message's header, kept as the current one (may_wait 0:
 * RC_PIPE_AGAIN unless it is here whole). */
int rc_sock_peek(rc_sock *s, int may_wait, rc_call *call, rc_pipe_msg *msg);
/* As rc_pipe_take: the current message's payload into dst (n bytes, exactly its nbytes:
 * RC_BADPLAN otherwise, nothing read), or skipped (dst NULL); then its answer, if asked for. */
int rc_sock_take(rc_sock *s, uint8_t *dst, uint64_t n, int reject, rc_call *call);

#ifdef __cplusplus
}
#endif
#endif
