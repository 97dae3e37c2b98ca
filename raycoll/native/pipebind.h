/*
 * What the two pipe types' bindings share (pipemodule.c: the shared-memory pair pipe, pipe.h;
 * sockpipemodule.c: the socket pipe, sockpipe.h): both give Python the same send / peek /
 * take / recv, so raycoll/transport/pipes.py matches messages one way on both. A type hands
 * its pipe's calls in an rc_pipe_ops; these functions parse the arguments, take the buffers
 * and release the GIL around the calls. Nothing is decided here.
 */
#ifndef RAYCOLL_PIPEBIND_H
#define RAYCOLL_PIPEBIND_H

#include "binding.h"
#include "pipe.h"

/* The head of both pipe objects: a call's direction is busy while it runs (in any thread),
 * and a second call that way is refused rather than interleaved. */
typedef struct {
    PyObject_HEAD
    int sending;   /* a send is in progress */
    int receiving; /* a peek, take or recv is in progress */
} rc_pipe_object;

typedef struct {
    /* The object's pipe, or NULL when it is closed. */
    void *(*pipe)(rc_pipe_object *self);
    int (*send)(void *pipe, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                const uint8_t *data, uint64_t n, int may_wait, int ack, int cma, rc_call *call);
    int (*peek)(void *pipe, int may_wait, rc_call *call, rc_pipe_msg *msg);
    int (*take)(void *pipe, uint8_t *dst, uint64_t n, int reject, rc_call *call);
    /* The message the last peek left current, or NULL. */
    const rc_pipe_msg *(*current)(void *pipe);
} rc_pipe_ops;

/* send(buf, tag, meta, may_wait, ack, cma, wait, check) -> (status, broke, exc) */
PyObject *pipebind_send(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args);
/* peek(may_wait, wait, check) -> (status, tag, nbytes, meta, broke, exc) */
PyObject *pipebind_peek(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args);
/* take(buf or None, reject, wait, check) -> (status, broke, exc) */
PyObject *pipebind_take(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args);
/* recv(buf, tag, meta, wait, check) -> (status, tag, nbytes, meta, broke, exc) */
PyObject *pipebind_recv(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args);

#endif
