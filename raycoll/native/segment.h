/*
 * raycoll's node segment: the shared memory that a group's ranks on one node run their
 * collectives through (see raycoll/transport/segment.py for the Python side).
 *
 * One segment per (group generation, node). The node's first rank creates it (shm_open with
 * O_EXCL, a name that carries a hash of the group's secret, mode 0600), reserves its memory
 * (posix_fallocate on Linux: a /dev/shm too small fails here with ENOSPC, never later with
 * SIGBUS), maps it and writes the header; the others open and map it; once every local rank
 * has mapped it, the name is unlinked, so that a crash or a kill -9 leaves nothing behind.
 *
 * Layout (every part starts on a 64-byte line; offsets in bytes):
 *
 *   [0, 128)                       rc_seg_header
 *   [128, 128 + n * RC_CTL_BYTES)  rc_ctl, one per local rank (by local rank)
 *   [data_off, ...)                the slots: local rank r's slot is two halves of
 *                                  half_bytes each, at data_off + (2 r + p) * half_bytes for
 *                                  parity p (data_off and half_bytes are multiples of 4096)
 *
 * Execution is a sequence of *steps*, the same on every local rank (the planner in Python
 * makes them: raycoll/algorithms/segment_plans.py; core.h's rc_exec runs them). Each rank
 * counts its steps; in step s it
 *   1. writes what it sends into its own slot half s % 2 (and, on a call's first step, its
 *      fingerprint and call into info[s % 2]: see compare_info in segment.c for the ranks
 *      meeting at a step with different calls);
 *   2. publishes s: a release store to its ctl.seq, then a futex wake if anyone sleeps on it;
 *   3. waits until every local rank has published s (acquire loads of their ctl.seq);
 *   4. reads the peers' halves s % 2: copies, or reduces them in rank order (every rank
 *      holds bitwise the same result), possibly into its own half (s + 1) % 2 for step s + 1.
 * Large collectives may instead read the peers' own buffers (where process_vm_readv may:
 * cross-memory attach), whose addresses the call's first step publishes (RC_STEP_PUBLISH):
 * one copy a byte, with a wait before the call ends so that no peer still reads a buffer its
 * owner has got back.
 * Every step waits for every local rank, so when a rank writes half p in step s + 2 every
 * peer has published s + 1, and so has finished reading half p in step s: two halves are
 * enough, with one wait a step. Python may read the peers' halves of the last step between
 * two runs (they stay put until this rank publishes its next step).
 *
 * seq is 32 bits (a futex word) and wraps: ranks are at most one step apart, so steps are
 * compared by their difference as a signed 32-bit number.
 */
#ifndef RAYCOLL_SEGMENT_H
#define RAYCOLL_SEGMENT_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RC_SEG_MAGIC 0x31304c4c4f435952ULL /* "RAYCOLL01", little-endian */
#define RC_SEG_VERSION 3u
#define RC_HEADER_BYTES 128u
#define RC_CTL_BYTES 640u
#define RC_FP_BYTES 192u
#define RC_PAGE 4096u
#define RC_MAX_RANKS 1024
#define RC_NAME_MAX 64

/* rc_step_info.flags (and RC_OP_SYNC's flags) */
#define RC_STEP_FIRST 1u   /* the first step of a call: fp and call_seq are compared */
#define RC_STEP_PUBLISH 2u /* the step publishes the call's buffers in the rank's half (its
                              count, then each one's address and length, as uint64): the
                              peers read them with process_vm_readv (RC_OP_CREAD,
                              RC_OP_CREDUCE), checked against those lengths, while the call
                              lasts (its plan writes nothing into that half meanwhile) */

/* Reasons a rank gives up on the group (rc_ctl.abort). */
#define RC_ABORT_FAILED 1u /* its call failed in the middle (timeout, a dead peer, ...) */
#define RC_ABORT_CLOSED 2u /* it destroyed its group while a call waited */

/* The segment's header, written once by the creator before the magic. */
typedef struct {
    uint64_t magic;       /* RC_SEG_MAGIC, stored last (release) by the creator */
    uint32_t version;     /* RC_SEG_VERSION */
    uint32_t nranks;      /* local ranks sharing the segment */
    uint64_t half_bytes;  /* bytes of each half of each rank's slot */
    uint64_t data_off;    /* where rank 0's slot starts */
    uint64_t total_bytes; /* the file's size */
    uint32_t attached;    /* atomic: ranks that mapped the segment (the creator counts) */
    uint32_t creator_pid; /* for debugging */
    uint8_t pad[RC_HEADER_BYTES - 48];
} rc_seg_header;

