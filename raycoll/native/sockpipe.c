/* Socket pipes: point-to-point messages across nodes (see sockpipe.h). Plain C. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "sockpipe.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/sockios.h>
#endif

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0 /* (Python ignores SIGPIPE) */
#endif

_Static_assert(sizeof(rc_pipe_msg) == RC_PIPE_MSG_BYTES, "a message header is 128 bytes");
_Static_assert(sizeof(rc_sock_reply) == 16, "a reply is 16 bytes");

/* The most a message may say it carries (a garbled header says more). */
#define MAX_MESSAGE (1ull << 48)
/* A tick where the caller gave none (the rest of an eager send taken in part). */
#define DEFAULT_TICK_NS 10000000ull

static int dup_fd(int fd, int *out) {
    *out = -1;
    if (fd < 0) return 0;
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) return errno;
    *out = d;
    return 0;
}

int rc_sock_open(rc_sock *s, int out_fd, int in_fd) {
    memset(s, 0, sizeof *s);
    s->out_fd = s->in_fd = -1;
    int err = dup_fd(out_fd, &s->out_fd);
    if (err == 0) err = dup_fd(in_fd, &s->in_fd);
    if (err != 0) rc_sock_close(s);
    return err;
}

int rc_sock_attach_in(rc_sock *s, int in_fd) {
    if (s->in_fd >= 0) return EBUSY;
    return dup_fd(in_fd, &s->in_fd);
}

void rc_sock_close(rc_sock *s) {
    if (s->out_fd >= 0) close(s->out_fd);
    if (s->in_fd >= 0) close(s->in_fd);
    s->out_fd = s->in_fd = -1;
}

static int io_failure(rc_call *call, int err) {
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) return RC_PEER_CLOSED;
    call->io_errno = err;
    return RC_IOERR;
}

/* One wait of an I/O call that would block on fd (events: POLLIN or POLLOUT). While *spin_end
 * is ahead it returns at once (the caller retries: a spin); then it sleeps in poll() up to a
 * tick, or until the caller's check is due. RC_OK: try again; RC_CLOSED: close() was called;
 * RC_CHECK: the check failed. */
static int wait_fd(rc_sock *s, int fd, short events, rc_call *call, rc_waiter *w,
                   uint64_t spin_end, int *spun) {
    if (s->closing) return RC_CLOSED;
    uint64_t now = rc_now_ns();
    if (now < spin_end) {
        rc_cpu_relax();
        *spun = 1;
        return RC_OK;
    }
    if (*spun == 1) { /* the spin ran its whole length */
        s->spin_fails++;
        *spun = 2;
    }
    int rc = rc_waiter_check(w, call, NULL, 0);
    if (rc) return rc;
    uint64_t tick = call->wait.tick_ns ? call->wait.tick_ns : DEFAULT_TICK_NS;
    uint64_t until = w->check_at < now + tick ? w->check_at : now + tick;
    int ms = until > now ? (int)((until - now + 999999) / 1000000) : 0;
    struct pollfd p = {fd, events, 0};
    if (poll(&p, 1, ms) < 0 && errno != EINTR) return io_failure(call, errno);
    return s->closing ? RC_CLOSED : RC_OK;
}

/* Move n bytes (iov, niov entries, consumed as it goes) on fd: writing or reading. *moved:
 * bytes moved. may_wait 0: returns RC_PIPE_AGAIN at the first would-block. */
