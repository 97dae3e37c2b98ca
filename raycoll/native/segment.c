/* The node segment: creating and mapping it, publishing steps and waiting for the peers (see
 * segment.h for the layout and the protocol; exec.c runs a plan's operations on it). Plain C:
 * no Python. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "futex.h"
#include "segment.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#endif

_Static_assert(sizeof(rc_seg_header) == RC_HEADER_BYTES, "rc_seg_header is one 128-byte block");
_Static_assert(sizeof(rc_ctl) == RC_CTL_BYTES, "rc_ctl is RC_CTL_BYTES");
_Static_assert(RC_CTL_BYTES % 64 == 0, "control blocks start on cache lines");

/* ---------------------------------------------------------------- atomics and time */
static inline uint32_t load_acquire(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Whether step counter value seq has reached step s (32-bit counters wrap). */
static inline int reached(uint32_t seq, uint32_t s) { return (int32_t)(seq - s) >= 0; }

/* Sleeping and waking: rc_sleep_on / rc_wake_all (futex.h). */

/* ---------------------------------------------------------------- layout */
static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

static uint64_t data_offset(int nranks) {
    return round_up(RC_HEADER_BYTES + (uint64_t)nranks * RC_CTL_BYTES, RC_PAGE);
}

size_t rc_seg_total_bytes(int nranks, uint64_t half_bytes) {
    return (size_t)(data_offset(nranks) + (uint64_t)nranks * 2u * half_bytes);
}

uint8_t *rc_seg_half(const rc_seg *s, int r, int p) {
    return s->data + ((uint64_t)r * 2u + (uint64_t)(p & 1)) * s->half;
}

static void set_view(rc_seg *s, uint8_t *base, size_t len, int nranks, int me, uint64_t half) {
    s->base = base;
    s->len = len;
    s->hdr = (rc_seg_header *)base;
    s->ctl = (rc_ctl *)(base + RC_HEADER_BYTES);
    s->data = base + data_offset(nranks);
    s->nranks = nranks;
    s->me = me;
    s->half = half;
    s->step = 0;
    s->closing = 0;
    s->spin_fails = 0;
}

static int check_shape(int nranks, int me, uint64_t half_bytes, char *err, size_t errlen) {
    if (nranks < 1 || nranks > RC_MAX_RANKS || me < 0 || me >= nranks) {
        snprintf(err, errlen, "bad segment shape: %d ranks, rank %d (at most %d ranks)", nranks,
                 me, RC_MAX_RANKS);
        return EINVAL;
    }
    if (half_bytes == 0 || half_bytes % RC_PAGE != 0 || half_bytes > (1ull << 40)) {
        snprintf(err, errlen, "bad slot size %llu: a positive multiple of %u bytes",
                 (unsigned long long)half_bytes, RC_PAGE);
        return EINVAL;
    }
    return 0;
}

static void mark_mapped(rc_seg *s) {
    rc_ctl *mine = &s->ctl[s->me];
    mine->pid = (int32_t)getpid();
    s->probe = rc_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s;
    mine->probe_addr = (uint64_t)(uintptr_t)&s->probe;
    mine->probe_value = s->probe;
    __atomic_store_n(&mine->mapped, 1u, __ATOMIC_RELEASE);
    __atomic_add_fetch(&s->hdr->attached, 1u, __ATOMIC_SEQ_CST);
}

int rc_seg_create(rc_seg *s, const char *name, int nranks, int me, uint64_t half_bytes,
                  char *err, size_t errlen) {
    int rc = check_shape(nranks, me, half_bytes, err, errlen);
    if (rc) return rc;
    size_t total = rc_seg_total_bytes(nranks, half_bytes);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
        rc = errno;
        snprintf(err, errlen, "shm_open(%s) failed: %s", name, strerror(rc));
        return rc;
    }
    if (ftruncate(fd, (off_t)total) != 0) {
        rc = errno;
        snprintf(err, errlen, "ftruncate(%s, %zu) failed: %s", name, total, strerror(rc));
        goto fail;
    }
#ifdef __linux__
    /* Reserve the pages now: a /dev/shm too small fails here (ENOSPC), not later (SIGBUS). */
    rc = posix_fallocate(fd, 0, (off_t)total);
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
        snprintf(err, errlen, "reserving %zu bytes of shared memory for %s failed: %s", total,
                 name, strerror(rc));
        goto fail;
    }
