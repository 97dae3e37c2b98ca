/*
 * Sleeping on and waking a 32-bit word of shared memory: the waits of the node segment
 * (segment.c) and of the pair pipes (pipe.c). On Linux a shared futex (the word lives in a
 * MAP_SHARED file, so the kernel keys the wait by the file's page, across processes);
 * elsewhere a short sleep, and the waker does nothing (a sleeper re-checks after it).
 */
#ifndef RAYCOLL_FUTEX_H
#define RAYCOLL_FUTEX_H

#include <limits.h>
#include <stdint.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Sleep while *addr == val, at most ns. */
static inline void rc_sleep_on(uint32_t *addr, uint32_t val, uint64_t ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    (void)syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

/* Wake every sleeper on addr. */
static inline void rc_wake_all(uint32_t *addr) {
    (void)syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}
#else
/* No futex: sleep a little, at most 200 us (the waker does nothing). */
static inline void rc_sleep_on(uint32_t *addr, uint32_t val, uint64_t ns) {
    (void)addr;
    (void)val;
    struct timespec ts;
    if (ns > 200000ull) ns = 200000ull;
    ts.tv_sec = 0;
    ts.tv_nsec = (long)ns;
    nanosleep(&ts, NULL);
}

static inline void rc_wake_all(uint32_t *addr) { (void)addr; }
#endif

#endif
