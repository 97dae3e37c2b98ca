/* The pair pipes: making and mapping one, sending, peeking and taking messages, and the
 * waits (see pipe.h for the layout and the protocol). Plain C: no Python. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "futex.h"
#include "pipe.h"

#include "cma.h"
#include "segment.h" /* RC_ABORT_*, rc_pid_gone */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

_Static_assert(sizeof(rc_pipe_header) == 128, "rc_pipe_header is one 128-byte block");
_Static_assert(sizeof(rc_pipe_side) == 128, "rc_pipe_side is 128 bytes");
_Static_assert(sizeof(rc_pipe_ring) == 192, "rc_pipe_ring is three lines");
_Static_assert(sizeof(rc_pipe_msg) == RC_PIPE_MSG_BYTES, "a message header is 128 bytes");
_Static_assert(128 + 2 * 128 + 2 * 192 <= RC_PIPE_DATA_OFF, "the control fits before the rings");

#define SIDES_OFF 128u
#define RINGS_OFF (128u + 2u * 128u)

/* ------------------------------------------- atomics (sleeping and waking: futex.h) */
static inline uint64_t load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Whether counter value v has reached target (u64 positions: compared by difference). */
static inline int at_least(uint64_t v, uint64_t target) { return (int64_t)(v - target) >= 0; }

/* Store a position (release), bump its futex word, wake its sleepers. */
static void publish(uint64_t *word, uint64_t value, uint32_t *futex, const uint32_t *waiters) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    __atomic_add_fetch(futex, 1u, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(waiters, __ATOMIC_SEQ_CST) != 0) rc_wake_all(futex);
}

static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

static uint8_t *ring_data(const rc_pipe *p, int dir) {
    return p->base + RC_PIPE_DATA_OFF + (uint64_t)dir * p->ring;
}

/* ---------------------------------------------------------------- making and mapping */
size_t rc_pipe_total_bytes(uint64_t ring_bytes) {
    return (size_t)(RC_PIPE_DATA_OFF + 2u * ring_bytes);
}

static void set_view(rc_pipe *p, uint8_t *base, size_t len, int side, uint64_t ring) {
    p->base = base;
    p->len = len;
    p->hdr = (rc_pipe_header *)base;
    p->sides = (rc_pipe_side *)(base + SIDES_OFF);
    p->rings = (rc_pipe_ring *)(base + RINGS_OFF);
    p->ring = ring;
    p->me = side;
    p->closing = 0;
    p->have_cur = 0;
}

/* This side's line, then the count; the second side to map unlinks the name. */
static void mark_mapped(rc_pipe *p) {
    rc_pipe_side *mine = &p->sides[p->me];
    mine->pid = (int32_t)getpid();
    __atomic_store_n(&mine->mapped, 1u, __ATOMIC_RELEASE);
    if (__atomic_add_fetch(&p->hdr->attached, 1u, __ATOMIC_SEQ_CST) >= 2u) shm_unlink(p->name);
}

static int create(rc_pipe *p, int fd, uint64_t ring, size_t total, char *err, size_t errlen) {
    int rc = 0;
    if (ftruncate(fd, (off_t)total) != 0) {
        rc = errno;
        snprintf(err, errlen, "ftruncate(%s, %zu) failed: %s", p->name, total, strerror(rc));
        return rc;
    }
#ifdef __linux__
    rc = posix_fallocate(fd, 0, (off_t)total); /* no room: ENOSPC now, not SIGBUS later */
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
        snprintf(err, errlen, "reserving %zu bytes of shared memory for %s failed: %s", total,
                 p->name, strerror(rc));
        return rc;
    }
