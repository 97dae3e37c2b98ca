/* The pipe types' shared binding (pipebind.h). */
#include "pipebind.h"

/* The pipe, if it is open and free for this direction (an exception set if not). */
static void *usable(rc_pipe_object *self, const rc_pipe_ops *ops, int busy) {
    void *pipe = ops->pipe(self);
    if (pipe == NULL) {
        PyErr_SetString(PyExc_ValueError, "the pipe is closed");
        return NULL;
    }
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "the pipe is busy with another call that way");
        return NULL;
    }
    return pipe;
}

/* Set up a call's waiting policy and check: 1, or 0 with an exception set. */
static int prepare(rc_call *call, check_arg *carg, PyObject *wait, PyObject *check) {
    memset(call, 0, sizeof *call);
    if (!parse_call(wait, call)) return 0;
    carg->fn = check;
    carg->ts = NULL;
    if (check != Py_None) {
        call->check = call_check;
        call->check_arg = carg;
    }
    return 1;
}

/* One message, whole (may_wait false: AGAIN unless it goes now; ack: wait until the
 * receiver took it, MISMATCH if it rejected it; cma, with ack: offer it across memory, where
 * the pipe can). The GIL is released only where the send may wait (may_wait or ack). */
PyObject *pipebind_send(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args) {
    PyObject *data_obj, *wait, *check;
    long long tag;
    Py_buffer meta;
    int may_wait, ack, cma;
    if (!PyArg_ParseTuple(args, "OLy*pppOO", &data_obj, &tag, &meta, &may_wait, &ack, &cma,
                          &wait, &check))
        return NULL;
    PyObject *result = NULL;
    Py_buffer data;
    int have_data = 0;
    rc_call call;
    check_arg carg;
    void *pipe = usable(self, ops, self->sending);
    if (pipe == NULL || !prepare(&call, &carg, wait, check)) goto done;
    if (meta.len > RC_PIPE_META_BYTES) {
        PyErr_Format(PyExc_ValueError, "meta: %zd bytes (at most %u)", meta.len,
                     RC_PIPE_META_BYTES);
        goto done;
    }
    if (take_buffer(data_obj, &data, 0) < 0) goto done;
    have_data = 1;
    self->sending = 1;
    int blocking = may_wait || ack;
    if (blocking) carg.ts = PyEval_SaveThread();
    int rc = ops->send(pipe, tag, (const uint8_t *)meta.buf, (uint32_t)meta.len,
                       (const uint8_t *)data.buf, (uint64_t)data.len, may_wait, ack, cma, &call);
    if (blocking) PyEval_RestoreThread(carg.ts);
    self->sending = 0;
    result = Py_BuildValue("(iiN)", rc, call.broke, check_exception(rc));
done:
    if (have_data) PyBuffer_Release(&data);
    PyBuffer_Release(&meta);
    return result;
}

/* (status, tag, nbytes, meta, broke, exc) of a peek or recv. */
static PyObject *msg_result(int rc, const rc_pipe_msg *msg, int broke) {
    if (rc != RC_OK && rc != RC_PIPE_OTHER && rc != RC_MISMATCH)
        return Py_BuildValue("(iLKy#iN)", rc, 0LL, 0ULL, "", (Py_ssize_t)0, broke,
                             check_exception(rc));
    return Py_BuildValue("(iLKy#iN)", rc, (long long)msg->tag, (unsigned long long)msg->nbytes,
                         (const char *)msg->meta, (Py_ssize_t)msg->meta_len, broke,
                         check_exception(rc));
}

/* The next message's header, kept as the current one (may_wait false: a poll, AGAIN if
 * none is there, with the GIL kept). */
