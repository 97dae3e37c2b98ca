/* Running a plan: every operation's ranges checked first, then the operations in order, on the
 * node segment (segment.c), the sockets (net.c) and the call's buffers (see core.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "core.h"
#include "net.h"
#include "reduce.h"
#include "segment.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int in_range(uint64_t off, uint64_t n, uint64_t len) { return n <= len && off <= len - n; }

static int overlap(uint64_t a, uint64_t an, uint64_t b, uint64_t bn) {
    return an && bn && a < b + bn && b < a + an;
}

/* Whether operation o may run: its buffers exist, its ranges lie inside them and the
 * segment's halves, what it writes is writable, its peers and sockets exist. */
static int op_ok(const rc_seg *seg, const rc_net *net, const int64_t *o, const rc_buf *bufs,
                 int nbufs, const rc_call *call) {
    int64_t kind = o[0], a = o[1], b = o[4];
    if (o[2] < 0 || o[3] < 0 || o[5] < 0) return 0;
    uint64_t a_off = (uint64_t)o[2], n = (uint64_t)o[3], b_off = (uint64_t)o[5];
    size_t esize = rc_dtype_size(call->dtype);
    uint64_t half = seg != NULL ? seg->half : 0;
    int a_buf = a >= 0 && a < nbufs;
    int b_buf = b >= 0 && b < nbufs;
    int src_ok = a_buf && in_range(a_off, n, bufs[a].len);
    int dst_ok = (a == RC_BUF_NEXT && seg != NULL && in_range(a_off, n, half)) ||
                 (src_ok && bufs[a].writable);
    int whole = esize && n % esize == 0;
    switch (kind) {
    case RC_OP_WRITE:
        return seg != NULL && src_ok && in_range(b_off, n, half);
    case RC_OP_COPY:
        return seg != NULL && dst_ok && b >= 0 && b < seg->nranks && in_range(b_off, n, half);
    case RC_OP_REDUCE:
        return seg != NULL && dst_ok && whole && in_range(b_off, n, half) &&
               rc_reduce_supported(call->dtype, call->op);
    case RC_OP_LOCAL:
        return dst_ok && a != RC_BUF_NEXT && b_buf && in_range(b_off, n, bufs[b].len);
    case RC_OP_FINAL:
        return dst_ok && a != RC_BUF_NEXT && whole;
    case RC_OP_SEND: /* (a connection the executor shut is never written again) */
        return net != NULL && src_ok && b >= 0 && b < net->npeers && net->out_fd[b] >= 0 &&
               !net->conns[b].out_cut;
    case RC_OP_RECV:
        return net != NULL && dst_ok && a != RC_BUF_NEXT && b >= 0 && b < net->npeers &&
               net->in_fd[b] >= 0 && !net->conns[b].in_cut;
    case RC_OP_XFER:
        return net != NULL && o[7] >= 0 && o[7] <= 0xffffffffll;
    case RC_OP_RED2:
        return dst_ok && a != RC_BUF_NEXT && b_buf && in_range(b_off, n, bufs[b].len) && whole &&
               rc_reduce_supported(call->dtype, call->op) &&
               !(a == b && overlap(a_off, n, b_off, n) && a_off != b_off);
    case RC_OP_SYNC: /* (a publishing step's table of the buffers fits the half) */
        return seg != NULL && (o[6] & ~(int64_t)(RC_STEP_FIRST | RC_STEP_PUBLISH)) == 0 &&
               (!(o[6] & RC_STEP_PUBLISH) || (uint64_t)(2 * nbufs + 1) * 8u <= half);
    case RC_OP_CREAD:
        return seg != NULL && dst_ok && a != RC_BUF_NEXT && b >= 0 && b < seg->nranks &&
               o[6] >= 0 && o[6] < RC_MAX_BUFS;
    case RC_OP_CREDUCE: {
        int64_t idx = o[6] & 0xff;
        if (!(seg != NULL && dst_ok && a != RC_BUF_NEXT && whole && idx < nbufs &&
              (o[6] & ~(int64_t)0x1ff) == 0 && in_range(b_off, n, bufs[idx].len) &&
              rc_reduce_supported(call->dtype, call->op)))
            return 0;
        /* this rank's own source is dst itself, or apart from it */
        return idx != a || b_off == a_off || !overlap(a_off, n, b_off, n);
    }
    case RC_OP_MREDUCE: {
        int64_t k = o[6], stride = o[7];
        if (!(dst_ok && a != RC_BUF_NEXT && b_buf && whole && k >= 1 && k <= RC_MAX_RANKS &&
              stride >= 0 && rc_reduce_supported(call->dtype, call->op)))
            return 0;
        uint64_t last = b_off + (uint64_t)(k - 1) * (uint64_t)stride;
        if ((uint64_t)stride > bufs[b].len || !in_range(last, n, bufs[b].len)) return 0;
        for (int64_t j = 0; j < k; j++)
            if (a == b && overlap(a_off, n, b_off + (uint64_t)(j * stride), n)) return 0;
        return 1;
    }
    default:
        return 0;
    }
}