/* What a rank says of one step, by step parity: written before it publishes the step, read
 * by the peers after they saw it published. */
typedef struct {
    uint64_t call_seq;        /* the collective's sequence number in its process group */
    uint32_t step;            /* the step this info was written for */
    uint32_t flags;           /* RC_STEP_* */
    uint32_t fp_len;          /* bytes of fp in use */
    uint32_t pad;
    uint8_t fp[RC_FP_BYTES];  /* the call's fingerprint (Python's encoding), compared whole */
} rc_step_info;

/* One rank's control block: three lines written by different parties, then its step info. */
typedef struct {
    /* line 0, written by the owner only */
    uint32_t seq;   /* futex word: the last step the owner published */
    uint32_t abort; /* 0, or RC_ABORT_*: the owner gave up on the group (peers stop waiting) */
    uint8_t pad0[56];
    /* line 1, written by the ranks that wait for the owner */
    uint32_t waiters; /* how many ranks sleep (futex) on seq: the owner wakes them if > 0 */
    uint8_t pad1[60];
    /* line 2, written by the owner when it maps the segment */
    int32_t pid;      /* the owner's process id: a peer whose pid is gone is named at once */
    uint32_t mapped;  /* 1 once the owner mapped the segment */
    uint64_t probe_addr;  /* a word in the owner's process, for the peers to read with
                             process_vm_readv (rc_seg_probe_cma) ... */
    uint64_t probe_value; /* ... which holds this */
    uint8_t pad2[40];
    /* lines 3.., by step parity */
    rc_step_info info[2];
    uint8_t pad3[RC_CTL_BYTES - 192 - 2 * sizeof(rc_step_info)];
} rc_ctl;

/* One process's view of a segment. */
typedef struct rc_seg {
    uint8_t *base;
    size_t len;
    rc_seg_header *hdr;
    rc_ctl *ctl;
    uint8_t *data;
    int nranks;
    int me;
    uint64_t half;
    uint32_t step;       /* the last step this rank published */
    volatile int closing; /* set by the binding's close(): a running wait ends at once */
    uint64_t spin_fails;  /* waits whose spin ran its whole length (the peer was not there) */
    uint32_t first_step;  /* the running call's first step (whose halves hold its buffers) */
    uint64_t probe;       /* the word whose address the control line publishes */
    char name[RC_NAME_MAX];
} rc_seg;

size_t rc_seg_total_bytes(int nranks, uint64_t half_bytes);
/* 0 or an errno; err gets a message. */
int rc_seg_create(rc_seg *s, const char *name, int nranks, int me, uint64_t half_bytes,
                  char *err, size_t errlen);
int rc_seg_attach(rc_seg *s, const char *name, int nranks, int me, uint64_t half_bytes,
                  char *err, size_t errlen);
int rc_seg_unlink(const char *name);
void rc_seg_unmap(rc_seg *s);
/* Tell the peers this rank gave up (reason RC_ABORT_*; a first reason stays), and wake
 * every sleeper. */
void rc_seg_abort(rc_seg *s, uint32_t reason);
/* One step (flags: RC_STEP_*): fill in this rank's step info (the call's first step), write
 * the call's buffers into its half (RC_STEP_PUBLISH), publish the next step, wait for every
 * rank, and (the first step) compare the infos: RC_OK, RC_RETRY (this
 * step stood in for a peer's earlier call: run the call again from the next step), or a
 * failure (*peer names a rank). */
int rc_seg_sync(rc_seg *s, int flags, rc_call *call, const rc_buf *bufs, int nbufs,
                int *peer);
/* Whether this process can read every peer's memory (process_vm_readv of the word each
 * published when it mapped the segment; Linux, with the peers' ptrace permission): 1 or 0.
 * Call once every rank has mapped the segment. */
int rc_seg_probe_cma(rc_seg *s);
/* A cross-memory read, during a call, of local rank r's published buffer idx, [off, +n), into
 * dst: RC_OK, RC_DEAD, RC_BADPLAN (past what it published) or RC_IOERR. */
int rc_seg_cma_read(rc_seg *s, int r, int idx, uint64_t off, uint64_t n, uint8_t *dst);
/* Whether process pid is gone: it no longer exists, or (Linux) it is a zombie its parent has
 * not reaped yet; 0 for pid <= 0 (not known yet). */
int rc_pid_gone(int32_t pid);
/* The bytes of rank r's half p. */
uint8_t *rc_seg_half(const rc_seg *s, int r, int p);

#ifdef __cplusplus
}
#endif
#endif