#endif
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        rc = errno;
        snprintf(err, errlen, "mmap(%s, %zu) failed: %s", p->name, total, strerror(rc));
        return rc;
    }
    set_view(p, (uint8_t *)base, total, p->me, ring);
    memset(base, 0, RC_PIPE_DATA_OFF);
    p->hdr->version = RC_PIPE_VERSION;
    p->hdr->ring_bytes = ring;
    p->hdr->total_bytes = total;
    p->created = 1;
    __atomic_store_n(&p->hdr->magic, RC_PIPE_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* Map the peer's pipe: 0, EAGAIN (not ready yet: its header is not written), or an errno. */
static int attach(rc_pipe *p, uint64_t ring, size_t total, char *err, size_t errlen) {
    int fd = shm_open(p->name, O_RDWR, 0);
    if (fd < 0) return errno == ENOENT ? ENOENT : errno;
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != total) {
        int bad = st.st_size != 0 && (size_t)st.st_size != total;
        close(fd);
        if (bad) {
            snprintf(err, errlen, "pipe %s has %lld bytes, expected %zu", p->name,
                     (long long)st.st_size, total);
            return EINVAL;
        }
        return EAGAIN; /* the creator has not sized it yet */
    }
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int rc = base == MAP_FAILED ? errno : 0;
    close(fd);
    if (rc) {
        snprintf(err, errlen, "mmap(%s, %zu) failed: %s", p->name, total, strerror(rc));
        return rc;
    }
    rc_pipe_header *hdr = (rc_pipe_header *)base;
    if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != RC_PIPE_MAGIC) {
        munmap(base, total);
        return EAGAIN;
    }
    if (hdr->version != RC_PIPE_VERSION || hdr->ring_bytes != ring) {
        snprintf(err, errlen, "pipe %s is not a raycoll pipe of %llu-byte rings (version %u)",
                 p->name, (unsigned long long)ring, RC_PIPE_VERSION);
        munmap(base, total);
        return EINVAL;
    }
    set_view(p, (uint8_t *)base, total, p->me, ring);
    p->created = 0;
    return 0;
}