/* Every operation against the buffers, the segment and the sockets, and SENDs and RECVs only
 * right before their XFER: before anything moves. */
static int check_plan(const rc_seg *seg, const rc_net *net, const int64_t *ops, size_t nops,
                      const rc_buf *bufs, int nbufs, const rc_call *call, int *bad) {
    int moving = 0; /* SENDs or RECVs wait for their XFER */
    for (size_t i = 0; i < nops; i++) {
        const int64_t *o = ops + i * RC_OP_WORDS;
        int ok = op_ok(seg, net, o, bufs, nbufs, call);
        if (o[0] == RC_OP_SEND || o[0] == RC_OP_RECV)
            moving = 1;
        else if (o[0] == RC_OP_XFER)
            moving = 0;
        else if (moving)
            ok = 0;
        if (!ok || (moving && i + 1 == nops)) {
            *bad = (int)i;
            return RC_BADPLAN;
        }
    }
    return RC_OK;
}

/* The reduction in rank order of every local rank's [off, +n) of its published buffer idx,
 * this rank's being dst itself, into dst: a block at a time, the peers' blocks read across
 * processes into a scratch (tmp: nranks blocks, allocated once a run), where it stays in the
 * caches for the reduction. */
#define CMA_BLOCK (256u << 10)

static int cma_reduce(rc_seg *seg, uint8_t *tmp, uint8_t *dst, uint64_t n, uint64_t off,
                      int idx, int final, const rc_buf *own, const rc_call *call, size_t esize,
                      int *peer) {
    int w = seg->nranks;
    uint64_t block = CMA_BLOCK / esize * esize;
    const void *srcs[RC_MAX_RANKS];
    for (uint64_t at = 0; at < n; at += block) {
        uint64_t len = n - at < block ? n - at : block;
        for (int r = 0; r < w; r++) {
            uint8_t *slot = tmp + (size_t)r * block;
            if (r == seg->me) {
                const uint8_t *mine = own->ptr + off + at;
                if (mine != dst + at || r < 2) { /* dst may be the first or second source */
                    srcs[r] = mine;
                    continue;
                }
                memcpy(slot, mine, len);
            } else {
                int rc = rc_seg_cma_read(seg, r, idx, off + at, len, slot);
                if (rc) {
                    *peer = r;
                    return rc;
                }
            }
            srcs[r] = slot;
        }
        rc_reduce(call->dtype, call->op, dst + at, srcs, w, len / esize);
        if (final) rc_finalize(call->dtype, call->op, dst + at, len / esize, call->divisor, call->factor);
    }
    return RC_OK;
}

/* Whether a failure (rc, with the check's verdict in call) leaves the group usable: the
 * ranks' steps and streams are whole. A mismatch or a call out of step is found before any
 * byte of the call is read (the segment's first step compares the calls; a message's
 * header is read before its bytes, and a step that fails finishes the messages it is in the
 * middle of). A soft check failure (the caller's error says so: a peer rejected its
 * arguments) is whole on the sockets (a receiver skips the messages of a call it left; a
 * message left mid-way is cut, and a cut breaks) and on the segment only in the call's
 * first step: a rank that leaves later would leave its peers waiting on a step its next
 * call would publish. */
static int soft_failure(int rc, const rc_call *call, int seg_begun) {
    if (call->cut) return 0;
    if (rc == RC_MISMATCH || rc == RC_SEQ) return 1;
    if (rc == RC_CHECK) return !seg_begun && call->check_rc == RC_CHECK_SOFT;
    return 0;
}

/* A failed run's clean-up, in C whatever the caller does next (see core.h). Runs after the
 * plan was checked: every failure here comes after the call's first publish. */
static int fail(rc_seg *seg, rc_net *net, int rc, rc_call *call, int seg_begun) {
    if (soft_failure(rc, call, seg_begun)) return rc;
    call->broke = 1;
    if (seg != NULL) rc_seg_abort(seg, RC_ABORT_FAILED);
    if (net != NULL) call->cut += rc_net_shut(net);
    return rc;
}

