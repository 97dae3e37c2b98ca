/* A step's messages over the group's sockets (see net.h for the protocol). Plain C. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "net.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0 /* (Python ignores SIGPIPE) */
#endif

_Static_assert(sizeof(rc_msg) == 32, "a message header is 32 bytes");
_Static_assert(sizeof(rc_end) == 24, "a message trailer is 24 bytes");
_Static_assert(sizeof(rc_conn) == RC_CONN_BYTES, "rc_conn is RC_CONN_BYTES");

#define HEADER ((uint64_t)sizeof(rc_msg))
#define TRAILER ((uint64_t)sizeof(rc_end))
#define MAX_IOV 64
/* The most a message may say it carries (a garbled header says more). */
#define MAX_MESSAGE (1ull << 48)

/* Where a message stands. */
enum { M_IDLE, M_HEADER, M_DATA, M_SKIP, M_DROP, M_DONE };

/* The trailer of the message whose header is h. */
static rc_end end_of(const rc_msg *h) {
    rc_end e;
    e.magic = RC_END_MAGIC;
    e.step = h->step;
    e.call_seq = h->call_seq;
    e.nbytes = h->nbytes;
    return e;
}

/* One message of the step: consecutive SENDs to (or RECVs from) one peer. */
typedef struct {
    int peer;
    int send;
    size_t first;     /* its first operation */
    size_t nparts;    /* its operations */
    uint64_t total;   /* its bytes */
    uint64_t done;    /* bytes moved: for a send, of header, data and trailer; for a
                         receive, of the state it is in (header bytes, data and trailer
                         bytes, bytes dropped) */
    uint64_t left;    /* M_SKIP / M_DROP: bytes still to drop */
    int state;
    rc_msg hdr;
    rc_end end;       /* a send's trailer; a receive's, as read */
} xmsg;

typedef struct {
    rc_net *net;
    const int64_t *ops;
    const rc_buf *bufs;
    rc_call *call;
    uint32_t step;
    xmsg *msgs;
    size_t nmsgs;
    int *busy;        /* per peer slot and direction: the message in progress (or -1) */
    int failed;       /* the first failure (RC_*), then only messages in progress go on */
    int failed_peer;
} xfer;

static int io_failure(rc_call *call, int err) {
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) return RC_PEER_CLOSED;
    call->io_errno = err;
    return RC_IOERR;
}

/* The iovec of a message's data and trailer from byte skip on (skip counts data bytes, then
 * trailer bytes), after the n entries iov holds already: at most MAX_IOV + 1 in all. */
static int data_iov(const xfer *x, xmsg *m, uint64_t skip, struct iovec *iov, int n) {
    size_t k = 0;
    for (; k < m->nparts && n < MAX_IOV; k++) {
        const int64_t *o = x->ops + (m->first + k) * RC_OP_WORDS;
        uint64_t len = (uint64_t)o[3];
        if (skip >= len) {
            skip -= len;
            continue;
        }
        iov[n].iov_base = x->bufs[o[1]].ptr + o[2] + skip;
        iov[n].iov_len = (size_t)(len - skip);
        n++;
        skip = 0;
    }
    if (k == m->nparts && skip < TRAILER) { /* every data byte is in: the trailer follows */
        iov[n].iov_base = (uint8_t *)&m->end + skip;
        iov[n].iov_len = (size_t)(TRAILER - skip);
        n++;
    }
    return n;
}

/* Send what the socket takes now. */
static int push(xfer *x, xmsg *m, int *progress) {
    int fd = (int)x->net->out_fd[m->peer];
    while (m->done < HEADER + m->total + TRAILER) {
        struct iovec iov[MAX_IOV + 2];
        int n = 0;
        uint64_t skip = m->done;
        if (skip < HEADER) {
            iov[n].iov_base = (uint8_t *)&m->hdr + skip;
            iov[n].iov_len = (size_t)(HEADER - skip);
            n++;
            skip = 0;
        } else {
            skip -= HEADER;
        }
        n = data_iov(x, m, skip, iov, n);
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)n;
        ssize_t k = sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RC_OK;
            if (errno == EINTR) continue;
            return io_failure(x->call, errno);
        }
        m->done += (uint64_t)k;
        *progress = 1;
    }
    m->state = M_DONE;
    x->net->conns[m->peer].sent += m->total;
    x->net->conns[m->peer].msgs_sent++;
    return RC_OK;
}