int rc_pipe_open(rc_pipe *p, const char *name, int side, uint64_t ring_bytes, uint64_t wait_ns,
                 char *err, size_t errlen) {
    memset(p, 0, sizeof *p);
    if (side < 0 || side > 1 || ring_bytes < RC_PAGE || ring_bytes % RC_PAGE != 0 ||
        ring_bytes > (1ull << 34) || strlen(name) >= RC_PIPE_NAME_MAX) {
        snprintf(err, errlen, "bad pipe: side %d (0 or 1), ring of %llu bytes (a positive "
                 "multiple of %u), name of at most %d characters", side,
                 (unsigned long long)ring_bytes, RC_PAGE, RC_PIPE_NAME_MAX - 1);
        return EINVAL;
    }
    snprintf(p->name, sizeof p->name, "%s", name);
    p->me = side;
    size_t total = rc_pipe_total_bytes(ring_bytes);
    uint64_t deadline = rc_now_ns() + wait_ns;
    for (;;) {
        int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        int rc;
        if (fd >= 0) {
            rc = create(p, fd, ring_bytes, total, err, errlen);
            close(fd);
            if (rc) {
                shm_unlink(name);
                return rc;
            }
            break;
        }
        if (errno != EEXIST) {
            rc = errno;
            snprintf(err, errlen, "shm_open(%s) failed: %s", name, strerror(rc));
            return rc;
        }
        rc = attach(p, ring_bytes, total, err, errlen);
        if (rc == 0) break;
        if (rc != EAGAIN && rc != ENOENT) return rc; /* ENOENT: unlinked meanwhile: again */
        if (rc_now_ns() > deadline) {
            snprintf(err, errlen, "pipe %s: its creator did not finish it within %.1f s", name,
                     (double)wait_ns / 1e9);
            return ETIMEDOUT;
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    mark_mapped(p);
    return 0;
}

void rc_pipe_unmap(rc_pipe *p) {
    if (p->base == NULL) return;
    /* a creator whose peer never came: nobody else will unlink the name, unless it sent
     * messages, which the peer may still come for (it unlinks the name when it maps it) */
    if (p->created && __atomic_load_n(&p->hdr->attached, __ATOMIC_ACQUIRE) < 2u &&
        p->rings[p->me].sent == 0)
        shm_unlink(p->name);
    munmap(p->base, p->len);
    p->base = NULL;
}

void rc_pipe_abort(rc_pipe *p, uint32_t reason) {
    uint32_t none = 0; /* the first reason stays */
    __atomic_compare_exchange_n(&p->sides[p->me].abort, &none, reason, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    for (int d = 0; d < 2; d++) {
        rc_wake_all(&p->rings[d].hseq);
        rc_wake_all(&p->rings[d].tseq);
    }
}

/* ---------------------------------------------------------------- waiting */
/* Wait until *word reaches target. It spins for call->wait.spin_ns, then sleeps on futex
 * (counting itself in *waiters), waking for the futex, for the peer's abort (it wakes every
 * futex) and at least every tick (the peer's process checked), and calls the caller's check
 * as rc_waiter says: RC_OK, RC_CLOSED (this side closed the pipe), RC_ABORTED (the peer gave
 * up), RC_DEAD (the peer's process is gone) or RC_CHECK. Bounded: the check carries the
 * caller's deadline. */
static int wait_for(rc_pipe *p, const uint64_t *word, uint64_t target, uint32_t *futex,
                    uint32_t *waiters, rc_call *call) {
    if (at_least(load64(word), target)) return RC_OK;
    const rc_pipe_side *peer = &p->sides[1 - p->me];
    rc_waiter w;
    rc_waiter_start(&w, call);
    uint64_t spin_until = w.start + call->wait.spin_ns;
    while (call->wait.spin_ns) {
        if (at_least(load64(word), target)) return RC_OK;
        if (rc_now_ns() >= spin_until) {
            p->spin_fails++;
            break;
        }
        for (int k = 0; k < 16; k++) rc_cpu_relax();
    }
    uint64_t tick = call->wait.tick_ns ? call->wait.tick_ns : 10000000ull;
    uint64_t live_at = w.start + tick;
    int who = 1 - p->me;
    for (;;) {
        if (at_least(load64(word), target)) return RC_OK;
        if (p->closing) return RC_CLOSED;
        if (__atomic_load_n(&peer->abort, __ATOMIC_ACQUIRE) != 0)
            return rc_pid_gone(peer->pid) ? RC_DEAD : RC_ABORTED;
        uint64_t now = rc_now_ns();
        if (now >= live_at) {
            if (rc_pid_gone(__atomic_load_n(&peer->pid, __ATOMIC_ACQUIRE))) return RC_DEAD;
            live_at = now + tick;
        }
        int rc = rc_waiter_check(&w, call, &who, 1);
        if (rc) return rc;
        __atomic_add_fetch(waiters, 1u, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(futex, __ATOMIC_SEQ_CST);
        if (!at_least(load64(word), target) && __atomic_load_n(&peer->abort, __ATOMIC_SEQ_CST) == 0 &&
            !p->closing) {
            uint64_t until = live_at < w.check_at ? live_at : w.check_at;
            now = rc_now_ns();
            rc_sleep_on(futex, seen, until > now ? until - now : 1000ull);
        }
        __atomic_sub_fetch(waiters, 1u, __ATOMIC_SEQ_CST);
    }
}

/* A failure in the middle of a message: the pipe is broken for both sides. */
static int broken(rc_pipe *p, int rc, rc_call *call) {
    rc_pipe_abort(p, RC_ABORT_FAILED);
    call->broke = 1;
    return rc;
}

/* Whether either side gave up on the pipe (checked before a message begins). */
static int given_up(const rc_pipe *p) {
    if (p->closing) return RC_CLOSED;
    if (__atomic_load_n(&p->sides[p->me].abort, __ATOMIC_ACQUIRE) != 0) return RC_ABORTED;
    const rc_pipe_side *peer = &p->sides[1 - p->me];
    if (__atomic_load_n(&peer->abort, __ATOMIC_ACQUIRE) != 0)
        return rc_pid_gone(peer->pid) ? RC_DEAD : RC_ABORTED;
    return RC_OK;
}

/* ---------------------------------------------------------------- sending */
/* Stream n bytes at data into the ring from pos (after the message's header, published or
 * not), then publish the message's end. A failure is in the middle of the message. */
static int stream(rc_pipe *p, rc_pipe_ring *r, uint64_t pos, uint64_t end, const uint8_t *data,
                  uint64_t n, rc_call *call) {
    uint8_t *ring = ring_data(p, p->me);
    uint64_t left = n;
    /* a quarter of the ring at a time once it is full, so both sides copy at once */
    uint64_t chunk = p->ring / 4u;
    int streaming = end - (pos - RC_PIPE_MSG_BYTES) > p->ring;
    while (left) {
        uint64_t room = p->ring - (pos - load64(&r->tail));
        if (room == 0) {
            publish(&r->head, pos, &r->hseq, &r->head_waiters);
            uint64_t want = left < chunk ? left : chunk;
            int rc = wait_for(p, &r->tail, pos + want - p->ring, &r->tseq, &r->tail_waiters, call);
            if (rc) return broken(p, rc, call);
            continue;
        }
        uint64_t off = pos % p->ring;
        uint64_t k = left < room ? left : room;
        if (k > p->ring - off) k = p->ring - off;
        memcpy(ring + off, data, k);
        data += k;
        pos += k;
        left -= k;
        if (left && streaming) publish(&r->head, pos, &r->hseq, &r->head_waiters);
    }
    publish(&r->head, end, &r->hseq, &r->head_waiters);
    return RC_OK;
}

int rc_pipe_send(rc_pipe *p, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                 const uint8_t *data, uint64_t n, int may_wait, int ack, int cma,
                 rc_call *call) {
    call->broke = 0;
    call->check_rc = 0;
    if (meta_len > RC_PIPE_META_BYTES || n > (1ull << 56)) return RC_BADPLAN;
    int rc = given_up(p);
    if (rc) return rc;
    rc_pipe_ring *r = &p->rings[p->me];
    uint8_t *ring = ring_data(p, p->me);
    uint64_t head = r->head; /* this side's own word */
    cma = cma && ack && n > 0 && !__atomic_load_n(&r->no_cma, __ATOMIC_ACQUIRE);
    uint64_t whole = RC_PIPE_MSG_BYTES + (cma ? 0 : round_up(n, RC_PIPE_MSG_BYTES));
    uint64_t end = head + whole;
    if (!at_least(load64(&r->tail) + p->ring, end)) { /* not whole now */
        if (!may_wait) return RC_PIPE_AGAIN;
        /* room for the header first (nothing written yet: a failure leaves the pipe whole) */
        rc = wait_for(p, &r->tail, head + RC_PIPE_MSG_BYTES - p->ring, &r->tseq,
                      &r->tail_waiters, call);
        if (rc) return rc;
    }
    rc_pipe_msg msg;
    memset(&msg, 0, sizeof msg);
    msg.magic = RC_PIPE_MSG_MAGIC;
    msg.meta_len = meta_len;
    msg.tag = tag;
    msg.nbytes = n;
    msg.number = r->sent + 1u;
    msg.flags = cma ? RC_PIPE_CMA : 0u;
    msg.addr = cma ? (uint64_t)(uintptr_t)data : 0u;
    memcpy(msg.meta, meta, meta_len);
    memcpy(ring + head % p->ring, &msg, sizeof msg); /* whole: starts are multiples of 128 */
    r->sent = msg.number;
    if (cma) { /* the header alone; the receiver reads the payload here, or asks for it */
        publish(&r->head, end, &r->hseq, &r->head_waiters);
        rc = wait_for(p, &r->answered, msg.number, &r->tseq, &r->tail_waiters, call);
        if (rc) return broken(p, rc, call); /* it may be reading this buffer: not whole */
        if (load64(&r->streamed) == msg.number) {
            rc = stream(p, r, end, end + round_up(n, RC_PIPE_MSG_BYTES), data, n, call);
            if (rc) return rc;
        }
    } else {
        rc = stream(p, r, head + RC_PIPE_MSG_BYTES, end, data, n, call);
        if (rc) return rc;
    }
    if (!ack) return RC_OK;
    rc = wait_for(p, &r->taken, msg.number, &r->tseq, &r->tail_waiters, call);
    if (rc) return broken(p, rc, call); /* it may be read in part: the pipe is no longer whole */
    return load64(&r->rejected) == msg.number ? RC_MISMATCH : RC_OK;
}

/* ---------------------------------------------------------------- receiving */
int rc_pipe_peek(rc_pipe *p, int may_wait, rc_call *call, rc_pipe_msg *msg) {
    call->broke = 0;
    call->check_rc = 0;
    if (p->have_cur) {
        *msg = p->cur;
        return RC_OK;
    }
    rc_pipe_ring *r = &p->rings[1 - p->me];
    uint64_t tail = r->tail; /* this side's own word */
    if (!at_least(load64(&r->head), tail + RC_PIPE_MSG_BYTES)) {
        int rc = given_up(p);
        if (rc) return rc;
        if (!may_wait) return RC_PIPE_AGAIN;
        rc = wait_for(p, &r->head, tail + RC_PIPE_MSG_BYTES, &r->hseq, &r->head_waiters, call);
        if (rc) return rc; /* nothing of a message was read: the pipe stays whole */
    }
    memcpy(&p->cur, ring_data(p, 1 - p->me) + tail % p->ring, sizeof p->cur);
    /* the peer's words: checked before they are used (the payload's length bounds nothing
     * here, the take copies at most the receiver's own buffer) */
    if (p->cur.magic != RC_PIPE_MSG_MAGIC || p->cur.meta_len > RC_PIPE_META_BYTES ||
        p->cur.nbytes > (1ull << 56) || p->cur.number != r->taken + 1u)
        return broken(p, RC_GARBLED, call);
    p->have_cur = 1;
    *msg = p->cur;
    return RC_OK;
}

int rc_pipe_take(rc_pipe *p, uint8_t *dst, uint64_t n, int reject, rc_call *call) {
    call->broke = 0;
    call->check_rc = 0;
    if (!p->have_cur || (dst != NULL && n != p->cur.nbytes)) return RC_BADPLAN;
    rc_pipe_ring *r = &p->rings[1 - p->me];
    const uint8_t *ring = ring_data(p, 1 - p->me);
    uint64_t start = r->tail;
    uint64_t end = start + RC_PIPE_MSG_BYTES + round_up(p->cur.nbytes, RC_PIPE_MSG_BYTES);
    if (p->cur.flags & RC_PIPE_CMA) {
        int rc = RC_IOERR, err = 0;
        if (dst != NULL) { /* bounds: exactly this buffer's n bytes, the message's */
            rc_range local = {(uint64_t)(uintptr_t)dst, n};
            rc_range remote = {p->cur.addr, n};
            rc = rc_cma_readv(__atomic_load_n(&p->sides[1 - p->me].pid, __ATOMIC_ACQUIRE),
                              &local, &remote, 1, &err);
            if (rc == RC_DEAD) {
                p->have_cur = 0;
                return broken(p, rc, call);
            }
        }
        if (rc == RC_OK || dst == NULL) { /* read (or skipped): the header was all of it */
            if (reject) __atomic_store_n(&r->rejected, p->cur.number, __ATOMIC_RELEASE);
            __atomic_store_n(&r->taken, p->cur.number, __ATOMIC_RELEASE);
            __atomic_store_n(&r->answered, p->cur.number, __ATOMIC_RELEASE);
            publish(&r->tail, start + RC_PIPE_MSG_BYTES, &r->tseq, &r->tail_waiters);
            p->have_cur = 0;
            return RC_OK;
        }
        /* not allowed here (no ptrace permission, say): the sender streams it after all */
        __atomic_store_n(&r->no_cma, 1u, __ATOMIC_RELEASE);
        __atomic_store_n(&r->streamed, p->cur.number, __ATOMIC_RELEASE);
        __atomic_store_n(&r->answered, p->cur.number, __ATOMIC_RELEASE);
        __atomic_add_fetch(&r->tseq, 1u, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&r->tail_waiters, __ATOMIC_SEQ_CST) != 0) rc_wake_all(&r->tseq);
    }
    uint64_t pos = start + RC_PIPE_MSG_BYTES;
    uint64_t left = p->cur.nbytes;
    while (left) {
        uint64_t avail = load64(&r->head) - pos;
        if (avail == 0) {
            int rc = wait_for(p, &r->head, pos + 1u, &r->hseq, &r->head_waiters, call);
            if (rc) {
                p->have_cur = 0;
                return broken(p, rc, call);
            }
            continue;
        }
        uint64_t off = pos % p->ring;
        uint64_t k = left < avail ? left : avail;
        if (k > p->ring - off) k = p->ring - off;
        if (dst != NULL) {
            memcpy(dst, ring + off, k);
            dst += k;
        }
        pos += k;
        left -= k;
        if (left) publish(&r->tail, pos, &r->tseq, &r->tail_waiters); /* room for the sender */
    }
    /* the sender published the message's end with its last bytes (pipe.h) */
    if (reject) __atomic_store_n(&r->rejected, p->cur.number, __ATOMIC_RELEASE);
    __atomic_store_n(&r->taken, p->cur.number, __ATOMIC_RELEASE);
    publish(&r->tail, end, &r->tseq, &r->tail_waiters);
    p->have_cur = 0;
    return RC_OK;
}