PyObject *pipebind_peek(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args) {
    PyObject *wait, *check;
    int may_wait;
    if (!PyArg_ParseTuple(args, "pOO", &may_wait, &wait, &check)) return NULL;
    rc_call call;
    check_arg carg;
    void *pipe = usable(self, ops, self->receiving);
    if (pipe == NULL || !prepare(&call, &carg, wait, check)) return NULL;
    rc_pipe_msg msg;
    if (!may_wait) return msg_result(ops->peek(pipe, 0, &call, &msg), &msg, call.broke);
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    int rc = ops->peek(pipe, 1, &call, &msg);
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    return msg_result(rc, &msg, call.broke);
}

/* The current message into buf (exactly its bytes), or skipped (buf None; reject: its
 * sender is told). */
PyObject *pipebind_take(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args) {
    PyObject *dst_obj, *wait, *check;
    int reject;
    if (!PyArg_ParseTuple(args, "OpOO", &dst_obj, &reject, &wait, &check)) return NULL;
    rc_call call;
    check_arg carg;
    void *pipe = usable(self, ops, self->receiving);
    if (pipe == NULL || !prepare(&call, &carg, wait, check)) return NULL;
    const rc_pipe_msg *cur = ops->current(pipe);
    if (cur == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "take: no message was peeked");
        return NULL;
    }
    Py_buffer dst;
    int have_dst = 0;
    if (dst_obj != Py_None) {
        if (take_buffer(dst_obj, &dst, 1) < 0) return NULL;
        have_dst = 1;
        if ((uint64_t)dst.len != cur->nbytes) { /* bounds: exactly the message */
            PyErr_Format(PyExc_ValueError, "take: the buffer has %zd bytes, the message %llu",
                         dst.len, (unsigned long long)cur->nbytes);
            PyBuffer_Release(&dst);
            return NULL;
        }
    }
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    int rc = ops->take(pipe, have_dst ? (uint8_t *)dst.buf : NULL,
                       have_dst ? (uint64_t)dst.len : 0, reject, &call);
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    if (have_dst) PyBuffer_Release(&dst);
    return Py_BuildValue("(iiN)", rc, call.broke, check_exception(rc));
}

/* The next message into buf when its tag is tag (RC_MISMATCH, the message skipped and its
 * sender told, when its meta or length differ from this receive's); RC_PIPE_OTHER (left in
 * the pipe) when its tag differs. One call for the common case: no Python between the wait
 * and the copy. */
PyObject *pipebind_recv(rc_pipe_object *self, const rc_pipe_ops *ops, PyObject *args) {
    PyObject *dst_obj, *wait, *check;
    long long tag;
    Py_buffer meta;
    if (!PyArg_ParseTuple(args, "OLy*OO", &dst_obj, &tag, &meta, &wait, &check)) return NULL;
    PyObject *result = NULL;
    Py_buffer dst;
    int have_dst = 0;
    rc_call call;
    check_arg carg;
    void *pipe = usable(self, ops, self->receiving);
    if (pipe == NULL || !prepare(&call, &carg, wait, check)) goto done;
    if (take_buffer(dst_obj, &dst, 1) < 0) goto done;
    have_dst = 1;
    self->receiving = 1;
    carg.ts = PyEval_SaveThread();
    rc_pipe_msg msg;
    int rc = ops->peek(pipe, 1, &call, &msg);
    if (rc == RC_OK && msg.tag != tag) {
        rc = RC_PIPE_OTHER;
    } else if (rc == RC_OK) {
        int same = msg.meta_len == (uint32_t)meta.len &&
                   memcmp(msg.meta, meta.buf, (size_t)meta.len) == 0 &&
                   msg.nbytes == (uint64_t)dst.len;
        rc = ops->take(pipe, same ? (uint8_t *)dst.buf : NULL, (uint64_t)dst.len, !same, &call);
        if (rc == RC_OK && !same) rc = RC_MISMATCH;
    }
    PyEval_RestoreThread(carg.ts);
    self->receiving = 0;
    result = msg_result(rc, &msg, call.broke);
done:
    if (have_dst) PyBuffer_Release(&dst);
    PyBuffer_Release(&meta);
    return result;
}