#endif
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        rc = errno;
        snprintf(err, errlen, "mmap(%s, %zu) failed: %s", name, total, strerror(rc));
        goto fail;
    }
    close(fd);
    set_view(s, (uint8_t *)base, total, nranks, me, half_bytes);
    snprintf(s->name, sizeof s->name, "%s", name);
    memset(base, 0, (size_t)data_offset(nranks)); /* header and control blocks */
    s->hdr->version = RC_SEG_VERSION;
    s->hdr->nranks = (uint32_t)nranks;
    s->hdr->half_bytes = half_bytes;
    s->hdr->data_off = data_offset(nranks);
    s->hdr->total_bytes = total;
    s->hdr->creator_pid = (uint32_t)getpid();
    mark_mapped(s);
    __atomic_store_n(&s->hdr->magic, RC_SEG_MAGIC, __ATOMIC_RELEASE);
    return 0;
fail:
    close(fd);
    shm_unlink(name);
    return rc;
}

int rc_seg_attach(rc_seg *s, const char *name, int nranks, int me, uint64_t half_bytes,
                  char *err, size_t errlen) {
    int rc = check_shape(nranks, me, half_bytes, err, errlen);
    if (rc) return rc;
    size_t total = rc_seg_total_bytes(nranks, half_bytes);
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        rc = errno;
        snprintf(err, errlen, "shm_open(%s) failed: %s", name, strerror(rc));
        return rc;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != total) {
        rc = EINVAL;
        snprintf(err, errlen, "segment %s has %lld bytes, expected %zu", name,
                 (long long)st.st_size, total);
        close(fd);
        return rc;
    }
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    rc = base == MAP_FAILED ? errno : 0;
    close(fd);
    if (rc) {
        snprintf(err, errlen, "mmap(%s, %zu) failed: %s", name, total, strerror(rc));
        return rc;
    }
    rc_seg_header *hdr = (rc_seg_header *)base;
    if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != RC_SEG_MAGIC ||
        hdr->version != RC_SEG_VERSION || hdr->nranks != (uint32_t)nranks ||
        hdr->half_bytes != half_bytes) {
        snprintf(err, errlen, "segment %s is not a raycoll segment of %d ranks and %llu-byte "
                 "halves (version %u)", name, nranks, (unsigned long long)half_bytes,
                 RC_SEG_VERSION);
        munmap(base, total);
        return EINVAL;
    }
    set_view(s, (uint8_t *)base, total, nranks, me, half_bytes);
    snprintf(s->name, sizeof s->name, "%s", name);
    mark_mapped(s);
    return 0;
}

int rc_seg_unlink(const char *name) { return shm_unlink(name) == 0 ? 0 : errno; }

void rc_seg_unmap(rc_seg *s) {
    if (s->base != NULL) munmap(s->base, s->len);
    s->base = NULL;
}

void rc_seg_abort(rc_seg *s, uint32_t reason) {
    uint32_t none = 0; /* the first reason stays (a close, then the run it ended failing) */
    __atomic_compare_exchange_n(&s->ctl[s->me].abort, &none, reason, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    for (int r = 0; r < s->nranks; r++) rc_wake_all(&s->ctl[r].seq);
}

/* ---------------------------------------------------------------- publishing and waiting */
static void publish(rc_seg *s, uint32_t step) {
    rc_ctl *mine = &s->ctl[s->me];
    s->step = step;
    __atomic_store_n(&mine->seq, step, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&mine->waiters, __ATOMIC_SEQ_CST) != 0) rc_wake_all(&mine->seq);
}

/* Whether rank r's process is gone (see rc_pid_gone). */
static int gone(const rc_seg *s, int r) { return rc_pid_gone(s->ctl[r].pid); }

/* Whether a process is gone: its pid no longer exists, or (Linux) it is a zombie that its
 * parent has not reaped yet (a killed process stays one until then). */
int rc_pid_gone(int32_t pid) {
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
#ifdef __linux__
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    const char *paren = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold spaces */
    return paren != NULL && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
#else
    return 0;
#endif
}

/* A reason to stop waiting other than the step: a peer's abort flag, this rank closing. A
 * peer that gave up because a rank died (its own wait found the process gone) raised its
 * flag at once: where a local rank's process is gone, that rank is named (RC_DEAD), not the
 * peer that gave up first. */
static int interrupted(const rc_seg *s, int *peer) {
    if (s->closing) {
        *peer = s->me;
        return RC_CLOSED;
    }
    for (int r = 0; r < s->nranks; r++) {
        if (__atomic_load_n(&s->ctl[r].abort, __ATOMIC_ACQUIRE) != 0) {
            for (int d = 0; d < s->nranks; d++) {
                if (d != s->me && gone(s, d)) {
                    *peer = d;
                    return RC_DEAD;
                }
            }
            *peer = r;
            return RC_ABORTED;
        }
    }
    return RC_OK;
}

/* Wait until every rank has published step, then make sure none gave up on the group (a
 * peer that published the step and then failed, say timed out waiting for this rank, left
 * its data behind: completing with it would succeed here and fail there). */