static int move(rc_sock *s, int fd, int writing, struct iovec *iov, int niov, uint64_t *moved,
                int may_wait, rc_call *call, rc_waiter *w, uint64_t spin_end) {
    int spun = 0;
    *moved = 0;
    while (niov > 0) {
        if (iov->iov_len == 0) {
            iov++;
            niov--;
            continue;
        }
        ssize_t k;
        if (writing) {
            struct msghdr mh;
            memset(&mh, 0, sizeof mh);
            mh.msg_iov = iov;
            mh.msg_iovlen = (size_t)niov;
            k = sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        } else {
            k = recv(fd, iov->iov_base, iov->iov_len, MSG_DONTWAIT);
            if (k == 0) return RC_PEER_CLOSED;
        }
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return io_failure(call, errno);
            if (!may_wait) return RC_PIPE_AGAIN;
            int rc = wait_fd(s, fd, writing ? POLLOUT : POLLIN, call, w, spin_end, &spun);
            if (rc != RC_OK) return rc;
            continue;
        }
        *moved += (uint64_t)k;
        size_t left = (size_t)k; /* consume k bytes of the iovec: bounded by its lengths */
        while (left > 0 && niov > 0) {
            size_t part = left < iov->iov_len ? left : iov->iov_len;
            iov->iov_base = (uint8_t *)iov->iov_base + part;
            iov->iov_len -= part;
            left -= part;
            if (iov->iov_len == 0) {
                iov++;
                niov--;
            }
        }
    }
    return RC_OK;
}

/* A message left mid-way on a connection: shut it (its framing is lost). */
static void cut(int fd, int *broken, rc_call *call) {
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
    *broken = 1;
    call->broke = 1;
}

/* Whether the kernel's send buffer has room for n more bytes with a margin. */
static int room_for(int fd, uint64_t n) {
#ifdef SIOCOUTQ
    int queued = 0, sndbuf = 0;
    socklen_t len = sizeof sndbuf;
    if (ioctl(fd, SIOCOUTQ, &queued) != 0) return 0;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) != 0) return 0;
    return (uint64_t)queued + 2 * n + 4096 <= (uint64_t)sndbuf;
#else
    (void)fd;
    return n <= 4096;
#endif
}

int rc_sock_send(rc_sock *s, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                 const uint8_t *data, uint64_t n, int may_wait, int ack, rc_call *call) {
    if (s->closing) return RC_CLOSED;
    if (s->out_fd < 0 || s->out_broken) return RC_PEER_CLOSED;
    if (meta_len > RC_PIPE_META_BYTES) return RC_BADPLAN;
    if (!may_wait && (ack || !room_for(s->out_fd, RC_PIPE_MSG_BYTES + n))) return RC_PIPE_AGAIN;
    rc_pipe_msg h;
    memset(&h, 0, sizeof h);
    h.magic = RC_SOCK_MSG_MAGIC;
    h.meta_len = meta_len;
    h.tag = tag;
    h.nbytes = n;
    h.number = s->sent + 1;
    h.flags = ack ? RC_SOCK_ACK : 0;
    memcpy(h.meta, meta, meta_len); /* bounded: meta_len <= RC_PIPE_META_BYTES, checked */
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)data, (size_t)n}};
    rc_waiter w;
    rc_waiter_start(&w, call);
    uint64_t spin_end = w.start + call->wait.spin_ns, moved = 0;
    int rc = move(s, s->out_fd, 1, iov, 2, &moved, may_wait, call, &w, spin_end);
    if (rc == RC_PIPE_AGAIN && moved > 0) /* taken in part: the rest now, waiting */
        rc = move(s, s->out_fd, 1, iov, 2, &moved, 1, call, &w, 0);
    if (rc == RC_PIPE_AGAIN) return rc; /* nothing written */
    if (rc != RC_OK) {
        if (moved > 0 || rc == RC_PEER_CLOSED || rc == RC_IOERR)
            cut(s->out_fd, &s->out_broken, call);
        return rc;
    }
    s->sent = h.number;
    if (!ack) return RC_OK;
    rc_sock_reply r;
    struct iovec riov = {&r, sizeof r};
    rc = move(s, s->out_fd, 0, &riov, 1, &moved, 1, call, &w, spin_end);
    if (rc == RC_OK && r.magic != RC_SOCK_REPLY_MAGIC)
        rc = (((const uint8_t *)&r)[0] == 'R' && ((const uint8_t *)&r)[1] == 'C') ? RC_FOREIGN
                                                                               : RC_GARBLED;
    if (rc == RC_OK && r.number != h.number) rc = RC_GARBLED;
    if (rc != RC_OK) { /* the answer stream is lost with it */
        cut(s->out_fd, &s->out_broken, call);
        return rc;
    }
    return r.kind == RC_SOCK_REJECTED ? RC_MISMATCH : RC_OK;
}