/* recv what has come, at most n bytes, into p: > 0 bytes, 0 nothing yet, < 0 a failure. */
static int take(xfer *x, int fd, void *p, size_t n, ssize_t *got) {
    for (;;) {
        ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            *got = k;
            return RC_OK;
        }
        if (k == 0) return RC_PEER_CLOSED;
        if (errno == EINTR) continue;
        *got = 0;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return RC_OK;
        return io_failure(x->call, errno);
    }
}

/* Read what has come of a message. */
static int pull(xfer *x, xmsg *m, int *progress) {
    rc_net *net = x->net;
    int fd = (int)net->in_fd[m->peer];
    uint8_t drop[16384];
    for (;;) {
        ssize_t got = 0;
        int rc;
        switch (m->state) {
        case M_IDLE:
            m->state = M_HEADER;
            m->done = 0;
            if (net->conns[m->peer].held) { /* read ahead by an earlier call */
                m->hdr = net->conns[m->peer].msg;
                net->conns[m->peer].held = 0;
                m->done = HEADER;
            }
            break;
        case M_HEADER: {
            const uint8_t *b = (const uint8_t *)&m->hdr;
            while (m->done < HEADER) {
                rc = take(x, fd, (uint8_t *)&m->hdr + m->done, (size_t)(HEADER - m->done), &got);
                if (rc == RC_PEER_CLOSED && m->done >= 2 && b[0] == RC_FOREIGN_0 &&
                    b[1] == RC_FOREIGN_1)
                    return RC_FOREIGN; /* a goodbye (shorter than a header), then the end */
                if (rc) return rc;
                if (got == 0) return RC_OK;
                m->done += (uint64_t)got;
                *progress = 1;
                if (m->done >= 2 && b[0] == RC_FOREIGN_0 && b[1] == RC_FOREIGN_1) {
                    m->state = M_DONE; /* the peer left: its stream ends here */
                    return RC_FOREIGN;
                }
            }
            if (m->hdr.magic != RC_MSG_MAGIC || m->hdr.nbytes > MAX_MESSAGE) return RC_GARBLED;
            m->done = 0;
            if (m->hdr.call_seq < x->call->call_seq) { /* an earlier call's: skipped */
                m->state = M_SKIP;
                m->left = m->hdr.nbytes + TRAILER;
            } else if (m->hdr.call_seq > x->call->call_seq) { /* a later call's: kept */
                net->conns[m->peer].msg = m->hdr;
                net->conns[m->peer].held = 1;
                m->state = M_DONE;
                return RC_SEQ;
            } else if (m->hdr.step != x->step || m->hdr.fp != x->call->fp_hash ||
                       m->hdr.nbytes != m->total) {
                m->state = M_DROP;
                m->left = m->hdr.nbytes + TRAILER;
            } else {
                m->state = M_DATA;
            }
            break;
        }
        case M_SKIP:
        case M_DROP:
            while (m->left) {
                size_t n = m->left < sizeof drop ? (size_t)m->left : sizeof drop;
                rc = take(x, fd, drop, n, &got);
                if (rc) return rc;
                if (got == 0) return RC_OK;
                m->left -= (uint64_t)got;
                *progress = 1;
            }
            if (m->state == M_DROP) {
                m->state = M_DONE;
                return RC_MISMATCH;
            }
            m->state = M_HEADER; /* the next message of the peer */
            m->done = 0;
            break;
        case M_DATA:
            while (m->done < m->total + TRAILER) {
                struct iovec iov[MAX_IOV + 1];
                int n = data_iov(x, m, m->done, iov, 0);
                struct msghdr mh;
                memset(&mh, 0, sizeof mh);
                mh.msg_iov = iov;
                mh.msg_iovlen = (size_t)n;
                ssize_t k = recvmsg(fd, &mh, MSG_DONTWAIT);
                if (k == 0) return RC_PEER_CLOSED;
                if (k < 0) {
                    if (errno == EINTR) continue;
                    if (errno == EAGAIN || errno == EWOULDBLOCK) return RC_OK;
                    return io_failure(x->call, errno);
                }
                m->done += (uint64_t)k;
                *progress = 1;
            }
            m->state = M_DONE;
            {
                rc_end want = end_of(&m->hdr);
                if (memcmp(&want, &m->end, sizeof want) != 0) return RC_GARBLED;
            }
            net->conns[m->peer].received += m->total;
            net->conns[m->peer].msgs_received++;
            return RC_OK;
        default:
            return RC_OK;
        }
    }
}