static int wait_step(rc_seg *s, uint32_t step, rc_call *call, int *peer);

static int wait_all(rc_seg *s, uint32_t step, rc_call *call, int *peer) {
    int rc = wait_step(s, step, call, peer);
    if (rc == RC_OK) rc = interrupted(s, peer);
    return rc;
}

/* The wait of one step. It spins for call->wait.spin_ns (where the ranks fit the cores),
 * then sleeps on the futex of the first rank not there yet, at most until the next of:
 *   - a liveness tick (every tick_ns, the first one tick_ns after the wait began: a pending
 *     peer whose process is gone fails the wait with RC_DEAD),
 *   - the caller's check (rc_waiter: after check_ns, then at intervals doubling to
 *     check_max_ns; RC_CHECK when it fails),
 * and wakes at once for a peer's publish or abort (both wake the futexes) and for this
 * rank's close. Bounded: the caller's check carries the call's deadline. */
static int wait_step(rc_seg *s, uint32_t step, rc_call *call, int *peer) {
    int pending[RC_MAX_RANKS];
    int npending = 0;
    for (int r = 0; r < s->nranks; r++)
        if (r != s->me && !reached(load_acquire(&s->ctl[r].seq), step)) pending[npending++] = r;
    if (npending == 0) return RC_OK;
    rc_waiter w;
    rc_waiter_start(&w, call);
    uint64_t spin_until = w.start + call->wait.spin_ns;
    /* Spin: where the ranks fit the cores, a peer's publish is seen within ~100 ns. */
    while (call->wait.spin_ns) {
        int left = 0;
        for (int i = 0; i < npending; i++)
            if (!reached(load_acquire(&s->ctl[pending[i]].seq), step)) pending[left++] = pending[i];
        npending = left;
        if (npending == 0) return RC_OK;
        if (rc_now_ns() >= spin_until) {
            s->spin_fails++;
            break;
        }
        for (int k = 0; k < 32; k++) rc_cpu_relax();
    }
    uint64_t tick = call->wait.tick_ns ? call->wait.tick_ns : 10000000ull;
    uint64_t live_at = w.start + tick;
    for (;;) {
        int left = 0;
        for (int i = 0; i < npending; i++)
            if (!reached(load_acquire(&s->ctl[pending[i]].seq), step)) pending[left++] = pending[i];
        npending = left;
        if (npending == 0) return RC_OK;
        int rc = interrupted(s, peer);
        if (rc) return rc;
        uint64_t now = rc_now_ns();
        if (now >= live_at) {
            for (int i = 0; i < npending; i++) {
                if (gone(s, pending[i])) {
                    *peer = pending[i];
                    return RC_DEAD;
                }
            }
            live_at = now + tick;
        }
        if (call->rank_map != NULL) { /* the check names group ranks (core.h) */
            int named[RC_MAX_RANKS];
            for (int i = 0; i < npending; i++)
                named[i] = pending[i] < call->rank_map_len ? (int)call->rank_map[pending[i]]
                                                           : pending[i];
            rc = rc_waiter_check(&w, call, named, npending);
        } else {
            rc = rc_waiter_check(&w, call, pending, npending);
        }
        if (rc) {
            *peer = -1;
            return rc;
        }
        rc_ctl *other = &s->ctl[pending[0]];
        __atomic_add_fetch(&other->waiters, 1u, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(&other->seq, __ATOMIC_SEQ_CST);
        if (!reached(seen, step) && __atomic_load_n(&other->abort, __ATOMIC_SEQ_CST) == 0 &&
            !s->closing) {
            uint64_t until = live_at < w.check_at ? live_at : w.check_at;
            now = rc_now_ns();
            rc_sleep_on(&other->seq, seen, until > now ? until - now : 1000ull);
        }
        __atomic_sub_fetch(&other->waiters, 1u, __ATOMIC_SEQ_CST);
    }
}

/* After the first step of a call: every rank's step info against this rank's. Ranks whose
 * calls took other paths (a rank that rejected its arguments, a call that went through the
 * coordinator on some ranks) took no step for them, so the ranks meeting at a step may be at
 * different calls: the earliest call there fails (RC_SEQ, naming a rank at a later one), and
 * the ranks at later calls take this step as a stand-in for it and run their own call again
 * from its next step (RC_RETRY), so that every rank stays on the same steps. */
static int compare_info(const rc_seg *s, uint32_t step, int *peer) {
    int p = (int)(step & 1u);
    const rc_step_info *mine = &s->ctl[s->me].info[p];
    uint64_t earliest = mine->call_seq;
    int later = -1;
    for (int r = 0; r < s->nranks; r++) {
        const rc_step_info *other = &s->ctl[r].info[p];
        if (other->step != step || !(other->flags & RC_STEP_FIRST)) {
            *peer = r; /* a rank in the middle of a call: cannot happen (a bug) */
            return RC_BADPLAN;
        }
        if (other->call_seq < earliest) earliest = other->call_seq;
        if (other->call_seq != mine->call_seq && later < 0) later = r;
    }
    if (mine->call_seq > earliest) return RC_RETRY;
    if (later >= 0) {
        *peer = later;
        return RC_SEQ;
    }
    for (int r = 0; r < s->nranks; r++) {
        const rc_step_info *other = &s->ctl[r].info[p];
        if (other->fp_len != mine->fp_len || memcmp(other->fp, mine->fp, mine->fp_len) != 0) {
            *peer = r;
            return RC_MISMATCH;
        }
    }
    return RC_OK;
}

/* ---------------------------------------------------------------- steps */
int rc_seg_sync(rc_seg *s, int flags, rc_call *call, const rc_buf *bufs, int nbufs,
                int *peer) {
    uint32_t step = s->step + 1u;
    int first = (flags & RC_STEP_FIRST) != 0;
    if (flags & RC_STEP_PUBLISH) {
        if ((uint64_t)(2 * nbufs + 1) * 8u > s->half) {
            *peer = -1;
            return RC_BADPLAN;
        }
        uint64_t *table = (uint64_t *)rc_seg_half(s, s->me, (int)(step & 1u));
        table[0] = (uint64_t)nbufs;
        for (int i = 0; i < nbufs; i++) {
            table[1 + 2 * i] = (uint64_t)(uintptr_t)bufs[i].ptr;
            table[2 + 2 * i] = bufs[i].len;
        }
        s->first_step = step;
    }
    if (first) {
        rc_step_info *info = &s->ctl[s->me].info[step & 1u];
        info->call_seq = call->call_seq;
        info->step = step;
        info->flags = RC_STEP_FIRST;
        info->fp_len = call->fp_len;
        memcpy(info->fp, call->fp, call->fp_len);
    }
    publish(s, step);
    int rc = wait_all(s, step, call, peer);
    if (rc == RC_OK && first) rc = compare_info(s, step, peer);
    return rc;
}

/* ---------------------------------------------------------------- cross-memory reads */
#ifdef __linux__
/* Read n bytes at address at in process pid into dst: RC_OK, RC_DEAD, or RC_IOERR. */
static int read_process(int32_t pid, uint64_t at, uint8_t *dst, uint64_t n) {
    while (n) {
        struct iovec local = {dst, (size_t)n};
        struct iovec remote = {(void *)(uintptr_t)at, (size_t)n};
        ssize_t k = process_vm_readv((pid_t)pid, &local, 1, &remote, 1, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno == ESRCH ? RC_DEAD : RC_IOERR;
        }
        if (k == 0) return RC_IOERR;
        dst += k;
        at += (uint64_t)k;
        n -= (uint64_t)k;
    }
    return RC_OK;
}

int rc_seg_probe_cma(rc_seg *s) {
    for (int r = 0; r < s->nranks; r++) {
        if (r == s->me) continue;
        const rc_ctl *c = &s->ctl[r];
        uint64_t got = 0;
        if (!__atomic_load_n(&c->mapped, __ATOMIC_ACQUIRE) || c->probe_addr == 0) return 0;
        if (read_process(c->pid, c->probe_addr, (uint8_t *)&got, sizeof got) != RC_OK ||
            got != c->probe_value)
            return 0;
    }
    return 1;
}

int rc_seg_cma_read(rc_seg *s, int r, int idx, uint64_t off, uint64_t n, uint8_t *dst) {
    if (r < 0 || r >= s->nranks || idx < 0) return RC_BADPLAN;
    const uint64_t *table = (const uint64_t *)rc_seg_half(s, r, (int)(s->first_step & 1u));
    /* the count is the peer's word in shared memory: bounded by what a half can hold before
     * it is used (no arithmetic on it that could wrap) */
    uint64_t count = table[0];
    if (count > (s->half / 8u - 1u) / 2u || (uint64_t)idx >= count) return RC_BADPLAN;
    uint64_t at = table[1 + 2 * idx], len = table[2 + 2 * idx];
    if (n > len || off > len - n) return RC_BADPLAN;
    return read_process(s->ctl[r].pid, at + off, dst, n);
}
#else
int rc_seg_probe_cma(rc_seg *s) {
    (void)s;
    return 0;
}

int rc_seg_cma_read(rc_seg *s, int r, int idx, uint64_t off, uint64_t n, uint8_t *dst) {
    (void)s, (void)r, (void)idx, (void)off, (void)n, (void)dst;
    return RC_BADPLAN;
}
#endif
