/*
 * raycoll's native sockets: the messages of a schedule's steps over the group's direct
 * connections (raycoll/transport/links.py opens them; raycoll/transport/native_tcp.py plans
 * what moves). Non-blocking sockets, waited on with poll; no Python between two messages.
 *
 * A message is a header (rc_msg, 32 bytes, little-endian), its bytes and a trailer (rc_end,
 * 24 bytes: the header's step, call and length again, under another magic). The receiver
 * reads the header before any byte of the message, and the trailer right after its bytes:
 * a message is accepted only whole, its length checked twice (a trailer that is not the
 * header's fails the call with RC_GARBLED and breaks the group: the stream lost its framing).
 * A sender never leaves a message mid-way on a connection it goes on using: a run that fails
 * with a message half sent or half read shuts that connection (rc_net_shut), so the peer
 * reads the end of the stream, never the start of another message where the rest of this
 * one should be. The receiver then:
 *   - a message of an earlier call (call_seq below this call's: a call that failed here
 *     after its peer sent) is skipped, its bytes read and dropped;
 *   - a message of a later call (its sender left this call out) is kept for that call (the
 *     header, in the connection's rc_conn; the bytes stay in the socket), and this call
 *     fails (RC_SEQ);
 *   - a message whose step, fingerprint or size is not what this rank expects fails the call
 *     (RC_MISMATCH), its bytes read and dropped;
 * and a rank whose call fails completes the messages it is in the middle of sending or
 * reading, and starts no other: every stream stays whole, so the group goes on.
 */
#ifndef RAYCOLL_NET_H
#define RAYCOLL_NET_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RC_MSG_MAGIC 0x3158434Eu /* the bytes "NCX1" (not "RC": a goodbye's) */
/* A goodbye (links.py's GOODBYE, written as a rank closes its connections) is these two bytes. */
#define RC_FOREIGN_0 0x52u
#define RC_FOREIGN_1 0x43u

/* A message's header. */
typedef struct {
    uint32_t magic;    /* RC_MSG_MAGIC */
    uint32_t step;     /* the XFER's number in its call */
    uint64_t call_seq; /* the collective's sequence number in its process group */
    uint64_t fp;       /* the call's fingerprint hash */
    uint64_t nbytes;   /* the bytes that follow */
} rc_msg;

#define RC_END_MAGIC 0x31444E45u /* the bytes "END1" */

/* A message's trailer. */
typedef struct {
    uint32_t magic;    /* RC_END_MAGIC */
    uint32_t step;     /* as the header's */
    uint64_t call_seq; /* as the header's */
    uint64_t nbytes;   /* as the header's */
} rc_end;

/* What a peer's connections keep between calls (RC_CONN_BYTES each, by peer slot, in a
 * buffer the caller owns): a header read ahead, that belongs to a later call, and whether
 * the executor shut either connection (a message was left mid-way on it, or the group
 * broke): a shut connection is never read or written again (the plan check refuses it),
 * and how often a wait's spin ran out on it. */
#define RC_CONN_BYTES 72
typedef struct {
    uint32_t held;    /* 1: msg is the next message's header, already read */
    uint32_t spin_fails; /* waits of a step whose spin ran out while a message with this
                            peer was unfinished (counted on the first such message's peer,
                            once per step; wraps: the caller reads differences and backs
                            off spinning, raycoll.transport.base.SpinBackoff) */
    rc_msg msg;
    uint32_t in_cut;  /* 1: the incoming connection is shut */
    uint32_t out_cut; /* 1: the outgoing connection is shut */
    /* what moved, counted where it moves (the caller's counters read these), ever: */
    uint64_t sent;     /* payload bytes of the whole messages sent to this peer */
    uint64_t received; /* payload bytes of the whole messages received from it */
    uint32_t msgs_sent; /* those messages (wrap: the caller reads differences) */
    uint32_t msgs_received;
} rc_conn;

/* A group's sockets for one run, by peer slot (the plan's peer numbers). */
typedef struct rc_net {
    int npeers;
    const int64_t *out_fd; /* the socket to send to peer i (-1: none) */
    const int64_t *in_fd;  /* the socket to receive from peer i (-1: none) */
    rc_conn *conns;        /* npeers, per peer slot */
} rc_net;

/* Move one step's messages: ops are its SEND and RECV operations (consecutive ones to or
 * from one peer form one message), step its number. RC_OK or a failure (*peer: a slot). A
 * failure that leaves a message mid-way shuts that message's connection (call->cut). */
int rc_net_xfer(rc_net *net, const int64_t *ops, size_t nops, const rc_buf *bufs,
                uint32_t step, rc_call *call, int *peer);

/* Shut (shutdown(2), both ways) every connection of net and mark it so in its rc_conn:
 * the peers read the end of the stream, and nothing here reads or writes it again. Returns
 * how many it shut now. The descriptors stay open: their owner closes them. */
int rc_net_shut(rc_net *net);

#ifdef __cplusplus
}
#endif
#endif