int rc_sock_peek(rc_sock *s, int may_wait, rc_call *call, rc_pipe_msg *msg) {
    if (s->closing) return RC_CLOSED;
    if (s->have_cur) {
        *msg = s->cur;
        return RC_OK;
    }
    if (s->in_fd < 0 || s->in_broken) return s->in_fd < 0 ? RC_PIPE_AGAIN : RC_PEER_CLOSED;
    rc_waiter w;
    rc_waiter_start(&w, call);
    /* bounded: hgot < RC_PIPE_MSG_BYTES here, the iovec covers the rest of hbuf only */
    struct iovec iov = {s->hbuf + s->hgot, RC_PIPE_MSG_BYTES - s->hgot};
    uint64_t moved = 0;
    int rc = move(s, s->in_fd, 0, &iov, 1, &moved, may_wait, call, &w,
                  w.start + call->wait.spin_ns);
    s->hgot += (uint32_t)moved;
    if (rc == RC_PIPE_AGAIN) return rc;
    if (rc != RC_OK) {
        if (s->hgot > 0 || rc != RC_PEER_CLOSED) cut(s->in_fd, &s->in_broken, call);
        if (rc == RC_PEER_CLOSED) s->in_broken = 1;
        if (rc == RC_PEER_CLOSED && s->hgot >= 2 && s->hbuf[0] == 'R' && s->hbuf[1] == 'C')
            rc = RC_FOREIGN; /* a goodbye frame shorter than a header, then the end */
        return rc;
    }
    s->hgot = 0;
    rc_pipe_msg h;
    memcpy(&h, s->hbuf, sizeof h);
    if (h.magic != RC_SOCK_MSG_MAGIC || h.meta_len > RC_PIPE_META_BYTES ||
        h.nbytes > MAX_MESSAGE) {
        int foreign = s->hbuf[0] == 'R' && s->hbuf[1] == 'C';
        cut(s->in_fd, &s->in_broken, call);
        return foreign ? RC_FOREIGN : RC_GARBLED;
    }
    s->cur = h;
    s->have_cur = 1;
    *msg = h;
    return RC_OK;
}

int rc_sock_take(rc_sock *s, uint8_t *dst, uint64_t n, int reject, rc_call *call) {
    if (s->closing) return RC_CLOSED;
    if (!s->have_cur || s->in_broken) return s->have_cur ? RC_PEER_CLOSED : RC_BADPLAN;
    if (dst != NULL && n != s->cur.nbytes) return RC_BADPLAN; /* bounds: exactly the message */
    rc_waiter w;
    rc_waiter_start(&w, call);
    uint64_t spin_end = w.start + call->wait.spin_ns, left = s->cur.nbytes, moved = 0;
    int rc = RC_OK;
    if (dst != NULL) {
        struct iovec iov = {dst, (size_t)n};
        rc = move(s, s->in_fd, 0, &iov, 1, &moved, 1, call, &w, spin_end);
        left -= moved;
    } else {
        uint8_t scratch[16384];
        while (rc == RC_OK && left > 0) { /* skipped: read into scratch, at most its size */
            struct iovec iov = {scratch, left < sizeof scratch ? (size_t)left : sizeof scratch};
            rc = move(s, s->in_fd, 0, &iov, 1, &moved, 1, call, &w, spin_end);
            left -= moved;
        }
    }
    if (rc != RC_OK) {
        if (left > 0) cut(s->in_fd, &s->in_broken, call);
        return rc;
    }
    s->have_cur = 0;
    if (s->cur.flags & RC_SOCK_ACK) {
        rc_sock_reply r = {RC_SOCK_REPLY_MAGIC, reject ? RC_SOCK_REJECTED : RC_SOCK_TAKEN,
                           s->cur.number};
        struct iovec riov = {&r, sizeof r};
        rc = move(s, s->in_fd, 1, &riov, 1, &moved, 1, call, &w, spin_end);
        if (rc != RC_OK) cut(s->in_fd, &s->in_broken, call);
    }
    return rc;
}