/* Whether a message is one a failed step still finishes: one it is in the middle of. */
static int in_progress(const xmsg *m) {
    if (m->send) return m->state != M_DONE && m->done > 0;
    return m->state == M_DATA || m->state == M_SKIP || m->state == M_DROP ||
           (m->state == M_HEADER && m->done > 0);
}

/* One pass over the messages: move what can move. *left: messages still to move. */
static int pass(xfer *x, int *progress, size_t *left) {
    int *busy = x->busy;
    for (int i = 0; i < 2 * x->net->npeers; i++) busy[i] = -1;
    *left = 0;
    for (size_t i = 0; i < x->nmsgs; i++) {
        xmsg *m = &x->msgs[i];
        if (m->state == M_DONE) continue;
        int *slot = &busy[2 * m->peer + (m->send ? 0 : 1)];
        if (*slot >= 0) { /* an earlier message to or from this peer goes first */
            (*left)++;
            continue;
        }
        *slot = (int)i;
        if (x->failed && !in_progress(m)) continue; /* failed: start nothing new */
        int rc = m->send ? push(x, m, progress) : pull(x, m, progress);
        if (rc) {
            if (!x->failed) {
                x->failed = rc;
                x->failed_peer = m->peer;
            }
            if (rc != RC_MISMATCH && rc != RC_SEQ) return rc; /* the stream is gone */
            continue;
        }
        if (m->state != M_DONE) (*left)++;
    }
    return RC_OK;
}

/* Wait until a socket with a message in progress is ready, or the caller's check is due. */
static int wait_ready(xfer *x, rc_waiter *w, struct pollfd *pfds, int *pending) {
    int n = 0;
    for (size_t i = 0; i < x->nmsgs; i++) {
        xmsg *m = &x->msgs[i];
        if (m->state == M_DONE || (x->failed && !in_progress(m))) continue;
        pfds[n].fd = (int)(m->send ? x->net->out_fd[m->peer] : x->net->in_fd[m->peer]);
        pfds[n].events = m->send ? POLLOUT : POLLIN;
        pfds[n].revents = 0;
        pending[n] = m->peer;
        n++;
    }
    if (n == 0) return RC_OK;
    int rc = rc_waiter_check(w, x->call, pending, n);
    if (rc) return rc;
    uint64_t now = rc_now_ns();
    uint64_t wait_ns = w->check_at > now ? w->check_at - now : 0;
    int ms = (int)(wait_ns / 1000000ull) + 1;
    if (poll(pfds, (nfds_t)n, ms) < 0 && errno != EINTR) return io_failure(x->call, errno);
    return RC_OK;
}

/* Group the step's operations into messages, fill the headers of the ones it sends. */
static size_t messages(xfer *x, size_t nops) {
    size_t n = 0;
    for (size_t i = 0; i < nops; i++) {
        const int64_t *o = x->ops + i * RC_OP_WORDS;
        int send = o[0] == RC_OP_SEND;
        xmsg *last = n ? &x->msgs[n - 1] : NULL;
        if (last != NULL && last->send == send && last->peer == (int)o[4] &&
            last->first + last->nparts == i) {
            last->nparts++;
            last->total += (uint64_t)o[3];
            continue;
        }
        xmsg *m = &x->msgs[n++];
        memset(m, 0, sizeof *m);
        m->peer = (int)o[4];
        m->send = send;
        m->first = i;
        m->nparts = 1;
        m->total = (uint64_t)o[3];
        m->state = send ? M_HEADER : M_IDLE;
    }
    for (size_t i = 0; i < n; i++) {
        xmsg *m = &x->msgs[i];
        if (!m->send) continue;
        m->hdr.magic = RC_MSG_MAGIC;
        m->hdr.step = x->step;
        m->hdr.call_seq = x->call->call_seq;
        m->hdr.fp = x->call->fp_hash;
        m->hdr.nbytes = m->total;
        m->end = end_of(&m->hdr);
    }
    return n;
}