int rc_exec(rc_seg *seg, rc_net *net, const int64_t *ops, size_t nops, const rc_buf *bufs,
            int nbufs, rc_call *call, int *peer) {
    call->broke = 0;
    call->cut = 0;
    call->check_rc = 0;
    int rc = check_plan(seg, net, ops, nops, bufs, nbufs, call, peer);
    if (rc) return rc;
    if (call->fp_len > RC_FP_BYTES) {
        *peer = -1;
        return RC_BADPLAN;
    }
    size_t esize = rc_dtype_size(call->dtype);
    const void *srcs[RC_MAX_RANKS];
    uint8_t *scratch = NULL; /* cma_reduce's blocks, on its first use */
    size_t moving_from = 0; /* the first SEND / RECV of the coming XFER */
    int moved = 0;          /* an XFER ran: a step cannot stand in for another call now */
    int seg_begun = 0;      /* the call is past its first step on the segment */
    for (size_t i = 0; i < nops; i++) {
        const int64_t *o = ops + i * RC_OP_WORDS;
        int64_t a = o[1];
        uint64_t a_off = (uint64_t)o[2], n = (uint64_t)o[3], b_off = (uint64_t)o[5];
        uint32_t cur = seg != NULL ? seg->step : 0;
        uint8_t *dst = NULL; /* buffer a's range: only for the operations that write it */
        switch (o[0]) {
        case RC_OP_COPY:
        case RC_OP_REDUCE:
        case RC_OP_LOCAL:
        case RC_OP_FINAL:
        case RC_OP_RED2:
        case RC_OP_MREDUCE:
        case RC_OP_CREAD:
        case RC_OP_CREDUCE:
            dst = a == RC_BUF_NEXT ? rc_seg_half(seg, seg->me, (int)((cur + 1u) & 1u)) + a_off
                                   : bufs[a].ptr + a_off;
            break;
        default:
            break;
        }
        switch (o[0]) {
        case RC_OP_WRITE:
            memcpy(rc_seg_half(seg, seg->me, (int)((cur + 1u) & 1u)) + b_off, bufs[a].ptr + a_off, n);
            break;
        case RC_OP_SYNC:
            rc = rc_seg_sync(seg, (int)o[6], call, bufs, nbufs, peer);
            if (rc == RC_RETRY) {
                if (moved) {  /* its messages are gone: the call fails, its step taken */
                    *peer = -1;
                    rc = RC_SEQ;
                    goto out;
                }
                i = (size_t)-1; /* this step stood in for an earlier call: again */
                continue;
            }
            if (rc) goto out;
            seg_begun = 1;
            break;
        case RC_OP_COPY:
            memcpy(dst, rc_seg_half(seg, (int)o[4], (int)(cur & 1u)) + b_off, n);
            break;
        case RC_OP_REDUCE:
            for (int r = 0; r < seg->nranks; r++) srcs[r] = rc_seg_half(seg, r, (int)(cur & 1u)) + b_off;
            rc_reduce(call->dtype, call->op, dst, srcs, seg->nranks, n / esize);
            if (o[6] & RC_FLAG_FINAL)
                rc_finalize(call->dtype, call->op, dst, n / esize, call->divisor, call->factor);
            break;
        case RC_OP_LOCAL:
            memmove(dst, bufs[o[4]].ptr + b_off, n);
            break;
        case RC_OP_FINAL:
            rc_finalize(call->dtype, call->op, dst, n / esize, call->divisor, call->factor);
            break;
        case RC_OP_SEND:
        case RC_OP_RECV:
            if (i == 0 || (ops[(i - 1) * RC_OP_WORDS] != RC_OP_SEND &&
                           ops[(i - 1) * RC_OP_WORDS] != RC_OP_RECV))
                moving_from = i;
            break;
        case RC_OP_XFER:
            rc = rc_net_xfer(net, ops + moving_from * RC_OP_WORDS, i - moving_from, bufs,
                             (uint32_t)o[7], call, peer);
            moved = 1;
            moving_from = i + 1;
            if (rc) goto out;
            break;
        case RC_OP_RED2:
            srcs[0] = dst;
            srcs[1] = bufs[o[4]].ptr + b_off;
            rc_reduce(call->dtype, call->op, dst, srcs, 2, n / esize);
            break;
        case RC_OP_MREDUCE:
            for (int64_t j = 0; j < o[6]; j++) srcs[j] = bufs[o[4]].ptr + b_off + (uint64_t)(j * o[7]);
            rc_reduce(call->dtype, call->op, dst, srcs, (int)o[6], n / esize);
            break;
        case RC_OP_CREAD:
            rc = rc_seg_cma_read(seg, (int)o[4], (int)o[6], b_off, n, dst);
            if (rc) {
                *peer = (int)o[4];
                goto out;
            }
            break;
        case RC_OP_CREDUCE:
            if (scratch == NULL) {
                scratch = (uint8_t *)malloc((size_t)seg->nranks * (CMA_BLOCK / esize * esize));
                if (scratch == NULL) {
                    *peer = -1;
                    call->io_errno = ENOMEM;
                    rc = RC_IOERR;
                    goto out;
                }
            }
            rc = cma_reduce(seg, scratch, dst, n, b_off, (int)(o[6] & 0xff),
                            (o[6] & RC_CFLAG_FINAL) != 0, &bufs[o[6] & 0xff], call, esize, peer);
            if (rc) goto out;
            break;
        }
    }
    rc = RC_OK;
out:
    free(scratch);
    return rc == RC_OK ? RC_OK : fail(seg, net, rc, call, seg_begun);
}
