/* Cross-memory reads of another process's buffers: see cma.h. */
#define _GNU_SOURCE
#include "cma.h"

#include <errno.h>

#include "core.h"

#ifdef __linux__
#include <limits.h>
#include <sys/uio.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

int rc_cma_readv(int32_t pid, const rc_range *local, const rc_range *remote, int n, int *err) {
    struct iovec lv[IOV_MAX], rv[IOV_MAX];
    int i = 0;        /* the first range not wholly read */
    uint64_t off = 0; /* bytes of range i already read */
    *err = 0;
    while (i < n) {
        if (local[i].len == off) { /* an empty range, or one just finished */
            i++;
            off = 0;
            continue;
        }
        int k = 0;
        for (int j = i; j < n && k < IOV_MAX; j++) {
            uint64_t skip = j == i ? off : 0;
            if (local[j].len == skip) continue;
            lv[k].iov_base = (void *)(uintptr_t)(local[j].addr + skip);
            lv[k].iov_len = (size_t)(local[j].len - skip);
            rv[k].iov_base = (void *)(uintptr_t)(remote[j].addr + skip);
            rv[k].iov_len = (size_t)(remote[j].len - skip);
            k++;
        }
        ssize_t got = process_vm_readv((pid_t)pid, lv, (unsigned long)k, rv, (unsigned long)k, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return errno == ESRCH ? RC_DEAD : RC_IOERR;
        }
        if (got == 0) return RC_IOERR;
        uint64_t left = (uint64_t)got; /* advance the cursor over what was read */
        while (left && i < n) {
            uint64_t rest = local[i].len - off;
            if (left < rest) {
                off += left;
                left = 0;
            } else {
                left -= rest;
                i++;
                off = 0;
            }
        }
    }
    return RC_OK;
}
#else
int rc_cma_readv(int32_t pid, const rc_range *local, const rc_range *remote, int n, int *err) {
    (void)pid, (void)local, (void)remote, (void)n;
    *err = ENOSYS;
    return RC_IOERR;
}
#endif