/* A wait's spin ran out: count it on the first unfinished message's peer (rc_conn). */
static void note_spin_fail(xfer *x) {
    for (size_t i = 0; i < x->nmsgs; i++) {
        if (x->msgs[i].state != M_DONE) {
            x->net->conns[x->msgs[i].peer].spin_fails++;
            return;
        }
    }
}

int rc_net_xfer(rc_net *net, const int64_t *ops, size_t nops, const rc_buf *bufs,
                uint32_t step, rc_call *call, int *peer) {
    if (nops == 0) return RC_OK;
    xfer x;
    memset(&x, 0, sizeof x);
    x.net = net;
    x.ops = ops;
    x.bufs = bufs;
    x.call = call;
    x.step = step;
    x.failed_peer = -1;
    size_t room = nops + (size_t)(2 * net->npeers);
    x.msgs = (xmsg *)malloc(nops * sizeof(xmsg));
    x.busy = (int *)malloc((size_t)(2 * net->npeers + 1) * sizeof(int));
    struct pollfd *pfds = (struct pollfd *)malloc(room * sizeof(struct pollfd));
    int *pending = (int *)malloc(room * sizeof(int));
    int rc = RC_OK;
    if (x.msgs == NULL || x.busy == NULL || pfds == NULL || pending == NULL) {
        rc = io_failure(call, ENOMEM);
        goto out;
    }
    x.nmsgs = messages(&x, nops);
    rc_waiter w;
    rc_waiter_start(&w, call);
    uint64_t spin_until = w.start + call->wait.spin_ns;
    int spun_out = 0;
    for (;;) {
        int progress = 0;
        size_t left = 0;
        rc = pass(&x, &progress, &left);
        if (rc) {
            *peer = x.failed_peer;
            goto out;
        }
        if (left == 0) break;
        if (progress) continue;
        if (rc_now_ns() < spin_until) {
            rc_cpu_relax();
            continue;
        }
        if (call->wait.spin_ns && !spun_out) {
            spun_out = 1;
            note_spin_fail(&x);
        }
        rc = wait_ready(&x, &w, pfds, pending);
        if (rc) {
            *peer = -1;
            goto out;
        }
    }
    rc = x.failed;
    *peer = x.failed_peer;
out:
    if (rc != RC_OK && x.msgs != NULL) {
        /* a message left mid-way: its connection lost its framing, shut it */
        for (size_t i = 0; i < x.nmsgs; i++) {
            xmsg *m = &x.msgs[i];
            if (m->state == M_DONE || !in_progress(m)) continue;
            rc_conn *c = &net->conns[m->peer];
            uint32_t *cut = m->send ? &c->out_cut : &c->in_cut;
            if (!*cut) {
                shutdown((int)(m->send ? net->out_fd[m->peer] : net->in_fd[m->peer]), SHUT_RDWR);
                *cut = 1;
                call->cut++;
            }
        }
    }
    free(x.msgs);
    free(x.busy);
    free(pfds);
    free(pending);
    return rc;
}

int rc_net_shut(rc_net *net) {
    int shut = 0;
    for (int p = 0; p < net->npeers; p++) {
        rc_conn *c = &net->conns[p];
        if (net->out_fd[p] >= 0 && !c->out_cut) {
            shutdown((int)net->out_fd[p], SHUT_RDWR);
            c->out_cut = 1;
            shut++;
        }
        if (net->in_fd[p] >= 0 && !c->in_cut) {
            shutdown((int)net->in_fd[p], SHUT_RDWR);
            c->in_cut = 1;
            shut++;
        }
    }
    return shut;
}
