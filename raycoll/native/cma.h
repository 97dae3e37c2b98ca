/*
 * Cross-memory reads of another process's buffers (Linux process_vm_readv), outside any node
 * segment: raycoll's Ray Direct Transport (raycoll/rdt.py) reads the tensors an actor kept
 * straight from that actor's memory, given its pid and each tensor's address and length.
 *
 * One call reads every range of an object: the ranges go to the kernel IOV_MAX at a time
 * (one system call for up to 1,024 tensors), and a partial transfer is resumed where it
 * stopped. The caller has checked that local[i] and remote[i] have the same length.
 */
#ifndef RAYCOLL_CMA_H
#define RAYCOLL_CMA_H

#include <stdint.h>

typedef struct {
    uint64_t addr; /* where the range starts (in its process) */
    uint64_t len;  /* its bytes */
} rc_range;

/* Read remote[i] of process pid into local[i], for i < n. RC_OK; RC_DEAD where pid is gone
 * (ESRCH); RC_IOERR with *err the errno (EPERM: no ptrace permission, EFAULT: a remote range
 * is not mapped) or 0 where the kernel read nothing. Not Linux: RC_IOERR, *err ENOSYS. */
int rc_cma_readv(int32_t pid, const rc_range *local, const rc_range *remote, int n, int *err);

#endif
